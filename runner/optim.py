"""What the runner's modules share about the optimizer and the tensors it steps: the AdamW settings, the
optimizer every engine builds, and a rank's own storage of a (possibly tensor-parallel) parameter."""

from __future__ import annotations

import torch

#: AdamW as the runner steps it (every engine: the plain runner, ZeRO's sharded step, RoundPipe)
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, **ADAMW, foreach=False)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The storage this rank holds: a DTensor's local shard (itself, not a copy), else the tensor."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t
