"""The planner's last step: the layer split of its best plans, corrected by the simulator (issue 25).

Every family splits a pipeline's layers by a speed estimate: the composition by the cost model's per-stage
coefficients, the families decoded from the space (``mixed_stages``) by each stage's summed per-rank rates.
The simulator sees what those estimates leave out (the embedding on the first stage and the head on the
last, recomputation, a mixed stage's busiest rank, ZeRO traffic), so its busiest stage is often not the one
the split expected. On Sailor's A100 + V100 setting with its measured layer times, a pipeline of a 16-V100
stage and a 16-A100 stage split 7 / 17 keeps the V100 stage busy 11.7 s against 7.7 s; 5 / 19 is 1.33x faster.

``rebalance(space, sim, candidate, max_simulations)`` moves one layer at a time from the busiest stage
(``Measurement.stage_busy_s``) to its less busy neighbour, in every pipeline alike, while the simulated
iteration time falls and the memory model says the plan fits.
"""

from __future__ import annotations

from dataclasses import replace

from autotune.planning.candidate import Candidate
from autotune.planning.space import SearchSpace
from autotune.specs import ParallelConfig

SUFFIX = "rebalanced"


def rebalance(space: SearchSpace, sim, candidate: Candidate, max_simulations: int = 12) -> Candidate:
    """``candidate`` with its layer split moved towards its simulated bottleneck (module docstring), at most
    ``max_simulations`` plans timed by ``sim`` (a ``Simulator``); the candidate itself when no move helps or
    its pipelines differ in depth (and for RoundPipe and interleaved plans, whose chunks split otherwise)."""
    config = candidate.config
    if config.is_roundpipe or config.virtual_stages > 1:
        return candidate
    depth = len(config.pipelines[0].stages)
    if depth < 2 or any(len(p.stages) != depth for p in config.pipelines):
        return candidate
    m = sim.evaluate(config)
    if not m.ok:
        return candidate
    best_s, busy = m.iteration_time_s, m.stage_busy_s
    moved_any = False
    for _ in range(max_simulations):
        hi = max(range(depth), key=lambda i: busy[i])
        neighbours = [j for j in (hi - 1, hi + 1) if 0 <= j < depth]
        lo = min(neighbours, key=lambda j: busy[j])
        moved = move_layer(config, hi, lo)
        if moved is None or space.check(moved) is not None:
            break
        memory = sim.memory_estimate(moved)
        if memory is None or not memory.ok:
            break
        m = sim.evaluate(moved)
        if not m.ok or m.iteration_time_s >= best_s:
            break
        config, best_s, busy, moved_any = moved, m.iteration_time_s, m.stage_busy_s, True
    if not moved_any:
        return candidate
    return Candidate(config, best_s, f"{candidate.family}+{SUFFIX}")


def move_layer(config: ParallelConfig, source: int, target: int) -> ParallelConfig | None:
    """``config`` with one layer moved from stage ``source`` to the adjacent stage ``target`` in every
    pipeline; None when a pipeline's ``source`` stage has only one layer."""
    pipes = []
    for p in config.pipelines:
        if p.stages[source].layers < 2:
            return None
        stages = list(p.stages)
        stages[source] = replace(stages[source], layers=stages[source].layers - 1)
        stages[target] = replace(stages[target], layers=stages[target].layers + 1)
        pipes.append(replace(p, stages=tuple(stages)))
    return replace(config, pipelines=tuple(pipes))
