"""A pipeline's execution order (``execution`` in a pipeline of the plan, docs/formats.md).

- ``"microbatch"`` (the default): each stage runs one micro-batch through all of its layers at a time,
  in the order the schedule (1F1B, GPipe, interleaved) gives.
- ``"layerwise"`` (Zorse, arXiv 2507.10392, its ``PipelineScheduleGpipe``): each rank of a stage runs one
  layer over all of its micro-batches before the next layer; the backward runs the layers in reverse,
  each over all micro-batches (last first). A layer's ZeRO all-gather and reduce-scatter (and offload
  ``all``'s weight streaming) therefore happen once per iteration instead of once per micro-batch, while
  every micro-batch's activations of the stage are alive at the end of the forward; with the stage's
  ``offload`` (``optimizer`` or ``all``) those activations wait in host memory. The stage sends each
  micro-batch to the next stage as its last layer finishes it, so stages overlap only across one layer's
  work. The stage's ``recompute`` keeps its meaning inside each layer.

Rules: the schedule is ``1f1b`` or ``gpipe`` (the name does not matter under layer-wise execution: the
order is the one above); not with ``interleaved-1f1b`` (one chunk per stage) or RoundPipe (its own
dispatch).
"""

from __future__ import annotations

from autotune.errors import SpecError, shown

MICROBATCH = "microbatch"
LAYERWISE = "layerwise"
EXECUTIONS = (MICROBATCH, LAYERWISE)


def check_execution(execution: object, schedule: str, source: str, field: str) -> None:
    """Raise SpecError when ``execution`` is not a mode or does not go with ``schedule``."""
    if not isinstance(execution, str) or execution not in EXECUTIONS:
        raise SpecError(source, field, f'must be "microbatch" or "layerwise", got {shown(execution)}')
    if execution == LAYERWISE and schedule not in ("1f1b", "gpipe"):
        raise SpecError(
            source,
            field,
            f'"layerwise" runs each stage as one chunk layer by layer: use schedule 1f1b or gpipe, not {schedule!r}',
        )
