"""Single-process training of the whole model on the whole global batch: the reference every plan's
loss curve must match (same seed, same data, same AdamW), used by the equivalence tests and experiment."""

from __future__ import annotations

from autotune.loading import load_model
from autotune.specs import ModelSpec
from runner.data import TokenSource
from runner.model import build_full_model, lm_loss
from runner.optim import make_optimizer


def reference_losses(model: str | ModelSpec, steps: int, seed: int = 0) -> list[float]:
    """The loss of each of ``steps`` optimizer steps of one process training ``model``."""
    spec = load_model(model)
    tokens = TokenSource(spec, seed)
    net = build_full_model(spec, seed)
    opt = make_optimizer(net.parameters())
    out = []
    for step in range(steps):
        opt.zero_grad()
        x, y = tokens.pipeline_batch(step, 0, spec.global_batch_size)
        loss = lm_loss(net(x), y)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def trained_difference(
    cluster, model: str | ModelSpec, config, steps: int, reference: list[float], **train_kw
) -> tuple[float | None, float, str]:
    """Train ``config`` for ``steps`` steps through the runner (``runner.train.train``) and compare its
    losses with ``reference`` (``reference_losses``): (the largest relative difference, or None when
    the run failed; wall seconds; the run's error)."""
    import json
    import tempfile
    import time
    from pathlib import Path

    from runner.train import train

    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        t0 = time.monotonic()
        out = train(cluster, model, config, steps=steps, metrics_out=metrics, quiet=True, **train_kw)
        wall = time.monotonic() - t0
        if out.returncode != 0:
            return None, wall, out.error
        losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference)), wall, ""
