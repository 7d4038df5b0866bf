"""The Optuna study several searches share (``SharedStudy``), and its budget rule across processes.

How a study is kept (``SharedStudy``): TPE samples in an in-memory copy of the study (no storage
round trip per parameter), and the storage gets only what other processes and a resumed search
need, four writes per evaluated plan:

1. a *claim*: a RUNNING trial created in one write with the plan's parameters and
   ``user_attrs`` ``claimed``, ``config_key``, ``config`` (the plan JSON), ``worker`` and
   ``heartbeat`` (``autotune.search.workers``);
2. after the evaluation ``measurement`` (the ``Measurement`` dict) and ``evaluated = True``;
3. the state COMPLETE with the plan's score (tokens/s, 0 when it does not run).

Invalid plans and repeats never reach the storage (they are free). Budget rule across processes
(``claim``): a claim with number ``n`` is evaluated only when the evaluated trials plus the live
claims with a smaller number are fewer than ``budget`` and no earlier claim or evaluation holds
the same plan; otherwise it is withdrawn (FAIL). Trial numbers are fixed at creation, so of any
``budget + 1`` evaluated trials the one with the largest number would have counted the others:
the study never exceeds ``budget`` evaluated trials, whatever the number of processes. A claim
whose worker is gone (killed, or silent for ``workers.GRACE_S``) is failed by whoever sees it, and
its plan may be evaluated again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autotune.planning.budget import PRUNED, BudgetedEvaluator
from autotune.planning.space import SearchSpace
from autotune.search import workers
from autotune.search.agents.optuna_storage import default_storage, open_storage
from autotune.specs import Measurement, ParallelConfig

log = logging.getLogger(__name__)


MLFLOW_RUN_ATTR = "mlflow_run_id"
PARENT_ATTR = "autotune.parent_run"  # on election trials (see ``SharedStudy.elect``)


def distributions(space: SearchSpace) -> dict[str, Any]:
    from optuna.distributions import CategoricalDistribution

    return {d.name: CategoricalDistribution(list(d.choices)) for d in space.dimensions}


def make_sampler(seed: int):
    import warnings

    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=10, multivariate=True)


@dataclass
class Claim:
    trial_id: int
    number: int
    config: ParallelConfig
    key: str
    done: bool = False


#: ``source`` of the trial of RoundPipe's start plan (``methods._roundpipe_start``): a study whose only
#: evaluations are such starts is still fresh (the heuristic warm starts are enqueued)
ROUNDPIPE_START = "roundpipe-start"


@dataclass(frozen=True)
class StudyState:
    evaluated: int  # COMPLETE trials with evaluated = True
    live_claims: int  # RUNNING claims whose worker is alive
    starts: int = 0  # of the evaluated: RoundPipe's start plan (``ROUNDPIPE_START``)


class SharedStudy:
    """One Optuna study in a storage, plus the in-memory copy TPE samples from."""

    def __init__(
        self,
        space: SearchSpace,
        study_name: str,
        storage: str | None,
        seed: int,
        fresh: bool = False,
        fingerprint: str | None = None,
    ) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.space = space
        self.url = storage or default_storage()
        self.storage = optuna.storages.get_storage(open_storage(self.url))
        study_name, self.passed_over = generation(self.storage, study_name, fresh, fingerprint)
        self.study = optuna.create_study(
            study_name=study_name,
            storage=self.storage,
            direction="maximize",
            load_if_exists=True,
            sampler=optuna.samplers.RandomSampler(seed),
        )
        if fingerprint is not None and FINGERPRINT_ATTR not in self.study.user_attrs:
            self.study.set_user_attr(FINGERPRINT_ATTR, fingerprint)
        self.study_name = study_name
        self.study_id = self.storage.get_study_id_from_name(study_name)
        self.local = optuna.create_study(direction="maximize", sampler=make_sampler(seed))
        self.dists = distributions(space)  # every dimension: what the storage's trials hold
        # what TPE models: a dimension with one choice tells it nothing and costs it time per trial
        # (TPE's work per ask grows with trials x dimensions); its value is added back by ``full``
        self.fixed = {k: d.choices[0] for k, d in self.dists.items() if len(d.choices) == 1}
        self.model_dists = {k: d for k, d in self.dists.items() if k not in self.fixed}
        self._mirrored: set[int] = set()  # storage trial ids copied into ``local``
        self._hb_lock = threading.Lock()
        self._hb_claim: Claim | None = None
        self._hb_thread: threading.Thread | None = None

    def full(self, params: dict[str, Any]) -> dict[str, Any]:
        """A TPE trial's parameters plus the one-choice dimensions TPE does not model."""
        return {**self.fixed, **params}

    def add_local(self, params: dict[str, Any], value: float, **kw: Any) -> None:
        """Tell TPE about a finished plan (``params``: every dimension of the space)."""
        import optuna

        self.local.add_trial(
            optuna.trial.create_trial(
                params={k: params[k] for k in self.model_dists}, distributions=self.model_dists, value=value, **kw
            )
        )

    # -- reading -----------------------------------------------------------------------------------
    def trials(self):
        return self.storage.get_all_trials(self.study_id, deepcopy=False)

    @property
    def user_attrs(self) -> dict[str, Any]:
        return self.storage.get_study_user_attrs(self.study_id)

    def set_user_attr(self, key: str, value: Any) -> None:
        self.storage.set_study_user_attr(self.study_id, key, value)

    def evaluated_trials(self) -> list:
        return evaluated_trials(self.study)

    def sync(
        self,
        evaluator: BudgetedEvaluator | None = None,
        notify: Callable[[Any], bool] | None = None,
        worker: str | None = None,
    ) -> StudyState:
        """Copy new evaluations into the TPE copy and ``evaluator``; fail abandoned claims.

        ``notify(trial)`` says whether ``evaluator``'s listeners hear about a trial (``--workers``:
        the evaluations of this search's own worker processes); other evaluations are preloaded."""
        from optuna.trial import TrialState

        evaluated, live, starts = 0, 0, 0
        now = time.time()
        for t in self.trials():
            if t.state == TrialState.COMPLETE and t.user_attrs.get("evaluated"):
                evaluated += 1
                starts += t.user_attrs.get("source") == ROUNDPIPE_START
                if t._trial_id not in self._mirrored:
                    self._mirror(t, evaluator, notify)
            elif t.state == TrialState.RUNNING and t.user_attrs.get("claimed"):
                if t.user_attrs.get("worker") == worker:
                    live += 1
                elif workers.abandoned(t.user_attrs.get("worker"), t.user_attrs.get("heartbeat"), now):
                    self._fail(t._trial_id, t.user_attrs)
                else:
                    live += 1
        return StudyState(evaluated, live, starts)

    def _mirror(self, t, evaluator: BudgetedEvaluator | None, notify: Callable[[Any], bool] | None) -> None:
        self._mirrored.add(t._trial_id)
        params = {k: v for k, v in t.params.items() if k in self.dists}
        if set(params) == set(self.dists) and all(v in self.dists[k].choices for k, v in params.items()):
            self.add_local(params, t.value or 0.0)
        found = trial_evaluation(t) if evaluator is not None else None
        if found is None or found[0] in evaluator:
            return
        config, m = found
        if notify is not None and notify(t):
            evaluator.record(config, m, params)
        else:
            evaluator.preload(config, m, params)

    def _fail(self, trial_id: int, attrs) -> None:
        from optuna.trial import TrialState

        try:
            if attrs.get("evaluated"):
                self.storage.set_trial_user_attr(trial_id, "evaluated", False)
            self.storage.set_trial_state_values(trial_id, TrialState.FAIL)
            log.info("optuna: failed trial %d left by worker %s", trial_id, attrs.get("worker"))
        except Exception as e:  # noqa: BLE001 - its owner finished it meanwhile: nothing to do
            log.debug("trial %d already finished: %s", trial_id, e)

    # -- claiming and completing -------------------------------------------------------------------
    def claim(
        self, params: dict[str, Any], config: ParallelConfig, key: str, worker: str, budget: int, **attrs: Any
    ) -> Claim | None:
        """Claim ``config`` for evaluation (see the module docstring); None when the plan is another
        worker's or the budget is spoken for."""
        import json

        import optuna
        from optuna.trial import TrialState

        template = optuna.trial.create_trial(
            state=TrialState.RUNNING,
            params=params,
            distributions={k: self.dists[k] for k in params},
            user_attrs={
                "claimed": True,
                "config_key": key,
                "config": json.loads(config.to_json(indent=None)),
                "worker": worker,
                "heartbeat": time.time(),
                **attrs,
            },
        )
        trial_id = self.storage.create_new_trial(self.study_id, template_trial=template)
        number = self.storage.get_trial_number_from_id(trial_id)
        evaluated, before, taken = 0, 0, False
        now = time.time()
        for t in self.trials():
            if t._trial_id == trial_id:
                continue
            if t.state == TrialState.COMPLETE and t.user_attrs.get("evaluated"):
                evaluated += 1
                taken |= t.user_attrs.get("config_key") == key
            elif t.state == TrialState.RUNNING and t.user_attrs.get("claimed") and t.number < number:
                if t.user_attrs.get("worker") != worker and workers.abandoned(
                    t.user_attrs.get("worker"), t.user_attrs.get("heartbeat"), now
                ):
                    continue
                before += 1
                taken |= t.user_attrs.get("config_key") == key
        if taken or evaluated + before >= budget:
            self._fail(trial_id, {})
            return None
        return Claim(trial_id, number, config, key)

    def complete(self, claim: Claim, m: Measurement, worker: str, budget: int) -> None:
        """Write an evaluated claim (after its evaluation, before anyone else hears of it)."""
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.trial import TrialState

        claim.done = True
        if m.status == PRUNED:  # screened out: not an evaluation, nothing to keep
            self._fail(claim.trial_id, {})
            return
        try:
            self.storage.set_trial_user_attr(claim.trial_id, "measurement", m.to_dict())
            self.storage.set_trial_user_attr(claim.trial_id, "evaluated", True)
            self.storage.set_trial_state_values(claim.trial_id, TrialState.COMPLETE, [m.score()])
            self._mirrored.add(claim.trial_id)
        except UpdateFinishedTrialError:
            # another process took this claim for abandoned and failed it: claim the plan again
            log.warning(
                "optuna: trial %d was failed by another worker while evaluating; re-recording it", claim.trial_id
            )
            again = self.claim(self._params_of(claim.trial_id), claim.config, claim.key, worker, budget)
            if again is None:
                log.warning(
                    "optuna: the budget was spent meanwhile; evaluation of %s not kept in the study",
                    claim.config.describe(),
                )
                return
            self.complete(again, m, worker, budget)

    def evaluate_outside(
        self,
        evaluator: BudgetedEvaluator,
        config: ParallelConfig,
        params: dict[str, Any],
        worker: str,
        source: str,
        encoded: bool = False,
    ) -> Measurement | None:
        """Evaluate a plan from outside TPE's encoding (the structured planner's start plan) under the
        study's budget rule; the study records it as a trial without parameters (TPE does not model
        it; the study's best value includes it), or with ``encoded`` (``params`` is a point of the
        space, e.g. RoundPipe's start plan) with its parameters, so TPE models it. None when another
        worker has the plan or the budget is spoken for. Free when the plan was evaluated before (a
        resume)."""
        from autotune.search.tracking import config_key

        if config in evaluator:
            return evaluator.evaluate(config)
        claim = self.claim(
            {k: params[k] for k in self.dists} if encoded else {},
            config,
            config_key(config),
            worker,
            evaluator.budget,
            source=source,
        )
        if claim is None:
            return None
        try:
            return evaluator.evaluate(
                config, params, commit=lambda m: self.complete(claim, m, worker, evaluator.budget)
            )
        finally:
            self.withdraw(claim)

    def withdraw(self, claim: Claim) -> None:
        if not claim.done:
            claim.done = True
            self._fail(claim.trial_id, {})

    def _params_of(self, trial_id: int) -> dict[str, Any]:
        return dict(self.storage.get_trial(trial_id).params)

    # -- heartbeat (long evaluations) --------------------------------------------------------------
    def heartbeat(self, claim: Claim | None) -> None:
        """Refresh ``claim``'s heartbeat every ``workers.HEARTBEAT_S`` until called with None."""
        with self._hb_lock:
            self._hb_claim = claim
            if claim is not None and (self._hb_thread is None or not self._hb_thread.is_alive()):
                self._hb_thread = threading.Thread(target=self._beat, name="autotune-heartbeat", daemon=True)
                self._hb_thread.start()

    def _beat(self) -> None:
        last: dict[int, float] = {}
        while True:
            time.sleep(1.0)
            with self._hb_lock:
                claim = self._hb_claim
                if claim is None:
                    self._hb_thread = None
                    return
                due = time.time() - last.setdefault(claim.trial_id, time.time()) >= workers.HEARTBEAT_S
                if due and not claim.done:
                    try:
                        self.storage.set_trial_user_attr(claim.trial_id, "heartbeat", time.time())
                    except Exception as e:  # noqa: BLE001 - finished or failed meanwhile
                        log.debug("heartbeat of trial %d: %s", claim.trial_id, e)
                    last[claim.trial_id] = time.time()

    # -- the MLflow parent run of the study ---------------------------------------------------------
    def elect(self, candidate: str, exists: Callable[[str], bool]) -> str:
        """The MLflow parent run all processes of this study log to: the run of the first election
        trial (smallest number) whose run ``exists`` in the caller's tracking store. ``candidate`` is
        the caller's new run, entered in the election (it wins when no earlier run exists)."""
        import optuna
        from optuna.trial import TrialState

        self.storage.create_new_trial(
            self.study_id,
            template_trial=optuna.trial.create_trial(state=TrialState.FAIL, user_attrs={PARENT_ATTR: candidate}),
        )
        winner = self.parent_run(exists) or candidate
        self.set_user_attr(MLFLOW_RUN_ATTR, winner)  # for people reading the study; elections decide
        return winner

    def parent_run(self, exists: Callable[[str], bool]) -> str | None:
        """The elected parent run in the caller's tracking store, if any (no write)."""
        seen: set[str] = set()
        for t in self.trials():
            run = t.user_attrs.get(PARENT_ATTR)
            if run and run not in seen:
                seen.add(run)
                if exists(run):
                    return run
        legacy = self.user_attrs.get(MLFLOW_RUN_ATTR)  # studies written before elections
        return legacy if legacy and exists(legacy) else None


#: a study's user attribute: the fingerprint of the search that made it (``SearchRequest.fingerprint``)
FINGERPRINT_ATTR = "autotune.fingerprint"


def generation(storage, base: str, fresh: bool = False, fingerprint: str | None = None) -> tuple[str, list[str]]:
    """The study a search named ``base`` works on, among ``base``, ``base__fresh2``, ``base__fresh3`` ... in
    ``storage``, and the generations passed over: with ``fingerprint`` (what the search's answer depends on,
    by content), the newest generation made for that fingerprint, else a new one (an edited cluster file
    under the same name is another search: its old study is passed over, never resumed); with ``fresh`` a
    new one (``--fresh`` starts over and keeps the earlier studies; a later run without it resumes the
    fresh one). Without ``fingerprint``: the newest (a worker joining a study by its full name)."""
    import re

    pattern = re.compile(re.escape(base) + r"(?:__fresh(\d+))?$")
    gens: dict[int, tuple[str, dict]] = {}
    for study in storage.get_all_studies():
        m = pattern.match(study.study_name)
        if m:
            gens[int(m.group(1) or 1)] = (study.study_name, study.user_attrs)
    newest = max(gens, default=0)
    passed: list[str] = []
    if fresh:
        k = newest + 1
    elif fingerprint is None:
        k = max(newest, 1)
    else:
        same = [g for g, (_, attrs) in gens.items() if attrs.get(FINGERPRINT_ATTR) == fingerprint]
        k = max(same) if same else newest + 1
        passed = [gens[g][0] for g in sorted(gens) if g > k or not same]
    return (base if k == 1 else f"{base}__fresh{k}"), passed


def open_study(
    space: SearchSpace,
    study_name: str,
    storage: str | None,
    seed: int,
    fresh: bool = False,
    fingerprint: str | None = None,
) -> SharedStudy:
    return SharedStudy(space, study_name, storage, seed, fresh=fresh, fingerprint=fingerprint)


def evaluated_trials(study) -> list:
    """COMPLETE trials whose plan was evaluated (``study``: an Optuna study or a ``SharedStudy``)."""
    from optuna.trial import TrialState

    if isinstance(study, SharedStudy):
        study = study.study
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.user_attrs.get("evaluated")]


def trial_evaluation(t) -> tuple[ParallelConfig, Measurement] | None:
    """The plan an evaluated trial ran and what it measured (its ``measurement`` attribute, else its value
    and status); None for a trial without a plan."""
    if "config" not in t.user_attrs:
        return None
    config = ParallelConfig.from_dict(t.user_attrs["config"], source=f"trial {t.number}")
    raw = t.user_attrs.get("measurement") or {
        "tokens_per_s": t.value or 0.0,
        "status": t.user_attrs.get("status", "ok"),
    }
    return config, Measurement.from_dict(raw)


def sync_from_evaluator(study: SharedStudy, space: SearchSpace, evaluator: BudgetedEvaluator) -> int:
    """Add evaluations the study does not know (recovered from MLflow) as finished trials."""
    import json

    import optuna

    from autotune.search.tracking import config_key

    known = {t.user_attrs.get("config_key") for t in study.evaluated_trials()}
    dists = study.dists
    added = 0
    for ev in evaluator.history:
        key = config_key(ev.config)
        if key in known or set(ev.params) != set(dists):
            continue
        params = {k: ev.params[k] for k in dists}
        if any(v not in dists[k].choices for k, v in params.items()):
            continue
        study.study.add_trial(
            optuna.trial.create_trial(
                params=params,
                distributions=dists,
                value=ev.score,
                user_attrs={
                    "evaluated": True,
                    "config_key": key,
                    "recovered": True,
                    "config": json.loads(ev.config.to_json(indent=None)),
                    "measurement": ev.measurement.to_dict(),
                },
            )
        )
        added += 1
    return added
