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
    """Run ``plan`` for STEPS steps (single-process loss), then 3 steps with a checkpoint and a resume to STEPS:
    the identical curve. The losses of the whole run."""
    import torch

    full = tmp / "full"
    full.mkdir()
    losses = run(plan, cluster, full)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=RTOL, atol=0)
    part = tmp / "part"
    part.mkdir()
    run(plan, cluster, part, steps=3, checkpoint_dir=part / "ckpt")
    assert run(plan, cluster, part, checkpoint_dir=part / "ckpt", resume=True) == losses
    return losses
