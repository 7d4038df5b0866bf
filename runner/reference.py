"""Single-process training of the whole model on the whole global batch: the reference every plan's
loss curve must match (same seed, same data, same AdamW), used by the equivalence tests and experiment."""

from __future__ import annotations

from pathlib import Path

from autotune.loading import load_model
from autotune.specs import ModelSpec
from runner.data import TokenSource
from runner.hf_checkpoint import load_weights
from runner.model import build_full_model, lm_loss
from runner.optim import TrainSettings, make_optimizer, set_lr


def reference_losses(
    model: str | ModelSpec,
    steps: int,
    seed: int = 0,
    settings: TrainSettings | None = None,
    init_from: str | Path | None = None,
    data: str | Path | None = None,
    grad_norms: list[float] | None = None,
) -> list[float]:
    """The loss of each of ``steps`` optimizer steps of one process training ``model`` (with ``settings``:
    the schedule's learning rate and ``torch.nn.utils.clip_grad_norm_``; ``init_from``: a Hugging Face
    checkpoint's weights, whose tokenizer reads ``data``; ``grad_norms``: gets each step's norm before clipping)."""
    import torch

    spec = load_model(model)
    settings = settings or TrainSettings()
    tokenizer = init_from if init_from is not None and data is not None else None
    tokens = TokenSource(spec, seed, data, tokenizer)
    net = build_full_model(spec, seed)
    if init_from is not None:
        load_weights([net], init_from)
    opt = make_optimizer(net.parameters(), settings)
    out = []
    for step in range(steps):
        opt.zero_grad()
        x, y = tokens.pipeline_batch(step, 0, spec.global_batch_size)
        loss = lm_loss(net(x), y)
        loss.backward()
        if settings.clip_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(net.parameters(), settings.clip_grad_norm)
            if grad_norms is not None:
                grad_norms.append(float(norm))
        set_lr(opt, settings.lr_at(step, steps))
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
