"""No process outlives its parent: ``kill -9`` (and SIGTERM for ``ui``) of ``train``, ``measure``,
``search --workers`` and ``ui``, then a /proc scan for a tag only that run's processes carry. Also:
a checkpoint directory in use refuses a second trainer, and run directories of killed runs are swept."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from paths import REPO
from proc_scan import kill_test_processes, processes_with
from servers import free_port

REPO = REPO
PLAN = {
    "micro_batch_size": 2,
    "schedule": "1f1b",
    "pipelines": [
        {"num_microbatches": 4, "stages": [{"devices": ["cpu:0"], "layers": 2}, {"devices": ["cpu:1"], "layers": 2}]}
    ],
}
SLOW = "nodes: [{name: cpu, gpu: cpu, count: 2, slowdown: 10}]\nnetwork: {bandwidth_GBps: 5}\n"

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def autotune(*args: str) -> list[str]:
    return [sys.executable, "-m", "autotune.cli", *args]


def tagged_env(tmp_path: Path) -> tuple[str, dict[str, str]]:
    tag = f"autotune-orphan-{uuid.uuid4().hex}"
    return tag, dict(os.environ, AUTOTUNE_TEST_TAG=tag, TMPDIR=str(tmp_path), PYTHONPATH=str(REPO))


def wait_for(condition, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the command ended first ({proc.returncode})")
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(0.1)


def kill_and_scan(proc: subprocess.Popen, tag: str, sig: int = signal.SIGKILL, within_s: float = 20.0) -> None:
    """Send ``sig`` to the command alone (not its group) and require every tagged process gone soon."""
    try:
        proc.send_signal(sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + within_s
        while processes_with(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = processes_with(tag)
    finally:
        kill_test_processes(proc, tag)
    assert left == [], f"processes outlived their parent: {left}"


def test_train_killed_leaves_no_rank_and_its_directory_is_locked_meanwhile(tmp_path):
    tag, env = tagged_env(tmp_path)
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    (tmp_path / "slow.yaml").write_text(SLOW)
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = [
        "train",
        "--cluster",
        str(tmp_path / "slow.yaml"),
        "--model",
        "tiny",
        "--config",
        str(tmp_path / "plan.json"),
        "--steps",
        "50",
        "--checkpoint-dir",
        str(ckpt),
        "--metrics-out",
        str(metrics),
    ]
    proc = subprocess.Popen(
        autotune(*args), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, 180, "first step", proc)
        second = subprocess.run(
            autotune(*args, "--resume"),
            cwd=tmp_path,
            env=dict(env, AUTOTUNE_TEST_TAG="x"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2, second.stderr
        assert second.stderr.count("\n") == 1 and "is in use by another training run" in second.stderr
        assert str(proc.pid) in second.stderr
    finally:
        kill_and_scan(proc, tag)  # torchrun and both ranks die with `autotune train`
    assert list(tmp_path.glob("autotune-train-*")), "the killed launcher's run directory (swept next time)"
    from runner.launch import sweep_stale_run_dirs

    assert sweep_stale_run_dirs(tmp_path) >= 1 and not list(tmp_path.glob("autotune-train-*"))


def test_measure_killed_leaves_no_rank_even_a_hung_one(tmp_path):
    tag, env = tagged_env(tmp_path)
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    proc = subprocess.Popen(
        autotune(
            "measure",
            "--cluster",
            "cpu-2",
            "--model",
            "tiny",
            "--config",
            str(tmp_path / "plan.json"),
            "--timeout",
            "600",
        ),
        cwd=tmp_path,
        env=dict(env, AUTOTUNE_FAULT="hang:rank1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: len([p for p in processes_with(tag) if p != proc.pid]) >= 2, 120, "both ranks", proc)
        time.sleep(1.0)  # the ranks are past their start (exec'd and importing)
    finally:
        kill_and_scan(proc, tag)
    from runner.launch import sweep_stale_run_dirs

    assert list(tmp_path.glob("autotune-run-*"))
    assert sweep_stale_run_dirs(tmp_path) == 1 and not list(tmp_path.glob("autotune-run-*"))


def test_search_workers_die_with_the_search(tmp_path):
    tag, env = tagged_env(tmp_path)
    proc = subprocess.Popen(
        autotune(
            "search",
            "--cluster",
            "mixed-a100-v100",
            "--model",
            "gpt2-xl",
            "--method",
            "optuna",
            "--budget",
            "5000",
            "--workers",
            "2",
            "--storage",
            str(tmp_path / "o.journal"),
            "--tracking-uri",
            f"sqlite:///{tmp_path}/m.db",
        ),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    journal = tmp_path / "o.journal"
    try:  # both workers are writing trials
        wait_for(lambda: journal.exists() and journal.read_text().count("\n") >= 40, 240, "trials", proc)
    finally:
        kill_and_scan(proc, tag)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=["SIGKILL", "SIGTERM", "SIGINT"])
def test_ui_server_dies_with_autotune_ui(tmp_path, sig):
    """SIGINT to ``autotune ui`` alone (``kill -INT``, not a terminal's Ctrl-C to the whole group): it used
    to wait for ever on a server nobody had stopped; now it stops it and exits 0."""
    tag, env = tagged_env(tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        autotune("ui", "--port", str(port), "--tracking-uri", f"sqlite:///{tmp_path}/m.db"),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: _listening(port), 240, "the MLflow UI", proc)
    finally:
        kill_and_scan(proc, tag, sig)
    assert not _listening(port)
    if sig == signal.SIGINT:
        assert proc.returncode == 0


def test_profile_killed_leaves_no_benchmark_process(tmp_path):
    tag, env = tagged_env(tmp_path)
    proc = subprocess.Popen(
        autotune("profile", "--cluster", "cpu-2", "--model", "tiny", "--quick", "--output", str(tmp_path / "p.json")),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:  # a probe process of its own is running, in a run directory of its own
        wait_for(
            lambda: [p for p in processes_with(tag) if p != proc.pid] and list(tmp_path.glob("autotune-probe-*")),
            300,
            "a probe process",
            proc,
        )
        time.sleep(0.5)
    finally:
        kill_and_scan(proc, tag)
    from runner.launch import sweep_stale_run_dirs

    assert list(tmp_path.glob("autotune-probe-*"))  # a killed process cannot remove its own
    assert sweep_stale_run_dirs(tmp_path) >= 1 and not list(tmp_path.glob("autotune-probe-*"))
