"""Several Optuna worker processes on one study (``--workers N``).

Each worker is a process running the same agent as a single search (``tpe.run_optuna``) with its own
evaluator and TPE sampler (seed + worker index) on the shared storage; the budget rule and the
claims that keep two workers off one plan are the study's (``tpe`` module docstring), so these
workers and any other ``autotune search`` on the same study share one budget. The parent process
evaluates nothing: it watches the study and hands every plan its own workers evaluated to the
``BudgetedEvaluator`` listeners (MLflow child run, progress bar); plans evaluated by other searches
on the study are counted, not logged again.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
import uuid
from typing import Any

from autotune.lifeline import start_spawned
from autotune.planning.budget import BudgetedEvaluator
from autotune.planning.space import SearchSpace

log = logging.getLogger(__name__)


def worker_main(
    cluster,
    model,
    backend: str,
    profile: str | None,
    storage: str,
    study_name: str,
    seed: int,
    budget: int,
    restrict: dict | None,
    token: str,
    warm_start: bool,
    max_sync_every: int = 1,
    parent_pid: int | None = None,
    run_timeout_s: float = 300.0,
    engine: str | None = None,
) -> None:
    """One worker process: the Optuna agent on the shared study until it holds ``budget`` plans.
    It dies with the search process ``parent_pid`` (``autotune.lifeline``), even when that is killed."""
    import os

    from autotune.lifeline import die_with_parent

    die_with_parent(parent=parent_pid)

    import torch

    from autotune.evaluator import make_evaluator
    from autotune.search import workers
    from autotune.search.agents.shared_study import open_study
    from autotune.search.agents.tpe import run_optuna

    torch.set_num_threads(1)
    space = SearchSpace(cluster, model, restrict=restrict, max_sync_every=max_sync_every, engine=engine)
    inner = make_evaluator(cluster, model, backend, profile, run_timeout_s=run_timeout_s)
    # memory first: real runs are screened by the simulator's memory model of the same profile
    memory = None if hasattr(inner, "memory_check") else make_evaluator(cluster, model, "sim", profile)
    evaluator = BudgetedEvaluator(inner, space, budget, memory_model=memory)
    study = open_study(space, study_name, storage, seed)
    run_optuna(
        space, evaluator, seed, study=study, warm_start=warm_start, worker=f"{workers.machine()}:{os.getpid()}:{token}"
    )


def run_workers(
    space: SearchSpace,
    budgeted: BudgetedEvaluator,
    seed: int,
    *,
    study,
    storage: str,
    workers: int,
    cluster,
    model,
    backend: str,
    profile,
    poll_s: float = 0.3,
    run_timeout_s: float = 300.0,
    **_: Any,
) -> None:
    """Start ``workers`` processes on ``study`` and report their evaluations through ``budgeted``."""
    ctx = multiprocessing.get_context("spawn")
    tokens = [f"w{i}-{uuid.uuid4().hex[:6]}" for i in range(workers)]
    procs = [
        ctx.Process(
            target=worker_main,
            daemon=True,
            args=(
                cluster,
                model,
                backend,
                str(profile) if profile else None,
                storage,
                study.study_name,
                seed + i,
                budgeted.budget,
                dict(space.restrict),
                tokens[i],
                i == 0,
                space.max_sync_every,
                os.getpid(),
                run_timeout_s,
                space.engine,
            ),
        )
        for i in range(workers)
    ]
    for p in procs:
        start_spawned(p)  # a library user's script without a __main__ guard is not run again there

    def ours(trial) -> bool:
        return str(trial.user_attrs.get("worker", "")).rsplit(":", 1)[-1] in tokens

    try:
        while True:
            alive = any(p.is_alive() for p in procs)
            study.sync(budgeted, notify=ours)
            if not alive:
                break
            time.sleep(poll_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
    study.sync(budgeted, notify=ours)
