"""The part of a plan a mainstream training engine can express: one grid of identical replicas.

torchtitan, Megatron-LM and DeepSpeed place every rank on a ``dp x pp x tp`` grid: every data-parallel
replica is the same pipeline (same stages, same layers per stage, same micro-batches), every stage has
the same tensor-parallel degree, and one activation-checkpointing, sequence-parallel, ZeRO and offload
setting holds for all. ``grid_of`` reads that grid from a plan, or names in one line the part of the plan
no such engine can run (uneven batch shares across replicas, mixed-GPU stages, per-stage tp, RoundPipe,
SPES). Each engine's module adds its own rules (``autotune.engines.<engine>.refusal``).
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.errors import SpecError
from autotune.specs import ParallelConfig


class Inexpressible(SpecError):
    """A plan (part) an engine cannot run; the message names the part."""

    def __init__(self, engine: str, rule: str) -> None:
        super().__init__(engine, "", rule)


@dataclass(frozen=True, slots=True)
class EngineGrid:
    """A plan as an engine's grid. ``chunk_layers``: the blocks of each model chunk in virtual-stage order
    (chunk ``c`` of stage ``s`` is entry ``c * pp + s``; ``vpp == 1``: one entry per stage)."""

    dp: int
    pp: int
    tp: int
    vpp: int
    micro_batch_size: int
    num_microbatches: int  # per replica and step (gradient accumulation)
    chunk_layers: tuple[int, ...]
    schedule: str  # 1f1b | gpipe | interleaved-1f1b
    recompute: bool | str = False  # a mode of autotune.specs.recompute
    sequence_parallel: bool = False
    zero: int = 0
    offload: str = "none"
    expert_parallel: int = 1

    @property
    def global_batch_size(self) -> int:
        return self.dp * self.micro_batch_size * self.num_microbatches

    @property
    def stage_layers(self) -> tuple[int, ...]:
        """Blocks each pipeline stage holds (its chunks together)."""
        return tuple(sum(self.chunk_layers[c * self.pp + s] for c in range(self.vpp)) for s in range(self.pp))

    @property
    def even_layers(self) -> bool:
        return len(set(self.chunk_layers)) == 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp


def _split(layers: tuple[int, ...]) -> str:
    return "/".join(str(n) for n in layers)


def grid_of(config: ParallelConfig, engine: str) -> EngineGrid:
    """``config`` as a grid; ``Inexpressible`` naming the part ``engine`` (its display name) cannot run."""
    if config.is_roundpipe:
        raise Inexpressible(
            engine, f"RoundPipe's round-robin dispatch (schedule roundpipe): {engine} has no such schedule"
        )
    if config.sync_every_steps > 1 or any(p.trains_experts is not None for p in config.pipelines):
        raise Inexpressible(
            engine, f"SPES (replicas training expert subsets, synchronised every few steps): {engine} has no such mode"
        )
    first = config.pipelines[0]
    for p, pipe in enumerate(config.pipelines):
        if pipe.execution != "microbatch":
            raise Inexpressible(
                engine, f"pipeline {p} runs Zorse's layer-wise execution: {engine} runs one micro-batch at a time"
            )
        for s, stage in enumerate(pipe.stages):
            if stage.ranks:
                shares = "/".join(str(r.num_microbatches) for r in stage.ranks)
                raise Inexpressible(
                    engine,
                    f"stage {s} of pipeline {p} is a mixed-GPU stage of {len(stage.ranks)} data-parallel ranks "
                    f"(micro-batch shares {shares}): {engine} gives every rank of a stage the same batch",
                )
        if pipe.num_microbatches != first.num_microbatches:
            raise Inexpressible(
                engine,
                f"replica {p} has {pipe.num_microbatches} micro-batches, replica 0 has {first.num_microbatches}: "
                f"{engine} gives every replica the same",
            )
        layers = tuple(st.layers for st in pipe.stages)
        if layers != tuple(st.layers for st in first.stages):
            raise Inexpressible(
                engine,
                f"replica {p} splits the layers {_split(layers)}, replica 0 {_split(tuple(st.layers for st in first.stages))}: "
                f"{engine} runs one pipeline layout for every replica",
            )
        tps = tuple(st.tp for st in pipe.stages)
        if len(set(tps)) > 1:
            raise Inexpressible(
                engine,
                f"replica {p} has tensor-parallel degrees {_split(tps)} over its stages: {engine} has one "
                "tensor-parallel degree",
            )
        if tps[0] != first.stages[0].tp:
            raise Inexpressible(
                engine,
                f"replica {p} has tensor-parallel degree {tps[0]}, replica 0 {first.stages[0].tp}: {engine} has "
                "one tensor-parallel degree",
            )
    stages = [st for pipe in config.pipelines for st in pipe.stages]
    for what, values in (
        ("activation checkpointing", {repr(st.recompute) for st in stages}),
        ("offload", {st.offload for st in stages}),
        ("sequence parallelism", {st.sequence_parallel and st.tp > 1 for st in stages}),
    ):
        if len(values) > 1:
            raise Inexpressible(
                engine, f"stages differ in {what} ({', '.join(sorted(map(str, values)))}): {engine} sets it for all"
            )
    v = config.virtual_stages
    chunks = tuple(st.layers // v for _ in range(v) for st in first.stages)
    return EngineGrid(
        dp=len(config.pipelines),
        pp=len(first.stages),
        tp=first.stages[0].tp,
        vpp=v,
        micro_batch_size=config.micro_batch_size,
        num_microbatches=first.num_microbatches,
        chunk_layers=chunks,
        schedule=config.schedule if len(first.stages) > 1 else "1f1b",  # one stage: no pipeline schedule
        recompute=first.stages[0].recompute,
        sequence_parallel=first.stages[0].sequence_parallel and first.stages[0].tp > 1,
        zero=config.zero,
        offload=first.stages[0].offload,
        expert_parallel=config.expert_parallel,
    )


def rank_devices(config: ParallelConfig, grid: EngineGrid) -> tuple[str, ...]:
    """The device each global rank must run on, in Megatron-LM's and torchtitan's order (tensor-parallel
    fastest, then data-parallel, then pipeline): rank ``tp_i + tp * (dp_i + dp * pp_i)``."""
    out = []
    for s in range(grid.pp):
        for pipe in config.pipelines:
            out.extend(pipe.stages[s].devices)
    return tuple(out)
