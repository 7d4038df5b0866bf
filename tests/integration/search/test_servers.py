"""Against real servers, as on several machines: searches sharing an Optuna study on a PostgreSQL
server, and a search recording into an ``mlflow server`` over HTTP (``tests/servers.py`` starts them
on loopback; they skip, saying why, where PostgreSQL or psycopg is missing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO
from servers import mlflow_server, postgres_server

AUTOTUNE = [sys.executable, "-m", "autotune.cli"]
ROOT = REPO


def _env(tmp_path: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(tmp_path / "cache"))


@pytest.mark.slow
def test_two_searches_share_one_study_on_a_postgresql_server(tmp_path):
    """Two ``autotune search --storage postgresql://...`` processes started together (two machines'
    workers): both finish, the study holds exactly --budget distinct plans, MLflow one parent run."""
    import optuna
    from mlflow.tracking import MlflowClient

    from autotune.search.agents.optuna_storage import open_storage

    budget = 24
    with postgres_server() as url:
        args = [
            "search",
            "--cluster",
            "mixed-a100-v100",
            "--model",
            "gpt2-xl",
            "--method",
            "optuna",
            "--budget",
            str(budget),
            "--storage",
            url,
            "--tracking-uri",
            f"sqlite:///{tmp_path}/mlflow.db",
        ]
        procs = [
            subprocess.Popen(
                [*AUTOTUNE, *args],
                cwd=tmp_path,
                env=_env(tmp_path),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
        study = optuna.load_study(study_name="mixed-a100-v100__gpt2-xl__optuna__seed0", storage=open_storage(url))
        done = [t for t in study.trials if t.user_attrs.get("evaluated")]
        assert len(done) == budget == len({t.user_attrs["config_key"] for t in done})
        assert all(t.state.name == "COMPLETE" for t in done)
        assert len({t.user_attrs["worker"] for t in done}) == 2  # both processes evaluated plans
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("mixed-a100-v100__gpt2-xl")
    (parent,) = client.search_runs([exp.experiment_id], filter_string="tags.`autotune.role` = 'search'")
    children = client.search_runs(
        [exp.experiment_id], max_results=1000, filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    assert len(children) == budget


@pytest.mark.slow
def test_a_search_records_into_a_real_mlflow_server(tmp_path):
    from mlflow.tracking import MlflowClient

    with mlflow_server(tmp_path / "server") as uri:
        r = subprocess.run(
            [
                *AUTOTUNE,
                "search",
                "--cluster",
                "mixed-a100-v100",
                "--model",
                "gpt2-xl",
                "--method",
                "random",
                "--budget",
                "6",
                "--tracking-uri",
                uri,
            ],
            cwd=tmp_path,
            env=_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"store {uri}" in r.stdout
        client = MlflowClient(uri)
        exp = client.get_experiment_by_name("mixed-a100-v100__gpt2-xl")
        assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
        (parent,) = client.search_runs([exp.experiment_id], filter_string="tags.`autotune.role` = 'search'")
        assert parent.info.status == "FINISHED" and parent.data.metrics["evaluations"] == 6
        children = client.search_runs(
            [exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
        )
        assert len(children) == 6 and {c.info.status for c in children} == {"FINISHED"}
        assert {"best_config.json", "best_timeline.png", "search_progress.png"} <= {
            a.path for a in client.list_artifacts(parent.info.run_id)
        }
        best = subprocess.run(
            [*AUTOTUNE, "best", "--tracking-uri", uri],
            cwd=tmp_path,
            env=_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert best.returncode == 0, best.stderr
        assert json.loads(best.stdout)["measurement"]["tokens_per_s"] == pytest.approx(
            parent.data.metrics["best_tokens_per_s"]
        )
