"""Fixed costs that do not scale with the math: the host's work to issue each layer, per micro-batch.

A training framework issues every layer's kernels from the host (Python, autograd, the framework's
hooks, the launches of its tensor-parallel collectives). The GPU runs them asynchronously (the host
runs ahead as long as kernels take longer to run than to issue), so a layer pass takes the longer of
two times:

    layer time = max(host time to issue it, device time to run it)

Small layers on fast GPUs are launch-bound: their time does not shrink with the micro-batch (Sailor's
measured GH200 layer times are flat from micro-batch 1 to 4 in the forward). ``HostCost`` holds the host
times per layer pass, for the embedding and for the head, per GPU class (the host a GPU comes with: a
GH200 is driven by its Grace CPU) and tensor-parallel degree; ``host_cost(gpu, tp)`` looks one up
(the nearest tensor-parallel degree of the class, then the default class).

Where the numbers come from (each entry names its source):

- ``GH200``, tp 4: Sailor's published per-layer times (eth-easl/sailor, ``profiles_tmp.json``, the
  ``sailor_layer_profiles`` of ``experiments/data/sailor_gh200_runs.json``) at micro-batch 1, where the
  device work is a small fraction of the measured time (0.05-0.4 ms of math for 1.5-1.7 ms measured):
  forward 1.5 ms and backward 1.73 ms per block, embedding 0.97 ms, head 2.4 + 1.66 ms. Megatron-DeepSpeed
  in fp32 with unfused attention on a Grace host. These five numbers are taken as published; nothing
  is fitted to the iteration times validated in ``experiments/fidelity/sailor_validation.py``.
- default (every other class, x86 hosts): 0.25 ms forward and 0.5 ms backward per block, 0.1 ms for
  the embedding and 0.3 + 0.3 ms for the head: ~25 kernels per block forward and ~50 backward at
  ~10 us of host time each in eager PyTorch (the CUDA-graphs write-up on the PyTorch blog, 2021:
  launch overheads of a few to ~10 us per kernel; Megatron-LM's fused kernels need fewer). An
  estimate, not a fit; large layers on any GPU hide it completely.

A calibration profile's measured layer times include the host's work, so the simulator uses no
``HostCost`` for a layer it takes from a profile; CPU devices (the CPU runner computes on the host
itself) have none.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HostCost:
    """Host seconds to issue one pass over one micro-batch."""

    layer_forward_s: float
    layer_backward_s: float
    embedding_forward_s: float
    embedding_backward_s: float
    head_forward_s: float
    head_backward_s: float
    source: str = ""


NO_HOST_COST = HostCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, "none")

DEFAULT_HOST_COST = HostCost(
    0.25e-3,
    0.5e-3,
    0.1e-3,
    0.1e-3,
    0.3e-3,
    0.3e-3,
    source="estimate: ~25 / ~50 kernels per block forward / backward at ~10 us of eager-PyTorch host time each",
)

#: (GPU class, tensor-parallel degree) -> host cost, from published per-layer measurements
HOST_COSTS: dict[tuple[str, int], HostCost] = {
    ("GH200", 4): HostCost(
        1.5e-3,
        1.728e-3,
        0.967e-3,
        0.002e-3,
        2.405e-3,
        1.663e-3,
        source="Sailor (eth-easl/sailor) profiles_tmp.json, OPT-350M at micro-batch 1, tp 4, GH200 (Clariden): "
        "Megatron-DeepSpeed fp32, launch-bound",
    ),
}


def host_cost(gpu: str, tp: int) -> HostCost:
    """The host cost of ``gpu`` at tensor-parallel degree ``tp``: the entry of that class at the nearest
    measured degree, else the default (``cpu`` devices: none)."""
    if gpu == "cpu":
        return NO_HOST_COST
    degrees = [t for g, t in HOST_COSTS if g == gpu]
    if not degrees:
        return DEFAULT_HOST_COST
    nearest = min(degrees, key=lambda t: (abs(t - tp), t))
    return HOST_COSTS[(gpu, nearest)]
