"""The ``dp`` agent: the structured planner's plans (``autotune.planning.planner``), best composed time
first, each evaluated by the search's evaluator (the full simulator, or a real run) until the budget is
spent. Deterministic: ``seed`` is unused."""

from __future__ import annotations

import logging

from autotune.planning.budget import BudgetedEvaluator
from autotune.planning.planner import plan_candidates
from autotune.planning.space import SearchSpace

log = logging.getLogger(__name__)

#: planner candidates drawn per unit of budget (invalid or repeated plans cost nothing)
CANDIDATES_PER_EVALUATION = 3


def run_dp(space: SearchSpace, evaluator: BudgetedEvaluator, seed: int = 0) -> None:
    del seed
    candidates = plan_candidates(space, evaluator, limit=max(8, CANDIDATES_PER_EVALUATION * evaluator.remaining))
    if not candidates:
        log.warning("dp: the planner found no plan that fits (every composition is out of memory)")
    for rank, cand in enumerate(candidates):
        if evaluator.exhausted:
            break
        meta = {"dp_rank": rank, "dp_family": cand.family, "dp_estimate_s": round(cand.estimate_s, 6)}
        evaluator.evaluate(cand.config, {**space.encode(cand.config), **meta})
    if not evaluator.exhausted and not any(ev.measurement.ok for ev in evaluator.history):
        # memory first: nothing the planner composed runs; the space's most memory-frugal plan
        from autotune.planning.memory_first import frugal_start

        frugal = frugal_start(space, evaluator)
        decoded = space.decode(frugal) if frugal is not None else None
        if decoded is not None and decoded.ok:
            evaluator.evaluate(decoded.config, frugal)
    if not evaluator.exhausted:
        evaluator.ended = f"every one of the planner's {len(candidates)} plans was evaluated"
