"""Optuna TPE over the shared search space, on a storage that survives a kill and that several
processes (on one machine or many) may share.

Every dimension of the space is a categorical parameter. The study lives in a storage (default
``optuna.journal`` in the working directory: Optuna's ``JournalStorage`` on a file, safe for several
processes; ``journal:PATH`` or any ``*.journal`` path selects one elsewhere; ``sqlite:///x.db``,
``postgresql://...`` or any SQLAlchemy URL is an ``RDBStorage``, PostgreSQL being the one for
workers on several machines; ``memory`` keeps it in memory, for experiments that need no resume).
The journal is the default because Optuna's RDB storage on SQLite costs ~100 ms of ORM work per
evaluated plan here, the journal ~2 ms; a working directory that already holds an ``optuna.db``
from an older autotune (and no journal) keeps using it, so its searches still resume.
A re-run with the same study name continues where the last one stopped.

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
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from autotune.search import workers
from autotune.planning.budget import PRUNED, BudgetedEvaluator
from autotune.planning.space import SearchSpace
from autotune.specs import Measurement, ParallelConfig

log = logging.getLogger(__name__)

DEFAULT_STORAGE = "optuna.journal"
LEGACY_STORAGE = "sqlite:///optuna.db"


def default_storage() -> str:
    """``optuna.journal``, or the ``optuna.db`` an older autotune left in the working directory."""
    if Path("optuna.db").exists() and not Path(DEFAULT_STORAGE).exists():
        return LEGACY_STORAGE
    return DEFAULT_STORAGE
MLFLOW_RUN_ATTR = "mlflow_run_id"
PARENT_ATTR = "autotune.parent_run"  # on election trials (see ``SharedStudy.elect``)


def _sqlite_path(url: str) -> Path | None:
    prefix = "sqlite:///"
    if not url.startswith(prefix) or ":memory:" in url:
        return None
    return Path(url[len(prefix):])


def postgres_driver(url: str) -> str:
    """``postgresql://...`` names SQLAlchemy's psycopg2 driver; with only psycopg 3 installed (the dev
    extra's), use it instead. A missing driver is one clear line."""
    import importlib.util

    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("postgresql", "postgres"):
        return url
    if importlib.util.find_spec("psycopg2") is not None:
        return "postgresql://" + rest
    if importlib.util.find_spec("psycopg") is not None:
        return "postgresql+psycopg://" + rest
    from autotune.errors import SpecError

    raise SpecError("--storage", "", "a PostgreSQL storage needs a driver: pip install 'psycopg[binary]' "
                                     "(or psycopg2)")


def _open_rdb(url: str, attempts: int = 6):
    """``RDBStorage(url)``; retried when another process is creating the same tables right now."""
    import optuna
    from sqlalchemy import event

    url = postgres_driver(url)
    path = _sqlite_path(url)
    engine_kwargs: dict[str, Any] = {}
    if path is not None:
        import sqlite3

        path.parent.mkdir(parents=True, exist_ok=True)
        with sqlite3.connect(path, timeout=30) as conn:  # persistent: readers never block the writer
            conn.execute("PRAGMA journal_mode=WAL")
        engine_kwargs = {"connect_args": {"timeout": 30}}
    else:
        engine_kwargs = {"pool_pre_ping": True}
    for attempt in range(attempts):
        try:
            storage = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
            break
        except Exception as e:  # noqa: BLE001 - concurrent table creation: retry, then give up loudly
            if attempt == attempts - 1 or "Can't load plugin" in str(e) or isinstance(e, (ImportError, ModuleNotFoundError)):
                raise
            log.info("optuna storage %s not ready (%s); retrying", url, type(e).__name__)
            time.sleep(0.2 * (attempt + 1))
    if path is not None:
        # WAL + synchronous=NORMAL: one fsync per checkpoint instead of several per commit; a
        # killed process loses nothing (the WAL is in the file), only a power cut may lose the
        # last commits (the search then re-evaluates those plans)
        @event.listens_for(storage.engine, "connect")
        def _pragmas(dbapi_conn, _record):  # pragma: no cover - exercised by every sqlite search
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        storage.engine.dispose()
    return storage


def open_storage(storage: str | None):
    """An Optuna storage from a URL: ``sqlite:///x.db`` or any SQLAlchemy URL (RDB),
    ``journal:path`` / ``*.journal`` (journal file) or ``memory``."""
    import optuna
    from optuna.storages import JournalStorage

    url = storage or default_storage()
    if url == "memory":  # no file: experiments that need no resume
        return optuna.storages.InMemoryStorage()
    if url.startswith("journal:") or url.endswith(".journal"):
        path = url.removeprefix("journal:").removeprefix("///") if url.startswith("journal:") else url
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(_journal_backend(path))
    return _open_rdb(url)


#: the journal is flushed to the OS at every write and forced to disk (fsync) at most this often
JOURNAL_FSYNC_EVERY_S = 1.0


def _journal_backend(path: str):
    """Optuna's ``JournalFileBackend`` with Optuna's own lock, but without an fsync per write.

    Optuna's backend fsyncs every log line: ~5 ms each here, four per evaluated plan, a fifth of a
    200-plan simulator search. Each write here still reaches the OS before the call returns (a killed
    search, ``kill -9`` included, loses nothing, and other processes read it at once); only the
    fsync is rationed to one per ``JOURNAL_FSYNC_EVERY_S`` and one when the process exits, so an
    operating-system crash or power cut can lose the last second of writes (the study then resumes
    from before them; MLflow's record is written separately)."""
    import atexit
    import os

    from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

    class RationedSyncBackend(JournalFileBackend):
        def __init__(self, file_path: str) -> None:
            self._autotune_lock = JournalFileSymlinkLock(file_path)
            super().__init__(file_path, lock_obj=self._autotune_lock)
            self._autotune_path = file_path
            self._synced_at = time.monotonic()
            self._dirty = False
            atexit.register(self.sync)

        def append_logs(self, logs: list[dict[str, Any]]) -> None:
            import json

            text = "\n".join(json.dumps(entry, separators=(",", ":")) for entry in logs) + "\n"
            self._autotune_lock.acquire()
            try:
                with open(self._autotune_path, "ab") as f:
                    f.write(text.encode("utf-8"))
                    f.flush()
                    if time.monotonic() - self._synced_at >= JOURNAL_FSYNC_EVERY_S:
                        os.fsync(f.fileno())
                        self._synced_at, self._dirty = time.monotonic(), False
                    else:
                        self._dirty = True
            finally:
                self._autotune_lock.release()

        def sync(self) -> None:
            if self._dirty:
                try:
                    fd = os.open(self._autotune_path, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                except OSError as e:  # the file was removed meanwhile: nothing left to keep
                    log.debug("journal fsync at exit: %s", e)
                self._dirty = False

    return RationedSyncBackend(path)


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


#: ``source`` of the trial of RoundPipe's start plan (``api._roundpipe_start``): a study whose only
#: evaluations are such starts is still fresh (the heuristic warm starts are enqueued)
ROUNDPIPE_START = "roundpipe-start"


@dataclass(frozen=True)
class StudyState:
    evaluated: int  # COMPLETE trials with evaluated = True
    live_claims: int  # RUNNING claims whose worker is alive
    starts: int = 0  # of the evaluated: RoundPipe's start plan (``ROUNDPIPE_START``)


class SharedStudy:
    """One Optuna study in a storage, plus the in-memory copy TPE samples from."""

    def __init__(self, space: SearchSpace, study_name: str, storage: str | None, seed: int,
                 fresh: bool = False) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.space = space
        self.url = storage or default_storage()
        self.storage = optuna.storages.get_storage(open_storage(self.url))
        study_name = generation(self.storage, study_name, fresh)
        self.study = optuna.create_study(study_name=study_name, storage=self.storage, direction="maximize",
                                         load_if_exists=True, sampler=optuna.samplers.RandomSampler(seed))
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

        self.local.add_trial(optuna.trial.create_trial(
            params={k: params[k] for k in self.model_dists}, distributions=self.model_dists, value=value, **kw))

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

    def sync(self, evaluator: BudgetedEvaluator | None = None, notify: Callable[[Any], bool] | None = None,
             worker: str | None = None) -> StudyState:
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
        if evaluator is None or "config" not in t.user_attrs:
            return
        config = ParallelConfig.from_dict(t.user_attrs["config"], source=f"trial {t.number}")
        if config in evaluator:
            return
        raw = t.user_attrs.get("measurement") or {"tokens_per_s": t.value or 0.0,
                                                  "status": t.user_attrs.get("status", "ok")}
        m = Measurement.from_dict(raw)
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
    def claim(self, params: dict[str, Any], config: ParallelConfig, key: str, worker: str,
              budget: int, **attrs: Any) -> Claim | None:
        """Claim ``config`` for evaluation (see the module docstring); None when the plan is another
        worker's or the budget is spoken for."""
        import json

        import optuna
        from optuna.trial import TrialState

        template = optuna.trial.create_trial(
            state=TrialState.RUNNING, params=params, distributions={k: self.dists[k] for k in params},
            user_attrs={"claimed": True, "config_key": key, "config": json.loads(config.to_json(indent=None)),
                        "worker": worker, "heartbeat": time.time(), **attrs})
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
                        t.user_attrs.get("worker"), t.user_attrs.get("heartbeat"), now):
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
            log.warning("optuna: trial %d was failed by another worker while evaluating; re-recording it",
                        claim.trial_id)
            again = self.claim(self._params_of(claim.trial_id), claim.config, claim.key, worker, budget)
            if again is None:
                log.warning("optuna: the budget was spent meanwhile; evaluation of %s not kept in the study",
                            claim.config.describe())
                return
            self.complete(again, m, worker, budget)

    def evaluate_outside(self, evaluator: BudgetedEvaluator, config: ParallelConfig, params: dict[str, Any],
                         worker: str, source: str, encoded: bool = False) -> Measurement | None:
        """Evaluate a plan from outside TPE's encoding (the structured planner's start plan) under the
        study's budget rule; the study records it as a trial without parameters (TPE does not model
        it; the study's best value includes it), or with ``encoded`` (``params`` is a point of the
        space, e.g. RoundPipe's start plan) with its parameters, so TPE models it. None when another
        worker has the plan or the budget is spoken for. Free when the plan was evaluated before (a
        resume)."""
        from autotune.search.tracking import config_key

        if config in evaluator:
            return evaluator.evaluate(config)
        claim = self.claim({k: params[k] for k in self.dists} if encoded else {}, config, config_key(config), worker,
                           evaluator.budget, source=source)
        if claim is None:
            return None
        try:
            return evaluator.evaluate(config, params,
                                      commit=lambda m: self.complete(claim, m, worker, evaluator.budget))
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

        self.storage.create_new_trial(self.study_id, template_trial=optuna.trial.create_trial(
            state=TrialState.FAIL, user_attrs={PARENT_ATTR: candidate}))
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


def generation(storage, base: str, fresh: bool = False) -> str:
    """The study a search named ``base`` works on: the newest of ``base``, ``base__fresh2``,
    ``base__fresh3`` ... in ``storage``; with ``fresh`` the next one (``--fresh`` starts over and keeps
    the earlier studies; a later run without it resumes the fresh one)."""
    import re

    pattern = re.compile(re.escape(base) + r"(?:__fresh(\d+))?$")
    newest = 0
    for study in storage.get_all_studies():
        m = pattern.match(study.study_name)
        if m:
            newest = max(newest, int(m.group(1) or 1))
    k = newest + 1 if fresh else max(newest, 1)
    return base if k == 1 else f"{base}__fresh{k}"


def open_study(space: SearchSpace, study_name: str, storage: str | None, seed: int, fresh: bool = False) -> SharedStudy:
    return SharedStudy(space, study_name, storage, seed, fresh=fresh)


def evaluated_trials(study) -> list:
    """COMPLETE trials whose plan was evaluated (``study``: an Optuna study or a ``SharedStudy``)."""
    from optuna.trial import TrialState

    if isinstance(study, SharedStudy):
        study = study.study
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.user_attrs.get("evaluated")]


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
        study.study.add_trial(optuna.trial.create_trial(
            params=params, distributions=dists, value=ev.score,
            user_attrs={"evaluated": True, "config_key": key, "recovered": True,
                        "config": json.loads(ev.config.to_json(indent=None)),
                        "measurement": ev.measurement.to_dict()}))
        added += 1
    return added


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


def _repair(space: SearchSpace, evaluator: BudgetedEvaluator, shared: SharedStudy, params: dict[str, Any],
            evaluate_claimed: Callable[[dict[str, Any], ParallelConfig], Measurement | None]) -> bool:
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


def run_optuna(space: SearchSpace, evaluator: BudgetedEvaluator, seed: int = 0, *, study: SharedStudy | None = None,
               study_name: str = "autotune", storage: str | None = None, warm_start: bool = True,
               max_asks_per_eval: int = 100, worker: str | None = None, poll_s: float = 0.2) -> None:
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
                return evaluator.evaluate(config, params,
                                          commit=lambda m, c=claim: shared.complete(c, m, worker, budget))
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
        log.info("optuna: %d asks in a row gave no new valid plan; stopping at %d evaluations",
                 max_asks_per_eval, evaluator.used)
