"""What the runner's modules share about the optimizer and the tensors it steps: the AdamW settings, the
training settings a user chooses (``TrainSettings``: learning rate and its schedule, weight decay,
gradient clipping), the optimizer every engine builds, and a rank's own storage of a (possibly
tensor-parallel) parameter."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from autotune.errors import SpecError

#: AdamW as the runner steps it (every engine: the plain runner, ZeRO's sharded step, RoundPipe)
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True, slots=True)
class TrainSettings:
    """``autotune train``'s optimizer options (docs/formats.md, "Training settings"). The learning rate
    rises linearly from 0 over ``warmup_steps``, then follows ``schedule`` down to ``min_lr_ratio`` of
    ``lr`` at the run's last step (``constant``: stays); ``clip_grad_norm`` > 0 scales the gradients so
    their global L2 norm is at most that (``torch.nn.utils.clip_grad_norm_``'s rule), 0 leaves them."""

    lr: float = ADAMW["lr"]
    warmup_steps: int = 0
    schedule: str = "constant"
    min_lr_ratio: float = 0.0
    weight_decay: float = ADAMW["weight_decay"]
    clip_grad_norm: float = 0.0

    def __post_init__(self) -> None:
        checks = (
            ("--lr", self.lr > 0 and math.isfinite(self.lr), "must be a positive number"),
            ("--warmup-steps", self.warmup_steps >= 0, "must be >= 0"),
            ("--lr-schedule", self.schedule in SCHEDULES, f"must be one of {', '.join(SCHEDULES)}"),
            ("--min-lr-ratio", 0.0 <= self.min_lr_ratio <= 1.0, "must be in [0, 1]"),
            ("--weight-decay", 0.0 <= self.weight_decay < 1.0, "must be in [0, 1)"),
            ("--clip-grad-norm", self.clip_grad_norm >= 0 and math.isfinite(self.clip_grad_norm), "must be >= 0"),
        )
        for option, ok, rule in checks:
            if not ok:
                raise SpecError(option, "", f"{rule}, got {getattr(self, _FIELD[option])!r}")

    def lr_at(self, step: int, total_steps: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based) of a run of ``total_steps``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        span = max(1, total_steps - self.warmup_steps - 1)
        done = min(1.0, (step - self.warmup_steps) / span)
        shape = 0.5 * (1 + math.cos(math.pi * done)) if self.schedule == "cosine" else 1.0 - done
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * shape)

    def to_dict(self) -> dict:
        return asdict(self)

    def record(self) -> dict:
        """What a checkpoint's ``train_settings.json`` says the run trained with: these settings and the
        optimizer's fixed ones (AdamW's betas and eps, which no option changes)."""
        return {**asdict(self), "optimizer": "AdamW", "betas": list(ADAMW["betas"]), "eps": ADAMW["eps"]}


_FIELD = {
    "--lr": "lr",
    "--warmup-steps": "warmup_steps",
    "--lr-schedule": "schedule",
    "--min-lr-ratio": "min_lr_ratio",
    "--weight-decay": "weight_decay",
    "--clip-grad-norm": "clip_grad_norm",
}


def make_optimizer(params, settings: TrainSettings | None = None) -> torch.optim.Optimizer:
    """torch's fused AdamW (one kernel over every tensor, on CUDA and on the CPU; DTensor parameters take it
    too), as torchtitan steps: ``foreach=False``'s per-tensor loop stepped 20M host parameters 7x slower on 2
    cores (``experiments/speed/bench_host_adam.py``); the two agree to ~1e-7 after 6 steps. Every plan, ZeRO's
    master shards and the single-process reference step with it."""
    from torch.distributed.tensor import DTensor

    s = settings or TrainSettings()
    # the fused kernel takes a group of plain tensors or of DTensors on one mesh: each apart (FSDP2 shards an MoE
    # plan's experts over their holders, the rest over the stage's ranks)
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    groups = [{"params": g} for g in by_mesh.values()]
    return torch.optim.AdamW(groups, **{**ADAMW, "lr": s.lr, "weight_decay": s.weight_decay}, fused=True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The storage this rank holds: a DTensor's local shard (itself, not a copy), else the tensor."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t
