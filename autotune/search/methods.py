"""How each method runs on the budget: RoundPipe's own plan and (optuna, rl ``--policy scratch`` with
``start="dp"``) the structured planner's best plans first, then the agent itself (rl's chooser starts with
the planner's first plan itself)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autotune.planning.budget import PRUNED, BudgetedEvaluator
from autotune.planning.space import SearchSpace
from autotune.search.agents import run_exhaustive, run_random, run_uniform
from autotune.specs import Measurement

#: planner plans evaluated first when ``start="dp"`` (they count against the budget like any plan):
#: the composition misranks a plan now and then, and on 24 validation scenarios
#: (experiments/quality/dp_start_plans.py) the best of the first 3 reached 98% of dp's best-of-20 on 23, the first
#: alone on 22
DP_START_PLANS = 3


def _starts_with_dp(method: str, start: str, policy) -> bool:
    """Whether ``method`` evaluates the planner's best plans first (``_dp_start``): optuna and rl with
    ``start="dp"``; rl's chooser (an acquisition policy) starts itself."""
    from autotune.search.agents.acquire import uses_acquisition  # the chooser's modules: only for a search

    return method in ("optuna", "rl") and start == "dp" and not (method == "rl" and uses_acquisition(policy))


def plans_ahead(method: str, start: str, policy, space: SearchSpace, evaluator) -> list | None:
    """The planner's plans ``_dp_start`` will filter, computed now (``autotune.search.api`` calls it while
    the MLflow writer process starts, whose start the search would otherwise wait for); None where the
    search does not start with them."""
    if not _starts_with_dp(method, start, policy):
        return None
    from autotune.planning.planner import planned

    return planned(space, evaluator, 4 * 4 * DP_START_PLANS)  # plan_candidates' own ask for 4 x plans


def _dp_start(
    space: SearchSpace,
    budgeted: BudgetedEvaluator,
    plans: int = DP_START_PLANS,
    evaluate: Callable[..., Measurement | None] | None = None,
    ahead: list | None = None,
) -> list:
    """Evaluate the planner's best ``plans`` valid plans (free on a resume: already evaluated);
    returns their (config, measurement). ``evaluate(config, params)`` replaces
    ``budgeted.evaluate`` (an Optuna study records the plan under its budget rule; None: another
    search on the study has it); ``ahead``: ``plans_ahead``'s plans for the default ``plans``."""
    from autotune.planning.planner import plan_candidates

    evaluate = evaluate or budgeted.evaluate
    out = []
    ahead = ahead if plans == DP_START_PLANS else None
    for cand in plan_candidates(space, budgeted, limit=4 * plans, ahead=ahead):
        if len(out) >= plans or (budgeted.exhausted and cand.config not in budgeted):
            break
        # the plan as a point of the space (``SearchSpace.encode``): TPE models it, an env episode starts from it
        params = {**space.encode(cand.config), "dp_family": cand.family, "dp_estimate_s": round(cand.estimate_s, 6)}
        m = evaluate(cand.config, params)
        if m is not None and m.status not in ("invalid", PRUNED):  # screened out by the memory model: no start
            out.append((cand.config, m))
    return out


def run_agent(method: str, space: SearchSpace, budgeted: BudgetedEvaluator, seed: int, **kw: Any) -> None:
    from autotune.search import workers as worker_ids

    worker = worker_ids.new_worker_id()
    with worker_ids.live(worker):
        _run_method(method, space, budgeted, seed, worker=worker, **kw)


def _roundpipe_start(space: SearchSpace, budgeted: BudgetedEvaluator, study=None, worker: str = "") -> None:
    """Evaluate the plan RoundPipe itself would pick (``SearchSpace.roundpipe_start``), where RoundPipe
    applies: every method starts from it (free on a resume: already evaluated). An Optuna study records
    it as a trial with its parameters, so TPE models it."""
    params = space.roundpipe_start()
    if params is None:
        return
    config = space.decode(params).config
    if config is None or (config not in budgeted and budgeted.exhausted):
        return
    if study is not None:
        from autotune.search.agents.shared_study import ROUNDPIPE_START

        study.evaluate_outside(budgeted, config, params, worker, source=ROUNDPIPE_START, encoded=True)
    else:
        budgeted.evaluate(config, params)


def _run_method(
    method: str, space: SearchSpace, budgeted: BudgetedEvaluator, seed: int, *, worker: str, **kw: Any
) -> None:
    # RoundPipe's own plan first, where it is free (the simulator); a real run is the planner's to choose:
    # the first real run was RoundPipe's default start on every method (issue 45), 0.29-1.0 of the best
    if kw.get("backend", "sim") != "real":
        _roundpipe_start(space, budgeted, kw.get("study") if method == "optuna" else None, worker)
    ahead = kw.pop("ahead", None)
    from autotune.search.agents.acquire import uses_acquisition  # the chooser's modules: only for a search

    acquire = method == "rl" and uses_acquisition(kw.get("policy"))
    if _starts_with_dp(method, kw.get("start", "dp"), kw.get("policy")):  # the chooser starts itself
        study = kw.get("study") if method == "optuna" else None
        if study is not None:  # the study stays the budget's memory (see SharedStudy.evaluate_outside)
            _dp_start(
                space,
                budgeted,
                evaluate=lambda config, params: study.evaluate_outside(budgeted, config, params, worker, source="dp"),
                ahead=ahead,
            )
        else:
            _dp_start(space, budgeted, ahead=ahead)
    if method == "random":
        run_random(space, budgeted, seed)
    elif method == "uniform":
        run_uniform(space, budgeted, seed)
    elif method == "exhaustive":
        run_exhaustive(space, budgeted, seed)
    elif method == "dp":
        from autotune.search.agents.dp import run_dp

        run_dp(space, budgeted, seed)
    elif method == "optuna":
        from autotune.search.agents import tpe

        if kw["workers"] > 1:
            from autotune.search.agents import parallel

            parallel.run_workers(space, budgeted, seed, **kw)
        else:
            tpe.run_optuna(space, budgeted, seed, study=kw["study"], worker=worker)
    elif acquire:
        from autotune.search.agents.acquire import STOP_GAIN, run_acquire

        stop = STOP_GAIN if kw.get("backend") == "real" else None
        run_acquire(space, budgeted, seed, policy_path=kw.get("policy"), stop_gain=stop)
    elif method == "rl":  # --policy scratch: online learning on autotune/ParallelConfig-v0
        from autotune.search.agents import rl

        rl.run_rl(space, budgeted, budgeted.budget, seed)
