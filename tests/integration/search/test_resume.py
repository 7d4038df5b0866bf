"""Every search method resumes after ``kill -9``: a re-run with the same arguments reopens the one MLflow
parent run, evaluates only the rest of the budget and ends with exactly ``--budget`` distinct child
runs, the parent FINISHED (optuna's own kill test is in tests/integration/search/test_search_cli.py)."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from paths import REPO

AUTOTUNE = [sys.executable, "-m", "autotune.cli"]
ENV = dict(os.environ, PYTHONPATH=str(REPO))


def finished_children(db: Path) -> int:
    """Child runs written to the end (terminated), read straight from the SQLite store."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as con:
            return con.execute(
                "SELECT COUNT(*) FROM runs r JOIN tags t ON r.run_uuid = t.run_uuid "
                "WHERE t.key = 'mlflow.parentRunId' AND r.status IN ('FINISHED', 'FAILED') "
                "AND r.lifecycle_stage = 'active'"
            ).fetchone()[0]
    except sqlite3.Error:  # the store or its tables do not exist yet, or it is being written
        return 0


@pytest.mark.slow
@pytest.mark.parametrize("method,budget", [("random", 24), ("rl", 16)])
def test_killed_search_resumes_to_exactly_budget(tmp_path, method, budget):
    from mlflow.tracking import MlflowClient

    db = tmp_path / "mlflow.db"
    args = [
        "search",
        "--cluster",
        "mixed-a100-v100",
        "--model",
        "gpt2-xl",
        "--method",
        method,
        "--budget",
        str(budget),
        "--seed",
        "3",
        "--tracking-uri",
        f"sqlite:///{db}",
    ]
    proc = subprocess.Popen(
        [*AUTOTUNE, *args],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 300  # generous: imports and the MLflow store on a loaded machine
        while time.time() < deadline and finished_children(db) < 4 and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None, "the search finished before it could be killed; raise the budget"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_at = finished_children(db)
    assert 4 <= killed_at < budget

    r = subprocess.run([*AUTOTUNE, *args], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stderr and f"of {budget} plans already evaluated" in r.stderr

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = client.get_experiment_by_name("mixed-a100-v100__gpt2-xl")
    parents = client.search_runs([exp.experiment_id], filter_string="tags.`autotune.role` = 'search'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert parents[0].data.metrics["evaluations"] == budget
    children = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'", max_results=1000
    )
    assert len(children) == budget == len({c.data.tags["autotune.config_key"] for c in children})
    assert all(c.info.status in ("FINISHED", "FAILED") for c in children)


def test_random_replays_its_draws_after_a_resume():
    """The preloaded plans of a killed run are replayed free, not counted as misses: a resumed random
    search evaluates the plans an uninterrupted one would have."""
    from autotune.loading import load_cluster, load_model
    from autotune.planning.budget import BudgetedEvaluator
    from autotune.planning.space import SearchSpace
    from autotune.search.agents.simple import run_random
    from autotune.simulator import Simulator

    cluster, model = load_cluster("mixed-a100-v100"), load_model("gpt2-xl")
    space, sim = SearchSpace(cluster, model), Simulator(cluster, model)
    whole = BudgetedEvaluator(sim, space, 30)
    run_random(space, whole, seed=5, max_tries_per_eval=10)
    resumed = BudgetedEvaluator(sim, space, 30)
    for ev in whole.history[:20]:  # what the killed run had recorded
        resumed.preload(ev.config, ev.measurement, ev.params)
    run_random(space, resumed, seed=5, max_tries_per_eval=10)
    assert [e.config for e in resumed.history] == [e.config for e in whole.history]
