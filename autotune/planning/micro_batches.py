"""The planner's micro-batch correction: its best plans at every other micro-batch size (issue 25).

The composition picks a plan's micro-batch size with its structure, and the families decoded around its best
plans (``mixed_stages``, ``moe_plans``) keep the base plan's size. The simulator prices what the choice trades
(kernel efficiency and launch overheads per micro-batch, the pipeline's fill, activation memory), so the best
size of a structure is often another: on ``internet-4node`` (2 nodes of 4 A100 + 2 of 4 RTX-4090 over
1 Gbit/s) dp's best plan, two mixed stages of 4 A100s at micro-batch 2, runs 8.6% faster at micro-batch 8,
which a local move from it finds and dp's composition did not.

``variants(space, sim, candidate, max_simulations)`` edits the plan's micro-batch size as a point of the space
(``SearchSpace.encode``: the plan itself, micro-batches and per-rank shares rescaled in proportion), keeps
the sizes the memory model says fit and returns the fastest, when it beats the plan.
"""

from __future__ import annotations

from autotune.planning.candidate import Candidate
from autotune.planning.space import SearchSpace


def variants(space: SearchSpace, sim, candidate: Candidate, max_simulations: int) -> list[Candidate]:
    """``[the plan at its fastest other micro-batch size]`` when that beats ``candidate``, else ``[]``; at most
    ``max_simulations`` calls of ``sim`` (a ``Simulator``: ``memory_estimate``, ``evaluate``)."""
    config = candidate.config
    if config.is_roundpipe:  # RoundPipe's own family varies its micro-batch size
        return []
    params = space.encode(config)
    best, calls = None, 0
    for mbs in space._dims["mbs"].choices:
        if mbs == config.micro_batch_size or calls >= max_simulations - 1:
            continue
        other = space.decode(dict(params, mbs=mbs)).config
        if other is None or other.micro_batch_size != mbs:
            continue
        memory = sim.memory_estimate(other)
        calls += 1
        if memory is None or not memory.ok:
            continue
        m = sim.evaluate(other)
        calls += 1
        limit = best.estimate_s if best is not None else candidate.estimate_s
        if m.ok and m.iteration_time_s < limit:
            best = Candidate(other, m.iteration_time_s, f"{candidate.family}+mbs{mbs}")
    return [best] if best is not None else []
