"""A plan's flat, MLflow-friendly parameters (``SearchSpace.params_of``): the same columns for every plan,
whoever proposed it."""

from __future__ import annotations

from typing import Any

from autotune.planning import mixed_space, roundpipe_space
from autotune.specs import ClusterSpec, ModelSpec, ParallelConfig
from autotune.specs.recompute import label as recompute_label


def params_of(cluster: ClusterSpec, model: ModelSpec, config: ParallelConfig) -> dict[str, Any]:
    """Flat, MLflow-friendly parameters of any plan (also those not from ``decode``)."""
    if config.is_roundpipe:
        return dict(roundpipe_space.params_of(config), devices_idle=cluster.num_devices - len(config.devices))
    pipes = config.pipelines
    return {
        "dp": len(pipes),
        "pp": ",".join(sorted({str(len(p.stages)) for p in pipes})),
        "tp": ",".join(sorted({str(s.tp) for p in pipes for s in p.stages})),
        "mbs": config.micro_batch_size,
        "schedule": config.schedule,
        "layers": "|".join("-".join(str(s.layers) for s in p.stages) for p in pipes),
        "microbatches": "-".join(str(p.num_microbatches) for p in pipes),
        "recompute_stages": sum(s.full_recompute for p in pipes for s in p.stages),
        "selective_stages": sum(s.selective_recompute for p in pipes for s in p.stages),
        "recompute": ",".join(sorted({recompute_label(s.recompute) or "none" for p in pipes for s in p.stages})),
        "seq_parallel_stages": sum(s.sequence_parallel and s.tp > 1 for p in pipes for s in p.stages),
        "zero": config.zero,
        "offload": ",".join(sorted({s.offload for p in pipes for s in p.stages})),
        "execution": ",".join(sorted({p.execution for p in pipes})),
        "devices_used": len(config.devices),
        "devices_idle": cluster.num_devices - len(config.devices),
        **(_moe_params_of(config) if model.is_moe else {}),
        **mixed_space.params_of(config),
    }


def _moe_params_of(config: ParallelConfig) -> dict[str, Any]:
    subsets = [p.trains_experts for p in config.pipelines]
    return {
        "expert_parallel": config.expert_parallel,
        "sync_every_steps": config.sync_every_steps,
        "trains_experts": "all"
        if all(t is None for t in subsets)
        else "|".join(",".join(map(str, t)) if t is not None else "all" for t in subsets),
    }
