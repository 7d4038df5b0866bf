"""``autotune search`` / ``autotune best`` as a user runs them (real subprocesses, real stores), including
an Optuna search killed mid-way and resumed to exactly ``--budget`` evaluated trials."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from paths import REPO

import autotune
from autotune.specs import ParallelConfig

AUTOTUNE = [sys.executable, "-m", "autotune.cli"]
MEASUREMENT_KEYS = {"tokens_per_s", "iteration_time_s", "oom", "peak_memory_GiB", "mfu", "bubble_fraction"}


def cli(*args: str, cwd: Path, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run([*AUTOTUNE, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("search_cli")


@pytest.fixture(scope="module")
def searched(workdir):
    r = cli(
        "search",
        "--cluster",
        "mixed-a100-v100",
        "--model",
        "gpt2-xl",
        "--method",
        "random",
        "--budget",
        "8",
        "--output",
        "best.json",
        cwd=workdir,
    )
    assert r.returncode == 0, r.stderr
    return r


def test_search_prints_the_plan_and_where_to_look(searched, workdir):
    out = searched.stdout
    assert "best plan: random on mixed-a100-v100 / gpt2-xl" in out
    assert "pipelines (data-parallel replicas)" in out and "a100:0" in out
    assert "MLflow: experiment mixed-a100-v100__gpt2-xl" in out and "autotune ui" in out
    assert "8/8" in searched.stderr  # the progress bar
    assert (workdir / "mlflow.db").exists()  # default store in the working directory


def test_output_file_is_a_config_plus_measurement(searched, workdir):
    doc = json.loads((workdir / "best.json").read_text())
    assert MEASUREMENT_KEYS <= set(doc["measurement"])
    config = ParallelConfig.from_dict(doc)
    config.validate(autotune.load_cluster("mixed-a100-v100"), autotune.load_model("gpt2-xl"))


def test_autotune_best_matches_the_library(searched, workdir):
    r = cli("best", cwd=workdir)
    assert r.returncode == 0, r.stderr
    printed = json.loads(r.stdout)
    assert MEASUREMENT_KEYS <= set(printed.pop("measurement"))
    uri = f"sqlite:///{workdir}/mlflow.db"
    assert ParallelConfig.from_dict(printed) == autotune.best_config(tracking_uri=uri)
    file_doc = json.loads((workdir / "best.json").read_text())
    file_doc.pop("measurement")
    assert ParallelConfig.from_dict(file_doc) == ParallelConfig.from_dict(printed)


def test_bad_input_is_one_clear_line(workdir):
    r = cli(
        "search",
        "--cluster",
        "mixed-a100-v100",
        "--model",
        "gpt2-xl",
        "--method",
        "annealing",
        "--budget",
        "3",
        cwd=workdir,
    )
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "method: must be one of rl | optuna | random | uniform | exhaustive | dp" in r.stderr
    r = cli(
        "search",
        "--cluster",
        "mixed-h100-a100-32",
        "--model",
        "llama2-7b",
        "--method",
        "exhaustive",
        "--budget",
        "3",
        cwd=workdir,
    )
    assert r.returncode == 2 and "combinations" in r.stderr and "exceed the limit" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["inline", "process"])
def test_killed_optuna_search_resumes_to_exactly_budget(tmp_path, writer):
    """SIGKILL to the whole process group mid-search (with the MLflow record written inline or by
    its writer process, whose queued writes die with it), then the same command resumes."""
    import optuna
    from mlflow.tracking import MlflowClient

    budget = 80  # far more than a poll interval's worth of evaluations: the kill lands mid-search
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
        "--seed",
        "3",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), AUTOTUNE_MLFLOW_WRITER=writer)
    proc = subprocess.Popen(
        [*AUTOTUNE, *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    from autotune.search.agents.optuna_storage import open_storage

    study_name = "mixed-a100-v100__gpt2-xl__optuna__seed3"
    journal = str(tmp_path / "optuna.journal")  # the default storage, in the working directory
    done = 0
    try:
        deadline = time.time() + 300  # generous: imports and the MLflow store on a loaded machine
        while time.time() < deadline and done < 5:
            time.sleep(0.05)
            try:
                study = optuna.load_study(study_name=study_name, storage=open_storage(journal))
                done = sum(bool(t.user_attrs.get("evaluated")) for t in study.trials)
            except Exception:  # the study or its tables do not exist yet
                done = 0
        assert proc.poll() is None, "the search finished before it could be killed; raise the budget"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    study = optuna.load_study(study_name=study_name, storage=open_storage(journal))
    killed_at = sum(bool(t.user_attrs.get("evaluated")) for t in study.trials)
    assert 5 <= killed_at < budget

    r = cli(*args, cwd=tmp_path, env={"AUTOTUNE_MLFLOW_WRITER": writer})
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stderr
    study = optuna.load_study(study_name=study_name, storage=open_storage(journal))
    evaluated = [t for t in study.trials if t.user_attrs.get("evaluated")]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in evaluated)
    assert len(evaluated) == budget
    assert len({t.user_attrs["config_key"] for t in evaluated}) == budget

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("mixed-a100-v100__gpt2-xl")
    parents = client.search_runs([exp.experiment_id], filter_string="tags.`autotune.role` = 'search'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'", max_results=1000
    )
    assert len(children) == budget == len({c.data.tags["autotune.config_key"] for c in children})


@pytest.mark.slow
@pytest.mark.distributed
def test_real_backend_smoke_one_profiled_run(tmp_path):
    """One real profiled run (torch.distributed, gloo) of the tiny model on two CPU ranks."""
    from autotune.search.api import tune

    result = tune(
        "cpu-2",
        "tiny",
        method="uniform",
        budget=1,
        backend="real",
        seed=0,
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
    )
    assert result.evaluations == 1 and result.backend == "real"
    m = result.best_measurement
    assert m.status == "ok", m.error
    assert m.tokens_per_s > 0 and m.iteration_time_s > 0
    (run,) = result.real_runs  # predicted before the run, measured (the median when it was run again)
    assert run.predicted_s > 0 and run.measured_s == m.iteration_time_s and 1 <= len(run.runs_s) <= 3
    assert type(result).from_json(result.to_json()).real_runs == result.real_runs


def test_real_backend_prints_predicted_against_measured_per_run_and_at_the_end(tmp_path):
    """``search --backend real`` says, per real run, what the corrected simulator predicted and what was
    measured (and the spread when the plan was measured again), and at the end the simulator's error."""
    r = cli(
        "search",
        "--cluster",
        "cpu-2",
        "--model",
        "tiny",
        "--method",
        "random",
        "--budget",
        "2",
        "--backend",
        "real",
        "--engine",  # issue 47: under an engine, the real runs are the runner holding its plan, said so
        "deepspeed",
        cwd=tmp_path,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("real run ")]
    assert len(lines) == 2 and all("predicted" in line and "measured" in line for line in lines), r.stderr
    assert "simulator error before each real run (corrected by the runs before it): mean" in r.stderr
    said = "--engine deepspeed --backend real: each real run is autotune's runner training the plan as DeepSpeed"
    assert r.stderr.count(said) == 2, r.stderr  # before the runs and in the summary


def test_rl_on_real_runs_says_why_it_stopped_and_a_rerun_resumes_without_new_runs(tmp_path):
    """``search --method rl --backend real`` is the chooser of real runs: it says after its last run why it
    stopped; the same command again resumes from the MLflow record and runs nothing new."""
    args = ("search", "--cluster", "cpu-hetero", "--model", "tiny", "--method", "rl", "--budget", "3")
    r = cli(*args, "--backend", "real", cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ran = [line for line in r.stderr.splitlines() if line.startswith("real run ")]
    stopped = [line for line in r.stderr.splitlines() if line.startswith("real runs stopped after ")]
    assert 1 <= len(ran) <= 3 and len(stopped) == 1, r.stderr
    again = cli(*args, "--backend", "real", cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not [line for line in again.stderr.splitlines() if line.startswith("real run ")], again.stderr
    assert f"real runs stopped after {len(ran)} of 3" in again.stderr


@pytest.mark.slow
def test_two_workers_share_one_study_and_one_budget(tmp_path):
    import optuna
    from mlflow.tracking import MlflowClient

    from autotune.search.agents.optuna_storage import open_storage
    from autotune.search.api import tune

    budget = 16
    journal = str(tmp_path / "optuna.journal")
    result = tune(
        "mixed-a100-v100",
        "gpt2-xl",
        method="optuna",
        budget=budget,
        workers=2,
        storage=journal,
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
    )
    assert result.evaluations == budget
    study = optuna.load_study(study_name="mixed-a100-v100__gpt2-xl__optuna__seed0", storage=open_storage(journal))
    evaluated = [t for t in study.trials if t.user_attrs.get("evaluated")]
    assert len(evaluated) == budget == len({t.user_attrs["config_key"] for t in evaluated})
    children = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_runs(
        [MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(result.run_id).info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{result.run_id}'",
    )
    assert len(children) == budget


def test_ui_serves_the_local_store_on_localhost_only():
    from autotune.commands.ui import command

    cmd = command(None, 5123)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "5123"
    assert cmd[cmd.index("--backend-store-uri") + 1] == "sqlite:///mlflow.db"
    assert command("sqlite:////x/m.db", 1)[cmd.index("--backend-store-uri") + 1] == "sqlite:////x/m.db"


def test_compare_prints_one_row_per_search(searched, workdir):
    """Three searches in one experiment (the module's random one and two more): three rows."""
    from autotune.search.api import tune

    uri = f"sqlite:///{workdir}/mlflow.db"
    tune("mixed-a100-v100", "gpt2-xl", method="uniform", budget=4, tracking_uri=uri)
    tune(
        "mixed-a100-v100",
        "gpt2-xl",
        method="optuna",
        budget=5,
        tracking_uri=uri,
        storage=str(workdir / "optuna.journal"),
    )
    r = cli("compare", "--experiment", "mixed-a100-v100__gpt2-xl", "--csv", cwd=workdir)
    assert r.returncode == 0, r.stderr
    import csv

    rows = list(csv.DictReader(r.stdout.splitlines()))
    assert [(row["method"], row["budget"]) for row in rows] == [("random", "8"), ("uniform", "4"), ("optuna", "5")]
    assert all(float(row["best_tokens_per_s"]) > 0 and int(row["found_at"]) >= 1 for row in rows)
    assert all(row["status"] == "FINISHED" for row in rows)
    table = cli("compare", cwd=workdir)  # the most recent search's experiment, as a table
    assert table.returncode == 0 and "searches in experiment mixed-a100-v100__gpt2-xl" in table.stdout
    assert (
        sum(line.split()[0] in ("random", "uniform", "optuna") for line in table.stdout.splitlines() if line.strip())
        == 3
    )


def test_compare_names_a_missing_experiment(searched, workdir):
    r = cli("compare", "--experiment", "nope", cwd=workdir)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no experiment 'nope'" in r.stderr


def test_search_ends_with_its_summary(searched):
    out = searched.stdout
    import re

    assert re.search(r"top [1-5] plans", out) and "best found at evaluation" in out
    assert "per second" in out and "out of memory" in out
    assert "x the best heterogeneity-blind uniform plan" in out
    assert "http://127.0.0.1:5000/#/experiments/" in out


@pytest.mark.slow
def test_ctrl_c_says_how_to_resume_and_fresh_starts_over(tmp_path):
    """SIGINT (Ctrl-C) mid-search: one message that re-running resumes, exit 130, the parent run
    KILLED; the same command then resumes to exactly --budget; --fresh starts a new study."""
    import optuna

    from autotune.search.agents.optuna_storage import open_storage
    from autotune.search.agents.shared_study import evaluated_trials

    args = [
        "search",
        "--cluster",
        "mixed-a100-v100",
        "--model",
        "gpt2-xl",
        "--method",
        "optuna",
        "--budget",
        "70",
        "--seed",
        "4",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [*AUTOTUNE, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    name = "mixed-a100-v100__gpt2-xl__optuna__seed4"
    journal = str(tmp_path / "optuna.journal")

    def evaluated(study_name: str = name) -> int:
        """Evaluations the study holds as the search counts them: COMPLETE trials. A Ctrl-C inside the
        write of the last one can leave it RUNNING with its ``evaluated`` attribute already set; the
        resumed search fails that trial and evaluates the plan again (counting those made this test
        expect one evaluation more than the resume reported)."""
        try:
            study = optuna.load_study(study_name=study_name, storage=open_storage(journal))
        except Exception:  # not created yet
            return 0
        trials = evaluated_trials(study)
        keys = [t.user_attrs.get("config_key") for t in trials]
        assert len(set(keys)) == len(keys), "a plan was evaluated twice"
        return len(trials)

    deadline = time.time() + 120
    while time.time() < deadline and evaluated() < 5:
        time.sleep(0.3)
    assert proc.poll() is None, "the search finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Re-run the same command to resume" in err and "Traceback" not in err
    done = evaluated()
    assert 5 <= done < 70

    again = cli(*args, cwd=tmp_path, timeout=240)
    assert again.returncode == 0, again.stderr
    assert f"resuming: {done} of 70 plans already evaluated" in again.stderr
    assert evaluated() == 70

    fresh = cli(*args[:-4], "--budget", "4", "--seed", "4", "--fresh", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    assert "resuming" not in fresh.stderr
    assert evaluated(name + "__fresh2") == 4 and evaluated() == 70  # the earlier study is kept


def test_restrict_narrows_the_search_from_the_command_line_and_names_the_search(tmp_path):
    """``--restrict name=value[,value...]`` (repeatable) narrows the space as the library's ``restrict=``
    does: every evaluated plan has 2 stages and no ZeRO; the run name and ``compare`` say how the search
    differs from the default one; a malformed or unknown name is one line, exit 2, before any work."""
    from mlflow.tracking import MlflowClient

    args = ["search", "--cluster", "mixed-a100-v100", "--model", "gpt2-xl", "--method", "random", "--budget", "6"]
    r = cli(*args, "--restrict", "pp=2", "--restrict", "zero=0", "--restrict", "roundpipe=false", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("mixed-a100-v100__gpt2-xl")
    parent = client.search_runs([exp.experiment_id], filter_string="tags.`autotune.role` = 'search'")[0]
    assert parent.info.run_name.endswith("pp=2 roundpipe=False zero=0")
    children = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    assert len(children) == 6 and {c.data.params["pp"] for c in children} == {"2"}
    assert {c.data.params["zero"] for c in children} == {"0"}
    rows = cli("compare", "--csv", cwd=tmp_path)
    assert rows.returncode == 0 and "pp=2 roundpipe=False zero=0" in rows.stdout
    for bad, names in (
        (["--restrict", "pp"], "--restrict: 'pp' is not name=value"),
        (["--restrict", "ppp=2"], "ppp: unknown dimension"),
        (["--restrict", "pp=99"], "pp: none of ['99'] is a valid choice"),
    ):
        r = cli(*args, *bad, cwd=tmp_path)
        assert r.returncode == 2 and names in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
