"""Memory as the device sees it: what ``nvidia-smi`` reports, not only what the model's tensors take.

``autotune.simulator.memory`` counts the bytes PyTorch's caching allocator hands out at the peak
(model states plus activations: what ``torch.cuda.max_memory_allocated`` reports; the simulator's
``allocated_memory_GiB``). The device holds more:

- the CUDA context, the kernels' modules, cuBLAS / cuDNN workspaces and NCCL's communication buffers
  (per communicator: a stage's tensor-parallel group, its pipeline and data-parallel groups), which
  the allocator never sees: a fixed amount per process, ``context_GiB``;
- the allocator's own pool: reserved blocks larger than what is allocated (fragmentation, the
  caching of freed blocks): ``fragmentation`` times the allocated peak.

So ``peak_memory_GiB = allocated x (1 + fragmentation) + context_GiB``, and a plan is ``oom`` when that
exceeds the device's capacity. Per GPU class (``DEVICE_MEMORY``):

- default: 1.0 GiB and 5%, the reserve the simulator kept before it predicted the device view (PyTorch's
  CUDA context with cuBLAS is ~0.3-0.5 GiB, NCCL buffers a few hundred MiB per communicator; the
  caching allocator typically leaves a few percent of reserved memory unused).
- ``GH200``: 3.92 GiB and 0%: fitted (least squares, two constants) to the 15 OPT-350M runs of
  ``experiments/data/sailor_gh200_runs.json`` (nvidia-smi at the end of each run, max over ranks)
  against this simulator's allocator view of the same plans; the 11 GPT-Neo-2.7B runs are not used in
  the fit (``experiments/fidelity/sailor_validation.py`` reports them separately). The constant is large: NCCL
  on NVLink-4 nodes (NVLS buffers), Megatron-DeepSpeed's fused-kernel modules and several communicators
  per rank; Sailor's own planner budgets 3 GB per GPU for the same (``megatron_mem``). The fit found no
  growth with the allocated peak (slope 0.98: the fraction is clamped at 0 and the constant refitted
  alone: the mean of nvidia-smi minus the allocator view; `sailor_validation.py --fit-memory`).
- ``cpu``: nothing (the CPU runner's calibration measures its process baseline instead).

A calibration profile's ``memory_baseline_GiB`` (measured per process) replaces the context term.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    context_GiB: float  # per process, besides the allocator: CUDA context, workspaces, NCCL buffers
    fragmentation: float  # allocator pool beyond the allocated peak, as a fraction of it
    source: str = ""

    def device_GiB(self, allocated_GiB: float) -> float:
        return allocated_GiB * (1.0 + self.fragmentation) + self.context_GiB


DEFAULT_DEVICE_MEMORY = DeviceMemory(1.0, 0.05, "the reserve before the device view: 1 GiB context + 5% pool")
NO_DEVICE_MEMORY = DeviceMemory(0.0, 0.0, "CPU runner: measured by the calibration profile")

DEVICE_MEMORY: dict[str, DeviceMemory] = {
    "GH200": DeviceMemory(3.92, 0.0, "fitted to Sailor's 15 OPT-350M GH200 runs (nvidia-smi); GPT-Neo held out"),
    "cpu": NO_DEVICE_MEMORY,
}


def device_memory(gpu: str) -> DeviceMemory:
    return DEVICE_MEMORY.get(gpu, DEFAULT_DEVICE_MEMORY)
