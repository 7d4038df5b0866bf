"""Optuna TPE over the shared search space, on a storage that survives a kill.

Every dimension of the space is a categorical parameter. The study lives in a storage on disk
(default ``sqlite:///optuna.db``; a ``.journal`` path or ``journal:`` URL selects Optuna's
``JournalStorage`` with a file backend, the storage for several worker processes; ``memory`` keeps
it in memory, for experiments that need no resume), so a re-run with
the same study name continues where the last one stopped.

Trial bookkeeping: a trial that evaluated a new plan carries ``user_attrs["evaluated"] = True``;
trials whose plan was invalid or a repeat (answered from the cache, free) carry ``False``. A search
ends when the study holds exactly ``budget`` evaluated trials. Plans found in MLflow but missing from
the study (a kill between the MLflow write and ``study.tell``) are added back as finished trials;
trials left RUNNING by a killed process are marked FAIL when the search resumes (one
``autotune search`` per study at a time; ``--workers`` processes are its own, see ``parallel``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from autotune.search.budget import BudgetedEvaluator
from autotune.search.space import SearchSpace
from autotune.specs import ParallelConfig

log = logging.getLogger(__name__)

DEFAULT_STORAGE = "sqlite:///optuna.db"
MLFLOW_RUN_ATTR = "mlflow_run_id"


def open_storage(storage: str | None):
    """An Optuna storage from a URL: ``sqlite:///x.db`` (RDB) or ``journal:path`` / ``*.journal``."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    url = storage or DEFAULT_STORAGE
    if url == "memory":  # no file: experiments that need no resume
        return optuna.storages.InMemoryStorage()
    if url.startswith("journal:") or url.endswith(".journal"):
        path = url.removeprefix("journal:").removeprefix("///") if url.startswith("journal:") else url
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(path))
    return optuna.storages.RDBStorage(url)


def distributions(space: SearchSpace) -> dict[str, Any]:
    from optuna.distributions import CategoricalDistribution

    return {d.name: CategoricalDistribution(list(d.choices)) for d in space.dimensions}


def open_study(space: SearchSpace, study_name: str, storage: str | None, seed: int):
    import optuna

    import warnings

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=10, multivariate=True)
    return optuna.create_study(study_name=study_name, storage=open_storage(storage), sampler=sampler,
                               direction="maximize", load_if_exists=True)


def evaluated_trials(study) -> list:
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.user_attrs.get("evaluated")]


def fail_stale_trials(study) -> int:
    """Mark trials left RUNNING by a killed process as FAIL (call only when no other worker runs)."""
    from optuna.trial import TrialState

    stale = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    for t in stale:
        # its plan, if it was evaluated, is recovered from MLflow as a new trial (sync_from_evaluator)
        study._storage.set_trial_user_attr(t._trial_id, "evaluated", False)  # public BaseStorage methods
        study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
    return len(stale)


def sync_from_evaluator(study, space: SearchSpace, evaluator: BudgetedEvaluator) -> int:
    """Add evaluations the study does not know (recovered from MLflow) as finished trials."""
    import optuna

    known = {t.user_attrs.get("config_key") for t in evaluated_trials(study)}
    dists = distributions(space)
    added = 0
    from autotune.search.tracking import config_key

    for ev in evaluator.history:
        key = config_key(ev.config)
        if key in known or set(ev.params) != set(dists):
            continue
        params = {k: ev.params[k] for k in dists}
        if any(v not in dists[k].choices for k, v in params.items()):
            continue
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions=dists, value=ev.score,
            user_attrs={"evaluated": True, "config_key": key, "status": ev.measurement.status, "recovered": True}))
        added += 1
    return added


def add_outside_trial(study, config: ParallelConfig, measurement, source: str) -> bool:
    """Record a plan evaluated outside TPE's encoding (the structured planner's start plan) as a
    finished trial without parameters: TPE ignores it when it models the parameters, the study's
    best value includes it, and the study still holds every evaluated plan (resume, new MLflow
    stores). False when the study has it already."""
    import optuna

    from autotune.search.tracking import config_key

    key = config_key(config)
    if key in {t.user_attrs.get("config_key") for t in evaluated_trials(study)}:
        return False
    study.add_trial(optuna.trial.create_trial(
        params={}, distributions={}, value=measurement.score(),
        user_attrs={"evaluated": True, "config_key": key, "status": "oom" if measurement.oom else measurement.status,
                    "config": json.loads(config.to_json(indent=None)), "measurement": measurement.to_dict(),
                    "source": source}))
    return True


def run_optuna(space: SearchSpace, evaluator: BudgetedEvaluator, seed: int = 0, *, study=None,
               study_name: str = "autotune", storage: str | None = None, warm_start: bool = True,
               max_asks_per_eval: int = 100) -> None:
    """TPE until ``evaluator`` has spent its budget. ``study`` may be passed already open (resume)."""
    from autotune.search.tracking import config_key

    if study is None:
        study = open_study(space, study_name, storage, seed)
    dists = distributions(space)
    if warm_start and not study.trials:
        for params in space.heuristic_params():
            study.enqueue_trial(params)
    misses = 0
    while not evaluator.exhausted and misses < max_asks_per_eval:
        trial = study.ask(dists)
        decoded = space.decode(trial.params)
        if not decoded.ok:
            misses += 1
            trial.set_user_attr("evaluated", False)
            trial.set_user_attr("invalid", decoded.reason[:500])
            study.tell(trial, 0.0)
            continue
        config: ParallelConfig = decoded.config  # type: ignore[assignment]
        new = evaluator.would_cost(config)
        measurement = evaluator.evaluate(config, trial.params)
        misses = 0 if new else misses + 1
        trial.set_user_attr("evaluated", new)
        trial.set_user_attr("config_key", config_key(config))
        trial.set_user_attr("status", "oom" if measurement.oom else measurement.status)
        if new:
            trial.set_user_attr("config", json.loads(config.to_json(indent=None)))
            trial.set_user_attr("measurement", measurement.to_dict())
        study.tell(trial, measurement.score())
    if not evaluator.exhausted:
        log.info("optuna: %d asks in a row gave no new valid plan; stopping at %d evaluations",
                 max_asks_per_eval, evaluator.used)
