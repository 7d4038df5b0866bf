"""RoundPipe's automatic partition (``ModelExecutePlan.auto("fused", ...)``), as the RoundPipe package cuts
a model for a pool: the unit times it packs (``unit_profile``, from the cost model where RoundPipe measures
them in a first iteration) and the pool's pipeline it gives (``auto_stages``). The dispatch schedule that
runs the stages is ``autotune.simulator.roundpipe``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autotune.simulator.cost_model import CostModel
from autotune.simulator.memory import GiB
from autotune.specs.roundpipe import RoundPipeStages


@dataclass(frozen=True, slots=True)
class Partition:
    """A partition in blocks, the fields of a roundpipe pipeline."""

    forward_layers: tuple[int, ...]
    fused_layers: int
    backward_layers: tuple[int, ...]
    stage_workload_s: float  # the stage time bound it was packed to

    @property
    def num_stages(self) -> int:
        return len(self.forward_layers) + 1 + len(self.backward_layers)


def auto_partition(
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    fwd_bytes: Sequence[float],
    bwd_bytes: Sequence[float],
    min_stages: int,
    upper_threshold: float = 1.1,
    memory_limit_bytes: float = math.inf,
) -> Partition:
    """RoundPipe's automatic partition of one model, as ``ModelExecutePlan.auto("fused", model)`` makes it.

    The units are RoundPipe's layers: the embedding, the ``L`` blocks, the head (final norm, LM head and
    loss), ``L + 2`` entries; ``fwd_s`` their forward times, ``bwd_s`` their recomputation plus backward
    times, ``fwd_bytes`` their parameter bytes, ``bwd_bytes`` parameters plus gradients. Every stage
    time bound ``W`` between the slowest unit and ``upper_threshold`` times it that some run of units sums
    to is tried: the fused stage takes the most last units that fit in ``W``, the forward pass is packed
    from the back and the backward pass from the front, a new stage whenever the next unit would push the
    stage over ``W`` or its bytes over half of ``memory_limit_bytes`` (two stages share a GPU while one is
    prefetched); the plan with the least ``max(stages, min_stages) * W`` wins (the first such ``W``).
    The fused stage never takes the embedding (a forward stage keeps it)."""
    n = len(fwd_s)
    if not (n == len(bwd_s) == len(fwd_bytes) == len(bwd_bytes)) or n < 3:
        raise ValueError("auto_partition needs the embedding, at least one block and the head")
    max_work = max(max(fwd_s), max(bwd_s))
    half = memory_limit_bytes / 2
    biggest = max(max(fwd_bytes), max(bwd_bytes))
    if biggest > half:  # RoundPipe warns and raises the limit to twice the biggest unit
        half = biggest
    candidates = set()
    for times in (fwd_s, bwd_s):
        for a in range(n):
            acc = 0.0
            for b in range(a, n):
                acc += times[b]
                if acc > max_work * upper_threshold:
                    break
                if acc >= max_work:
                    candidates.add(acc)
    best: tuple[float, list, int, list, float] | None = None
    for W in sorted(candidates):
        end, acc, size = n, 0.0, 0.0
        for u in range(n - 1, 0, -1):  # the fused stage: the last units that fit (never the embedding)
            if acc + bwd_s[u] > W or size + bwd_bytes[u] > half:
                break
            acc += bwd_s[u]
            size += bwd_bytes[u]
            end = u
        fwd = _pack(range(end - 1, -1, -1), fwd_s, fwd_bytes, W, half)[::-1]
        bwd = _pack(range(end), bwd_s, bwd_bytes, W, half)
        cost = max(len(fwd) + 1 + len(bwd), min_stages) * W
        if best is None or cost < best[0]:
            best = (cost, fwd, end, bwd, W)
    assert best is not None
    _, fwd, end, bwd, W = best
    # units -> blocks: unit 0 is the embedding, units 1..L the blocks, unit L + 1 the head
    L = n - 2
    return Partition(
        tuple(_blocks(run) for run in sorted(fwd)), L + 1 - end, tuple(_blocks(run) for run in sorted(bwd)), W
    )


def _pack(order: range, times: Sequence[float], sizes: Sequence[float], W: float, half: float) -> list[tuple[int, int]]:
    """Stages ``(first unit, last unit)`` packed along ``order``, each within ``W`` and ``half``."""
    stages: list[list[int]] = []
    acc = size = math.inf
    for u in order:
        if acc + times[u] > W or size + sizes[u] > half:
            stages.append([])
            acc = size = 0.0
        stages[-1].append(u)
        acc += times[u]
        size += sizes[u]
    return [(min(s), max(s)) for s in stages]


def _blocks(run: tuple[int, int]) -> int:
    """Blocks in a run of units (the embedding, unit 0, is not a block)."""
    a, b = run
    return b - max(a, 1) + 1 if b >= 1 else 0


def unit_profile(costs: CostModel, device: str, mbs: int) -> tuple[list[float], list[float], list[float], list[float]]:
    """(forward s, recompute + backward s, parameter bytes, parameter + gradient bytes) of the ``L + 2``
    units on ``device`` for one micro-batch: what RoundPipe's timer and sizes give ``auto``."""
    model = costs.model
    lf, lb, lbr, ef, eb, hf, hb = costs.unit_costs(device, mbs)
    L = model.num_layers
    w = model.bytes_per_element
    emb = model.end_params(True, False) * w
    block = model.params_per_layer * w
    head = model.end_params(False, True) * w
    fwd = [ef] + [lf] * L + [hf]
    bwd = [ef + eb] + [lbr] * L + [hf + hb]
    fb = [emb] + [block] * L + [head]
    return fwd, bwd, fb, [2 * x for x in fb]


def auto_stages(
    costs: CostModel,
    devices: Sequence[str],
    mbs: int,
    upper_threshold: float = 1.1,
    memory_limit_GiB: float = 0.0,
    recompute_grain: str = "stage",
    accumulation_steps: int = 1,
) -> RoundPipeStages:
    """The pool's pipeline as RoundPipe's ``ModelExecutePlan.auto`` would cut it for this model: unit times
    on the pool's slowest GPU (the simulator's, where RoundPipe measures them in a first iteration),
    ``min_stages`` = the pool size, the memory limit (0: RoundPipe's 60% default) in GiB."""
    slowest = max(devices, key=lambda d: sum(costs.unit_costs(d, mbs)))
    fwd, bwd, fb, bb = unit_profile(costs, slowest, mbs)
    smallest = min(costs.effective_cluster.device(d).memory_GiB for d in devices)
    probe = RoundPipeStages(tuple(devices), (1,), (1,), memory_limit_GiB=memory_limit_GiB)
    limit = probe.memory_limit_for(smallest)
    part = auto_partition(fwd, bwd, fb, bb, len(devices), upper_threshold, limit * GiB)
    return RoundPipeStages(
        tuple(devices),
        part.forward_layers,
        part.backward_layers,
        part.fused_layers,
        recompute_grain,
        memory_limit_GiB,
        accumulation_steps,
    )
