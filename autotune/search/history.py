"""Searches read back from MLflow: one row per search for ``autotune compare`` (``list_searches``) and the
best plan recorded (``read_best``, ``autotune best``, ``autotune.best_config``). The writing side is
``autotune.search.tracking``."""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from autotune.errors import SpecError
from autotune.search.tracking import BEST_ARTIFACT, BEST_TAG, ROLE_TAG, client_for
from autotune.specs import Measurement, ParallelConfig


@dataclass(frozen=True, slots=True)
class SearchRow:
    """One search (parent run) of an experiment, as ``autotune compare`` prints it."""

    run_id: str
    run_name: str
    method: str
    budget: int
    seed: int
    backend: str
    status: str
    evaluations: int
    best_tokens_per_s: float
    found_at: int
    wall_time_s: float
    speedup_vs_uniform: float | None
    oom_plans: int  # out of memory: evaluated plans plus those the memory model answered (no budget spent)
    started: str  # local time, "YYYY-MM-DD HH:MM"
    variant: str = ""  # start, restriction, profile, batch where they differ from the default search

    FIELDS = (
        "method",
        "budget",
        "seed",
        "backend",
        "variant",
        "best_tokens_per_s",
        "found_at",
        "evaluations",
        "wall_time_s",
        "speedup_vs_uniform",
        "oom_plans",
        "status",
        "started",
        "run_name",
        "run_id",
    )


def _experiment_ids(client, uri: str, experiment: str | None) -> tuple[list[str], str]:
    if experiment is not None:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            names = [e.name for e in client.search_experiments()]
            raise SpecError(
                uri, "experiment", f"no experiment {experiment!r} (the store has: {', '.join(names) or 'none'})"
            )
        return [exp.experiment_id], exp.name
    exps = client.search_experiments()
    latest = (
        client.search_runs(
            [e.experiment_id for e in exps],
            filter_string=f"tags.`{ROLE_TAG}` = 'search'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if exps
        else []
    )
    if not latest:
        raise SpecError(uri, "experiment", "no search recorded in this MLflow store; run `autotune search` first")
    exp_id = latest[0].info.experiment_id
    return [exp_id], client.get_experiment(exp_id).name


def list_searches(experiment: str | None = None, tracking_uri: str | None = None) -> tuple[str, list[SearchRow]]:
    """Every search of ``experiment`` (default: the experiment of the most recent search), oldest
    first: (experiment name, rows)."""
    client, uri = client_for(tracking_uri)
    exp_ids, name = _experiment_ids(client, uri, experiment)
    runs = client.search_runs(
        exp_ids, filter_string=f"tags.`{ROLE_TAG}` = 'search'", order_by=["attributes.start_time ASC"], max_results=5000
    )
    rows = []
    for r in runs:
        p, m = r.data.params, r.data.metrics

        def num(key: str, cast=float, default=0):
            try:
                return cast(float(p[key])) if key in p else cast(m[key]) if key in m else default
            except (TypeError, ValueError):
                return default

        rows.append(
            SearchRow(
                run_id=r.info.run_id,
                run_name=r.info.run_name or "",
                method=p.get("method", "?"),
                budget=num("budget", int),
                seed=num("seed", int),
                backend=p.get("backend", "?"),
                status=r.info.status,
                evaluations=int(m.get("evaluations", 0)),
                best_tokens_per_s=float(m.get("best_tokens_per_s", 0.0)),
                found_at=int(m.get("found_at", 0)),
                wall_time_s=float(m.get("wall_time_s", 0.0)),
                speedup_vs_uniform=m.get("speedup_vs_uniform"),
                oom_plans=int(m.get("oom_plans", 0) + m.get("memory_screened", 0)),  # evaluated + memory-screened
                started=time.strftime("%Y-%m-%d %H:%M", time.localtime(r.info.start_time / 1000)),
                variant=p.get("variant", ""),
            )
        )
    return name, rows


def read_best(
    experiment: str | None = None, tracking_uri: str | None = None
) -> tuple[ParallelConfig, Measurement, str]:
    """The best plan recorded in MLflow: over the search runs of ``experiment`` (default: the
    experiment of the most recent search), the one with the highest ``best_tokens_per_s``.
    Returns (config, measurement, parent run id)."""
    client, uri = client_for(tracking_uri)
    exp_ids, _ = _experiment_ids(client, uri, experiment)
    runs = client.search_runs(
        exp_ids,
        filter_string=f"tags.`{ROLE_TAG}` = 'search'",
        order_by=["metrics.best_tokens_per_s DESC"],
        max_results=50,
    )
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
