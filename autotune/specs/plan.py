"""The plan (docs/formats.md, "Parallel config"): stages, pipelines (data-parallel replicas) and the
plan-wide settings, with the rules that need the cluster and the model (``ParallelConfig.validate``).

The feature parts (``mixed_stage``: Zorse's stages of several ranks, ``roundpipe``: RoundPipe's pools) take
values from here and hold their own rules."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from autotune.errors import SpecError, shown
from autotune.specs import mixed_stage, roundpipe
from autotune.specs.cluster import ClusterSpec
from autotune.specs.execution import MICROBATCH, check_execution
from autotune.specs.limits import ALL_SCHEDULES, OFFLOAD_MODES, ROUNDPIPE, ZERO_STAGES, positive
from autotune.specs.mixed_stage import RankConfig
from autotune.specs.model import ModelSpec
from autotune.specs.recompute import flag as recompute_flag
from autotune.specs.recompute import recompute_problem
from autotune.specs.roundpipe import RoundPipeStages


@dataclass(frozen=True, slots=True)
class StageConfig:
    """One pipeline stage. ``recompute``: ``False``, ``True`` (full: keep each layer's input, recompute the
    layer in the backward), ``"selective"`` (recompute only the attention core, Korthikanti et al.
    2022), ``"selective-op"`` or ``"every-N"`` (torchtitan's; ``autotune.specs.recompute``). ``sequence_parallel``: Megatron's sequence parallelism inside the stage's tensor-parallel
    group (norms and dropout split along the sequence; reduce-scatter + all-gather instead of
    all-reduce); no effect on a one-device stage.

    ``ranks`` (Zorse, ``autotune.specs.mixed_stage``): the stage's data-parallel ranks, each a tensor-parallel
    group with its own share of the pipeline's micro-batches. Given, ``devices`` is derived from them
    (every rank's devices, in order); empty, the stage is one rank of ``devices`` holding every
    micro-batch (``ranks_of``)."""

    devices: tuple[str, ...]
    layers: int
    recompute: bool | str = False
    offload: str = "none"  # OFFLOAD_MODES: none | optimizer | all
    sequence_parallel: bool = False
    ranks: tuple[RankConfig, ...] = ()

    def __post_init__(self) -> None:
        if self.ranks:
            object.__setattr__(self, "devices", tuple(d for r in self.ranks for d in r.devices))

    @property
    def tp(self) -> int:
        """The tensor-parallel degree (of the widest rank in a stage of several ranks)."""
        return max(r.tp for r in self.ranks) if self.ranks else len(self.devices)

    @property
    def mixed(self) -> bool:
        """A stage of several data-parallel ranks (``ranks`` with two or more entries)."""
        return len(self.ranks) > 1

    def ranks_of(self, num_microbatches: int) -> tuple[RankConfig, ...]:
        """The stage's ranks; a ``devices`` stage is one rank holding all ``num_microbatches``."""
        return mixed_stage.ranks_of(self.ranks, self.devices, num_microbatches)

    def shares(self, num_microbatches: int) -> tuple[int, ...]:
        """The stage's micro-batch share per rank (one rank holding all ``num_microbatches``: a ``devices`` stage)."""
        return mixed_stage.shares_of(self.ranks, num_microbatches)

    @property
    def full_recompute(self) -> bool:
        return self.recompute is True

    @property
    def selective_recompute(self) -> bool:
        return self.recompute == "selective"


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    num_microbatches: int
    stages: tuple[StageConfig, ...]
    #: expert indices this replica trains (SPES); None = "all". Only its gradients and optimizer state exist.
    trains_experts: tuple[int, ...] | None = None
    #: schedule "roundpipe": the device pool and the partitions (``autotune.specs.roundpipe``); stages is empty
    roundpipe: RoundPipeStages | None = None
    #: "microbatch" or Zorse's "layerwise" (``autotune.specs.execution``)
    execution: str = MICROBATCH

    @property
    def devices(self) -> tuple[str, ...]:
        if self.roundpipe is not None:
            return self.roundpipe.devices
        return tuple(d for s in self.stages for d in s.devices)

    def stage_ranks(self, stage: int) -> tuple[RankConfig, ...]:
        """Stage ``stage``'s data-parallel ranks with their micro-batch shares (``StageConfig.ranks_of``)."""
        return self.stages[stage].ranks_of(self.num_microbatches)


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """A plan (SPEC.md "Parallel config"). Hashable, so it is a cache key."""

    micro_batch_size: int
    pipelines: tuple[PipelineConfig, ...]
    schedule: str = "1f1b"
    virtual_stages: int = 1
    zero: int = 0  # ZERO_STAGES: sharding across each set of data-parallel peers
    #: MoE experts split across groups of this many consecutive replicas (all-to-all inside each group)
    expert_parallel: int = 1
    #: > 1: replicas (expert-parallel groups) train locally and exchange what they trained every N steps (SPES)
    sync_every_steps: int = 1

    def __post_init__(self) -> None:
        where = "config"
        positive(where, "micro_batch_size", self.micro_batch_size, integer=True)
        positive(where, "virtual_stages", self.virtual_stages, integer=True)
        if isinstance(self.zero, bool) or self.zero not in ZERO_STAGES:
            raise SpecError(where, "zero", f"must be 0, 1, 2 or 3 (ZeRO stage), got {shown(self.zero)}")
        positive(where, "expert_parallel", self.expert_parallel, integer=True)
        positive(where, "sync_every_steps", self.sync_every_steps, integer=True)
        if self.schedule not in ALL_SCHEDULES:
            raise SpecError(where, "schedule", f"must be one of {', '.join(ALL_SCHEDULES)}, got {shown(self.schedule)}")
        if self.schedule == "interleaved-1f1b" and self.virtual_stages < 2:
            raise SpecError(
                where,
                "virtual_stages",
                "interleaved-1f1b needs virtual_stages >= 2 (model chunks per "
                f"stage's devices), got {shown(self.virtual_stages)}",
            )
        if self.schedule != "interleaved-1f1b" and self.virtual_stages != 1:
            raise SpecError(
                where,
                "virtual_stages",
                f"only applies to interleaved-1f1b, got {self.virtual_stages} with schedule {shown(self.schedule)}",
            )
        if not self.pipelines:
            raise SpecError(where, "pipelines", "must list at least one pipeline")
        for p, pipe in enumerate(self.pipelines):
            positive(where, f"pipelines[{p}].num_microbatches", pipe.num_microbatches, integer=True)
            check_execution(pipe.execution, self.schedule, where, f"pipelines[{p}].execution")
            if pipe.trains_experts is not None:
                te = pipe.trains_experts
                if not isinstance(te, tuple) or not all(
                    isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in te
                ):
                    raise SpecError(
                        where,
                        f"pipelines[{p}].trains_experts",
                        f'must be "all" or a list of expert indices (integers >= 0), got {shown(te)}',
                    )
                if len(set(te)) != len(te):
                    raise SpecError(where, f"pipelines[{p}].trains_experts", f"lists an expert twice: {list(te)}")
        if self.schedule == ROUNDPIPE:
            for p, pipe in enumerate(self.pipelines):
                roundpipe.check_pool(pipe.roundpipe, bool(pipe.stages), pipe.num_microbatches, where, f"pipelines[{p}]")
            trains = [p.trains_experts for p in self.pipelines]
            roundpipe.check_plan(self.zero, self.expert_parallel, self.sync_every_steps, trains, where)
            return
        for p, pipe in enumerate(self.pipelines):
            if pipe.roundpipe is not None:
                raise SpecError(
                    where,
                    f"pipelines[{p}].forward_layers",
                    f"a device pool and forward/backward partitions need schedule 'roundpipe', not {self.schedule!r}",
                )
        self._check_mixed_stages(where)
        for p, pipe in enumerate(self.pipelines):
            if not pipe.stages:
                raise SpecError(where, f"pipelines[{p}].stages", "must list at least one stage")
            for s, stage in enumerate(pipe.stages):
                f = f"pipelines[{p}].stages[{s}]"
                if not stage.devices:
                    raise SpecError(where, f"{f}.devices", "must list at least one device")
                positive(where, f"{f}.layers", stage.layers, integer=True, strict=False)
                if stage.offload not in OFFLOAD_MODES:
                    raise SpecError(
                        where, f"{f}.offload", f"must be one of {', '.join(OFFLOAD_MODES)}, got {shown(stage.offload)}"
                    )
                bad = recompute_problem(stage.recompute)
                if bad is not None:
                    raise SpecError(where, f"{f}.recompute", bad)
                if not isinstance(stage.sequence_parallel, bool):
                    raise SpecError(
                        where, f"{f}.sequence_parallel", f"must be true or false, got {shown(stage.sequence_parallel)}"
                    )

    def _check_mixed_stages(self, where: str) -> None:
        """Each stage's ``ranks`` (``autotune.specs.mixed_stage``), and what a plan with mixed stages may not
        combine with."""
        mixed = None
        for p, pipe in enumerate(self.pipelines):
            for s, stage in enumerate(pipe.stages):
                if stage.ranks:
                    f = f"pipelines[{p}].stages[{s}].ranks"
                    mixed_stage.check_ranks(stage.ranks, pipe.num_microbatches, where, f)
                    if len(stage.ranks) > 1 and mixed is None:
                        mixed = f
        if mixed is not None:
            spes = (
                "sync_every_steps"
                if self.sync_every_steps != 1
                else "trains_experts"
                if any(p.trains_experts is not None for p in self.pipelines)
                else None
            )
            mixed_stage.check_combination(mixed, self.schedule, self.expert_parallel, spes, where)

    # -- derived -----------------------------------------------------------------------------------
    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for p in self.pipelines for d in p.devices)

    @property
    def global_batch_size(self) -> int:
        return sum(p.num_microbatches for p in self.pipelines) * self.micro_batch_size

    @property
    def has_mixed_stages(self) -> bool:
        """Some stage has several data-parallel ranks (Zorse, ``autotune.specs.mixed_stage``)."""
        return any(s.mixed for p in self.pipelines for s in p.stages)

    @property
    def offloads(self) -> bool:
        """True when any stage keeps state in host memory."""
        return any(s.offload != "none" for p in self.pipelines for s in p.stages)

    @property
    def is_roundpipe(self) -> bool:
        """RoundPipe's dispatch schedule (``autotune.specs.roundpipe``)."""
        return self.schedule == ROUNDPIPE

    def notes(self) -> list[str]:
        """Settings that are valid but do nothing (``describe`` shows them; nothing is rejected)."""
        out = [
            n
            for p, pipe in enumerate(self.pipelines)
            if pipe.roundpipe is not None
            for n in roundpipe.notes(pipe.roundpipe, pipe.num_microbatches, f"pipelines[{p}]")
        ]
        if self.zero and len(self.pipelines) == 1 and not self.has_mixed_stages:
            out.append(f"zero {self.zero} with one replica does nothing (no data-parallel peers to shard across)")
        return out

    def validate(self, cluster: ClusterSpec | None, model: ModelSpec, source: str = "config") -> None:
        """Check the rules that need the cluster and model; raise SpecError naming the broken one. Without a
        cluster (``export --model`` alone), every rule but the devices' (which exist, where they are)."""
        _validate_expert_plan(self, model, source)
        if self.schedule == ROUNDPIPE:
            pools: dict[str, str] = {}
            for p, pipe in enumerate(self.pipelines):
                assert pipe.roundpipe is not None  # the plan checked itself when it was built
                if cluster is None:
                    continue
                roundpipe.validate_pool(
                    pipe.roundpipe, pipe.num_microbatches, cluster, model, source, f"pipelines[{p}]", pools
                )
            self._check_batch(model, source)
            return
        seen: set[str] = set()
        good_tp: set[int] = set()  # degrees already checked against the model
        for p, pipe in enumerate(self.pipelines):
            if self.schedule == "interleaved-1f1b" and pipe.num_microbatches % len(pipe.stages):
                raise SpecError(
                    source,
                    f"pipelines[{p}].num_microbatches",
                    f"interleaved-1f1b needs num_microbatches divisible by the number of stages "
                    f"(Megatron-LM's rule): {pipe.num_microbatches} % {len(pipe.stages)} != 0",
                )
            total = sum(s.layers for s in pipe.stages)
            if total != model.num_layers:
                raise SpecError(
                    source,
                    f"pipelines[{p}].stages",
                    f"layers sum to {total}, model {shown(model.name)} has num_layers={model.num_layers}",
                )
            for s, stage in enumerate(pipe.stages):
                if stage.layers < 1 and len(pipe.stages) > 1:
                    raise SpecError(
                        source, f"pipelines[{p}].stages[{s}].layers", "must be >= 1 in a pipeline of several stages"
                    )
                if self.schedule == "interleaved-1f1b" and stage.layers % self.virtual_stages:
                    raise SpecError(
                        source,
                        f"pipelines[{p}].stages[{s}].layers",
                        f"{stage.layers} layers do not split into virtual_stages={self.virtual_stages} chunks",
                    )
                for d in stage.devices:
                    if cluster is not None and not cluster.has_device(d):
                        raise SpecError(
                            source,
                            _field(p, s, stage),
                            f"unknown device id {shown(d)} (cluster {shown(cluster.name)} has "
                            f"{', '.join(n.name + ':0..' + str(n.count - 1) for n in cluster.nodes)})",
                        )
                    elif d in seen:
                        raise SpecError(source, _field(p, s, stage), f"device {shown(d)} is used more than once")
                    seen.add(d)
                for k, tp in enumerate([r.tp for r in stage.ranks] if stage.ranks else [len(stage.devices)]):
                    if tp in good_tp:
                        continue
                    where = f"pipelines[{p}].stages[{s}]." + (f"ranks[{k}].devices" if stage.ranks else "devices")
                    if model.num_heads % tp or (model.num_kv_heads % tp and tp % model.num_kv_heads):
                        raise SpecError(
                            source,
                            where,
                            f"tensor-parallel degree {tp} must divide num_heads={model.num_heads} "
                            f"and num_kv_heads={model.num_kv_heads} (or be a multiple of it)",
                        )
                    if model.ffn_hidden_size % tp:
                        raise SpecError(
                            source,
                            where,
                            f"tensor-parallel degree {tp} must divide ffn_hidden_size={model.ffn_hidden_size}",
                        )
                    good_tp.add(tp)
        self._check_batch(model, source)

    def _check_batch(self, model: ModelSpec, source: str) -> None:
        if self.global_batch_size != model.global_batch_size:
            parts = " + ".join(f"{p.num_microbatches}" for p in self.pipelines)
            raise SpecError(
                source,
                "num_microbatches",
                f"({parts}) x micro_batch_size {self.micro_batch_size} = {self.global_batch_size} "
                f"sequences, global_batch_size is {model.global_batch_size}",
            )

    # -- (de)serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"micro_batch_size": self.micro_batch_size, "schedule": self.schedule}
        if self.schedule == "interleaved-1f1b":
            out["virtual_stages"] = self.virtual_stages
        if self.zero:
            out["zero"] = self.zero
        if self.expert_parallel != 1:
            out["expert_parallel"] = self.expert_parallel
        if self.sync_every_steps != 1:
            out["sync_every_steps"] = self.sync_every_steps

        def stage(s: StageConfig) -> dict[str, Any]:
            d: dict[str, Any] = (
                {"ranks": mixed_stage.ranks_to_dict(s.ranks)} if s.ranks else {"devices": list(s.devices)}
            )
            d.update(layers=s.layers, recompute=s.recompute)
            if s.offload != "none":
                d["offload"] = s.offload
            if s.sequence_parallel:
                d["sequence_parallel"] = True
            return d

        out["pipelines"] = []
        for p in self.pipelines:
            pipe: dict[str, Any] = {"num_microbatches": p.num_microbatches}
            if p.trains_experts is not None:
                pipe["trains_experts"] = list(p.trains_experts)
            if p.execution != MICROBATCH:
                pipe["execution"] = p.execution
            if p.roundpipe is not None:
                pipe.update(roundpipe.pipeline_to_dict(p.num_microbatches, p.roundpipe))
            else:
                pipe["stages"] = [stage(s) for s in p.stages]
            out["pipelines"].append(pipe)
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> ParallelConfig:
        if not isinstance(data, Mapping):
            raise SpecError(source, "", f"must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - {
            "micro_batch_size",
            "schedule",
            "virtual_stages",
            "zero",
            "pipelines",
            "measurement",
            "expert_parallel",
            "sync_every_steps",
        }
        if unknown:
            raise SpecError(source, str(sorted(unknown, key=str)[0]), "unknown field")
        try:
            pipelines_raw = data["pipelines"]
            mbs = data["micro_batch_size"]
        except KeyError as e:
            raise SpecError(source, str(e.args[0]), "is required") from None
        if not isinstance(pipelines_raw, list):
            raise SpecError(source, "pipelines", "must be a list")
        if data.get("schedule", "1f1b") not in ALL_SCHEDULES:
            raise SpecError(
                source, "schedule", f"must be one of {', '.join(ALL_SCHEDULES)}, got {shown(data.get('schedule'))}"
            )
        pipelines = []
        for p, raw in enumerate(pipelines_raw):
            if not isinstance(raw, Mapping):
                raise SpecError(source, f"pipelines[{p}]", "must be an object")
            if data.get("schedule") == ROUNDPIPE:
                m, rp, trains = roundpipe.pipeline_from_dict(raw, source, p)
                pipelines.append(PipelineConfig(m, (), _trains_experts_from(trains, source, p), rp))
                continue
            if "forward_layers" in raw or "backward_layers" in raw:
                raise SpecError(
                    source,
                    f"pipelines[{p}].forward_layers",
                    'a device pool with forward/backward partitions needs "schedule": "roundpipe"',
                )
            stages_raw = raw.get("stages")
            if not isinstance(stages_raw, list):
                raise SpecError(source, f"pipelines[{p}].stages", "is required and must be a list")
            stages = []
            for s, st in enumerate(stages_raw):
                f = f"pipelines[{p}].stages[{s}]"
                if not isinstance(st, Mapping):
                    raise SpecError(source, f, "must be an object")
                extra = set(st) - {"devices", "ranks", "layers", "recompute", "offload", "sequence_parallel"}
                if extra:
                    raise SpecError(source, f"{f}.{sorted(extra, key=str)[0]}", "unknown field")
                ranks: tuple[RankConfig, ...] = ()
                if "ranks" in st:  # Zorse: data-parallel ranks with their own shares (autotune.specs.mixed_stage)
                    if "devices" in st:
                        raise SpecError(source, f"{f}.ranks", "give devices (one rank) or ranks, not both")
                    ranks = mixed_stage.ranks_from_dict(st["ranks"], source, f"{f}.ranks")
                    devices = []
                else:
                    devices = st.get("devices")
                    if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
                        raise SpecError(
                            source, f"{f}.devices", "is required (or ranks) and must be a list of device ids"
                        )
                if "layers" not in st:
                    raise SpecError(source, f"{f}.layers", "is required")
                stages.append(
                    StageConfig(
                        tuple(devices),
                        st["layers"],
                        st.get("recompute", False),
                        st.get("offload", "none"),
                        st.get("sequence_parallel", False),
                        ranks,
                    )
                )
            if "num_microbatches" not in raw:
                raise SpecError(source, f"pipelines[{p}].num_microbatches", "is required")
            extra = set(raw) - {"num_microbatches", "stages", "trains_experts", "execution"}
            if extra:
                raise SpecError(source, f"pipelines[{p}].{sorted(extra, key=str)[0]}", "unknown field")
            pipelines.append(
                PipelineConfig(
                    raw["num_microbatches"],
                    tuple(stages),
                    _trains_experts_from(raw.get("trains_experts", "all"), source, p),
                    execution=raw.get("execution", MICROBATCH),
                )
            )
        try:
            return cls(
                micro_batch_size=mbs,
                pipelines=tuple(pipelines),
                schedule=data.get("schedule", "1f1b"),
                virtual_stages=data.get("virtual_stages", 1),
                zero=data.get("zero", 0),
                expert_parallel=data.get("expert_parallel", 1),
                sync_every_steps=data.get("sync_every_steps", 1),
            )
        except SpecError as e:
            raise SpecError(source, e.field, e.rule) from None

    @classmethod
    def from_json(cls, text: str, source: str = "config") -> ParallelConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(source, "", f"invalid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        return cls.from_dict(data, source)

    def describe(self) -> str:
        """A short human summary, e.g. ``mbs=2 1f1b | [a100:0-1 x20 | v100:0-3 x12 R] m=64``; ``zero=2``
        and a stage's ``off=optimizer`` / ``off=all`` when set, then any ``notes()``."""
        parts = []
        for p in self.pipelines:
            if p.roundpipe is not None:
                parts.append(f"[{p.roundpipe.summary()}] m={p.num_microbatches}")
                continue
            stages = " | ".join(
                f"{mixed_stage.summary(s.ranks, s.devices)} x{s.layers}{_stage_flags(s)}"
                f"{' off=' + s.offload if s.offload != 'none' else ''}"
                for s in p.stages
            )
            experts = "" if p.trains_experts is None else f" E={_ranges(p.trains_experts)}"
            lw = " layerwise" if p.execution != MICROBATCH else ""
            parts.append(f"[{stages}] m={p.num_microbatches}{experts}{lw}")
        zero = f"zero={self.zero} " if self.zero else ""
        moe = (f"ep={self.expert_parallel} " if self.expert_parallel != 1 else "") + (
            f"sync={self.sync_every_steps} " if self.sync_every_steps != 1 else ""
        )
        notes = "".join(f" (note: {n})" for n in self.notes())
        return f"mbs={self.micro_batch_size} {self.schedule} {zero}{moe}" + " ; ".join(parts) + notes

    # -- experts (MoE plans) -------------------------------------------------------------------------
    def expert_groups(self) -> tuple[tuple[int, ...], ...]:
        """Pipelines of each expert-parallel group: consecutive runs of ``expert_parallel`` replicas."""
        g = self.expert_parallel
        n = len(self.pipelines)
        return tuple(tuple(range(i, min(i + g, n))) for i in range(0, n, g))

    @property
    def spes(self) -> bool:
        """Replicas train locally between syncs (SPES, ``sync_every_steps > 1``) or train expert subsets."""
        return self.sync_every_steps > 1 or any(p.trains_experts is not None for p in self.pipelines)


def _ranges(indices: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"``."""
    out, run = [], []
    for i in sorted(indices):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out) or "-"


def _expert_set(trains: tuple[int, ...] | None) -> frozenset[int] | None:
    return None if trains is None else frozenset(trains)


def _trains_experts_from(raw: Any, source: str, p: int) -> tuple[int, ...] | None:
    if raw == "all":
        return None
    if not isinstance(raw, list):
        raise SpecError(
            source, f"pipelines[{p}].trains_experts", f'must be "all" or a list of expert indices, got {shown(raw)}'
        )
    return tuple(raw)


def _field(p: int, s: int, stage: StageConfig) -> str:
    """The field naming stage ``s`` of pipeline ``p``'s devices (built only for an error)."""
    return f"pipelines[{p}].stages[{s}]." + ("ranks" if stage.ranks else "devices")


def _validate_expert_plan(config: ParallelConfig, model: ModelSpec, source: str) -> None:
    """The plan rules of MoE plans: expert parallelism, trained expert subsets, SPES sync (SPEC.md
    "Extensions"). Expert-parallel groups are consecutive runs of ``expert_parallel`` replicas; every
    all-to-all needs all of a group's replicas, so they must have the same shape and batch."""
    g, n = config.expert_parallel, len(config.pipelines)
    E = model.num_experts
    if g > 1:
        if not model.is_moe:
            raise SpecError(
                source,
                "expert_parallel",
                f"{g} needs a mixture-of-experts model (num_experts > 0); model {model.name!r} is dense",
            )
        if E % g:
            raise SpecError(
                source,
                "expert_parallel",
                f"{g} must divide num_experts={E} (each of a group's "
                f"replicas holds num_experts / expert_parallel experts)",
            )
        if n % g:
            raise SpecError(
                source, "expert_parallel", f"{g} must divide the number of data-parallel replicas (pipelines), {n}"
            )
        for group in config.expert_groups():
            first = config.pipelines[group[0]]
            shape = [(s.layers, s.tp) for s in first.stages]
            for p in group[1:]:
                pipe = config.pipelines[p]
                if [(s.layers, s.tp) for s in pipe.stages] != shape:
                    raise SpecError(
                        source,
                        f"pipelines[{p}].stages",
                        f"replicas of one expert-parallel group (pipelines {group[0]}..{group[-1]}) "
                        f"need the same stages (layers, tensor-parallel degree): "
                        f"{[(s.layers, s.tp) for s in pipe.stages]} != {shape} in pipelines[{group[0]}]",
                    )
                if pipe.num_microbatches != first.num_microbatches:
                    raise SpecError(
                        source,
                        f"pipelines[{p}].num_microbatches",
                        f"replicas of one expert-parallel group (pipelines {group[0]}..{group[-1]}) "
                        f"need the same num_microbatches: {pipe.num_microbatches} != "
                        f"{first.num_microbatches} in pipelines[{group[0]}]",
                    )
                if _expert_set(pipe.trains_experts) != _expert_set(first.trains_experts):
                    raise SpecError(
                        source,
                        f"pipelines[{p}].trains_experts",
                        f"replicas of one expert-parallel group (pipelines {group[0]}..{group[-1]}) "
                        "train one set of experts together: give them the same list",
                    )
    subsets = [(p, pipe.trains_experts) for p, pipe in enumerate(config.pipelines) if pipe.trains_experts is not None]
    if subsets:
        if not model.is_moe:
            raise SpecError(
                source,
                f"pipelines[{subsets[0][0]}].trains_experts",
                f"needs a mixture-of-experts model (num_experts > 0); model {model.name!r} is dense: "
                'leave it out or give "all"',
            )
        for p, te in subsets:
            bad = [e for e in te if e >= E]
            if bad:
                raise SpecError(
                    source,
                    f"pipelines[{p}].trains_experts",
                    f"expert index {bad[0]} out of range: model {model.name!r} has num_experts={E} "
                    f"(indices 0..{E - 1})",
                )
        covered: set[int] = set()
        for pipe in config.pipelines:
            covered |= set(range(E)) if pipe.trains_experts is None else set(pipe.trains_experts)
        missing = sorted(set(range(E)) - covered)
        if missing:
            raise SpecError(
                source,
                "trains_experts",
                f"expert(s) {_ranges(tuple(missing))} are trained by no "
                "replica: together the replicas must cover every expert",
            )
    if config.sync_every_steps > 1 and len(config.expert_groups()) < 2:
        raise SpecError(
            source,
            "sync_every_steps",
            f"{config.sync_every_steps} needs at least two replicas (expert-parallel groups) to "
            f"synchronise, the plan has {len(config.expert_groups())}",
        )


def _stage_flags(stage: StageConfig) -> str:
    """The recompute flag (``recompute.flag``), `` SP`` sequence parallel (``describe``)."""
    return recompute_flag(stage.recompute) + (" SP" if stage.sequence_parallel else "")


def iter_stages(config: ParallelConfig) -> Iterator[tuple[int, int, StageConfig]]:
    for p, pipe in enumerate(config.pipelines):
        for s, stage in enumerate(pipe.stages):
            yield p, s, stage
