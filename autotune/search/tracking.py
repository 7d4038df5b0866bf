"""MLflow record of a search: one parent run per search, one nested child run per evaluated plan.

Default store: ``sqlite:///mlflow.db`` in the working directory; default experiment
``<cluster>__<model>``, so every method run on one cluster and model lands in one experiment and the
MLflow UI compares them side by side. The parent holds the search's params (cluster, model, method,
budget, seed, backend), a ``best_tokens_per_s`` curve (one step per evaluation), the best plan as
``best_config.json`` (SPEC.md format plus ``"measurement"``) and tag, and two PNGs: the best plan's
pipeline timeline and the search-progress curve. A child holds the plan's encoding (``x.*``) and
shape params, every ``Measurement`` metric, its status, and the plan JSON as a tag, so a resumed
search can reload what it already evaluated without evaluating it again.

Only ``MlflowClient`` is used (no global active run), with one batched write per child.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from autotune.errors import SpecError
from autotune.search.budget import PRUNED, Evaluation
from autotune.specs import Measurement, ParallelConfig

log = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
ROLE_TAG = "autotune.role"
CONFIG_TAG = "autotune.config"
BEST_TAG = "autotune.best_config"
BEST_ARTIFACT = "best_config.json"
RESUME_TAG = "autotune.resume_key"
_MAX_TAG = 8000
_MAX_PARAM = 500


def experiment_name(cluster_name: str, model_name: str) -> str:
    return f"{cluster_name}__{model_name}"


def resume_key(*parts: Any) -> str:
    """What makes two searches the same search (method, seed, backend, the cluster and model specs,
    ...): a re-run with the same key continues the parent run of the earlier one."""
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


def config_key(config: ParallelConfig) -> str:
    return hashlib.sha1(config.to_json(indent=None).encode()).hexdigest()[:16]


def _client(tracking_uri: str | None):
    import os

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = tracking_uri or DEFAULT_TRACKING_URI
    mlflow.set_tracking_uri(uri)
    return MlflowClient(tracking_uri=uri), uri


def artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """Artifacts of a local SQLite store go beside the database (``<dir>/mlruns/<experiment>``), not
    into whatever directory the search happened to run in."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix) or ":memory:" in tracking_uri:
        return None
    db = Path(tracking_uri[len(prefix):]).resolve()
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in experiment)
    return (db.parent / "mlruns" / safe).as_uri()


def _metrics_of(m: Measurement) -> dict[str, float]:
    peak = max(m.peak_memory_GiB.values(), default=0.0)
    return {"tokens_per_s": m.tokens_per_s, "iteration_time_s": m.iteration_time_s, "oom": float(m.oom),
            "mfu": m.mfu, "bubble_fraction": m.bubble_fraction, "peak_memory_max_GiB": peak,
            "ok": float(m.ok)}


@dataclass(frozen=True, slots=True)
class Recorded:
    """A plan found in an existing parent run (for resuming)."""

    config: ParallelConfig
    measurement: Measurement
    params: Mapping[str, Any]


class SearchTracker:
    """Writes one search into MLflow. ``start`` creates the parent run or reopens ``resume_run_id``."""

    def __init__(self, tracking_uri: str | None, experiment: str) -> None:
        self.client, self.tracking_uri = _client(tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(
            experiment, artifact_location=artifact_location(self.tracking_uri, experiment))
        self.experiment = experiment
        self.parent_id: str | None = None
        self.method = ""
        self._logged: set[str] = set()
        self._curve: list[tuple[int, float]] = []
        self._curve_logged = 0  # steps of the best_tokens_per_s curve already in the parent run
        self._best = 0.0

    # -- parent ------------------------------------------------------------------------------------
    def start(self, run_name: str, params: Mapping[str, Any], tags: Mapping[str, str] | None = None,
              resume_run_id: str | None = None) -> str:
        from mlflow.entities import Param

        self.method = str(params.get("method", ""))
        if resume_run_id:
            run = self.client.get_run(resume_run_id)
            self.parent_id = run.info.run_id
            self.client.update_run(self.parent_id, status="RUNNING")
            for child in self._children():
                if child.info.status == "RUNNING":
                    # a kill cut this write short (``set_terminated`` is its last step): its params or
                    # metrics may be missing, so drop it and let the search evaluate the plan again
                    log.info("deleting MLflow run %s, left half-written by a killed search", child.info.run_id)
                    self.client.delete_run(child.info.run_id)
                    continue
                self._logged.add(child.data.tags.get("autotune.config_key", ""))
            self._best = float(run.data.metrics.get("best_tokens_per_s", 0.0))
            self._curve_logged = len(self.client.get_metric_history(self.parent_id, "best_tokens_per_s"))
            log.info("resuming MLflow run %s with %d plans", self.parent_id, len(self._logged))
            return self.parent_id
        all_tags = {ROLE_TAG: "search", "mlflow.runName": run_name, **(tags or {})}
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=all_tags)
        self.parent_id = run.info.run_id
        self.client.log_batch(self.parent_id, params=[Param(k, str(v)[:_MAX_PARAM]) for k, v in params.items()])
        return self.parent_id

    def find_parent(self, key: str) -> str | None:
        """The most recent parent run of this experiment tagged with resume key ``key``, if any."""
        runs = self.client.search_runs([self.experiment_id], filter_string=f"tags.`{RESUME_TAG}` = '{key}'",
                                       order_by=["attributes.start_time DESC"], max_results=1)
        return runs[0].info.run_id if runs else None

    def _children(self):
        return self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{self.parent_id}'",
            max_results=50000)

    def recorded(self) -> list[Recorded]:
        """The plans already logged under the parent (in evaluation order)."""
        out = []
        children = sorted(self._children(), key=lambda r: int(r.data.params.get("eval_index", "0") or 0))
        for child in children:
            text = child.data.tags.get(CONFIG_TAG)
            raw_m = child.data.tags.get("autotune.measurement")
            if not text or not raw_m:
                continue
            params = {k[2:]: _parse_param(v) for k, v in child.data.params.items() if k.startswith("x.")}
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
        tags = {"mlflow.parentRunId": self.parent_id, ROLE_TAG: "plan", "autotune.config_key": key,
                "status": m.status if not m.oom else "oom", "autotune.method": self.method,
                "autotune.measurement": json.dumps(m.to_dict())[:_MAX_TAG]}
        if pruned:  # screened out by the corrected simulator: its metrics are predictions
            tags["autotune.pruned"] = "true"
        if m.error:
            tags["error"] = m.error[:_MAX_TAG]
        if len(text) <= _MAX_TAG:
            tags[CONFIG_TAG] = text
        name = f"{self.method}-pruned-{ev.index:04d}" if pruned else f"{self.method}-{ev.index:04d}"
        child = self.client.create_run(self.experiment_id, run_name=name, tags=tags)
        params = {("pruned_index" if pruned else "eval_index"): ev.index, **shape, **{f"x.{k}": v for k, v in ev.params.items()}}
        self.client.log_batch(
            child.info.run_id,
            metrics=[Metric(k, float(v), now, 0) for k, v in _metrics_of(m).items()],
            params=[Param(k, str(v)[:_MAX_PARAM]) for k, v in params.items()])
        if len(text) > _MAX_TAG:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "config.json"
                path.write_text(ev.config.to_json())
                self.client.log_artifact(child.info.run_id, str(path))
        self.client.set_terminated(child.info.run_id, "FINISHED" if m.ok else "FAILED")
        self._logged.add(key)
        if pruned:
            return
        self._best = max(self._best, m.score())
        self._curve.append((ev.index, self._best))

    def log_parent_metrics(self, metrics: Mapping[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.parent_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def log_parent_artifact(self, path: str | Path) -> None:
        self.client.log_artifact(self.parent_id, str(path))

    # -- end ---------------------------------------------------------------------------------------
    def finish(self, best: Evaluation | None, best_curve: list[float], scores: list[float], title: str,
               status: str = "FINISHED") -> None:
        from mlflow.entities import Metric, RunTag

        from autotune.search import plots

        now = int(time.time() * 1000)
        metrics = [Metric("best_tokens_per_s", v, now, i + 1) for i, v in enumerate(best_curve)
                   if i >= self._curve_logged]
        metrics.append(Metric("evaluations", float(len(best_curve)), now, 0))
        tags = []
        if best is not None:
            tags.append(RunTag(BEST_TAG, best.config.to_json(indent=None)[:_MAX_TAG]))
            tags.append(RunTag("autotune.best_summary", best.config.describe()[:_MAX_TAG]))
        for i in range(0, len(metrics), 900):
            self.client.log_batch(self.parent_id, metrics=metrics[i:i + 900], tags=tags if i == 0 else [])
        with tempfile.TemporaryDirectory() as tmp:
            tmpdir = Path(tmp)
            if best is not None:
                doc = best.config.to_dict()
                doc["measurement"] = best.measurement.to_dict()
                (tmpdir / BEST_ARTIFACT).write_text(json.dumps(doc, indent=2))
                self.client.log_artifact(self.parent_id, str(tmpdir / BEST_ARTIFACT))
                plots.timeline_png(best.config, best.measurement, tmpdir / "best_timeline.png")
                self.client.log_artifact(self.parent_id, str(tmpdir / "best_timeline.png"))
            if best_curve:
                plots.progress_png(best_curve, tmpdir / "search_progress.png", title=title, scores=scores)
                self.client.log_artifact(self.parent_id, str(tmpdir / "search_progress.png"))
        self.client.set_terminated(self.parent_id, status)

    @property
    def run_url_hint(self) -> str:
        return (f"mlflow ui --backend-store-uri {self.tracking_uri}  (or `autotune ui`): experiment "
                f"{self.experiment!r}, run {self.parent_id}")


def _parse_param(v: str) -> Any:
    if v in ("True", "False"):
        return v == "True"
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def read_best(experiment: str | None = None, tracking_uri: str | None = None) -> tuple[ParallelConfig, Measurement, str]:
    """The best plan recorded in MLflow: over the search runs of ``experiment`` (default: the
    experiment of the most recent search), the one with the highest ``best_tokens_per_s``.
    Returns (config, measurement, parent run id)."""
    client, uri = _client(tracking_uri)
    if experiment is not None:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            names = [e.name for e in client.search_experiments()]
            raise SpecError(uri, "experiment", f"no experiment {experiment!r} (the store has: "
                                               f"{', '.join(names) or 'none'})")
        exp_ids = [exp.experiment_id]
    else:
        exps = client.search_experiments()
        latest = client.search_runs([e.experiment_id for e in exps], filter_string=f"tags.`{ROLE_TAG}` = 'search'",
                                    order_by=["attributes.start_time DESC"], max_results=1) if exps else []
        if not latest:
            raise SpecError(uri, "experiment", "no search recorded in this MLflow store; run `autotune search` first")
        exp_ids = [latest[0].info.experiment_id]
    runs = client.search_runs(exp_ids, filter_string=f"tags.`{ROLE_TAG}` = 'search'",
                              order_by=["metrics.best_tokens_per_s DESC"], max_results=50)
    runs = [r for r in runs if BEST_TAG in r.data.tags]
    if not runs:
        raise SpecError(uri, "experiment", "no finished search with a best plan in this experiment")
    best = max(runs, key=lambda r: r.data.metrics.get("best_tokens_per_s", 0.0))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client.download_artifacts(best.info.run_id, BEST_ARTIFACT, tmp)
            doc = json.loads(Path(path).read_text())
        except Exception:  # artifact store moved: fall back to the tag
            doc = json.loads(best.data.tags[BEST_TAG])
    measurement = Measurement.from_dict(doc.pop("measurement", {}))
    return ParallelConfig.from_dict(doc, source=f"run {best.info.run_id}"), measurement, best.info.run_id
