"""Whether any plan (decoded, proposed by a planner, edited by the env, or a user's file) is a valid plan of
a search space: the plan's own rules (``ParallelConfig.validate``), the space's restriction to or away
from RoundPipe, the engine's refusals, tensor-parallel groups inside one node, and Megatron-LM's
interleaved schedule."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autotune.engines import check as engine_check
from autotune.errors import SpecError
from autotune.planning import roundpipe_space
from autotune.specs import ClusterSpec, ModelSpec, ParallelConfig


def check(
    cluster: ClusterSpec,
    model: ModelSpec,
    restrict: Mapping[str, Sequence[Any]],
    engine: str | None,
    config: ParallelConfig,
) -> str | None:
    """None when ``config`` is a valid plan of this cluster and model within ``restrict`` and ``engine``,
    else the broken rule."""
    try:
        config.validate(cluster, model)
    except SpecError as e:
        return f"{e.field}: {e.rule}" if e.field else e.rule
    outside = roundpipe_space.restriction(restrict, config)  # restrict={"roundpipe": [True]} or [False]
    if outside is None:
        outside = restriction(restrict, config)
    if outside is not None:
        return outside
    if engine is not None:
        refused = engine_check(engine, config)
        if refused is not None:
            return f"--engine {engine}: {refused}"
    for p, pipe in enumerate(config.pipelines):
        for s, stage in enumerate(pipe.stages):
            for k, rank in enumerate(stage.ranks_of(pipe.num_microbatches)):
                nodes = {cluster.node_of(d).name for d in rank.devices}
                if len(nodes) > 1:
                    where = f"pipelines[{p}].stages[{s}]" + (f".ranks[{k}]" if stage.ranks else "")
                    return f"{where}: TP group spans nodes {sorted(nodes)}"
            if stage.layers < 1:
                return f"pipelines[{p}].stages[{s}]: has no layers"
        if config.schedule == "interleaved-1f1b" and pipe.num_microbatches % len(pipe.stages):
            return (
                f"pipelines[{p}].num_microbatches: interleaved-1f1b needs a multiple of the "
                f"{len(pipe.stages)} stages, got {pipe.num_microbatches} (Megatron-LM)"
            )
    return None


def _recompute_modes(config: ParallelConfig) -> set[str]:
    """The recompute choices of a plan's stages, as the space names them (``none``, ``all``, a mode)."""
    return {f if isinstance(f, str) else ("all" if f else "none") for p in config.pipelines for f in _flags(p)}


def _flags(pipe) -> list:
    return [s.recompute for s in pipe.stages]


def restriction(restrict: Mapping[str, Sequence[Any]], config: ParallelConfig) -> str | None:
    """Why ``config`` lies outside ``restrict`` (``--restrict``), for the dimensions a plan shows directly:
    ``pp`` (every replica), ``mbs``, ``schedule``, ``recompute``, ``seq_parallel``, ``zero``, ``offload``,
    ``execution``, ``expert_parallel``, ``sync_every``. None when inside. A plan from the planner, a start or
    the user's file is held to the restriction as a sampled one is (``--restrict`` is never ignored)."""
    if not restrict:
        return None
    shown: dict[str, set[Any]] = {"mbs": {config.micro_batch_size}, "zero": {config.zero}}
    if config.is_roundpipe:  # its schedule is its own; it has no pipeline depth or stage settings to restrict
        shown["schedule"] = {config.schedule}
        for name in ("pp", "recompute", "offload", "seq_parallel"):
            if name in restrict:
                return f"--restrict {name}: a roundpipe plan has no such setting (restricted to pipeline plans)"
    else:
        stages = [s for p in config.pipelines for s in p.stages]
        shown.update(
            pp={len(p.stages) for p in config.pipelines},
            schedule={config.schedule},
            recompute=_recompute_modes(config),
            offload={s.offload for s in stages},
            execution={p.execution for p in config.pipelines},
            expert_parallel={config.expert_parallel},
            sync_every={config.sync_every_steps},
        )
        split = {s.sequence_parallel for s in stages if s.tp > 1}
        if split:
            shown["seq_parallel"] = split
    for name, allowed in restrict.items():
        values = shown.get(name)
        if values is None:
            continue
        if name == "recompute" and "low-memory" in allowed:  # its stages are on or off
            allowed = [*allowed, "none", "all"]
        if not values <= set(allowed):
            got = ",".join(str(v) for v in sorted(values, key=str))
            return f"--restrict {name}={','.join(map(str, allowed))}: the plan has {name} {got}"
    return None
