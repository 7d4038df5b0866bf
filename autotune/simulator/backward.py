"""How much longer a layer's backward pass runs than its forward pass, where that was measured.

Without one, the simulator derives a block's backward from pass counts: twice the forward's matmul
FLOPs (input and weight gradients), twice its memory-bound traffic, five passes over stored attention
scores for the forward's four, the same two tensor-parallel all-reduces (``CostModel.layer_costs``).
That gives a backward of 1.4-1.5x the forward for the fp32, unfused-attention blocks of Sailor's
GH200 runs, where Sailor measured 2.4x (OPT-350M, tensor-parallel 4: 1.70 / 3.32 ms forward / backward at
micro-batch 4, 2.70 / 6.47 ms at 8; Megatron-DeepSpeed). The cause is not pinned down (fp32 dgrad /
wgrad GEMM and batched-matmul kernels on transposed operands, autograd's gradient sums and copies of
non-contiguous views, all of which the pass counts leave out); the ratio is measured.

``BACKWARD_RATIOS`` holds, per (GPU class, precision, attention), the measured ratio of a block's
backward device time to the simulator's own forward device time (tensor-parallel all-reduces included).
It applies only in the regime it was measured in; everywhere else the pass counts stand. A calibration
profile's measured layer times replace both.

- ``GH200``, ``fp32``, ``standard``: 2.48, fitted (one constant, least squares) to Sailor's published
  OPT-350M block backward times at micro-batch 1, 2, 4 and 8, tp 4 (``sailor_layer_profiles`` of
  ``experiments/data/sailor_gh200_runs.json``; ``experiments/fidelity/sailor_validation.py --fit-backward``),
  each predicted as ``max(host backward, ratio x forward device time)``. Nothing of GPT-Neo-2.7B (its
  layer times or its 11 runs) and no iteration time went into the fit: those are the held-out check.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BackwardRatio:
    ratio: float  # block backward device seconds / the simulator's forward device seconds
    source: str = ""


#: (GPU class, precision, attention) -> measured backward / forward ratio of a block
BACKWARD_RATIOS: dict[tuple[str, str, str], BackwardRatio] = {
    ("GH200", "fp32", "standard"): BackwardRatio(
        2.48,
        "fitted to Sailor's OPT-350M block times (mbs 1-8, tp 4, GH200, Megatron-DeepSpeed fp32, unfused "
        "attention): experiments/fidelity/sailor_validation.py --fit-backward; GPT-Neo-2.7B held out",
    ),
}


def backward_ratio(gpu: str, precision: str, attention: str) -> float | None:
    """The measured backward / forward ratio for this regime, or ``None`` (use the pass counts)."""
    entry = BACKWARD_RATIOS.get((gpu, precision, attention))
    return entry.ratio if entry is not None else None
