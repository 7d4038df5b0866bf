"""Stages of one pipeline at different tensor-parallel degrees (Sailor's per-stage tp): the activation and
its gradient cross each boundary as ``autotune.specs.handoff`` gives (``runner.mixed``), and the run trains
like one process, clips with the same global norm, and resumes exactly from a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mixed_runs import rewind
from paths import DATA

from runner.optim import TrainSettings
from runner.reference import reference_losses
from runner.train import train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
torch.set_num_threads(1)

LLAMA = str(DATA / "tiny-llama.yaml")
RTOL = 1e-5
SETTINGS = TrainSettings(clip_grad_norm=0.5)


def _plan(first: dict, second: dict, microbatches: int = 4) -> dict:
    return {
        "micro_batch_size": 1,
        "schedule": "1f1b",
        "pipelines": [{"num_microbatches": microbatches, "stages": [first, second]}],
    }


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_stages_at_tp2_then_tp1_train_like_one_process_and_resume_exactly(tmp_path):
    steps = 6
    plan = _plan({"devices": ["cpu:0", "cpu:1"], "layers": 1}, {"devices": ["cpu:2"], "layers": 1})
    norms: list[float] = []
    reference = reference_losses(LLAMA, steps, settings=SETTINGS, grad_norms=norms)
    whole, ckpt = tmp_path / "whole.jsonl", tmp_path / "ckpt"
    kw = {"steps": steps, "settings": SETTINGS, "checkpoint_dir": ckpt, "quiet": True, "timeout_s": 600}
    out = train("cpu-4", LLAMA, plan, metrics_out=whole, checkpoint_every=1, **kw)
    assert out.returncode == 0, out.error
    got = _records(whole)
    assert len(got) == steps
    torch.testing.assert_close(torch.tensor([r["loss"] for r in got]), torch.tensor(reference), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in got]), torch.tensor(norms), rtol=RTOL, atol=0)
    # resume from the step-3 checkpoint: steps 4 to 6 again, the same losses bit for bit
    rewind(ckpt, 3)
    resumed = tmp_path / "resumed.jsonl"
    again = train("cpu-4", LLAMA, plan, metrics_out=resumed, resume=True, **kw)
    assert again.returncode == 0, again.error
    assert [r["loss"] for r in _records(resumed)] == [r["loss"] for r in got[3:]]


def test_a_stage_at_tp1_then_a_sequence_parallel_tp2_stage_train_like_one_process(tmp_path):
    """The receiver holds half the sequence each: the tp 1 stage sends each half to its owner and gathers
    the two halves of the gradient."""
    steps = 3
    plan = _plan(
        {"devices": ["cpu:0"], "layers": 1}, {"devices": ["cpu:1", "cpu:2"], "layers": 1, "sequence_parallel": True}
    )
    reference = reference_losses(LLAMA, steps)
    out = train("cpu-4", LLAMA, plan, steps=steps, metrics_out=tmp_path / "m.jsonl", quiet=True, timeout_s=600)
    assert out.returncode == 0, out.error
    got = [r["loss"] for r in _records(tmp_path / "m.jsonl")]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(reference), rtol=RTOL, atol=0)


def test_a_mixed_stage_of_a_tp2_rank_and_a_tp1_rank_trains_like_one_process(tmp_path):
    """Zorse's mixed stage with tensor parallelism inside: its two data-parallel ranks shard the layer
    differently (their gradients averaged part by part, ``runner.reshard``) and hand off to a tp 1 stage."""
    steps = 3
    plan = _plan(
        {
            "layers": 1,
            "ranks": [
                {"devices": ["cpu:0", "cpu:1"], "num_microbatches": 3},
                {"devices": ["cpu:2"], "num_microbatches": 1},
            ],
        },
        {"devices": ["cpu:3"], "layers": 1},
    )
    norms: list[float] = []
    reference = reference_losses(LLAMA, steps, settings=SETTINGS, grad_norms=norms)
    out = train(
        "cpu-4",
        LLAMA,
        plan,
        steps=steps,
        settings=SETTINGS,
        metrics_out=tmp_path / "m.jsonl",
        quiet=True,
        timeout_s=600,
    )
    assert out.returncode == 0, out.error
    got = _records(tmp_path / "m.jsonl")
    torch.testing.assert_close(torch.tensor([r["loss"] for r in got]), torch.tensor(reference), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in got]), torch.tensor(norms), rtol=RTOL, atol=0)
