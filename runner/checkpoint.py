"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): model + optimizer + step, and each rank's RNG state.

Layout: ``<dir>/step-00000010/`` is one DCP checkpoint (every rank writes its shards; weights have
the same global names on every replica, ``blocks.3.attn.q_proj.weight``, so DCP stores a replicated
weight once), ``rng-rank<r>.pt`` beside it, and ``<dir>/latest`` names the newest complete one; it
is written by rank 0 after a barrier, so a checkpoint interrupted mid-write is never picked up.

SPES plans (``sync_every_steps > 1``): between synchronisations the expert-parallel groups hold
different values under the same names, so their model and optimizer state are stored under
``group<k>`` (one copy per group; the replicas inside a group hold the same values).

``resume_point`` (no torch import: the launcher calls it before anything starts) picks the checkpoint
a ``--resume`` continues from: the one ``latest`` names; if ``latest`` names a step that is missing or
incomplete (no DCP ``.metadata``), the newest complete ``step-*`` directory; if there is none, a
``SpecError``. ``.lock`` in the directory is held by the ``autotune train`` using it (``lock``).

Reading never unpickles freely: DCP's ``.metadata`` is a pickle, read here by an unpickler that only
builds DCP's own metadata classes, ``torch.Size``, dtypes and paths (``_MetadataUnpickler``); the RNG
files go through ``torch.load(weights_only=True)``. Any failure names the checkpoint directory.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
from pathlib import Path

from autotune.errors import SpecError

log = logging.getLogger(__name__)
LATEST = "latest"
LOCK = ".lock"
METADATA = ".metadata"
SETTINGS = "train_settings.json"
RUN = "run.json"  # what the directory's checkpoints are of: the model's architecture and the plan (``claim``)
#: model fields a checkpoint does not depend on (a resume may change them)
_NOT_IN_WEIGHTS = ("name", "seq_len", "global_batch_size", "dropout", "attention")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read (the message names it)."""


# --------------------------------------------------------------------------------------------------
# The directory (launcher side, no torch)


def step_of(path: Path) -> int:
    return int(path.name.split("-", 1)[1])


def step_dir(directory: str | Path, step: int) -> Path:
    """Where the checkpoint of ``step`` goes in ``directory`` (``step-00000010``)."""
    return Path(directory) / f"step-{step:08d}"


def _complete(path: Path) -> bool:
    return path.is_dir() and (path / METADATA).is_file() and path.name.startswith("step-") and path.name[5:].isdigit()


def complete_steps(directory: str | Path) -> list[Path]:
    """The complete checkpoints in ``directory``, oldest first."""
    return sorted((p for p in Path(directory).glob("step-*") if _complete(p)), key=step_of)


def latest(directory: str | Path) -> Path | None:
    """The checkpoint ``latest`` names, when it exists and is complete."""
    marker = Path(directory) / LATEST
    if not marker.is_file():
        return None
    path = Path(directory) / marker.read_text(errors="replace").strip()
    return path if _complete(path) and path.parent == Path(directory) else None


def resume_point(directory: str | Path) -> Path:
    """The checkpoint ``--resume`` continues from (see the module docstring)."""
    directory = Path(directory)
    found = latest(directory)
    if found is not None:
        return found
    complete = complete_steps(directory)
    marker = directory / LATEST
    if marker.is_file():
        named = marker.read_text(errors="replace").strip()[:80]
        if complete:
            log.warning(
                "checkpoint: %s names %r, which is missing or incomplete; resuming from %s, the newest "
                "complete checkpoint",
                marker,
                named,
                complete[-1].name,
            )
            return complete[-1]
        raise SpecError(
            "--resume",
            "",
            f"{marker} names {named!r}, which is missing or incomplete, and "
            f"{directory} holds no other complete checkpoint",
        )
    if complete:
        log.warning(
            "checkpoint: %s has no %r marker; resuming from %s, the newest complete checkpoint",
            directory,
            LATEST,
            complete[-1].name,
        )
        return complete[-1]
    raise SpecError("--resume", "", f"no checkpoint in {directory} to resume from (drop --resume to start from step 0)")


def claim(directory: str | Path, model, config, resume: bool) -> None:
    """Refuse, before launch, a ``--checkpoint-dir`` whose checkpoints belong to another run, then record this
    run's in ``run.json``: a directory holding another model's checkpoints (any field the weights depend on)
    is refused, and so is one holding another plan's unless ``--resume`` continues them under the new plan;
    starting from step 0 there would overwrite ``latest`` and break the earlier run's resume (issue 46). A
    directory of checkpoints with no ``run.json`` (an earlier release's) is recorded only by a run resuming them."""
    import dataclasses
    import json

    directory = Path(directory)
    arch = json.loads(json.dumps({k: v for k, v in dataclasses.asdict(model).items() if k not in _NOT_IN_WEIGHTS}))
    plan = json.loads(config.to_json(indent=None))
    path = directory / RUN
    has_steps = bool(complete_steps(directory))
    if has_steps and not path.is_file() and not resume:
        return  # checkpoints of an earlier release, of no recorded run: nothing to check, nothing to record
    if has_steps and path.is_file():
        try:
            held = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            held = {}
        theirs = held.get("model") or {}
        if theirs and theirs != arch:
            fields = sorted(k for k in arch.keys() | theirs.keys() if arch.get(k) != theirs.get(k))
            raise SpecError(
                "--checkpoint-dir",
                "",
                f"{directory} holds the checkpoints of another model (it differs in {', '.join(fields[:4])}); "
                "use another directory",
            )
        if held.get("plan") not in (None, plan) and not resume:
            raise SpecError(
                "--checkpoint-dir",
                "",
                f"{directory} holds the checkpoints of another plan of this model: --resume continues them under "
                "this plan; starting over would overwrite them (use another directory)",
            )
    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(RUN + ".tmp")
    tmp.write_text(json.dumps({"model": arch, "plan": plan}, default=str) + "\n")
    os.replace(tmp, path)


def hold(directory: str | Path, model, config, resume: bool):
    """``lock`` the directory, then ``claim`` it for this run; the lock is let go when the claim is refused."""
    held = lock(directory)
    try:
        claim(directory, model, config, resume)
    except BaseException:
        held.close()
        raise
    return held


def lock(directory: str | Path):
    """Hold ``<directory>/.lock`` for as long as the returned file stays open; ``SpecError`` when another
    training run holds it. The lock goes with the process (a killed trainer frees it)."""
    import fcntl

    path = Path(directory) / LOCK
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.seek(0)
        holder = f.read().strip()[:40]
        f.close()
        if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise SpecError(
                "--checkpoint-dir",
                "",
                f"{directory} is in use by another training run "
                f"(pid {holder or '?'}); wait for it to end or use "
                "another directory",
            ) from None
        raise
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


# --------------------------------------------------------------------------------------------------
# Saving and loading (ranks)


def _peer(engine) -> str | None:
    """The name a SPES plan's group stores its own state under (None: every replica holds the same)."""
    return f"group{engine.plan.expert_group}" if engine.layout.sync_every_steps > 1 else None


def _holder_key(name: str) -> str:
    """The ``Layout`` key of weight ``name`` (``blocks.3.attn.q_proj.weight`` -> ``layer3``)."""
    from runner.layout import EMBED_KEY, HEAD_KEY

    if name.startswith("blocks."):
        return "layer" + name.split(".", 2)[1]
    return EMBED_KEY if name.startswith(("embed.", "positions.")) else HEAD_KEY


def _renamed(engine, tree: dict, back: bool = False) -> dict:
    """A weight that replicas shard with different tensor-parallel degrees (``runner.reshard``) is stored
    once per degree, ``<name>@tp<d>``: DCP keeps one layout per name (a resumed run has the same plan)."""
    mixed = getattr(engine.layout, "resharded", lambda: {})()
    if not mixed:
        return tree
    tag = f"@tp{engine.plan.tp_degree}"
    if back:
        return {k.removesuffix(tag): v for k, v in tree.items()}
    return {k + tag if _holder_key(k) in mixed else k: v for k, v in tree.items()}


def _wrap(engine, tree):
    tree = _renamed(engine, tree)
    peer = _peer(engine)
    return tree if peer is None else {peer: tree}


def _unwrap(engine, tree):
    peer = _peer(engine)
    return _renamed(engine, tree if peer is None else tree[peer], back=True)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP's ``.metadata`` holds; any other global is refused."""

    def find_class(self, module: str, name: str):
        import torch

        if module == "torch.distributed.checkpoint.metadata" or (module, name) == (
            "torch.distributed.checkpoint.filesystem",
            "_StorageInfo",
        ):
            import importlib

            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type):
                return obj
        elif module == "torch" and name == "Size":
            return torch.Size
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) == ("torch.serialization", "_get_layout"):
            from torch.serialization import _get_layout

            return _get_layout
        elif module == "pathlib" and name in ("PosixPath", "PurePosixPath", "Path"):
            import pathlib

            return getattr(pathlib, name)
        elif (module, name) == ("collections", "OrderedDict"):
            import collections

            return collections.OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def _reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(Path(self.path) / METADATA, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def save(directory: str | Path, engine, step: int, weights: bool = False) -> Path:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    directory = Path(directory)
    path = step_dir(directory, step)
    if engine.zero is not None and weights:  # the shards and the full weights (``full_weights``: --save-hf)
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        with engine.zero.whole():
            model = _wrap(engine, get_model_state_dict(engine.module))
            dcp.save({"zero": engine.zero.state_dict(), "model": model, "step": step}, checkpoint_id=str(path))
    elif engine.zero is not None:  # sharded state: each rank writes its own shards (runner.zero)
        dcp.save({"zero": engine.zero.state_dict(), "step": step}, checkpoint_id=str(path))
    else:
        model_sd, optim_sd = get_state_dict(engine.module, engine.optimizer)
        # Only the optimizer's per-weight state travels: its hyperparameters are the same constants in every run.
        dcp.save(
            {"model": _wrap(engine, model_sd), "optim": _wrap(engine, optim_sd["state"]), "step": step},
            checkpoint_id=str(path),
        )
    torch.save({"torch": torch.get_rng_state()}, path / f"rng-rank{engine.rank}.pt")
    if engine.rank == 0:  # the optimizer options the run trains with (runner.optim.TrainSettings)
        import json

        (path / SETTINGS).write_text(json.dumps(engine.settings.record()) + "\n")
    dist.barrier()
    if engine.rank == 0:
        tmp = directory / f".{LATEST}.tmp"
        tmp.write_text(path.name + "\n")
        os.replace(tmp, directory / LATEST)
        log.info("checkpoint at step %d: %s", step, path)
    dist.barrier()
    return path


def _dcp_load(state: dict, path: Path) -> None:
    """``dcp.load`` of ``state`` from ``path``; any failure but an interrupt is one ``CheckpointError``."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state, storage_reader=_reader(path))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path} cannot be read: {_cause(e)}") from None


def load(path: Path, engine) -> int:
    """Restore ``engine`` from checkpoint ``path``; return the number of optimizer steps it had done.
    ``CheckpointError`` (naming ``path`` and the file when known) if it cannot be read."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if engine.zero is not None:  # sharded state: each rank reads its own shards (runner.zero)
        state = {"zero": engine.zero.empty_state_dict(steps_done=True), "step": 0}
        _dcp_load(state, path)
        engine.zero.load_state_dict(state["zero"])
        _load_rng(path, engine)
        log.info("resumed from %s (step %d, sharded state)", path, state["step"])
        return int(state["step"])
    model_sd, optim_sd = get_state_dict(engine.module, engine.optimizer)
    state = {"model": _wrap(engine, model_sd), "optim": _wrap(engine, optim_sd["state"]), "step": 0}
    _dcp_load(state, path)
    set_state_dict(
        engine.module,
        engine.optimizer,
        model_state_dict=_unwrap(engine, state["model"]),
        optim_state_dict={"state": _unwrap(engine, state["optim"]), "param_groups": optim_sd["param_groups"]},
    )
    _load_rng(path, engine)
    _compare_settings(path, engine)
    log.info("resumed from %s (step %d)", path, state["step"])
    return int(state["step"])


def _compare_settings(path: Path, engine) -> None:
    import json

    saved = path / SETTINGS
    if engine.rank == 0 and saved.is_file():
        before = json.loads(saved.read_text())
        now = engine.settings.record()
        if {k: v for k, v in before.items() if k in now} != {k: now[k] for k in before if k in now}:
            log.warning("resuming with other training settings than %s was trained with: %s, now %s", path, before, now)


def holds_zero_units(path: Path) -> bool:
    """Whether checkpoint ``path`` holds ``runner.zero``'s units: a plan FSDP2 runs now (``runner.fsdp``) that was
    checkpointed when ``runner.zero`` ran it resumes on ``runner.zero`` (``load`` reports an unreadable one)."""
    try:
        stored = _reader(path).read_metadata().state_dict_metadata
    except Exception:
        return False
    return any(k.startswith("zero.") for k in stored)


def full_weights(path: Path, model, seed: int = 0) -> dict:
    """The whole model's weights (global names, full tensors) from checkpoint ``path``, read in this one
    process: DCP reassembles every rank's shards (tensor-parallel ones included) into the full shapes."""
    import warnings

    from runner.model import build_full_model

    full = dict(build_full_model(model, seed).state_dict())
    # a weight stored once per tensor-parallel degree (``_renamed``): any of its copies has the full values
    stored = {k.removeprefix("model.") for k in _reader(path).read_metadata().state_dict_metadata}
    names = {k: k if k in stored else next((s for s in sorted(stored) if s.startswith(k + "@tp")), k) for k in full}
    state = {"model": {names[k]: v for k, v in full.items()}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        _dcp_load(state, path)
    return {k: state["model"][names[k]] for k in full}


def _load_rng(path: Path, engine) -> None:
    import torch

    rng = path / f"rng-rank{engine.rank}.pt"
    if rng.exists():
        try:
            torch.set_rng_state(torch.load(rng, weights_only=True)["torch"])
        except Exception as e:
            raise CheckpointError(f"checkpoint file {rng} cannot be read: {_cause(e)}") from None


def _cause(e: BaseException) -> str:
    """The first line of the innermost error (DCP wraps each rank's as ``(exception, traceback)`` in a
    ``CheckpointException``)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            e = inner[0]
    while e.__cause__ is not None:
        e = e.__cause__
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__
