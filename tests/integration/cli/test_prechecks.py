"""Paths, stores and numbers are checked before any work (``autotune.prechecks``): one line, exit 2,
and nothing searched, profiled, launched or created first."""

from __future__ import annotations

import json
import socket
import sys

import cli_run
import pytest
from servers import free_port

PLAN = {
    "micro_batch_size": 2,
    "schedule": "1f1b",
    "pipelines": [
        {"num_microbatches": 4, "stages": [{"devices": ["cpu:0"], "layers": 2}, {"devices": ["cpu:1"], "layers": 2}]}
    ],
}


def run_cli(capsys, monkeypatch, tmp_path, *args: str) -> tuple[int, str]:
    monkeypatch.chdir(tmp_path)
    code, _, err = cli_run.run_cli(capsys, *args)
    return code, err


def refused(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


SEARCH = ["search", "--cluster", "mixed-a100-v100", "--model", "gpt2-xl", "--method", "random", "--budget", "3"]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--output", "no-such-dir/best.json"], "--output: directory 'no-such-dir' does not exist"),
        (["--output", "."], "is a directory"),
        (["--tracking-uri", "foo://bar"], "--tracking-uri: unsupported scheme 'foo'"),
        (["--tracking-uri", "sqlite:///notes.txt"], "'notes.txt' is not an SQLite database"),
        (["--tracking-uri", "sqlite:////no/such/dir/m.db"], "directory '/no/such/dir' of the database does not exist"),
        (["--tracking-uri", "http://127.0.0.1:{port}"], "no MLflow server answers at 127.0.0.1:{port}"),
        (["--method", "optuna", "--storage", "foo://bar"], "--storage: unsupported storage 'foo://bar'"),
        (
            ["--method", "optuna", "--storage", "sqlite:///notes.txt"],
            "--storage: 'notes.txt' is not an SQLite database",
        ),
        (["--seed", "-1"], "--seed: must be an integer from 0 to 4,294,967,295, got -1"),
        (["--seed", str(2**32)], "--seed: must be an integer from 0 to 4,294,967,295"),
    ],
    ids=[
        "output-dir-missing",
        "output-is-dir",
        "uri-scheme",
        "uri-not-db",
        "uri-dir-missing",
        "uri-unreachable",
        "storage-scheme",
        "storage-not-db",
        "seed-negative",
        "seed-2**32",
    ],
)
def test_search_prechecks(capsys, monkeypatch, tmp_path, extra, message):
    (tmp_path / "notes.txt").write_text("not a database\n")
    port = str(free_port())
    code, err = run_cli(capsys, monkeypatch, tmp_path, *SEARCH, *[x.format(port=port) for x in extra])
    refused(code, err, message.format(port=port))
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "optuna.db").exists()  # no work started


def test_profile_output_is_checked_before_profiling(capsys, monkeypatch, tmp_path):
    code, err = run_cli(capsys, monkeypatch, tmp_path, "profile", "--cluster", "cpu-2", "--output", "nope/p.json")
    refused(code, err, "--output: directory 'nope' does not exist")


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--metrics-out", "nope/m.jsonl"], "--metrics-out: directory 'nope' does not exist"),
        (["--checkpoint-dir", "notes.txt"], "--checkpoint-dir: 'notes.txt' exists and is not a directory"),
        (["--tracking-uri", "foo://bar"], "--tracking-uri: unsupported scheme"),
        (["--seed", "-5"], "--seed: must be an integer from 0"),
        (["--checkpoint-dir", "ckpt", "--resume"], "--resume: no checkpoint in ckpt to resume from"),
    ],
    ids=["metrics-out", "checkpoint-dir", "tracking-uri", "seed", "resume-empty"],
)
def test_train_prechecks_before_any_rank(capsys, monkeypatch, tmp_path, extra, message):
    (tmp_path / "notes.txt").write_text("x\n")
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    code, err = run_cli(
        capsys,
        monkeypatch,
        tmp_path,
        "train",
        "--cluster",
        "cpu-2",
        "--model",
        "tiny",
        "--config",
        "plan.json",
        "--steps",
        "2",
        *extra,
    )
    refused(code, err, message)
    assert not list(tmp_path.glob("**/step-*"))


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_measure_timeout_must_be_finite(capsys, monkeypatch, tmp_path, value):
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    code, err = run_cli(
        capsys,
        monkeypatch,
        tmp_path,
        "measure",
        "--cluster",
        "cpu-2",
        "--model",
        "tiny",
        "--config",
        "plan.json",
        "--timeout",
        value,
    )
    refused(code, err, "--timeout: must be a finite number > 0")


def test_ui_port_range_and_port_in_use(capsys, monkeypatch, tmp_path):
    code, err = run_cli(capsys, monkeypatch, tmp_path, "ui", "--port", "99999")
    refused(code, err, "--port: must be a TCP port from 1 to 65535, got 99999")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err = run_cli(capsys, monkeypatch, tmp_path, "ui", "--port", str(port))
    refused(code, err, f"--port: 127.0.0.1:{port} is in use")


def test_ui_exits_1_when_its_server_stops_by_itself(capsys, monkeypatch, tmp_path):
    """``mlflow ui`` exits 0 when it cannot bind its port: ``autotune ui`` must not."""
    import autotune.commands.ui as ui

    monkeypatch.setattr(ui, "command", lambda uri, port: [sys.executable, "-c", "raise SystemExit(0)"])
    code, err = run_cli(capsys, monkeypatch, tmp_path, "ui", "--port", str(free_port()))
    assert code == 1 and "the MLflow UI server stopped by itself (exit code 0)" in err, err


def test_library_tune_checks_too(tmp_path):
    from autotune.errors import SpecError
    from autotune.search.api import tune

    with pytest.raises(SpecError, match="--seed"):
        tune("mixed-a100-v100", "gpt2-xl", method="random", budget=2, seed=2**40, track=False)
    with pytest.raises(SpecError, match="--seed: must be an integer from 0 to 4,294,967,294"):
        tune("mixed-a100-v100", "gpt2-xl", method="optuna", budget=2, seed=2**32 - 1, workers=2, track=False)


def test_run_timeout_option(capsys, monkeypatch, tmp_path):
    from autotune.evaluator import DEFAULT_RUN_TIMEOUT_S, make_evaluator
    from autotune.loading import load_cluster, load_model

    code, err = run_cli(capsys, monkeypatch, tmp_path, *SEARCH, "--backend", "real", "--run-timeout", "nan")
    refused(code, err, "--run-timeout: must be a finite number > 0")
    cluster, model = load_cluster("cpu-2"), load_model("tiny")
    assert make_evaluator(cluster, model, "real").timeout_s == DEFAULT_RUN_TIMEOUT_S == 300
    assert make_evaluator(cluster, model, "real", run_timeout_s=42).timeout_s == 42


@pytest.mark.slow
@pytest.mark.distributed
def test_real_search_ends_a_hung_run_at_its_run_timeout(monkeypatch, tmp_path):
    from autotune.search.api import tune

    monkeypatch.setenv("AUTOTUNE_FAULT", "hang:rank1")
    result = tune("cpu-2", "tiny", method="uniform", budget=1, backend="real", run_timeout_s=6, track=False)
    m = result.best_measurement
    assert m.status == "timeout" and "no result after 6 s" in m.error, m.error
