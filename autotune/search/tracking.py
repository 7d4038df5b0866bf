"""MLflow record of a search: one parent run per search, one nested child run per evaluated plan.

Default store: ``sqlite:///mlflow.db`` in the working directory; default experiment
``<cluster>__<model>``, so every method run on one cluster and model lands in one experiment and the
MLflow UI compares them side by side. The parent holds the search's params (cluster, model, method,
budget, seed, backend), a ``best_tokens_per_s`` curve (one step per evaluation), the best plan as
``best_config.json`` (SPEC.md format plus ``"measurement"``) and tag, and two PNGs: the best plan's
pipeline timeline and the search-progress curve. A child holds the plan's shape params (dp, pp, tp,
layers, zero ...), every ``Measurement`` metric, its status, the plan JSON as a tag and its encoding
in the search space (``x.*``, what TPE and the agents see) in the ``autotune.params`` tag (as MLflow
params only when that tag would be too long: MLflow's store writes a row per param, half a child's
cost), so a resumed search can reload what it already evaluated without evaluating it again.

Only ``MlflowClient`` is used (no global active run). A child is three calls: ``create_run`` with
every tag (the plan, its measurement and its encoding, so the run is complete from its first
write), one ``log_batch`` (metrics and params) and ``set_terminated``. Children are FINISHED whatever
the plan's outcome (out of memory is a normal answer; ``status`` tag and the ``ok``/``oom`` metrics
say which); only a real run that crashed or timed out is FAILED. A child left RUNNING by a killed
search is completed from its tags when the search resumes.

A local SQLite store is created under a file lock (two searches started together on a fresh store
both proceed) from a cached empty store of the installed MLflow version (``store_template``), so a
new store takes milliseconds instead of the seconds MLflow's schema migrations take; it is put in
WAL mode, so ``autotune ui`` reads it while a search writes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.planning.budget import PRUNED, Evaluation
from autotune.search import workers
from autotune.specs import Measurement, ParallelConfig

log = logging.getLogger(__name__)


def quiet_libraries() -> None:
    """MLflow and alembic announce database creation at INFO; the progress bar says enough. Call it
    before MLflow is first imported (this module imports it only inside its functions)."""
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # read when mlflow is first imported
    for name in ("mlflow", "alembic", "optuna"):
        logging.getLogger(name).setLevel(logging.WARNING)


DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
ROLE_TAG = "autotune.role"
CONFIG_TAG = "autotune.config"
BEST_TAG = "autotune.best_config"
BEST_ARTIFACT = "best_config.json"
RESUME_TAG = "autotune.resume_key"
PARAMS_TAG = "autotune.params"  # the child's params as JSON: a half-written child is completed from it
WORKER_TAG = "autotune.worker"
EVALUATED_MS_TAG = "autotune.evaluated_ms"  # a plan's run: when it was logged, ms since the epoch
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")  # the UI opens on training runs
_MAX_TAG = 8000
_MAX_PARAM = 500
_FAILED_STATUSES = ("failed", "timeout")
#: plans' runs are dated this long before their experiment was created (``SearchTracker._child_start_ms``)
CHILD_EPOCH_S = 7 * 24 * 3600  # a real run that crashed: the only FAILED children


def experiment_name(cluster_name: str, model_name: str) -> str:
    return f"{cluster_name}__{model_name}"


def resume_key(*parts: Any) -> str:
    """What makes two searches the same search (method, seed, backend, the cluster and model specs,
    ...): a re-run with the same key continues the parent run of the earlier one."""
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


def file_digest(path: Any) -> str:
    """A file's content hash (what a resume key holds of a profile or a policy file); other values (None, a
    built-in policy's name, a profile object) as ``repr``."""
    if isinstance(path, (str, Path)) and Path(path).is_file():
        return hashlib.sha1(Path(path).read_bytes()).hexdigest()[:16]
    return repr(path) if not isinstance(path, (str, Path)) else str(path)


def config_key(config: ParallelConfig) -> str:
    return hashlib.sha1(config.to_json(indent=None).encode()).hexdigest()[:16]


def client_for(tracking_uri: str | None):
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = tracking_uri or DEFAULT_TRACKING_URI
    prepare_store(uri)
    if _sqlite_path(uri) is not None:
        _sqlite_synchronous_normal()
    mlflow.set_tracking_uri(uri)
    return MlflowClient(tracking_uri=uri), uri


_NORMAL_SYNC: list[bool] = []


def _sqlite_synchronous_normal() -> None:
    """``PRAGMA synchronous=NORMAL`` on every SQLite connection SQLAlchemy opens in this process
    from now on (MLflow makes its own engine). In WAL mode that is one fsync per checkpoint instead
    of one per commit; a killed process loses nothing, a power cut at most the last commits."""
    if _NORMAL_SYNC:
        return
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    @event.listens_for(Engine, "connect")
    def _normal(dbapi_conn, _record):  # pragma: no cover - every sqlite connection
        if type(dbapi_conn).__module__.startswith("sqlite3"):
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

    _NORMAL_SYNC.append(True)


def _sqlite_path(uri: str) -> Path | None:
    prefix = "sqlite:///"
    if not uri.startswith(prefix) or ":memory:" in uri:
        return None
    return Path(uri[len(prefix) :].split("?", 1)[0])


@contextmanager
def _file_lock(path: Path):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autotune"


def store_template() -> Path | None:
    """An empty MLflow SQLite store at the installed MLflow's schema (no experiments, WAL mode), made
    once per MLflow version in ``~/.cache/autotune`` (None where that cannot be written)."""
    import sqlite3

    import mlflow
    from mlflow.tracking import MlflowClient

    try:
        cache = _cache_dir()
        template = cache / f"mlflow-{mlflow.__version__}-empty.db"
        if template.exists():
            return template
        with _file_lock(cache / ".mlflow-template.lock"):
            if template.exists():
                return template
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                db = Path(tmp) / "store.db"
                MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()  # runs the migrations
                with sqlite3.connect(db) as conn:  # MLflow re-creates "Default" where the store is used
                    conn.execute("DELETE FROM experiment_tags WHERE experiment_id = 0")
                    conn.execute("DELETE FROM experiments WHERE experiment_id = 0")
                conn.close()
                with sqlite3.connect(db) as conn:
                    conn.execute("PRAGMA journal_mode=WAL")
                conn.close()
                os.replace(db, template)
        return template
    except Exception as e:  # noqa: BLE001 - only a speed-up: MLflow creates the store itself
        log.debug("no MLflow store template: %s", e)
        return None


def prepare_store(uri: str) -> None:
    """Create a missing local SQLite store, once, under a lock (concurrent searches wait for it)."""
    import shutil

    path = _sqlite_path(uri)
    if path is None or (path.exists() and path.stat().st_size > 0):
        return
    with _file_lock(path.with_name(path.name + ".lock")):
        if path.exists() and path.stat().st_size > 0:
            return
        template = store_template()
        if template is not None:
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            shutil.copyfile(template, tmp)
            os.replace(tmp, path)
        else:
            from mlflow.tracking import MlflowClient

            MlflowClient(tracking_uri=uri).search_experiments()  # the migrations, inside the lock


def artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """Artifacts of a local SQLite store go beside the database (``<dir>/mlruns/<experiment>``), not
    into whatever directory the search happened to run in."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix) or ":memory:" in tracking_uri:
        return None
    db = Path(tracking_uri[len(prefix) :]).resolve()
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in experiment)
    return (db.parent / "mlruns" / safe).as_uri()


def _metrics_of(m: Measurement) -> dict[str, float]:
    peak = max(m.peak_memory_GiB.values(), default=0.0)
    return {
        "tokens_per_s": m.tokens_per_s,
        "iteration_time_s": m.iteration_time_s,
        "oom": float(m.oom),
        "mfu": m.mfu,
        "bubble_fraction": m.bubble_fraction,
        "peak_memory_max_GiB": peak,
        "ok": float(m.ok),
        "expected_error": m.expected_error,
    }


@dataclass(frozen=True, slots=True)
class Recorded:
    """A plan found in an existing parent run (for resuming)."""

    config: ParallelConfig
    measurement: Measurement
    params: Mapping[str, Any]


def status_of(m: Measurement) -> str:
    """A plan's outcome in one word: ``ok``, ``oom`` (out of memory), ``failed``, ``timeout``, ``pruned``."""
    return "oom" if m.oom else m.status


def plan_shape(config: ParallelConfig) -> str:
    """``dp2 pp4 tp2 mbs2 1f1b``: the plan's degrees in a few characters (run names, tables), then what sets
    plans of those degrees apart: ``r8`` (a mixed stage of 8 data-parallel ranks), ``z3`` (ZeRO),
    ``off`` / ``off-all`` (offload), ``rc`` (recomputation), ``lw`` (layer-wise), ``ep4``, ``sync10``; a
    roundpipe plan: ``dp1 rp22 mbs1 roundpipe`` (stages per pass, handed round-robin to its pool)."""
    if config.is_roundpipe:
        stages = max(p.roundpipe.num_stages for p in config.pipelines)
        return f"dp{len(config.pipelines)} rp{stages} mbs{config.micro_batch_size} {config.schedule}"
    pipes = config.pipelines
    pp = max(len(p.stages) for p in pipes)
    tp = max(r.tp for p in pipes for s in p.stages for r in s.ranks_of(p.num_microbatches))  # a rank's, not a stage's
    ranks = max(len(s.ranks) for p in pipes for s in p.stages)
    stages = [s for p in pipes for s in p.stages]
    offload = max((s.offload for s in stages), key=("none", "optimizer", "all").index)
    extra = (
        (f" r{ranks}" if ranks > 1 else "")  # mixed stages: the most data-parallel ranks in one stage
        + (f" z{config.zero}" if config.zero else "")
        + {"none": "", "optimizer": " off", "all": " off-all"}[offload]
        + (" rc" if any(s.recompute for s in stages) else "")
        + (" lw" if any(p.execution != "microbatch" for p in pipes) else "")
        + (f" ep{config.expert_parallel}" if config.expert_parallel > 1 else "")
        + (f" sync{config.sync_every_steps}" if config.sync_every_steps > 1 else "")
    )
    return f"dp{len(pipes)} pp{pp} tp{tp} mbs{config.micro_batch_size} {config.schedule}{extra}"


def child_run_name(method: str, ev: Evaluation) -> str:
    m = ev.measurement
    if m.status == PRUNED:
        outcome = "screened out"
    elif m.ok:
        outcome = f"{m.tokens_per_s:,.0f} tokens/s"
    else:
        outcome = "out of memory" if m.oom else m.status
    prefix = "pruned " if m.status == PRUNED else ""
    return f"{method} {prefix}#{ev.index:04d}: {outcome}, {plan_shape(ev.config)}"


def _shown_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The child's params logged as MLflow params when its ``PARAMS_TAG`` holds them all: the plan's
    shape, not its encoding (``x.*``, read back from the tag by ``recorded``)."""
    return {k: v for k, v in params.items() if not k.startswith("x.")}


class SearchTracker:
    """Writes one search into MLflow. ``start`` creates the parent run or reopens ``resume_run_id``."""

    def __init__(self, tracking_uri: str | None, experiment: str, description: str = "") -> None:
        from mlflow.exceptions import MlflowException

        self.client, self.tracking_uri = client_for(tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            try:
                self.experiment_id = self.client.create_experiment(
                    experiment,
                    artifact_location=artifact_location(self.tracking_uri, experiment),
                    tags={EXPERIMENT_KIND[0]: EXPERIMENT_KIND[1], "mlflow.note.content": description},
                )
            except MlflowException:  # another search created it a moment ago
                exp = self.client.get_experiment_by_name(experiment)
                if exp is None:
                    raise
        if exp is not None:
            self.experiment_id = exp.experiment_id
            if exp.tags.get(EXPERIMENT_KIND[0]) != EXPERIMENT_KIND[1]:  # made by an older autotune
                self.client.set_experiment_tag(self.experiment_id, *EXPERIMENT_KIND)
            if description and not exp.tags.get("mlflow.note.content"):
                self.client.set_experiment_tag(self.experiment_id, "mlflow.note.content", description)
        self.experiment = experiment
        self.parent_id: str | None = None
        self.method = ""
        self.worker = workers.new_worker_id()
        self._logged: set[str] = set()
        self._curve: list[tuple[int, float]] = []
        self._curve_logged = 0  # steps of the best_tokens_per_s curve already in the parent run
        self._best = 0.0
        self._prior_wall_s = 0.0  # wall time of the runs this one resumes
        self._experiment_created_ms: int | None = None

    # -- parent ------------------------------------------------------------------------------------
    def run_exists(self, run_id: str) -> bool:
        """True when ``run_id`` is a live run of this experiment in this store."""
        try:
            run = self.client.get_run(run_id)
        except Exception:  # noqa: BLE001 - another store's run, or deleted for good
            return False
        return run.info.lifecycle_stage == "active" and run.info.experiment_id == self.experiment_id

    def start(
        self,
        run_name: str,
        params: Mapping[str, Any],
        tags: Mapping[str, str] | None = None,
        resume_run_id: str | None = None,
    ) -> str:
        from mlflow.entities import Param

        self.method = str(params.get("method", ""))
        if resume_run_id:
            self.resume(resume_run_id)
            return self.parent_id
        all_tags = {ROLE_TAG: "search", "mlflow.runName": run_name, **(tags or {})}
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=all_tags)
        self.parent_id = run.info.run_id
        self.client.log_batch(self.parent_id, params=[Param(k, str(v)[:_MAX_PARAM]) for k, v in params.items()])
        return self.parent_id

    def find_parent(self, key: str) -> str | None:
        """The most recent parent run of this experiment tagged with resume key ``key``, if any."""
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{RESUME_TAG}` = '{key}'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        return runs[0].info.run_id if runs else None

    def resume(self, run_id: str) -> None:
        """Continue in ``run_id``: know its children, complete those a killed search left RUNNING."""
        run = self.client.get_run(run_id)
        self.parent_id = run.info.run_id
        if run.info.status != "RUNNING":
            self.client.update_run(self.parent_id, status="RUNNING")
        now = time.time()
        for child in self._children():
            key = child.data.tags.get("autotune.config_key", "")
            if child.info.status == "RUNNING":
                began_ms = float(child.data.tags.get(EVALUATED_MS_TAG, child.info.start_time))
                if not workers.abandoned(child.data.tags.get(WORKER_TAG), began_ms / 1000, now):
                    self._logged.add(key)  # another live search is writing it right now
                    continue
                if not self._complete_child(child):
                    log.info("deleting MLflow run %s, left half-written by a killed search", child.info.run_id)
                    self.client.delete_run(child.info.run_id)
                    continue
            self._logged.add(key)
        self._best = float(run.data.metrics.get("best_tokens_per_s", 0.0))
        self._prior_wall_s = float(run.data.metrics.get("wall_time_s", 0.0))
        self._curve_logged = len(self.client.get_metric_history(self.parent_id, "best_tokens_per_s"))
        log.info("resuming MLflow run %s with %d plans", self.parent_id, len(self._logged))

    def adopt(self, run_id: str, candidate: str) -> None:
        """Another search on the same study won the election (``SharedStudy.elect``): log to its run."""
        if candidate and candidate != run_id:
            self.client.delete_run(candidate)
        self.resume(run_id)

    def _complete_child(self, child) -> bool:
        """Finish a child a kill cut short after ``create_run`` (all its data is in its tags)."""
        from mlflow.entities import Metric, Param

        tags = child.data.tags
        try:
            m = Measurement.from_dict(json.loads(tags["autotune.measurement"]))
            params = _shown_params(json.loads(tags[PARAMS_TAG]))
        except (KeyError, ValueError):
            return False
        now = int(time.time() * 1000)
        have = set(child.data.params)
        self.client.log_batch(
            child.info.run_id,
            metrics=[Metric(k, float(v), now, 0) for k, v in _metrics_of(m).items() if k not in child.data.metrics],
            params=[Param(k, str(v)[:_MAX_PARAM]) for k, v in params.items() if k not in have],
        )
        self.client.set_terminated(child.info.run_id, "FAILED" if m.status in _FAILED_STATUSES else "FINISHED")
        log.info("completed MLflow run %s, left half-written by a killed search", child.info.run_id)
        return True

    def _children(self):
        return self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{self.parent_id}'", max_results=50000
        )

    def recorded(self) -> list[Recorded]:
        """The plans already logged under the parent (in evaluation order)."""
        out = []
        children = sorted(self._children(), key=lambda r: int(r.data.params.get("eval_index", "0") or 0))
        for child in children:
            text = child.data.tags.get(CONFIG_TAG)
            raw_m = child.data.tags.get("autotune.measurement")
            if not text or not raw_m or child.info.lifecycle_stage != "active":
                continue
            params = {k[2:]: parse_param(v) for k, v in child.data.params.items() if k.startswith("x.")}
            if not params and PARAMS_TAG in child.data.tags:
                params = {k[2:]: v for k, v in json.loads(child.data.tags[PARAMS_TAG]).items() if k.startswith("x.")}
            out.append(Recorded(ParallelConfig.from_json(text), Measurement.from_dict(json.loads(raw_m)), params))
        return out

    # -- children ----------------------------------------------------------------------------------
    def log_evaluation(self, ev: Evaluation, shape: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric, Param

        key = config_key(ev.config)
        if key in self._logged:
            return
        now = int(time.time() * 1000)
        text = ev.config.to_json(indent=None)
        m = ev.measurement
        pruned = m.status == PRUNED
        params = {
            ("pruned_index" if pruned else "eval_index"): ev.index,
            **shape,
            **{f"x.{k}": v for k, v in ev.params.items()},
        }
        tags = {
            "mlflow.parentRunId": self.parent_id,
            ROLE_TAG: "plan",
            "autotune.config_key": key,
            "status": status_of(m),
            "autotune.method": self.method,
            WORKER_TAG: self.worker,
            "autotune.measurement": json.dumps(m.to_dict())[:_MAX_TAG],
            "autotune.plan": ev.config.describe()[:_MAX_TAG],
        }
        params_json = json.dumps(params, default=str)
        if len(params_json) <= _MAX_TAG:
            tags[PARAMS_TAG] = params_json
            params = _shown_params(params)
        if pruned:  # screened out by the corrected simulator: its metrics are predictions
            tags["autotune.pruned"] = "true"
        if m.error:
            tags["error"] = m.error[:_MAX_TAG]
        if len(text) <= _MAX_TAG:
            tags[CONFIG_TAG] = text
        tags["autotune.evaluated_at"] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now / 1000))
        tags[EVALUATED_MS_TAG] = str(now)  # the real time (the run's start_time dates it for the UI's order)
        started = self._child_start_ms(ev.index)
        child = self.client.create_run(
            self.experiment_id, start_time=started, run_name=child_run_name(self.method, ev), tags=tags
        )
        self.client.log_batch(
            child.info.run_id,
            metrics=[Metric(k, float(v), now, 0) for k, v in _metrics_of(m).items()],
            params=[Param(k, str(v)[:_MAX_PARAM]) for k, v in params.items()],
        )
        if len(text) > _MAX_TAG:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "config.json"
                path.write_text(ev.config.to_json())
                self.client.log_artifact(child.info.run_id, str(path))
        status = "FAILED" if m.status in _FAILED_STATUSES else "FINISHED"
        self.client.set_terminated(child.info.run_id, status, end_time=started + max(1, int(1000 * m.iteration_time_s)))
        self._logged.add(key)
        if pruned:
            return
        self._best = max(self._best, m.score())
        self._curve.append((ev.index, self._best))
        if self._curve_logged == 0 and len(self._curve) == 1:
            # the parent's first metric: the MLflow UI's compare view plots a search's first metric by default
            self.client.log_batch(self.parent_id, metrics=[Metric("best_tokens_per_s", self._best, now, 1)])
            self._curve_logged = 1

    def _child_start_ms(self, index: int) -> int:
        """A plan's run is dated before every search of the experiment (``CHILD_EPOCH_S`` before the
        experiment was created, plus its evaluation index in ms), so the MLflow UI, which lists runs newest
        first 100 at a time, shows every search (parent run) on its first page and the plans under them;
        the real time of the evaluation is the tag ``autotune.evaluated_at``."""
        if self._experiment_created_ms is None:
            self._experiment_created_ms = int(self.client.get_experiment(self.experiment_id).creation_time or 0)
        return max(0, self._experiment_created_ms - 1000 * CHILD_EPOCH_S) + int(index)

    def log_parent_metrics(self, metrics: Mapping[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.parent_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def log_parent_artifact(self, path: str | Path) -> None:
        self.client.log_artifact(self.parent_id, str(path))

    # -- end ---------------------------------------------------------------------------------------
    def finish(
        self,
        best: Evaluation | None,
        best_curve: list[float],
        scores: list[float],
        title: str,
        status: str = "FINISHED",
        summary: Mapping[str, float] | None = None,
        statuses: list[str] | None = None,
        artifacts_dir: str | None = None,
    ) -> None:
        """The parent's summary: the best-so-far curve, ``evaluations`` and ``summary`` metrics (the
        comparison columns), the best plan as tag and artifact, and the two pictures (drawn here,
        or already drawn into ``artifacts_dir`` by ``write_artifacts``)."""
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        logged = self._curve_logged
        if logged:  # another search on the same study may have logged steps since this one started
            logged = max(logged, len(self.client.get_metric_history(self.parent_id, "best_tokens_per_s")))
        metrics = [Metric("best_tokens_per_s", v, now, i + 1) for i, v in enumerate(best_curve) if i >= logged]
        metrics.append(Metric("evaluations", float(len(best_curve)), now, 0))
        summary = dict(summary or {})
        if "wall_time_s" in summary:  # the search's wall time over all its runs (kills and resumes)
            summary["wall_time_s"] += self._prior_wall_s
        metrics += [Metric(k, float(v), now, 0) for k, v in summary.items()]
        tags = []
        if best is not None:
            tags.append(RunTag(BEST_TAG, best.config.to_json(indent=None)[:_MAX_TAG]))
            tags.append(RunTag("autotune.best_summary", best.config.describe()[:_MAX_TAG]))
        for i in range(0, len(metrics), 900):
            self.client.log_batch(self.parent_id, metrics=metrics[i : i + 900], tags=tags if i == 0 else [])
        if artifacts_dir is not None:
            if any(Path(artifacts_dir).iterdir()):
                self.client.log_artifacts(self.parent_id, artifacts_dir)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                write_artifacts(tmp, best, best_curve, scores, title, statuses)
                if any(Path(tmp).iterdir()):
                    self.client.log_artifacts(self.parent_id, tmp)
        self.client.set_terminated(self.parent_id, status)

    @property
    def run_url_hint(self) -> str:
        return (
            f"mlflow ui --backend-store-uri {self.tracking_uri}  (or `autotune ui`): experiment "
            f"{self.experiment!r}, run {self.parent_id}"
        )


def write_artifacts(
    directory: str | Path,
    best: Evaluation | None,
    best_curve: list[float],
    scores: list[float],
    title: str,
    statuses: list[str] | None = None,
) -> None:
    """The parent run's files: ``best_config.json``, ``best_timeline.png``, ``search_progress.png``."""
    from autotune.search import plots

    directory = Path(directory)
    if best is not None:
        doc = best.config.to_dict()
        doc["measurement"] = best.measurement.to_dict()
        (directory / BEST_ARTIFACT).write_text(json.dumps(doc, indent=2))
        plots.timeline_png(best.config, best.measurement, directory / "best_timeline.png")
    if best_curve:
        plots.progress_png(best_curve, directory / "search_progress.png", title=title, scores=scores, statuses=statuses)


def parse_param(v: str) -> Any:
    if v in ("True", "False"):
        return v == "True"
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v
