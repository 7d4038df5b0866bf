"""Real runs of the runner on a small CPU cluster of fast and slow ranks (gloo), shared by the tests of
mixed stages (``test_mixed_runner``) and layer-wise execution (``test_layerwise_runner``)."""

from __future__ import annotations

import json
from pathlib import Path

STEPS = 6
RTOL = 1e-5


def cluster_yaml(tmp: Path, fast: int, slow: int) -> Path:
    path = tmp / "cluster.yaml"
    path.write_text(
        f"nodes: [{{name: fast, gpu: cpu, count: {fast}}}, "
        f"{{name: slow, gpu: cpu, count: {slow}, slowdown: 2}}]\nnetwork: {{bandwidth_GBps: 5}}\n"
    )
    return path


def rank(device: str, m: int) -> dict:
    return {"devices": [device], "num_microbatches": m}


def read_losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def run(config: dict, cluster: Path, directory: Path, steps: int = STEPS, model: str = "tiny", **kw) -> list[float]:
    from runner.train import train

    metrics = directory / "m.jsonl"
    outcome = train(str(cluster), model, config, steps=steps, metrics_out=metrics, quiet=True, timeout_s=300, **kw)
    assert outcome.returncode == 0, outcome.error
    return read_losses(metrics)


def trains_like_one_process_and_resumes(plan: dict, cluster: Path, tmp: Path, reference: list[float]) -> list[float]:
    """Run ``plan`` for STEPS steps (single-process loss), checkpointing every 3 steps, then resume from its
    step-3 checkpoint to STEPS: the identical steps 4-6 (two launches, not three). The losses of the whole run."""
    import torch

    full, ckpt = tmp / "full", tmp / "ckpt"
    full.mkdir()
    losses = run(plan, cluster, full, checkpoint_dir=ckpt, checkpoint_every=3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=RTOL, atol=0)
    rewind(ckpt, 3)
    again = tmp / "resumed"
    again.mkdir()
    assert run(plan, cluster, again, checkpoint_dir=ckpt, resume=True) == losses[3:]
    return losses


def rewind(checkpoint_dir: Path, step: int) -> None:
    """Point the directory's ``latest`` at its step-``step`` checkpoint: a ``--resume`` continues from there."""
    from runner.checkpoint import LATEST, step_dir

    path = step_dir(checkpoint_dir, step)
    assert path.is_dir()
    (checkpoint_dir / LATEST).write_text(path.name + "\n")
