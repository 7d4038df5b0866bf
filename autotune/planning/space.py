"""The one search space every method shares: a compact plan encoding and its decoder.

The raw space (which devices form each stage, how stages chain into pipelines, layers per stage,
micro-batches per replica, micro-batch size, schedule, recompute per stage) is astronomically large.
Every method searches instead over a small set of *dimensions*, each a finite list of choices:

``tp.<class>``     tensor-parallel degree on each node class (power of 2 dividing heads and ffn; a TP
                   group never leaves its node). A node class is a set of identical nodes.
``use.<class>``    whether that node class takes part at all (idle devices), only with several classes.
``pp``             stages per pipeline; replicas: as many as the TP groups allow (the slowest left over idle).
``assign``         ``grouped``: pipelines are cut from the TP groups sorted by speed (homogeneous
                   pipelines, stages node-adjacent); ``mixed``: every pipeline takes one group from
                   each speed tier (identical replicas of a heterogeneous pipeline).
``order``          stage order inside a pipeline: ``fast-first`` or ``slow-first``.
``layer_split``    exponent a: layers per stage proportional to (stage speed)^a, with the LM head
                   counted as extra work on the last stage (0 = even split, 1 = speed-proportional).
``batch_split``    exponent b: micro-batches per replica proportional to (replica speed)^b.
``mbs``            micro-batch size (divides the global batch).
``schedule``       ``1f1b``, ``gpipe`` or ``interleaved-1f1b`` (two virtual stages).
``recompute``      ``none``, ``all``, ``low-memory`` (stages with less memory than the largest used device),
                   ``selective`` (Megatron's attention core; models with ``attention: standard`` only),
                   torchtitan's ``selective-op`` and ``every-2`` (``autotune.specs.recompute``).
``seq_parallel``   sequence parallelism in every tensor-parallel stage, when some class can have tp > 1.
``zero``           ZeRO / FSDP stage 0-3 across the data-parallel peers (0 without peers: the same plan).
``offload``        ``none``, ``optimizer`` or ``all``: every stage's CPU offload (host memory).
``execution``      ``microbatch`` or Zorse's ``layerwise`` (``autotune.specs.execution``), every pipeline; only
                   with ZeRO-2/3 or offload (the traffic it batches per layer), else the same plan.
``expert_parallel``, ``trains_experts``, ``sync_every``: MoE models only (``autotune.planning.moe_space``):
                   expert parallelism, SPES's expert subsets per replica group, the sync period.
``stage_ranks``    several node classes only (``autotune.planning.mixed_space``): Zorse's stages of 1-8 ranks
                   (mixed GPU types, shares by per-layer latency) or cut on the bandwidth graph.

``SearchSpace.decode(params)`` turns one choice per dimension into a valid ``ParallelConfig`` or the
reason it cannot. ``SearchSpace.check(config)`` says whether *any* plan (also one edited by the env)
is valid and why not. The heterogeneity-blind baseline (``uniform_plans``) and the speed-proportional
starting points (``heuristic_params``) live here too, so all agents see the same plans.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from autotune.engines import model_check as engine_model_check
from autotune.engines import restrict as engine_restrict
from autotune.errors import SpecError
from autotune.planning import encoding, mixed_space, moe_space, plan_params, roundpipe_space, uniform, validity
from autotune.planning.vocabulary import (
    ASSIGNMENTS,
    DEFAULTED_DIMENSIONS,
    EXHAUSTIVE_LIMIT,
    INTERLEAVED_CHUNKS,
    ORDERS,
    SPLIT_EXPONENTS,
    TORCHTITAN_RECOMPUTE,
    Decoded,
    Dimension,
    NodeClass,
    Params,
    SpaceContext,
    TPGroup,
    apportion,
    group_speed,
    head_extra_layers,
    layerwise_pays,
    mixed_pipelines,
    node_classes,
    powers_of_two_upto,
    same_choice,
    stage_recompute,
    valid_tp,
)
from autotune.specs import (
    OFFLOAD_MODES,
    SCHEDULES,
    ZERO_STAGES,
    ClusterSpec,
    ModelSpec,
    ParallelConfig,
    PipelineConfig,
)
from autotune.specs.execution import EXECUTIONS, MICROBATCH

log = logging.getLogger(__name__)


class SearchSpace:
    """Plans for one cluster and model. ``restrict`` narrows any dimension's choices by name."""

    def __init__(
        self,
        cluster: ClusterSpec,
        model: ModelSpec,
        *,
        max_mbs: int = 32,
        restrict: Mapping[str, Sequence[Any]] | None = None,
        max_sync_every: int = 1,
        engine: str | None = None,
    ) -> None:
        self.cluster = cluster
        #: only plans this engine runs (``autotune.engines``): its restrictions narrow the dimensions, its
        #: check makes the rest of its refusals invalid proposals
        self.engine = engine
        self.model = model
        self.max_sync_every = max_sync_every
        self.restrict = {k: list(v) for k, v in (restrict or {}).items()}
        self.node_classes = node_classes(cluster)
        self._class_of_node = {n: c.name for c in self.node_classes for n in c.node_names}
        self.head_extra = head_extra_layers(model)
        self.max_peak_tflops = max(n.device.peak_tflops for n in cluster.nodes)
        dims = []
        for c in self.node_classes:
            tps = [t for t in powers_of_two_upto(c.count) if valid_tp(model, t)]
            dims.append(Dimension(f"tp.{c.name}", tuple(tps), ordinal=True))
        if len(self.node_classes) > 1:
            for c in self.node_classes:
                dims.append(Dimension(f"use.{c.name}", (True, False)))
        max_pp = min(model.num_layers, cluster.num_devices)
        pps = sorted({p for p in range(1, max_pp + 1) if p <= 8 or model.num_layers % p == 0 or p & (p - 1) == 0})
        dims.append(Dimension("pp", tuple(pps), ordinal=True))
        if len(self.node_classes) > 1:
            dims.append(Dimension("assign", ASSIGNMENTS))
            dims.append(Dimension("order", ORDERS))
            dims.append(Dimension("layer_split", SPLIT_EXPONENTS, ordinal=True))
            dims.append(Dimension("batch_split", SPLIT_EXPONENTS, ordinal=True))
        else:
            dims.append(Dimension("assign", ("grouped",)))
            dims.append(Dimension("order", ("fast-first",)))
            dims.append(Dimension("layer_split", (1.0,), ordinal=True))
            dims.append(Dimension("batch_split", (1.0,), ordinal=True))
        gbs = model.global_batch_size
        dims.append(Dimension("mbs", tuple(m for m in range(1, min(max_mbs, gbs) + 1) if gbs % m == 0), ordinal=True))
        dims.append(Dimension("schedule", SCHEDULES))
        memories = {c.memory_GiB for c in self.node_classes}
        modes = (
            ("none", "all")
            + (("low-memory",) if len(memories) > 1 else ())
            + (("selective",) if model.attention == "standard" else ())
            + TORCHTITAN_RECOMPUTE
        )
        dims.append(Dimension("recompute", modes))
        if any(t > 1 for d in dims if d.name.startswith("tp.") for t in d.choices):
            dims.append(Dimension("seq_parallel", (False, True)))
        dims.append(Dimension("zero", ZERO_STAGES, ordinal=True))
        dims.append(Dimension("offload", OFFLOAD_MODES, ordinal=True))  # ordered by host-memory use
        dims.append(Dimension("execution", EXECUTIONS))
        # mixture of experts: expert parallelism, SPES expert subsets and sync period (autotune.planning.moe_space)
        dims += [
            Dimension(name, choices, ordinal)
            for name, choices, ordinal in moe_space.dimensions(cluster, model, max_sync_every)
        ]
        # Zorse's mixed data-parallel stages and bandwidth grouping (autotune.planning.mixed_space)
        dims += [
            Dimension(name, choices, ordinal)
            for name, choices, ordinal in mixed_space.dimensions(cluster, model, len(self.node_classes) > 1)
        ]
        dims += roundpipe_space.dimensions(self.node_classes, cluster)  # RoundPipe's plans, where a node qualifies
        if engine is not None and (why := engine_model_check(engine, model)) is not None:
            raise SpecError("--engine", engine, why)  # nothing of this space would export
        if engine is not None:  # the engine's narrowings where they leave a choice (the user's own win)
            restrict = engine_restrict(engine, {d.name: d.choices for d in dims}, restrict or {})
        if restrict:
            by_name = {d.name: d for d in dims}
            for name, allowed in restrict.items():
                if name not in by_name:
                    raise SpecError("search space", name, f"unknown dimension (the space has {', '.join(by_name)})")
                kept = tuple(c for c in by_name[name].choices if any(same_choice(c, a) for a in allowed))
                if not kept:
                    raise SpecError(
                        "search space",
                        name,
                        f"none of {list(allowed)} is a valid choice (choices: {list(by_name[name].choices)})",
                    )
                by_name[name] = Dimension(name, kept, by_name[name].ordinal)
            dims = [by_name[d.name] for d in dims]
            # the restriction as the space's own values (a command line gives "false" for False, "2" for 2)
            self.restrict = {name: list(by_name[name].choices) for name in restrict}
        dims = roundpipe_space.drop_if_off(dims)  # restricted to pipeline plans: no roundpipe dimensions at all
        if not layerwise_pays(*(next(d.choices for d in dims if d.name == n) for n in ("zero", "offload"))):
            dims = [d for d in dims if d.name != "execution"]  # layer-wise execution would be the same plans
        self.dimensions: tuple[Dimension, ...] = tuple(dims)
        self._dims = {d.name: d for d in dims}
        #: what the feature families are given (``vocabulary.SpaceContext``): values, not this space
        self.context = SpaceContext(cluster, model, self.node_classes, self._dims, self.restrict)
        #: plans encoded as points (``encode``): anchor key -> (plan, its nearest point)
        self._anchors: dict[str, tuple[ParallelConfig, Params]] = {}

    # -- structure ---------------------------------------------------------------------------------
    def node_class(self, name: str) -> NodeClass:
        return next(c for c in self.node_classes if c.name == name)

    def tp_groups(self, tp_by_class: Mapping[str, int], used: Mapping[str, bool] | None = None) -> list[TPGroup]:
        """TP groups of the used classes, fastest first; ties keep cluster order (node-adjacent)."""
        groups = []
        for node in self.cluster.nodes:
            cname = self._class_of_node[node.name]
            if used is not None and not used.get(cname, True):
                continue
            tp = tp_by_class[cname]
            ids = node.device_ids()
            speed = tp * node.device.peak_tflops / node.slowdown
            for g in range(node.count // tp):
                groups.append(TPGroup(ids[g * tp : (g + 1) * tp], cname, speed, node.device.memory_GiB))
        groups.sort(key=lambda g: -g.speed_tflops)  # stable: cluster order within equal speed
        return groups

    def group_speed(self, devices: Sequence[str]) -> float:
        return group_speed(self.cluster, devices)

    #: dimensions that matter for both kinds of plan (pipeline plans and roundpipe plans)
    SHARED_DIMENSIONS = ("mbs",)

    def _families(self) -> list[tuple[dict[str, Any], list[Dimension]]]:
        """(fixed choices, free dimensions) of each kind of plan: pipeline plans, and roundpipe plans where
        the space has them; a kind's irrelevant dimensions are fixed at their first choice."""
        rp_names = set(roundpipe_space.DIMENSION_NAMES)
        if roundpipe_space.SWITCH not in self._dims:
            return [({}, list(self.dimensions))]
        out = []
        for on in self._dims[roundpipe_space.SWITCH].choices:
            free = [
                d
                for d in self.dimensions
                if d.name != roundpipe_space.SWITCH
                and (d.name in self.SHARED_DIMENSIONS or (d.name in rp_names) == bool(on))
            ]
            fixed = {d.name: d.choices[0] for d in self.dimensions if d not in free}
            fixed[roundpipe_space.SWITCH] = on
            out.append((fixed, free))
        return out

    @property
    def size(self) -> int:
        """Raw number of combinations (before removing invalid and duplicate plans): pipeline plans'
        dimensions times each other, plus roundpipe plans' (``roundpipe_space``)."""
        return sum(math.prod(len(d.choices) for d in free) for _, free in self._families())

    # -- decoding ----------------------------------------------------------------------------------
    def decode(self, params: Mapping[str, Any]) -> Decoded:
        """One choice per dimension -> a valid ParallelConfig, or the reason there is none (an anchored point
        of ``encode``: its plan, with the state choices that differ applied)."""
        anchored = self._anchors.get(str(params.get(encoding.ANCHOR)))
        if anchored is not None:
            config = encoding.decode_anchored(self.context, *anchored, params)
            if config is not None:
                reason = config if isinstance(config, str) else self.check(config)
                return Decoded(None, reason) if reason else Decoded(config, "")
        missing = [
            d.name
            for d in self.dimensions
            if d.name not in params and d.name not in mixed_space.DEFAULTS and d.name not in DEFAULTED_DIMENSIONS
        ]
        if missing:
            return Decoded(None, f"missing choice for {', '.join(missing)}")
        if params.get(roundpipe_space.SWITCH):
            decoded = roundpipe_space.decode(self.context, params)
            reason = self.check(decoded.config) if decoded.config is not None else None
            return decoded if reason is None else Decoded(None, reason)
        pipes = self._decode_pipes(params)
        if isinstance(pipes, str):
            return Decoded(None, pipes)
        splits = self._decode_splits(params, pipes)
        if isinstance(splits, str):
            return Decoded(None, splits)
        config = self._decode_plan(params, pipes, *splits)
        if isinstance(config, str):
            return Decoded(None, config)
        reason = self.check(config)
        return Decoded(config, "") if reason is None else Decoded(None, reason)

    def _decode_pipes(self, params: Mapping[str, Any]) -> list[list[Any]] | str:
        """The pipelines' stages (TP groups, or ``RankGroup``s of mixed stages), in stage order."""
        model = self.model
        tp_by_class = {c.name: int(params[f"tp.{c.name}"]) for c in self.node_classes}
        used = {c.name: bool(params.get(f"use.{c.name}", True)) for c in self.node_classes}
        if not any(used.values()):
            return "no node class is used"
        groups = self.tp_groups(tp_by_class, used)
        pp = int(params["pp"])
        if pp > model.num_layers:
            return f"pp={pp} exceeds num_layers={model.num_layers}"
        if len(groups) < pp:
            return f"pp={pp} needs {pp} TP groups, the used devices form {len(groups)}"
        if mixed_space.wanted(params):  # stages of several ranks (Zorse): they replace the TP groups below
            built = mixed_space.build_pipes(self.context, groups, pp, params)
            if isinstance(built, str):
                return built
            pipes = built[0]
        else:
            dp = len(groups) // pp
            groups = groups[: dp * pp]  # the slowest left-over groups stay idle
            if params["assign"] == "grouped":
                pipes = [groups[p * pp : (p + 1) * pp] for p in range(dp)]
            else:
                pipes = mixed_pipelines(groups, dp)
        if params["order"] == "slow-first":
            pipes = [list(reversed(p)) for p in pipes]
        if params["schedule"] == "interleaved-1f1b" and pp == 1:
            return "interleaved-1f1b needs pp >= 2"
        return pipes

    def _decode_splits(
        self, params: Mapping[str, Any], pipes: list[list[Any]]
    ) -> tuple[list[list[int]], list[int]] | str:
        """(layers per stage of each pipeline, micro-batches of each pipeline), by the speed exponents."""
        model, pp, dp = self.model, len(pipes[0]), len(pipes)
        interleaved = params["schedule"] == "interleaved-1f1b"
        quantum = INTERLEAVED_CHUNKS if interleaved else 1
        alpha, beta = float(params["layer_split"]), float(params["batch_split"])
        layer_splits = []
        for pipe in pipes:
            split = self.split_layers([g.speed_tflops for g in pipe], alpha, quantum)
            if split is None:
                return f"{model.num_layers} layers do not split into {pp} stages of multiples of {quantum}"
            layer_splits.append(split)
        ep = int(params.get("expert_parallel", 1))
        if ep > 1:  # the replicas of an expert-parallel group run in lockstep: give them one shape
            aligned = moe_space.align_groups(pipes, layer_splits, ep, alpha, quantum, self.split_layers)
            if isinstance(aligned, str):
                return aligned
            layer_splits = aligned
        mbs = int(params["mbs"])
        if model.global_batch_size % mbs:
            return f"mbs={mbs} does not divide global_batch_size={model.global_batch_size}"
        total_mb = model.global_batch_size // mbs
        if total_mb < dp:
            return f"{total_mb} micro-batches of {mbs} cannot feed {dp} replicas"
        speeds = [self.replica_speed([g.speed_tflops for g in pipe], split) for pipe, split in zip(pipes, layer_splits)]
        # Megatron-LM's interleaved schedule needs each replica's micro-batches in multiples of pp
        mb_quantum = pp if interleaved else 1
        if ep > 1:
            mbs_split = moe_space.group_microbatches(total_mb, speeds, ep, beta, mb_quantum, apportion)
            if isinstance(mbs_split, str):
                return mbs_split
        else:
            mbs_split = apportion(total_mb, [s**beta for s in speeds], minimum=mb_quantum, quantum=mb_quantum)
        if mbs_split is None:
            return (
                f"{total_mb} micro-batches do not split into {dp} replicas in multiples of "
                f"{mb_quantum} (interleaved-1f1b)"
            )
        return layer_splits, mbs_split

    def _decode_plan(
        self, params: Mapping[str, Any], pipes: list[list[Any]], layer_splits: list[list[int]], mbs_split: list[int]
    ) -> ParallelConfig | str:
        """The plan of these pipelines and splits, with the rest of the choices (recompute, offload, ZeRO,
        sequence parallelism, MoE), before the space's own check."""
        model, dp = self.model, len(pipes)
        mbs, schedule = int(params["mbs"]), str(params["schedule"])
        ep = int(params.get("expert_parallel", 1))
        trains = moe_space.trained_experts(params.get("trains_experts", "all"), model, mbs_split, ep)
        mode = params["recompute"]
        sp = bool(params.get("seq_parallel", False))
        offload = str(params.get("offload", "none"))
        # no peers (one replica, one rank per stage): zero k is the zero-0 plan; a stage of several ranks
        # has its ranks as peers (mixed_space.has_peers)
        zero = int(params.get("zero", 0)) if dp > 1 or mixed_space.has_peers(pipes) else 0
        execution = str(params.get("execution", MICROBATCH)) if layerwise_pays((zero,), (offload,)) else MICROBATCH
        max_mem = max(g.memory_GiB for pipe in pipes for g in pipe)
        pipelines = []
        for pipe, split, m, experts in zip(pipes, layer_splits, mbs_split, trains):
            stages = tuple(
                mixed_space.stage_config(
                    self.context,
                    g,
                    n,
                    stage_recompute(mode, g.memory_GiB, max_mem),
                    offload,
                    m,
                    mbs,
                    sp,
                )
                for g, n in zip(pipe, split)
            )
            bad = next((st for st in stages if isinstance(st, str)), None)
            if bad is not None:
                return bad
            pipelines.append(PipelineConfig(m, stages, experts, execution=execution))
        try:
            return ParallelConfig(
                mbs,
                tuple(pipelines),
                schedule,
                INTERLEAVED_CHUNKS if schedule == "interleaved-1f1b" else 1,
                zero,
                expert_parallel=ep,
                sync_every_steps=int(params.get("sync_every", 1)),
            )
        except SpecError as e:
            return str(e)

    def split_layers(self, speeds: Sequence[float], alpha: float, quantum: int = 1) -> list[int] | None:
        """Layers per stage proportional to speed^alpha, the LM head's work counted on the last stage."""
        n = len(speeds)
        weights = [s**alpha for s in speeds]
        total_work = self.model.num_layers + self.head_extra
        share = [w / sum(weights) * total_work for w in weights]
        share[-1] -= self.head_extra
        share = [max(x, 1e-3) for x in share]
        return apportion(self.model.num_layers, share, minimum=quantum, quantum=quantum) if n else None

    def replica_speed(self, speeds: Sequence[float], layers: Sequence[int]) -> float:
        """Nominal micro-batches per unit time of a pipeline: set by its bottleneck stage."""
        work = [n + (self.head_extra if i == len(layers) - 1 else 0.0) for i, n in enumerate(layers)]
        return 1.0 / max(w / s for w, s in zip(work, speeds))

    # -- validity of any plan ------------------------------------------------------------------------
    def check(self, config: ParallelConfig) -> str | None:
        """None when ``config`` is a valid plan of this cluster and model, else the broken rule
        (``autotune.planning.validity``)."""
        return validity.check(self.cluster, self.model, self.restrict, self.engine, config)

    # -- sampling and enumeration ---------------------------------------------------------------------
    def sample(self, rng: np.random.Generator) -> Params:
        return {d.name: d.choices[int(rng.integers(len(d.choices)))] for d in self.dimensions}

    def sample_valid(self, rng: np.random.Generator, tries: int = 1000) -> tuple[Params, ParallelConfig]:
        for _ in range(tries):
            params = self.sample(rng)
            decoded = self.decode(params)
            if decoded.ok:
                return params, decoded.config  # type: ignore[return-value]
        raise SpecError("search space", "", f"no valid plan in {tries} random samples")

    def all_params(self, limit: int = EXHAUSTIVE_LIMIT) -> Iterator[Params]:
        if self.size > limit:
            sizes = " + ".join(" x ".join(f"{d.name}:{len(d.choices)}" for d in free) for _, free in self._families())
            raise SpecError(
                "search space",
                "exhaustive",
                f"{self.size:,} combinations ({sizes}) exceed the limit of {limit:,}; "
                "use --method optuna, random or rl",
            )
        order = [d.name for d in self.dimensions]
        for fixed, free in self._families():
            names = [d.name for d in free]
            for combo in itertools.product(*(d.choices for d in free)):
                params = dict(fixed, **dict(zip(names, combo)))
                yield {k: params[k] for k in order}

    def enumerate(self, limit: int = EXHAUSTIVE_LIMIT) -> list[tuple[Params, ParallelConfig]]:
        """Every distinct valid plan of the space (first encoding that produces it), in a fixed order."""
        seen: set[ParallelConfig] = set()
        out = []
        for params in self.all_params(limit):
            decoded = self.decode(params)
            if decoded.ok and decoded.config not in seen:
                seen.add(decoded.config)  # type: ignore[arg-type]
                out.append((params, decoded.config))
        return out  # type: ignore[return-value]

    # -- heuristics ------------------------------------------------------------------------------------
    def rough_weight_memory_GiB(self, tp: int, pp: int) -> float:
        """Weights + grads + Adam states per device, 16 bytes/param (mixed precision, Rajbhandari et al.
        2020, ZeRO sec. 3.1), model split evenly into tp x pp pieces. A rough filter for start points."""
        return 16 * self.model.num_params / (tp * pp) / 2**30

    def heuristic_params(self) -> list[Params]:
        """Speed-proportional starting points, most promising first (the RL start and Optuna seeds).

        All node classes used, the largest TP degree that keeps per-device weight state under half
        the smallest device memory at the smallest such pp, layers and batch proportional to speed;
        then, with mixed-stage dimensions, Zorse's starts (``mixed_space.start_params``); then
        ``memory_params``: the first speed-proportional start sharded ZeRO-3 with its optimizer
        offloaded and recomputation on, and the memory-first plan (``memory_first_params``). When no
        tp x pp split of the unsharded weight state fits half the smallest device (the model is too big
        for plain pipeline and tensor parallelism), those two come first.
        """

        def pick(dim: str, want: Any) -> Any:
            choices = self._dims[dim].choices
            if want in choices:
                return want
            numbers = all(isinstance(c, int | float) and not isinstance(c, bool) for c in (*choices, want))
            if self._dims[dim].ordinal and numbers:  # an ordinal of names (offload) has no distance
                return min(choices, key=lambda c: abs(float(c) - float(want)))
            return choices[0]

        min_mem = min(c.memory_GiB for c in self.node_classes)
        candidates = []
        for tp_mode in ("small", "large"):
            base: Params = {}
            for c in self.node_classes:
                tps = self._dims[f"tp.{c.name}"].choices
                base[f"tp.{c.name}"] = tps[0] if tp_mode == "small" else tps[-1]
                if f"use.{c.name}" in self._dims:
                    base[f"use.{c.name}"] = pick(f"use.{c.name}", True)
            tp_min = min(base[f"tp.{c.name}"] for c in self.node_classes)
            pps = self._dims["pp"].choices
            fitting = [p for p in pps if self.rough_weight_memory_GiB(tp_min, p) < 0.5 * min_mem]
            pp = fitting[0] if fitting else pps[-1]
            for assign in ("mixed", "grouped"):
                params = dict(
                    base,
                    pp=pp,
                    assign=pick("assign", assign),
                    order=pick("order", "fast-first"),
                    layer_split=pick("layer_split", 1.0),
                    batch_split=pick("batch_split", 1.0),
                    mbs=pick("mbs", 1 if pp > 1 else 4),
                    schedule=pick("schedule", "1f1b"),
                    recompute=pick("recompute", "none"),
                )
                if "seq_parallel" in self._dims:  # off, as the plans these starts were tuned with; the
                    params["seq_parallel"] = pick("seq_parallel", False)  # methods that search dims turn it on
                params.update(roundpipe_space.off_params(self._dims))  # pipeline plans (RoundPipe starts apart)
                if "expert_parallel" in self._dims:  # MoE: plain data parallelism first, then SPES, then EP
                    params.update(
                        expert_parallel=pick("expert_parallel", 1),
                        trains_experts=pick("trains_experts", "all"),
                        sync_every=pick("sync_every", 1),
                    )
                candidates.append(params)
                if "expert_parallel" in self._dims:
                    syncs = self._dims["sync_every"].choices
                    candidates.append(
                        dict(params, trains_experts=pick("trains_experts", "partition"), sync_every=syncs[-1])
                    )
                    for g in reversed(self._dims["expert_parallel"].choices):  # the widest that decodes
                        if g > 1 and self.decode(dict(params, expert_parallel=g)).ok:
                            candidates.append(dict(params, expert_parallel=g))
                            break
                if len(self.node_classes) == 1:
                    break
        for params in candidates:  # zero 0, no offload, micro-batch execution (DEFAULTED_DIMENSIONS)
            params.update({k: pick(k, v) for k, v in DEFAULTED_DIMENSIONS.items() if k in self._dims})
        candidates += mixed_space.start_params(self.context, candidates)
        # tight: even the deepest pipeline at the smallest TP degree leaves no room (the first start's rule)
        tight = not any(
            self.rough_weight_memory_GiB(min(self._dims[f"tp.{c.name}"].choices[0] for c in self.node_classes), p)
            < 0.5 * min_mem
            for p in self._dims["pp"].choices
        )
        memory = self.memory_params(candidates[0] if candidates else None)
        candidates = memory + candidates if tight else candidates + memory
        out, seen = [], set()
        for params in candidates:
            for pp_shift in (0, 1, -1, 2):
                pps = self._dims["pp"].choices
                i = pps.index(params["pp"]) + pp_shift
                if not 0 <= i < len(pps):
                    continue
                p = dict(params, pp=pps[i])
                d = self.decode(p)
                if d.ok and d.config not in seen:
                    seen.add(d.config)  # type: ignore[arg-type]
                    out.append(p)
                    break
        return out

    def memory_first_params(self) -> Params:
        """The smallest-memory pipeline plan of the space: every node class used at its largest
        tensor-parallel degree (splits weights, activations and streamed units), the fewest stages
        (fewest micro-batches in flight), micro-batch 1, recomputation everywhere, ZeRO-3 and everything
        in host memory (nothing resident on the devices but the streamed units and activations). If any
        pipeline plan fits the devices, this one does, as far as host memory holds its state. RoundPipe's
        plans (the loss taken in chunks) can need less; ``roundpipe_start`` is their own start."""

        def last(dim: str) -> Any:
            return self._dims[dim].choices[-1]

        def first(dim: str) -> Any:
            return self._dims[dim].choices[0]

        params: Params = {f"tp.{c.name}": last(f"tp.{c.name}") for c in self.node_classes}
        for c in self.node_classes:
            if f"use.{c.name}" in self._dims:
                params[f"use.{c.name}"] = (
                    True if True in self._dims[f"use.{c.name}"].choices else first(f"use.{c.name}")
                )
        params.update(
            pp=first("pp"),
            assign=first("assign"),
            order=first("order"),
            layer_split=last("layer_split"),
            batch_split=last("batch_split"),
            mbs=first("mbs"),
            schedule="1f1b" if "1f1b" in self._dims["schedule"].choices else first("schedule"),
            recompute="all" if "all" in self._dims["recompute"].choices else last("recompute"),
            zero=last("zero"),
            offload=last("offload"),
        )
        for d in self.dimensions:  # any other dimension (MoE): its first choice
            params.setdefault(d.name, d.choices[0])
        for p in self._dims["pp"].choices:  # the fewest stages that decode (e.g. enough TP groups)
            if self.decode(dict(params, pp=p)).ok:
                params["pp"] = p
                break
        return params

    def memory_params(self, base: Params | None) -> list[Params]:
        """Memory-first starts: ``base`` (a speed-proportional start) at the fewest stages (the most
        replicas to shard across) with ZeRO-3, offloaded optimizer and recomputation, then
        ``memory_first_params``. None when the space has neither sharding nor offload (restricted)."""
        if self._dims["zero"].choices == (0,) and self._dims["offload"].choices == ("none",):
            return []
        out = []
        if base is not None:

            def pick(dim: str, want: Any) -> Any:
                return want if want in self._dims[dim].choices else self._dims[dim].choices[-1]

            sharded = dict(
                base,
                zero=pick("zero", 3),
                offload=pick("offload", "optimizer"),
                recompute=pick("recompute", "all"),
                mbs=self._dims["mbs"].choices[0],
            )
            for p in self._dims["pp"].choices:  # the fewest stages that decode
                if self.decode(dict(sharded, pp=p)).ok:
                    sharded["pp"] = p
                    break
            out.append(sharded)
        out.append(self.memory_first_params())
        return out

    def roundpipe_start(self) -> Params | None:
        """The plan RoundPipe itself would pick here (``roundpipe_space.start_params``), where RoundPipe
        applies and the plan decodes; else None."""
        params = roundpipe_space.start_params(self.context)
        return params if params is not None and self.decode(params).ok else None

    def uniform_plans(self) -> list[ParallelConfig]:
        """The heterogeneity-blind baseline grid (``autotune.planning.uniform``)."""
        return uniform.uniform_plans(self.context, self.check)

    def encode(self, config: ParallelConfig) -> Params:
        """Any plan as a point of this space (``autotune.planning.encoding``): its nearest point and its
        anchor, so that decoding gives the plan back and moving a state dimension changes only that choice."""
        point = encoding.nearest(self.context, config)
        key = encoding.key_of(config)
        self._anchors[key] = (config, point)
        return dict(point, **{encoding.ANCHOR: key})

    # -- describing plans --------------------------------------------------------------------------------
    def params_of(self, config: ParallelConfig) -> dict[str, Any]:
        """Flat, MLflow-friendly parameters of any plan (``autotune.planning.plan_params``)."""
        return plan_params.params_of(self.cluster, self.model, config)
