"""``autotune train`` against faults: rank errors printed verbatim (no rich markup), a ``latest`` naming
a missing step, replayed steps in ``--metrics-out``, corrupt and crafted checkpoints (named, never
unpickled freely)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from paths import REPO

from autotune.errors import SpecError
from runner import checkpoint
from runner.train import TrainOutcome, train

PLAN = {
    "micro_batch_size": 2,
    "schedule": "1f1b",
    "pipelines": [
        {"num_microbatches": 4, "stages": [{"devices": ["cpu:0"], "layers": 2}, {"devices": ["cpu:1"], "layers": 2}]}
    ],
}
GLOO = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500"


def test_rank_error_with_brackets_is_printed_not_parsed(monkeypatch, capsys):
    """gloo's messages start with "[/path:line]": rich read it as a closing markup tag and died."""
    import runner.train as rt
    from autotune.commands import train as command

    outcome = TrainOutcome(1, errors=[{"rank": 1, "type": "DistBackendError", "message": GLOO, "time": 0.0}])
    monkeypatch.setattr(rt, "train", lambda *a, **k: outcome)
    code = command.run("cpu-2", "tiny", Path("plan.json"), None, 2, None, 0, False, None, None, None, 0, [])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 1 and GLOO in err and "rank 1 failed: DistBackendError" in err


def _dir_with(tmp_path: Path, names: list[str], latest: str | None, complete: set[str]) -> Path:
    d = tmp_path / "ckpt"
    for name in names:
        (d / name).mkdir(parents=True)
        if name in complete:
            (d / name / checkpoint.METADATA).write_bytes(b"x")
    if latest is not None:
        (d / checkpoint.LATEST).write_text(latest + "\n")
    return d


def test_resume_point_falls_back_to_the_newest_complete_checkpoint_or_refuses(tmp_path):
    d = _dir_with(tmp_path, ["step-00000002", "step-00000004"], "step-00000009", {"step-00000002"})
    assert checkpoint.resume_point(d) == d / "step-00000002"  # 9 is missing, 4 is incomplete
    (d / "step-00000004" / checkpoint.METADATA).write_bytes(b"x")
    assert checkpoint.resume_point(d) == d / "step-00000004"
    (d / checkpoint.LATEST).write_text("step-00000002\n")
    assert checkpoint.resume_point(d) == d / "step-00000002"  # latest wins when it is complete
    shutil.rmtree(d)
    d = _dir_with(tmp_path, ["step-00000003"], "step-00000003", set())
    with pytest.raises(SpecError, match="names 'step-00000003', which is missing or incomplete"):
        checkpoint.resume_point(d)
    (d / checkpoint.LATEST).write_text("../../etc\n")
    with pytest.raises(SpecError, match="missing or incomplete"):
        checkpoint.resume_point(d)


def test_second_lock_on_a_directory_is_refused(tmp_path):
    held = checkpoint.lock(tmp_path)
    try:
        with pytest.raises(SpecError, match=f"in use by another training run \\(pid {os.getpid()}\\)"):
            checkpoint.lock(tmp_path)  # another open file description: refused like another process
    finally:
        held.close()
    checkpoint.lock(tmp_path).close()  # free again


def _losses(path: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())]


@pytest.mark.slow
@pytest.mark.distributed
def test_dangling_latest_resumes_from_newest_complete_and_metrics_keep_one_row_per_step(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    first = train(
        "cpu-2",
        "tiny",
        PLAN,
        steps=4,
        checkpoint_dir=ckpt,
        checkpoint_every=2,
        metrics_out=metrics,
        quiet=True,
        timeout_s=300,
    )
    assert first.returncode == 0, first.error
    uninterrupted = _losses(metrics)
    assert [s for s, _ in uninterrupted] == [1, 2, 3, 4]
    # a kill left `latest` naming a step that was never written, and step 4 half-written
    (ckpt / "latest").write_text("step-00000009\n")
    (ckpt / "step-00000004" / ".metadata").unlink()
    resumed = train(
        "cpu-2", "tiny", PLAN, steps=5, checkpoint_dir=ckpt, resume=True, metrics_out=metrics, quiet=True, timeout_s=300
    )
    assert resumed.returncode == 0, resumed.error
    assert resumed.steps_done == 5
    rows = _losses(metrics)
    assert [s for s, _ in rows] == [1, 2, 3, 4, 5]  # steps 3 and 4 trained again, logged once
    assert rows[:4] == uninterrupted  # resumed from step 2 (not 0): the same losses
    assert (ckpt / "latest").read_text().strip() == "step-00000005"

    # a corrupt checkpoint names itself; a crafted .metadata is refused, its payload never runs
    (ckpt / "latest").write_text("step-00000002\n")
    (ckpt / "step-00000002" / ".metadata").write_bytes(b"\x80\x04garbage")
    bad = train("cpu-2", "tiny", PLAN, steps=3, checkpoint_dir=ckpt, resume=True, quiet=True, timeout_s=300)
    assert bad.returncode != 0
    assert f"CheckpointError: checkpoint {ckpt.resolve() / 'step-00000002'} cannot be read" in bad.error, bad.error
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (ckpt / "step-00000002" / ".metadata").write_bytes(pickle.dumps(Payload()))
    evil = train("cpu-2", "tiny", PLAN, steps=3, checkpoint_dir=ckpt, resume=True, quiet=True, timeout_s=300)
    assert evil.returncode != 0 and "posix.system is not part of a checkpoint's metadata" in evil.error, evil.error
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_train_reports_each_step_and_ends_with_a_summary(tmp_path):
    """``on_step`` hears of rank 0's steps (the CLI's progress bar); the CLI ends with steps, mean
    tokens/s, final loss and wall time."""
    import subprocess
    import sys

    heard = []
    outcome = train("cpu-2", "tiny", PLAN, steps=3, quiet=True, timeout_s=300, on_step=heard.append)
    assert outcome.returncode == 0, outcome.error
    assert [r["step"] for r in heard] == [1, 2, 3] and outcome.steps_run == 3
    assert outcome.final_loss == pytest.approx(heard[-1]["loss"]) and outcome.mean_tokens_per_s > 0
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    tmp = tmp_path / "tmp"  # the run's temporary directory: it must be left empty
    tmp.mkdir()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune.cli",
            "train",
            "--cluster",
            "cpu-2",
            "--model",
            "tiny",
            "--config",
            str(plan),
            "--steps",
            "2",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO), TMPDIR=str(tmp)),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "training done after step 2" in r.stderr and "2 steps in" in r.stderr and "final loss" in r.stderr
    # neither autotune's run directory nor torchrun's torchelastic_* log folder stays behind
    assert sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor")) == []


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGABRT"])
def test_a_rank_killed_without_a_word_leaves_torchrun_s_and_the_ranks_output_in_the_error(sig, tmp_path):
    """A quiet run keeps torchrun's output and each rank's in its run directory; a failure that no rank
    reported (here a rank killed by a signal after the first step) quotes their ends, where it used to say
    only "torchrun exited with 1", and names the killed rank. SIGABRT, what glibc sends itself on a corrupted
    heap: the rank's own stderr holds its Python stack (``faulthandler``)."""
    import signal

    from runner.train import _ranks_of

    killed: list[int] = []

    def kill_rank_1(record: dict) -> None:
        if killed:
            return
        # this process's torchrun child (the suite may have other children: MLflow writers, servers)
        torchrun = next(
            p for p in _ranks_of(os.getpid()) if b"runner.torchrun" in Path(f"/proc/{p}/cmdline").read_bytes()
        )
        ranks = sorted(_ranks_of(torchrun))
        killed.append(ranks[-1])
        os.kill(ranks[-1], getattr(signal, sig))

    out = train("cpu-2", "tiny", PLAN, steps=50, quiet=True, timeout_s=240, on_step=kill_rank_1)
    assert killed and out.returncode != 0
    # rank 0 reports only that its peer went away: the cause is in torchrun's output, now quoted
    assert "no rank reported a failure of its own" in out.error or "torchrun exited with" in out.error
    assert "--- torchrun.log" in out.error and f" ({sig})" in out.error, out.error
    assert "killed by a signal, without a Python error: rank " in out.error, out.error
    if sig == "SIGABRT":
        assert "Fatal Python error: Aborted" in out.error, out.error


def test_a_directory_of_another_model_s_checkpoints_is_refused_before_launch_and_its_resume_kept(tmp_path):
    """Issue 46, case 7: training a second model into a directory holding a first model's checkpoints
    overwrote its ``latest``; resuming the first then failed after launch. Now refused before launch, one
    line; the first run still resumes. Another plan of the same model: refused unless ``--resume``."""
    ckpt = tmp_path / "ckpt"
    first = train("cpu-2", "tiny", PLAN, steps=2, checkpoint_dir=ckpt, quiet=True, timeout_s=240)
    assert first.returncode == 0, first.error
    latest = (ckpt / checkpoint.LATEST).read_text()
    from dataclasses import replace

    from autotune import load_model

    tiny = load_model("tiny")
    wider = replace(tiny, name="tiny-wider", ffn_hidden_size=2 * tiny.ffn_hidden_size)
    with pytest.raises(SpecError, match="holds the checkpoints of another model.*ffn_hidden_size"):
        train("cpu-2", wider, PLAN, steps=2, checkpoint_dir=ckpt, quiet=True, timeout_s=240)
    other_plan = {**PLAN, "micro_batch_size": 1, "pipelines": [{**PLAN["pipelines"][0], "num_microbatches": 8}]}
    with pytest.raises(SpecError, match="another plan of this model: --resume continues them"):
        train("cpu-2", "tiny", other_plan, steps=2, checkpoint_dir=ckpt, quiet=True, timeout_s=240)
    assert (ckpt / checkpoint.LATEST).read_text() == latest
    again = train("cpu-2", "tiny", PLAN, steps=3, checkpoint_dir=ckpt, resume=True, quiet=True, timeout_s=240)
    assert again.returncode == 0 and again.steps_done == 3, again.error
