"""Optuna TPE over the shared search space (``run_optuna``), on a study several processes may share
(``shared_study.SharedStudy``, in a storage that survives a kill: ``optuna_storage``).

Every dimension of the space is a categorical parameter. A re-run with the same study name continues
where the last one stopped.

Memory first: a proposal the memory model says does not fit (``BudgetedEvaluator.screen_memory``)
is never claimed; TPE's copy gets it with the constraint ``memory`` = how far over its usable memory
the fullest device is (``trial.set_constraint``; every evaluated trial gets its own, <= 0), so TPE
learns where plans fit, and the proposal is repaired toward memory (``_repair``): the first of
``memory_first.memory_repairs`` that fits is evaluated as a trial of its own. The warm start ends
with the space's most memory-frugal plan. Screened-out proposals are not kept in the storage (they
are free and the memory model answers them again on a resume).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from autotune.planning.budget import BudgetedEvaluator
from autotune.planning.space import SearchSpace
from autotune.search import workers
from autotune.search.agents.shared_study import SharedStudy, open_study
from autotune.specs import Measurement, ParallelConfig

log = logging.getLogger(__name__)


def warm_start_params(space: SearchSpace, evaluator=None) -> list:
    """The trials TPE starts with: the speed-proportional starts, then the most memory-frugal plan of
    the space (``autotune.planning.memory_first``), each once."""
    from autotune.planning.memory_first import frugal_start

    out = list(space.heuristic_params())
    frugal = frugal_start(space, evaluator)
    if frugal is not None:
        seen = {space.decode(p).config for p in out}
        if space.decode(frugal).config not in seen:
            out.append(frugal)
    return out


def memory_constraint(evaluator: BudgetedEvaluator, measurement: Measurement) -> float:
    """TPE's constraint for a trial (``trial.set_constraint("memory", ...)``; feasible when <= 0):
    the fullest device's use of its usable memory minus 1 by the memory model (how far a plan is from
    fitting, so TPE learns the boundary), capped at 0 for a plan that runs; 1 for an out-of-memory
    plan whose memory the evaluator does not know, 0 for other failures."""
    use = evaluator.memory_use(measurement) if measurement.peak_memory_GiB else None
    if measurement.oom:
        return max(use - 1.0, 1e-3) if use is not None else 1.0
    if use is None:
        return 0.0
    return min(use - 1.0, 0.0)


def _repair(
    space: SearchSpace,
    evaluator: BudgetedEvaluator,
    shared: SharedStudy,
    params: dict[str, Any],
    evaluate_claimed: Callable[[dict[str, Any], ParallelConfig], Measurement | None],
) -> bool:
    """A TPE proposal the memory model screened out is repaired toward memory
    (``memory_first.memory_repairs``: recompute, micro-batch 1, ZeRO, offload, then wider tp and a
    deeper pipeline step by step; screened steps are free): the first step the memory model passes is
    evaluated (claimed like any plan) and told to TPE as a trial of its own parameters, so TPE learns
    the infeasible proposal (its constraint) and a feasible plan next to it, and a memory-tight space
    costs about one ask per evaluation instead of tens. True when a repair was evaluated."""
    from autotune.planning.memory_first import memory_repairs

    for fixed in memory_repairs(space, params):
        decoded = space.decode(fixed)
        if not decoded.ok:
            continue
        if evaluator.exhausted:
            return False
        config: ParallelConfig = decoded.config  # type: ignore[assignment]
        if not evaluator.would_cost(config):
            if evaluator.evaluate(config).oom:
                continue  # screened out before: one more step
            return False  # a plan evaluated before: TPE has it already
        if evaluator.screen_memory(config, fixed) is not None:
            continue
        m = evaluate_claimed(fixed, config)
        if m is None:
            return False
        shared.add_local(fixed, m.score(), constraints={"memory": memory_constraint(evaluator, m)})
        return True
    return False


def run_optuna(
    space: SearchSpace,
    evaluator: BudgetedEvaluator,
    seed: int = 0,
    *,
    study: SharedStudy | None = None,
    study_name: str = "autotune",
    storage: str | None = None,
    warm_start: bool = True,
    max_asks_per_eval: int = 100,
    worker: str | None = None,
    poll_s: float = 0.2,
) -> None:
    """TPE until the study holds ``evaluator.budget`` evaluated plans (this process's and any other's
    on the same study). ``study`` may be passed already open (resume)."""
    from optuna.trial import TrialState

    from autotune.search.tracking import config_key

    shared = study if study is not None else open_study(space, study_name, storage, seed)
    worker = worker or workers.new_worker_id()
    budget = evaluator.budget
    with workers.live(worker):
        state = shared.sync(evaluator, worker=worker)
        # nothing TPE can model yet but RoundPipe's start plan (a dp start plan has no parameters)
        if warm_start and len(shared.local.trials) <= state.starts:
            for params in warm_start_params(space, evaluator):
                shared.local.enqueue_trial({k: v for k, v in params.items() if k in shared.model_dists})

        def evaluate_claimed(params: dict[str, Any], config: ParallelConfig) -> Measurement | None:
            """Claim, evaluate and record one new plan under the study's budget rule; None when the
            claim is refused (another worker's plan, or the budget is spoken for)."""
            claim = shared.claim(dict(params), config, config_key(config), worker, budget)
            if claim is None:
                return None
            shared.heartbeat(claim)
            try:
                return evaluator.evaluate(
                    config, params, commit=lambda m, c=claim: shared.complete(c, m, worker, budget)
                )
            finally:
                shared.heartbeat(None)
                shared.withdraw(claim)  # nothing evaluated (invalid for the backend): give the claim back

        misses = 0
        while misses < max_asks_per_eval:
            if state.evaluated >= budget or evaluator.exhausted:
                break
            if state.evaluated + state.live_claims >= budget:  # the rest is being evaluated elsewhere
                time.sleep(poll_s)
                state = shared.sync(evaluator, worker=worker)
                continue
            trial = shared.local.ask(shared.model_dists)
            params = shared.full(trial.params)
            decoded = space.decode(params)
            if not decoded.ok:
                misses += 1
                evaluator.invalid += 1  # a proposal that breaks a rule: free, counted for the summary
                shared.local.tell(trial, 0.0)
                continue
            config: ParallelConfig = decoded.config  # type: ignore[assignment]
            if not evaluator.would_cost(config):  # a repeat (of any worker's plan): free
                misses += 1
                m = evaluator.evaluate(config)
                trial.set_constraint("memory", memory_constraint(evaluator, m))
                shared.local.tell(trial, m.score())
                continue
            oom = evaluator.screen_memory(config, params)  # memory first: free, nothing claimed
            if oom is not None:
                trial.set_constraint("memory", memory_constraint(evaluator, oom))
                shared.local.tell(trial, 0.0)
                if not evaluator.exhausted:
                    _repair(space, evaluator, shared, params, evaluate_claimed)
                    state = shared.sync(evaluator, worker=worker)
                continue
            m = evaluate_claimed(params, config)
            if m is None:  # another worker's plan, or the budget is spoken for
                misses += 1
                shared.local.tell(trial, state=TrialState.FAIL)
                time.sleep(poll_s / 4)
                state = shared.sync(evaluator, worker=worker)
                continue
            misses = misses + 1 if m.status == "invalid" else 0
            trial.set_constraint("memory", memory_constraint(evaluator, m))
            shared.local.tell(trial, m.score())
            state = shared.sync(evaluator, worker=worker)
    if not evaluator.exhausted:
        evaluator.ended = f"{max_asks_per_eval} asks in a row gave no new valid plan: the reachable space is exhausted"
        log.info("optuna: %s; stopping at %d evaluations", evaluator.ended, evaluator.used)
