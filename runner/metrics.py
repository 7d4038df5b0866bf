"""What every training path reports, whatever engine ran it: rank 0's MLflow run of a training job."""

from __future__ import annotations

from autotune.specs import ModelSpec, ParallelConfig


class MlflowLogger:
    """Rank 0's MLflow run for a training job (mlflow imported only when a tracking URI is given)."""

    def __init__(self, job: dict, config: ParallelConfig, model: ModelSpec) -> None:
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(job["tracking_uri"])
        mlflow.set_experiment(job.get("experiment") or "autotune-train")
        mlflow.start_run(run_name=f"train {model.name} {config.describe()}"[:250])
        mlflow.log_params(
            {
                "model": model.name,
                "config": config.to_json(indent=None)[:6000],
                "steps": job["steps"],
                "seed": job.get("seed", 0),
                "data": job.get("data") or "synthetic",
            }
        )

    def log(self, record: dict) -> None:
        self.mlflow.log_metrics({"loss": record["loss"], "tokens_per_s": record["tokens_per_s"]}, step=record["step"])

    def close(self) -> None:
        self.mlflow.end_run()
