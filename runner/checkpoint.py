"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): model + optimizer + step, and each rank's RNG state.

Layout: ``<dir>/step-00000010/`` is one DCP checkpoint (every rank writes its shards; weights have
the same global names on every replica, ``blocks.3.attn.q_proj.weight``, so DCP stores a replicated
weight once), ``rng-rank<r>.pt`` beside it, and ``<dir>/latest`` names the newest complete one; it
is written by rank 0 after a barrier, so a checkpoint interrupted mid-write is never picked up.

SPES plans (``sync_every_steps > 1``): between synchronisations the expert-parallel groups hold
different values under the same names, so their model and optimizer state are stored under
``group<k>`` (one copy per group; the replicas inside a group hold the same values).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from runner.engine import Engine

log = logging.getLogger(__name__)
LATEST = "latest"


def _peer(engine: Engine) -> str | None:
    """The name a SPES plan's group stores its own state under (None: every replica holds the same)."""
    return f"group{engine.plan.expert_group}" if engine.layout.sync_every_steps > 1 else None


def _wrap(engine: Engine, tree):
    peer = _peer(engine)
    return tree if peer is None else {peer: tree}


def _unwrap(engine: Engine, tree):
    peer = _peer(engine)
    return tree if peer is None else tree[peer]


def save(directory: str | Path, engine: Engine, step: int) -> Path:
    directory = Path(directory)
    path = directory / f"step-{step:08d}"
    model_sd, optim_sd = get_state_dict(engine.module, engine.optimizer)
    # Only the optimizer's per-weight state travels: its hyperparameters are the same constants in every run.
    dcp.save({"model": _wrap(engine, model_sd), "optim": _wrap(engine, optim_sd["state"]), "step": step},
             checkpoint_id=str(path))
    torch.save({"torch": torch.get_rng_state()}, path / f"rng-rank{engine.rank}.pt")
    dist.barrier()
    if engine.rank == 0:
        tmp = directory / f".{LATEST}.tmp"
        tmp.write_text(path.name + "\n")
        os.replace(tmp, directory / LATEST)
        log.info("checkpoint at step %d: %s", step, path)
    dist.barrier()
    return path


def latest(directory: str | Path) -> Path | None:
    marker = Path(directory) / LATEST
    if not marker.exists():
        return None
    path = Path(directory) / marker.read_text().strip()
    return path if path.is_dir() else None


def load(path: Path, engine: Engine) -> int:
    """Restore ``engine`` from checkpoint ``path``; return the number of optimizer steps it had done."""
    model_sd, optim_sd = get_state_dict(engine.module, engine.optimizer)
    state = {"model": _wrap(engine, model_sd), "optim": _wrap(engine, optim_sd["state"]), "step": 0}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(engine.module, engine.optimizer, model_state_dict=_unwrap(engine, state["model"]),
                   optim_state_dict={"state": _unwrap(engine, state["optim"]), "param_groups": optim_sd["param_groups"]})
    rng = path / f"rng-rank{engine.rank}.pt"
    if rng.exists():
        torch.set_rng_state(torch.load(rng)["torch"])
    log.info("resumed from %s (step %d)", path, state["step"])
    return int(state["step"])
