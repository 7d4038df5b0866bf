"""RoundPipe plans (``"schedule": "roundpipe"``): their fields, parsing, validation and summary, in one place.

The plan part of a feature: it takes a pipeline's pool and partitions (and the plan's values it rules
on), never the whole plan; ``autotune.specs.plan`` composes it.

RoundPipe (Luo et al. 2026, arXiv 2604.27085; PyPI ``roundpipe``) keeps every model state in host memory
and treats a node's GPUs as a pool of stateless workers: the model is cut into *stages* (contiguous runs
of layers), and the stages are handed to the pool's GPUs round-robin, each GPU running one stage for all
of a pass's micro-batches before it takes the next stage handed to it. The forward and the backward pass
are cut differently (an *asymmetric* partition), and the last layers with the LM head and the loss run
forward and backward in one *fused* stage. A pipeline of a roundpipe plan is::

    {"num_microbatches": 64,
     "devices": ["box:0", "box:1", "box:2", "box:3", "box:4", "box:5", "box:6", "box:7"],
     "forward_layers": [3, 4, 4, 4, 4, 4, 4, 4, 4],
     "fused_layers": 5,
     "backward_layers": [2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3],
     "recompute_grain": "stage",
     "memory_limit_GiB": 13.4,
     "accumulation_steps": 1}

- ``devices``: the pool, all on one node (one RoundPipe process drives one node's GPUs).
- ``forward_layers``: transformer blocks per forward-only stage, in layer order; the embedding runs with
  the first (an entry of 0 there: a stage of the embedding alone).
- ``fused_layers``: the last blocks, which run with the final norm, LM head and loss as one stage
  (forward, then backward) [0: the head alone].
- ``backward_layers``: blocks per backward-only stage, in layer order (they run last stage first); the
  embedding's backward runs with the first (0 there: the embedding alone). Each recomputes its forward
  from its stage input kept in host memory.
- ``sum(forward_layers) + fused_layers == sum(backward_layers) + fused_layers == num_layers``.
- ``recompute_grain`` [``"stage"``]: RoundPipe's backward recomputation: ``stage`` keeps each backward
  stage's input and recomputes the whole stage before its backward (one stage's activations on the GPU);
  ``layer`` keeps every block's input and recomputes and back-propagates one block at a time (one
  block's activations on the GPU, every block's input in host memory).
- ``memory_limit_GiB`` [0 = 60% of the smallest pool GPU, RoundPipe's default]: GPU memory the plan's
  stage parameters and gradients may take, the running stage and the one prefetched behind it together
  (RoundPipe's ``model_memory_limit``); the rest is for activations. A plan whose stages exceed it is
  invalid.
- ``accumulation_steps`` [1]: forward-backward passes per optimizer step (gradient accumulation, as
  RoundPipe's scripts call ``forward_backward`` several times before ``step``): each pass sends
  ``num_microbatches / accumulation_steps`` micro-batches through the stages.

Several pipelines are data-parallel replicas, each a pool on its own node; their gradients are summed in
host memory across the network before each node's optimizer step. ``zero`` does not apply (the state is
in host memory already) and ``virtual_stages`` stays 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autotune.errors import SpecError, shown
from autotune.specs.cluster import ClusterSpec
from autotune.specs.limits import ROUNDPIPE
from autotune.specs.model import ModelSpec

__all__ = ["ROUNDPIPE", "RECOMPUTE_GRAINS", "RoundPipeStages", "DEFAULT_MEMORY_FRACTION"]
RECOMPUTE_GRAINS = ("stage", "layer")
#: RoundPipe's default ``model_memory_limit``: 60% of the smallest GPU's memory (``ModelExecutePlan.auto``)
DEFAULT_MEMORY_FRACTION = 0.6
#: the pipeline fields of a roundpipe plan (a pipeline of another schedule has ``stages`` instead)
PIPELINE_FIELDS = (
    "num_microbatches",
    "devices",
    "forward_layers",
    "fused_layers",
    "backward_layers",
    "recompute_grain",
    "memory_limit_GiB",
    "accumulation_steps",
    "trains_experts",
)


@dataclass(frozen=True, slots=True)
class RoundPipeStages:
    """One roundpipe pipeline's pool and partitions (see the module docstring for each field)."""

    devices: tuple[str, ...]
    forward_layers: tuple[int, ...]
    backward_layers: tuple[int, ...]
    fused_layers: int = 0
    recompute_grain: str = "stage"
    memory_limit_GiB: float = 0.0  # 0: DEFAULT_MEMORY_FRACTION of the smallest pool device
    accumulation_steps: int = 1

    @property
    def num_stages(self) -> int:
        """Stages one pass hands out: the forward stages, the fused stage, the backward stages."""
        return len(self.forward_layers) + 1 + len(self.backward_layers)

    def memory_limit_for(self, device_memory_GiB: float) -> float:
        """The limit in GiB, resolving the default against the smallest pool device's memory."""
        return self.memory_limit_GiB if self.memory_limit_GiB > 0 else DEFAULT_MEMORY_FRACTION * device_memory_GiB

    def forward_ranges(self, num_layers: int) -> list[tuple[int, int]]:
        """Block ranges ``[a, b)`` of the forward stages, the fused stage last."""
        return _ranges_of(self.forward_layers) + [(num_layers - self.fused_layers, num_layers)]

    def backward_ranges(self, num_layers: int) -> list[tuple[int, int]]:
        """Block ranges ``[a, b)`` of the backward stages in layer order, the fused stage last."""
        return _ranges_of(self.backward_layers) + [(num_layers - self.fused_layers, num_layers)]

    def stage_rows(self, num_layers: int) -> list[tuple[str, str]]:
        """(label, what it runs) of each stage in the order a pass hands them out: ``F0 ..``, ``FB``,
        then the backward stages last first (``B<k>`` numbered in layer order)."""

        def text(a: int, b: int, embedding: bool, head: bool = False) -> str:
            parts = (
                (["embedding"] if embedding else [])
                + ([f"blocks {a}-{b - 1}" if b - a > 1 else f"block {a}"] if b > a else [])
                + (["head + loss"] if head else [])
            )
            return " + ".join(parts)

        fwd = self.forward_ranges(num_layers)
        bwd = self.backward_ranges(num_layers)
        rows = [(f"F{k}", text(a, b, k == 0)) for k, (a, b) in enumerate(fwd[:-1])]
        rows.append(("FB", text(*fwd[-1], False, True)))
        rows += [(f"B{k}", text(*bwd[k], k == 0)) for k in range(len(bwd) - 2, -1, -1)]
        return rows

    def summary(self) -> str:
        grain = "" if self.recompute_grain == "stage" else " grain=layer"
        limit = f" limit={self.memory_limit_GiB:g}GiB" if self.memory_limit_GiB > 0 else ""
        acc = f" acc={self.accumulation_steps}" if self.accumulation_steps != 1 else ""
        return (
            f"pool {_device_span(self.devices)} | F {','.join(map(str, self.forward_layers))} | "
            f"FB {self.fused_layers}+head | B {','.join(map(str, self.backward_layers))}{grain}{limit}{acc}"
        )


def _ranges_of(counts: tuple[int, ...]) -> list[tuple[int, int]]:
    out, a = [], 0
    for n in counts:
        out.append((a, a + n))
        a += n
    return out


def _device_span(devices: tuple[str, ...]) -> str:
    """``("box:0", ..., "box:7")`` -> ``"box:0-7"`` when the indices run on one node, else a list."""
    nodes = {d.rpartition(":")[0] for d in devices}
    idx = [d.rpartition(":")[2] for d in devices]
    if len(nodes) == 1 and all(i.isdigit() for i in idx):
        n = [int(i) for i in idx]
        if n == list(range(n[0], n[0] + len(n))):
            return f"{next(iter(nodes))}:{n[0]}-{n[-1]}" if len(n) > 1 else devices[0]
    return ",".join(devices)


# --------------------------------------------------------------------------------------------------
# Parsing


#: at most this many stages per partition and devices per pool (a partition has at most one stage per
#: block plus the embedding's; specs.LIMITS["layers"] blocks, specs.MAX_DEVICES devices)
MAX_STAGES = 2049
MAX_POOL = 16_384
#: at most this many passes per step (as many as micro-batches: specs.LIMITS["num_microbatches"])
MAX_ACCUMULATION_STEPS = 65_536


def _int_list(source: str, field: str, raw: Any) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        raise SpecError(source, field, f"must be a list of layer counts (integers), got {shown(raw)}")
    if len(raw) > MAX_STAGES:
        raise SpecError(
            source,
            field,
            f"lists {len(raw):,} stages, at most {MAX_STAGES:,} (one per block and one for the embedding)",
        )
    return tuple(raw)


def _sum_text(counts: tuple[int, ...]) -> str:
    return " + ".join(map(str, counts)) if len(counts) <= 16 else f"{len(counts)} stages of {sum(counts)} blocks"


def pipeline_from_dict(raw: Mapping[str, Any], source: str, p: int) -> tuple[int, RoundPipeStages, Any]:
    """(num_microbatches, stages, raw trains_experts) of one roundpipe pipeline object."""
    f = f"pipelines[{p}]"
    if "stages" in raw:
        raise SpecError(
            source,
            f"{f}.stages",
            "a roundpipe pipeline has no stages bound to devices: give "
            "devices, forward_layers, fused_layers and backward_layers",
        )
    extra = sorted(set(raw) - set(PIPELINE_FIELDS))
    if extra:
        raise SpecError(
            source, f"{f}.{extra[0]}", f"unknown field (a roundpipe pipeline has {', '.join(PIPELINE_FIELDS)})"
        )
    for key in ("num_microbatches", "devices", "forward_layers", "backward_layers"):
        if key not in raw:
            raise SpecError(source, f"{f}.{key}", "is required in a roundpipe pipeline")
    devices = raw["devices"]
    if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
        raise SpecError(source, f"{f}.devices", "must be a list of device ids (the pool)")
    if len(devices) > MAX_POOL:
        raise SpecError(source, f"{f}.devices", f"lists {len(devices):,} devices, at most {MAX_POOL:,}")
    stages = RoundPipeStages(
        devices=tuple(devices),
        forward_layers=_int_list(source, f"{f}.forward_layers", raw["forward_layers"]),
        backward_layers=_int_list(source, f"{f}.backward_layers", raw["backward_layers"]),
        fused_layers=raw.get("fused_layers", 0),
        recompute_grain=raw.get("recompute_grain", "stage"),
        memory_limit_GiB=raw.get("memory_limit_GiB", 0.0),
        accumulation_steps=raw.get("accumulation_steps", 1),
    )
    return raw["num_microbatches"], stages, raw.get("trains_experts", "all")


def pipeline_to_dict(num_microbatches: int, rp: RoundPipeStages) -> dict[str, Any]:
    out: dict[str, Any] = {
        "num_microbatches": num_microbatches,
        "devices": list(rp.devices),
        "forward_layers": list(rp.forward_layers),
        "fused_layers": rp.fused_layers,
        "backward_layers": list(rp.backward_layers),
        "recompute_grain": rp.recompute_grain,
    }
    if rp.memory_limit_GiB > 0:
        out["memory_limit_GiB"] = rp.memory_limit_GiB
    if rp.accumulation_steps != 1:
        out["accumulation_steps"] = rp.accumulation_steps
    return out


# --------------------------------------------------------------------------------------------------
# Validation


def check_pool(rp: RoundPipeStages | None, has_stages: bool, num_microbatches: Any, where: str, field: str) -> None:
    """One pipeline (``field``) of a roundpipe plan, without the cluster or the model: a pool and partitions
    in place of stages, each field in its range."""
    f = field
    if rp is None or has_stages:
        raise SpecError(
            where,
            f"{f}.stages",
            "schedule 'roundpipe' takes devices, forward_layers, fused_layers and backward_layers in place of stages",
        )
    if not rp.devices:
        raise SpecError(where, f"{f}.devices", "must list at least one device (the pool)")
    if len(set(rp.devices)) != len(rp.devices):
        dup = next(d for d in rp.devices if rp.devices.count(d) > 1)
        raise SpecError(where, f"{f}.devices", f"device {shown(dup)} is listed twice in the pool")
    for name, counts in (("forward_layers", rp.forward_layers), ("backward_layers", rp.backward_layers)):
        if not counts:
            raise SpecError(where, f"{f}.{name}", "must list at least one stage (the first runs the embedding)")
        for s, n in enumerate(counts):
            if isinstance(n, bool) or not isinstance(n, int) or n < (0 if s == 0 else 1):
                rule = ">= 0 (0: the embedding alone)" if s == 0 else ">= 1"
                raise SpecError(where, f"{f}.{name}[{s}]", f"must be an integer {rule}, got {shown(n)}")
    if isinstance(rp.fused_layers, bool) or not isinstance(rp.fused_layers, int) or rp.fused_layers < 0:
        raise SpecError(
            where, f"{f}.fused_layers", f"must be an integer >= 0 (0: the LM head alone), got {shown(rp.fused_layers)}"
        )
    if rp.recompute_grain not in RECOMPUTE_GRAINS:
        raise SpecError(
            where,
            f"{f}.recompute_grain",
            f"must be one of {', '.join(RECOMPUTE_GRAINS)}, got {shown(rp.recompute_grain)}",
        )
    lim = rp.memory_limit_GiB
    if isinstance(lim, bool) or not isinstance(lim, (int, float)) or not math.isfinite(lim) or lim < 0:
        raise SpecError(
            where, f"{f}.memory_limit_GiB", f"must be a number >= 0 (0: 60% of the smallest pool GPU), got {shown(lim)}"
        )
    acc = rp.accumulation_steps
    if isinstance(acc, bool) or not isinstance(acc, int) or not 1 <= acc <= MAX_ACCUMULATION_STEPS:
        raise SpecError(
            where,
            f"{f}.accumulation_steps",
            f"must be an integer from 1 to {MAX_ACCUMULATION_STEPS:,}, got {shown(acc)}",
        )
    if isinstance(num_microbatches, int) and num_microbatches % acc:
        raise SpecError(
            where,
            f"{f}.num_microbatches",
            f"{num_microbatches} micro-batches do not split into accumulation_steps={acc} equal passes",
        )


def check_plan(
    zero: int, expert_parallel: int, sync_every_steps: int, trains_experts: Sequence[tuple[int, ...] | None], where: str
) -> None:
    """The plan-wide settings a roundpipe plan cannot take (``trains_experts``: each pipeline's)."""
    if zero:
        raise SpecError(
            where,
            "zero",
            f"does not apply to schedule 'roundpipe' (its state lives in host memory already), got zero={zero}",
        )
    if expert_parallel != 1:
        raise SpecError(
            where,
            "expert_parallel",
            f"does not apply to schedule 'roundpipe' (each GPU runs whole "
            f"stages, their experts included), got {expert_parallel}",
        )
    if sync_every_steps != 1:
        raise SpecError(
            where,
            "sync_every_steps",
            f"does not apply to schedule 'roundpipe' (its replicas synchronise every step), got {sync_every_steps}",
        )
    for p, te in enumerate(trains_experts):
        if te is not None:
            raise SpecError(
                where,
                f"pipelines[{p}].trains_experts",
                "does not apply to schedule 'roundpipe' (every replica trains every expert)",
            )


def validate_pool(
    rp: RoundPipeStages,
    num_microbatches: int,
    cluster: ClusterSpec,
    model: ModelSpec,
    source: str,
    field: str,
    seen: dict[str, str],
) -> None:
    """One pipeline's pool and partitions against the cluster and the model (``seen``: device -> the pipeline
    field whose pool holds it, filled as the pools are checked); raise SpecError naming the broken rule."""
    f = field
    known = set(cluster.device_ids())
    L = model.num_layers
    for d in rp.devices:
        if d not in known:
            raise SpecError(
                source,
                f"{f}.devices",
                f"unknown device id {shown(d)} (cluster {cluster.name!r} has "
                f"{', '.join(n.name + ':0..' + str(n.count - 1) for n in cluster.nodes)})",
            )
        if d in seen:
            raise SpecError(source, f"{f}.devices", f"device {shown(d)} is already in {seen[d]}'s pool")
        seen[d] = f
    nodes = sorted({cluster.node_of(d).name for d in rp.devices})
    if len(nodes) > 1:
        raise SpecError(
            source,
            f"{f}.devices",
            f"a roundpipe pool is one node's GPUs (one RoundPipe process "
            f"per node), this one spans nodes {', '.join(nodes)}: give "
            f"each node its own pipeline",
        )
    for name, counts in (("forward_layers", rp.forward_layers), ("backward_layers", rp.backward_layers)):
        total = sum(counts) + rp.fused_layers
        if total != L:
            raise SpecError(
                source,
                f"{f}.{name}",
                f"{_sum_text(counts)} + fused_layers {rp.fused_layers} = {total} blocks, "
                f"model {model.name!r} has num_layers={L}",
            )
    smallest = min(cluster.device(d).memory_GiB for d in rp.devices)
    if rp.memory_limit_GiB > smallest:
        raise SpecError(
            source,
            f"{f}.memory_limit_GiB",
            f"{rp.memory_limit_GiB:g} GiB exceeds the smallest pool GPU's {smallest:g} GiB",
        )
    if num_microbatches // rp.accumulation_steps < 1:
        raise SpecError(source, f"{f}.num_microbatches", "must be >= accumulation_steps")


def notes(rp: RoundPipeStages, num_microbatches: int, field: str) -> list[str]:
    """Valid settings of one pipeline's pool that waste something (``describe`` shows them)."""
    out = []
    per_pass = num_microbatches // max(1, rp.accumulation_steps)
    if rp.num_stages < len(rp.devices):
        out.append(
            f"{field}: {rp.num_stages} stages per pass for a pool of {len(rp.devices)} GPUs: "
            f"{len(rp.devices) - rp.num_stages} stay idle"
        )
    if per_pass < len(rp.devices):
        out.append(
            f"{field}: {per_pass} micro-batches per pass fill at most {per_pass} of the {len(rp.devices)} GPUs at once"
        )
    return out
