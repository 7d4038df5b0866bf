"""Several Optuna worker processes on one study (``--workers N``).

Each worker is a process with its own evaluator and TPE sampler (seed + worker index) on the shared
storage (default ``optuna.journal``: Optuna's ``JournalStorage`` with a file backend, safe for
several processes). The parent process evaluates nothing: it watches the study and hands every newly
evaluated plan to the ``BudgetedEvaluator`` listeners (MLflow child run, progress bar).

Budget rule across processes: a worker evaluates its trial's plan only when the evaluated trials plus
the still-running trials with a smaller number are fewer than ``budget``. A trial's number is fixed
when it is created, so of any ``budget + 1`` evaluated trials the one with the largest number would
have counted the others, and the study never exceeds ``budget`` evaluated trials. A plan another
worker is evaluating right now, or has evaluated, is not evaluated again.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import time
from typing import Any

from autotune.search.budget import BudgetedEvaluator
from autotune.search.space import SearchSpace
from autotune.specs import Measurement, ParallelConfig

log = logging.getLogger(__name__)
DEFAULT_JOURNAL = "optuna.journal"


def _counts(study, number: int | None = None) -> tuple[int, int, dict[str, Any], set[str]]:
    from optuna.trial import TrialState

    evaluated, running_before, known, claimed = 0, 0, {}, set()
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.COMPLETE and t.user_attrs.get("evaluated"):
            evaluated += 1
            known[t.user_attrs["config_key"]] = t.value
        elif t.state == TrialState.RUNNING:
            if t.user_attrs.get("claimed"):
                claimed.add(t.user_attrs.get("config_key", ""))
            if number is None or t.number < number:
                running_before += 1 if (number is not None or t.user_attrs.get("claimed")) else 0
    return evaluated, running_before, known, claimed


def worker_main(cluster, model, backend: str, profile: str | None, storage: str, study_name: str, seed: int,
                budget: int, restrict: dict | None) -> None:
    """One worker process: ask, decode, claim, evaluate, tell, until the study holds ``budget`` plans."""
    import torch
    from optuna.trial import TrialState

    from autotune.search.agents.tpe import distributions, open_study
    from autotune.evaluator import make_evaluator
    from autotune.search.tracking import config_key

    torch.set_num_threads(1)
    space = SearchSpace(cluster, model, restrict=restrict)
    evaluator = make_evaluator(cluster, model, backend, profile)
    study = open_study(space, study_name, storage, seed)
    dists = distributions(space)
    idle = 0
    while idle < 200:
        evaluated, claimed_running, known, _ = _counts(study)
        if evaluated + claimed_running >= budget:
            return
        trial = study.ask(dists)
        decoded = space.decode(trial.params)
        if not decoded.ok:
            trial.set_user_attr("evaluated", False)
            study.tell(trial, 0.0)
            idle += 1
            continue
        config: ParallelConfig = decoded.config  # type: ignore[assignment]
        key = config_key(config)
        evaluated, before, known, claimed = _counts(study, trial.number)
        if key in known:
            trial.set_user_attr("evaluated", False)
            study.tell(trial, known[key])
            idle += 1
            continue
        if key in claimed or evaluated + before >= budget:
            study.tell(trial, state=TrialState.FAIL)  # someone else has it, or the budget may be spoken for
            idle += 1
            time.sleep(0.05)
            continue
        trial.set_user_attr("claimed", True)
        trial.set_user_attr("config_key", key)
        m = evaluator.evaluate(config)
        idle = 0
        trial.set_user_attr("evaluated", True)
        trial.set_user_attr("status", "oom" if m.oom else m.status)
        trial.set_user_attr("config", json.loads(config.to_json(indent=None)))
        trial.set_user_attr("measurement", m.to_dict())
        study.tell(trial, m.score())


def run_workers(space: SearchSpace, budgeted: BudgetedEvaluator, seed: int, *, study, storage: str | None,
                workers: int, cluster, model, backend: str, profile, poll_s: float = 0.5, **_: Any) -> None:
    """Start ``workers`` processes on ``study`` and report their evaluations through ``budgeted``."""
    if not study.trials:
        for params in space.heuristic_params():  # the same warm start as one worker
            study.enqueue_trial(params)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=worker_main, daemon=True,
                         args=(cluster, model, backend, str(profile) if profile else None, storage or DEFAULT_JOURNAL,
                               study.study_name, seed + i, budgeted.budget, dict(space.restrict)))
             for i in range(workers)]
    for p in procs:
        p.start()
    try:
        while True:
            alive = any(p.is_alive() for p in procs)
            _collect(study, budgeted)
            if not alive:
                break
            time.sleep(poll_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
    _collect(study, budgeted)


def _collect(study, budgeted: BudgetedEvaluator) -> None:
    from optuna.trial import TrialState

    for t in sorted(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=lambda t: t.number):
        if not t.user_attrs.get("evaluated") or "config" not in t.user_attrs:
            continue
        config = ParallelConfig.from_dict(t.user_attrs["config"])
        if config in budgeted:
            continue
        m = Measurement.from_dict(t.user_attrs.get("measurement", {"status": t.user_attrs.get("status", "ok"),
                                                                      "tokens_per_s": t.value or 0.0}))
        budgeted.record(config, m, t.params)
