"""``autotune train`` of one plan on ``cpu-4`` checked against single-process training, and the plans of two
tensor-parallel replicas, shared by the runner's tensor-parallel tests (vocabulary-parallel head, tp inside MoE
blocks, ZeRO-3 with tp)."""

from __future__ import annotations

import json
from pathlib import Path

RTOL = 1e-5
STEPS = 3  # DTensor on gloo is slow on CPU


def trains_like_one_process(tmp_path: Path, model: str, plan: dict, settings=None) -> None:
    """``plan`` trains ``model`` for ``STEPS`` steps with the losses of one process (relative ``RTOL``), and with
    clipping in ``settings`` (``runner.optim.TrainSettings``) by the same global gradient norms."""
    import torch

    from runner.optim import TrainSettings
    from runner.reference import reference_losses
    from runner.train import train

    settings = settings or TrainSettings()
    norms: list[float] = []
    reference = reference_losses(model, STEPS, settings=settings, grad_norms=norms)
    metrics = tmp_path / "m.jsonl"
    out = train("cpu-4", model, plan, steps=STEPS, settings=settings, metrics_out=metrics, quiet=True, timeout_s=600)
    assert out.returncode == 0, out.error
    got = [json.loads(line) for line in metrics.read_text().splitlines()]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in got]), torch.tensor(reference), rtol=RTOL, atol=0)
    if settings.clip_grad_norm:
        torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in got]), torch.tensor(norms), rtol=RTOL, atol=0)


def tp2_replicas(stage: dict, microbatches: int, **plan) -> dict:
    """Two replicas of one ``stage`` on two devices each (``cpu:0-1``, ``cpu:2-3``), micro-batches of one."""
    pipes = [
        {"num_microbatches": microbatches, "stages": [{**stage, "devices": [f"cpu:{2 * p}", f"cpu:{2 * p + 1}"]}]}
        for p in range(2)
    ]
    return {"micro_batch_size": 1, "pipelines": pipes, **plan}
