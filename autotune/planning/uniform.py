"""The heterogeneity-blind baseline of ``--method uniform``: the grid a Megatron-LM or DeepSpeed user of a
homogeneous cluster would set by hand."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from autotune.planning.vocabulary import SpaceContext, powers_of_two_upto, valid_tp
from autotune.specs import ParallelConfig, PipelineConfig, StageConfig


def uniform_plans(ctx: SpaceContext, check: Callable[[ParallelConfig], str | None]) -> list[ParallelConfig]:
    """The heterogeneity-blind baseline grid (SPEC.md ``--method uniform``).

    One TP degree for every stage, pp dividing num_layers (even layers), every replica identical
    and fed an equal share of the batch, devices taken in cluster order as a homogeneous-cluster
    user would (Megatron-style tp/pp/dp flags), recompute off, full or (where the space has it)
    selective everywhere, sequence parallelism off or on (tp > 1), schedule 1f1b. Devices that do not
    fill a TP group or a whole replica stay idle. The ZeRO stage (with replicas) and the offload
    mode are grid dimensions too, the same on every stage, as a DeepSpeed user sets them.
    """
    model, cluster, dims = ctx.model, ctx.cluster, ctx.dims
    tps = [t for t in powers_of_two_upto(max(n.count for n in cluster.nodes)) if valid_tp(model, t)]
    mbs_choices = dims["mbs"].choices
    recompute = [
        {"none": False, "all": True, "selective": "selective"}[r]
        for r in dims["recompute"].choices
        if r in ("none", "all", "selective")
    ]
    sps = dims["seq_parallel"].choices if "seq_parallel" in dims else (False,)
    zeros, offloads = dims["zero"].choices, dims["offload"].choices
    plans, seen = [], set()
    for tp in tps:
        groups = [node.device_ids()[g * tp : (g + 1) * tp] for node in cluster.nodes for g in range(node.count // tp)]
        for pp in range(1, min(len(groups), model.num_layers) + 1):
            if model.num_layers % pp:
                continue
            dp = len(groups) // pp
            # MoE: Megatron's --expert-model-parallel-size, every replica training every expert each step
            eps = [g for g in dims["expert_parallel"].choices if dp % g == 0] if "expert_parallel" in dims else [1]
            for mbs in mbs_choices:
                if model.global_batch_size % (mbs * dp):
                    continue
                per_replica = model.global_batch_size // (mbs * dp)
                for rc, ep, sp, zero, offload in itertools.product(
                    recompute, eps, sps if tp > 1 else (False,), zeros if dp > 1 else zeros[:1], offloads
                ):
                    pipes = tuple(
                        PipelineConfig(
                            per_replica,
                            tuple(
                                StageConfig(
                                    groups[r * pp + s], model.num_layers // pp, rc, offload, sequence_parallel=sp
                                )
                                for s in range(pp)
                            ),
                        )
                        for r in range(dp)
                    )
                    config = ParallelConfig(mbs, pipes, "1f1b", zero=zero, expert_parallel=ep)
                    if config not in seen and check(config) is None:
                        seen.add(config)
                        plans.append(config)
    return plans
