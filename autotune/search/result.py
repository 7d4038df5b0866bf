"""What a search returns (``TuneResult``): the best plan, its measurement and where the search is recorded."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from autotune.search.screen import RealRun
from autotune.search.summary import SearchSummary
from autotune.specs import Measurement, ParallelConfig

MLFLOW_UI_TRAINING_VIEW = "workflowType=machine_learning"  # the MLflow UI's model-training view (see run_url)


@dataclass(frozen=True, slots=True)
class TuneResult:
    """What a search found. ``best_curve[i]`` is the best tokens/s after i+1 evaluations."""

    best_config: ParallelConfig
    best_measurement: Measurement
    evaluations: int
    method: str
    cluster: str
    model: str
    budget: int
    seed: int
    backend: str
    experiment: str = ""
    run_id: str = ""
    tracking_uri: str = ""
    best_curve: tuple[float, ...] = field(default_factory=tuple)
    screened: int = 0  # plans screened out without spending the budget (memory model, calibration screen)
    memory_screened: int = 0  # of those, the plans the memory model alone answered oom (memory first)
    summary: SearchSummary | None = None  # top plans, found at, speed, oom counts, speedup vs uniform
    experiment_id: str = ""
    #: ``backend="real"``: each plan's real run(s) against the corrected simulator's prediction before them
    real_runs: tuple[RealRun, ...] = ()

    @property
    def run_url(self) -> str:
        """The parent run's page in the MLflow UI started by ``autotune ui`` (default port 5000).

        ``workflowType=machine_learning``: MLflow 3.17's UI keeps a GenAI / model-training switch per
        browser (GenAI by default, whatever the experiment's kind); the link opens on model training."""
        if not self.run_id or not self.experiment_id:
            return ""
        return f"http://127.0.0.1:5000/#/experiments/{self.experiment_id}/runs/{self.run_id}?{MLFLOW_UI_TRAINING_VIEW}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "best_config": self.best_config.to_dict(),
            "best_measurement": self.best_measurement.to_dict(timeline=True),
            "evaluations": self.evaluations,
            "method": self.method,
            "cluster": self.cluster,
            "model": self.model,
            "budget": self.budget,
            "seed": self.seed,
            "backend": self.backend,
            "experiment": self.experiment,
            "run_id": self.run_id,
            "tracking_uri": self.tracking_uri,
            "best_curve": list(self.best_curve),
            "screened": self.screened,
            "memory_screened": self.memory_screened,
            "summary": self.summary.to_dict() if self.summary is not None else None,
            "experiment_id": self.experiment_id,
            "real_runs": [r.to_dict() for r in self.real_runs],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> TuneResult:
        d = json.loads(text)
        return cls(
            best_config=ParallelConfig.from_dict(d["best_config"], source="TuneResult"),
            best_measurement=Measurement.from_dict(d["best_measurement"]),
            evaluations=int(d["evaluations"]),
            method=d["method"],
            cluster=d["cluster"],
            model=d["model"],
            budget=int(d["budget"]),
            seed=int(d["seed"]),
            backend=d["backend"],
            experiment=d.get("experiment", ""),
            run_id=d.get("run_id", ""),
            tracking_uri=d.get("tracking_uri", ""),
            best_curve=tuple(d.get("best_curve", ())),
            screened=int(d.get("screened", 0)),
            memory_screened=int(d.get("memory_screened", 0)),
            summary=SearchSummary.from_dict(d["summary"]) if d.get("summary") else None,
            experiment_id=d.get("experiment_id", ""),
            real_runs=tuple(RealRun.from_dict(r) for r in d.get("real_runs", ())),
        )

    def output_document(self) -> dict[str, Any]:
        """The ``search --output`` file: the config (SPEC.md format) plus ``"measurement"``."""
        doc = self.best_config.to_dict()
        doc["measurement"] = self.best_measurement.to_dict()
        return doc
