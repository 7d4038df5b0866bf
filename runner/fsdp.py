"""ZeRO-2/3 by torch's FSDP2 (``fully_shard``) where the replicas are even.

Where every pipeline splits the layers alike, runs the same micro-batches on the same share of the batch and
keeps its weights on the device (no offload, no mixed stages, no MoE, no layer-wise execution, one
tensor-parallel degree of 1), the ranks holding a stage's layers reach each layer in one order, and ZeRO is
what torch's FSDP2 does: each transformer block, the embedding and the final norm with the LM head are one
``fully_shard`` unit over the stage's data-parallel ranks (torchtitan's wrapping), the rest of a chunk (a tied
embedding, learned positions) its root unit. Every other sharded plan runs on ``runner.zero`` (docs/runner.md
says why FSDP2 does not fit those).

Per micro-batch, as ``autotune.simulator.zero`` counts ZeRO (and not as ``torch.distributed.pipelining``
drives FSDP by default, reducing once per step with the whole gradient accumulated on the device): every
unit's gradient is reduce-scattered after its backward (``set_requires_gradient_sync(True)`` each backward,
``FsdpStage``); zero 3 frees the gathered weights after each forward and backward
(``reshard_after_forward``), zero 2 keeps them whole until the step's last backward, so they are gathered
once per step. FSDP2 averages the gradient over the stage's ranks, which is the replicas' weighting when
their shares are equal; the schedule's ``scale_grads`` averages the micro-batches.

Checkpoints are the model's and the optimizer's sharded DTensors (``get_state_dict`` / ``dcp``), each rank
writing its shards, as without ZeRO."""

from __future__ import annotations

from torch import nn

from runner.layout import Layout, replicas_out_of_step


def fsdp_misfit(layout: Layout) -> str | None:
    """Why FSDP2 does not run this sharded plan's ZeRO (``runner.zero`` does), or None where it does."""
    ranks = layout.ranks
    if layout.zero not in (2, 3):
        return f"zero {layout.zero} (FSDP2 shards the weights and gradients: zero 2 / 3)"
    if any(r.offload != "none" for r in ranks):
        return "CPU offload"
    if layout.mixed or any(r.layerwise for r in ranks):
        return "mixed stages or layer-wise execution (their ranks run different micro-batch counts)"
    if layout.sync_every_steps > 1 or any(r.moe_layers or r.trains_experts is not None for r in ranks):
        return "MoE blocks (each expert is trained by its own ranks)"
    if any(r.tp_degree > 1 for r in ranks):
        return "tensor parallelism"
    if replicas_out_of_step(layout) or len({(r.num_microbatches, r.batch_size) for r in ranks}) > 1:
        return "replicas of other layer splits, micro-batch counts or batch shares"
    return None


def stage_groups(layout: Layout) -> tuple[tuple[int, ...], ...]:
    """Per stage, the ranks holding its layers (its chunks, with virtual stages), one per pipeline."""
    groups: dict[int, list[int]] = {}
    for r in sorted(layout.ranks, key=lambda r: (r.pipeline, r.rank)):
        groups.setdefault(r.stage, []).append(r.rank)
    return tuple(tuple(v) for _, v in sorted(groups.items()))


def shard_chunks(chunks: list, layout: Layout, rank: int, device_type: str) -> None:
    """``fully_shard`` this rank's chunks over their stage's data-parallel ranks (every rank creates every
    group, in one order)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mine = None
    for ranks in stage_groups(layout):
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = group
    mesh = DeviceMesh.from_group(mine, device_type)
    reshard = layout.zero >= 3
    for chunk in chunks:
        for unit in units_of(chunk):
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(chunk, mesh=mesh, reshard_after_forward=reshard)


def units_of(chunk) -> list[nn.Module | list[nn.Module]]:
    """A chunk's FSDP units but its root: each block, the embedding, the final norm with an untied head (a
    tied head multiplies by the embedding, so both stay in the root unit, gathered for the whole forward)."""
    units: list[nn.Module | list[nn.Module]] = list(chunk.blocks.values())
    tied = chunk.head is not None and not isinstance(chunk.head, nn.Linear)
    if chunk.embed is not None and not tied:
        units.insert(0, chunk.embed)
    if chunk.head is not None and not tied:
        units.append([chunk.norm, chunk.head])
    return units
