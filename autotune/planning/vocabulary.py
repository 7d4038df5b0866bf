"""The vocabulary of the search space, shared by the space and its feature families: dimensions, node
classes, tensor-parallel groups, a decoded plan, the integer split every family uses, and ``SpaceContext``,
what a family is given (the cluster, the model, the space's dimensions and one cost model) instead of
the space itself."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autotune.errors import SpecError
from autotune.simulator.cost_model import CostModel
from autotune.specs import ClusterSpec, ModelSpec, ParallelConfig

#: exhaustive enumeration refuses spaces with more raw combinations than this
EXHAUSTIVE_LIMIT = 100_000
#: the interleaved schedule always uses this many model chunks per stage
INTERLEAVED_CHUNKS = 2
ASSIGNMENTS = ("grouped", "mixed")
ORDERS = ("fast-first", "slow-first")
#: torchtitan's activation-checkpointing modes the space offers (``autotune.specs.recompute``); every-2 is
#: torchtitan 0.2's default per-layer frequency (0.3 dropped per-layer checkpointing; the runner keeps it)
TORCHTITAN_RECOMPUTE = ("selective-op", "every-2")
RECOMPUTE_MODES = ("none", "all", "low-memory", "selective") + TORCHTITAN_RECOMPUTE
SPLIT_EXPONENTS = (0.0, 0.5, 1.0)
#: dimensions added after the first layout; a params dict without them (an older Optuna study, a
#: stored start) decodes with these defaults
DEFAULTED_DIMENSIONS = {"zero": 0, "offload": "none", "execution": "microbatch"}

Params = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Dimension:
    """One decision with a finite list of choices; ``ordinal`` when the choices are ordered numbers."""

    name: str
    choices: tuple
    ordinal: bool = False


@dataclass(frozen=True, slots=True)
class NodeClass:
    """Identical nodes (same device type, device count and intra-node link)."""

    name: str
    node_names: tuple[str, ...]
    count: int  # devices per node
    peak_tflops: float
    memory_GiB: float
    intra_bandwidth_GBps: float


@dataclass(frozen=True, slots=True)
class TPGroup:
    """Devices of one node that together form one stage (its tensor-parallel group)."""

    devices: tuple[str, ...]
    node_class: str
    speed_tflops: float  # tp x peak: the nominal compute of the group
    memory_GiB: float  # per device


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decoded plan, or why it cannot exist."""

    config: ParallelConfig | None
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.config is not None


def apportion(total: int, weights: Sequence[float], minimum: int = 1, quantum: int = 1) -> list[int] | None:
    """Split ``total`` into integers proportional to ``weights`` (largest remainder), each at least
    ``minimum`` and a multiple of ``quantum``; None when impossible."""
    n = len(weights)
    if total % quantum or n * minimum > total or minimum % quantum:
        return None
    units = total // quantum
    min_units = minimum // quantum
    w = np.asarray(weights, dtype=float)
    w = np.where(np.isfinite(w) & (w > 0), w, 0.0)
    if w.sum() <= 0:
        w = np.ones(n)
    free = units - n * min_units
    raw = w / w.sum() * free
    base = np.floor(raw).astype(int)
    rest = free - int(base.sum())
    order = np.argsort(-(raw - base), kind="stable")
    base[order[:rest]] += 1
    return [int((b + min_units) * quantum) for b in base]


def powers_of_two_upto(n: int) -> list[int]:
    return [1 << k for k in range(int(math.log2(n)) + 1)] if n >= 1 else []


def valid_tp(model: ModelSpec, tp: int) -> bool:
    return (
        model.num_heads % tp == 0
        and (model.num_kv_heads % tp == 0 or tp % model.num_kv_heads == 0)
        and model.ffn_hidden_size % tp == 0
    )


def head_extra_layers(model: ModelSpec) -> float:
    """LM-head work in units of one transformer block's work, per token (forward flops).

    Block: 2 x params (matmuls) + 4 x seq x hidden (attention scores and values, causal average
    ignored), as in Megatron-LM's flops formula (Narayanan et al. 2021, appendix); head: 2 x h x V.
    """
    block = 2 * model.params_per_layer + 4 * model.seq_len * model.hidden_size
    return 2 * model.hidden_size * model.vocab_size / block


def node_classes(cluster: ClusterSpec) -> tuple[NodeClass, ...]:
    """The cluster's node classes: identical nodes (device type and speed, device count, intra-node link),
    in cluster order; a class of one node is named after it, one of several after its device type."""
    groups: dict[tuple, list[str]] = {}
    first = {}
    for node in cluster.nodes:
        key = (
            node.device.name,
            node.device.peak_tflops,
            node.device.memory_GiB,
            node.count,
            node.intra_node.bandwidth_GBps,
            node.slowdown,
        )
        groups.setdefault(key, []).append(node.name)
        first.setdefault(key, node)
    classes = []
    used_names: set[str] = set()
    for key, names in groups.items():
        node = first[key]
        base = node.name if len(names) == 1 else node.device.name
        base = base.replace(".", "_").replace(":", "_")
        name, k = base, 1
        while name in used_names:
            k += 1
            name = f"{base}-{k}"
        used_names.add(name)
        classes.append(
            NodeClass(
                name,
                tuple(names),
                node.count,
                node.device.peak_tflops / node.slowdown,
                node.device.memory_GiB,
                node.intra_node.bandwidth_GBps,
            )
        )
    return tuple(classes)


def mixed_pipelines(groups: list[TPGroup], dp: int) -> list[list[TPGroup]]:
    """Identical replicas: each pipeline takes a contiguous run of every class's groups, fastest
    class first; quotas per class are g_c // dp plus a round-robin share of the remainders."""
    by_class: dict[str, list[TPGroup]] = {}
    for g in groups:
        by_class.setdefault(g.node_class, []).append(g)
    pipes: list[list[TPGroup]] = [[] for _ in range(dp)]
    turn = 0
    for members in by_class.values():
        quota = [len(members) // dp] * dp
        for _ in range(len(members) % dp):
            quota[turn % dp] += 1
            turn += 1
        start = 0
        for p in range(dp):
            pipes[p].extend(members[start : start + quota[p]])
            start += quota[p]
    return pipes


def group_speed(cluster: ClusterSpec, devices: Sequence[str]) -> float:
    """Nominal compute of a tensor-parallel group: tp x its device's peak (slowed down as the node says)."""
    node = cluster.node_of(devices[0])
    return len(devices) * node.device.peak_tflops / node.slowdown


@dataclass(frozen=True)
class SpaceContext:
    """What a feature family of the space (``mixed_space``, ``roundpipe_space``) is given: the cluster, the
    model, the space's node classes and dimensions (after ``restrict``), the restriction itself, one
    datasheet cost model to price units with, and a place for the family's per-space caches."""

    cluster: ClusterSpec
    model: ModelSpec
    node_classes: tuple[NodeClass, ...]
    dims: Mapping[str, Dimension]
    restrict: Mapping[str, Sequence[Any]]
    caches: dict[str, Any] = field(default_factory=dict, compare=False)

    def cache(self, name: str) -> dict:
        """The family's cache called ``name`` (created empty on first use)."""
        return self.caches.setdefault(name, {})

    def calibrate(self, costs: CostModel) -> None:
        """Price units with ``costs`` (the search's profile-calibrated cost model) instead of the datasheet's:
        Zorse's micro-batch shares then follow the measured per-layer latency. Drops what was cached."""
        self.caches.clear()
        self.caches["costs"] = costs

    @property
    def costs(self) -> CostModel:
        """The cost model the families price units with: the datasheet's (the space estimates, the evaluator
        measures), built on first use, unless ``calibrate`` gave the search's calibrated one."""
        hit = self.caches.get("costs")
        if hit is None:
            hit = self.caches["costs"] = CostModel(self.cluster, self.model)
        return hit

    @property
    def dimensions(self) -> tuple[Dimension, ...]:
        return tuple(self.dims.values())


def same_choice(choice: Any, value: Any) -> bool:
    """Whether ``value`` (of ``restrict``) names ``choice``: equal, or its text as a command line writes it
    (``true`` / ``false``, ``2``, ``0.5``, ``bandwidth``)."""
    if not isinstance(value, str) or isinstance(choice, str):
        return choice == value
    text = value.strip().lower()
    if isinstance(choice, bool):
        return text == str(choice).lower()
    try:
        return float(text) == float(choice)
    except (TypeError, ValueError):
        return False


def parse_restrictions(items: Sequence[str]) -> dict[str, list[str]]:
    """``--restrict name=value[,value...]`` (repeatable) as ``restrict``: the values stay text, which
    ``SearchSpace`` matches against each dimension's choices. A malformed item is one clear error."""
    out: dict[str, list[str]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        if not sep or not name.strip() or not values.strip():
            raise SpecError("--restrict", "", f"{item!r} is not name=value[,value...] (e.g. --restrict pp=2,4)")
        out.setdefault(name.strip(), []).extend(v.strip() for v in values.split(",") if v.strip())
    return out


def stage_recompute(mode: str, memory_GiB: float, max_memory_GiB: float) -> bool | str:
    """A stage's recomputation under the space's ``recompute`` choice ``mode``: a partial mode (Megatron's
    ``selective``, torchtitan's) as it is; ``all``; ``low-memory`` for a stage with less memory than the
    plan's largest device (``memory_GiB < max_memory_GiB``); else none."""
    if mode in ("selective",) + TORCHTITAN_RECOMPUTE:
        return mode
    return mode == "all" or (mode == "low-memory" and memory_GiB < max_memory_GiB)


def layerwise_pays(zero: Sequence[int], offload: Sequence[str]) -> bool:
    """Whether Zorse's layer-wise execution can differ from micro-batch execution among these choices: it
    batches ZeRO-2/3's and offload's per-layer traffic per iteration (``autotune.specs.execution``)."""
    return any(z >= 2 for z in zero) or any(o != "none" for o in offload)


def composed_settings(dims) -> tuple[tuple[bool, ...], str]:
    """What a planner-composed stage's recomputation may be (off, on) and the schedule composed plans are
    built with, within the space's (``--restrict``-ed) ``recompute`` and ``schedule`` choices; modes other
    than on and off are the state variants' to set."""
    modes = set(dims["recompute"].choices)
    allowed = tuple(
        rc for rc, names in ((False, {"none", "low-memory"}), (True, {"all", "low-memory"})) if modes & names
    )
    schedules = dims["schedule"].choices
    return allowed or (False, True), "1f1b" if "1f1b" in schedules or "gpipe" not in schedules else "gpipe"
