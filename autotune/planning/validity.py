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
