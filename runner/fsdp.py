"""ZeRO-1/2/3 by torch's FSDP2 (``fully_shard``) where the replicas' collectives pair up.

Where every pipeline splits the layers alike and runs the same micro-batch count (zero 1 on one-device stages
without interleaving or MoE: any splits and counts) and offloads a stage alike (nothing, or with zero 3
everything: FSDP2's ``CPUOffloadPolicy``; no mixed stages, no layer-wise execution, no SPES subsets or periods,
no MoE block split by tensor parallelism), the ranks holding a stage's layers reach each layer in one order, and ZeRO is what torch's FSDP2 does: each transformer block, the
embedding and the final norm with the LM head are one ``fully_shard`` unit over the stage's data-parallel ranks
(torchtitan's wrapping; with tensor parallelism over the ``dp`` dimension of a ``dp`` x ``tp`` mesh, sharding the
DTensor weights further), the rest of a chunk (a tied embedding, learned positions) its root unit. Under expert
parallelism an MoE block's held experts are one more unit, inside the block's, over the ranks that hold them
(one per expert-parallel group: torchtitan's ``dp_shard_mod_ep``); a holder's expert gradient sums the tokens of
its whole group, so the unit divides by the stage's data-parallel size, not its own mesh's
(``set_gradient_divide_factor``), and every held expert runs on every micro-batch (``runner.moe.setup_experts``)
so that every holder makes the unit's collectives. Every other sharded plan runs on ``runner.zero`` (docs/runner.md says why FSDP2 does not fit
those).

Per micro-batch, as ``autotune.simulator.zero`` counts ZeRO (and not as ``torch.distributed.pipelining``
drives FSDP by default, reducing once per step with the whole gradient accumulated on the device): every
unit's gradient is reduce-scattered after its backward (``runner.engine.TimedStage.backward_maybe_with_nosync``);
zero 3 frees the gathered weights after each forward and backward (``reshard_after_forward``), zero 2 keeps
them whole until the step's last backward, so they are gathered once per step. Zero 1 is FSDP2 with gradient
synchronisation off until the step's last backward (``set_requires_gradient_sync``): the whole gradient
accumulates on the device, as ZeRO-1 keeps it, and is reduce-scattered once; the weights are gathered once per
step and kept whole until then. Its step's collectives are ZeRO-1's (one reduce-scatter, one all-gather: an
all-reduce's bytes) and its peak holds what ZeRO-1 holds (whole weights and gradients, the optimizer state's
shard); between steps the weights rest sharded, which ZeRO-1 does not do (less memory, never more). FSDP2 averages the gradient
over the stage's ranks, which is the replicas' weighting when their shares are equal; the schedule's
``scale_grads`` averages the micro-batches. Zero 1 over replicas of different micro-batch counts (uneven batch
shares, the heterogeneous case; one device per stage, no interleaving or MoE: untested there) makes the same
collectives once per step on every rank, so it runs on FSDP2 too: each micro-batch's loss is weighted by its part of the global batch (``loss_scale``) and the schedule does not
divide. Replicas of other layer splits (zero 1, one device per stage, no interleaving or MoE) shard each unit over
its own weight key's holders, one rank per replica at whatever pipeline position (``key_meshes``): a group then
holds one layer, and each holder gathers it at its first forward and reduce-scatters it at its last backward, so
every group's calls pair up and no rank waits on a group whose lower layers (forward) or higher layers (backward)
are not done. Zero 2 / 3 reduce-scatter per micro-batch (zero 3 also gathers per use), so replicas of other
counts or splits would not pair their calls, or would wait on each other's schedules (``runner.zero`` pads them
and issues them without waiting).

Checkpoints are the model's and the optimizer's sharded DTensors (``get_state_dict`` / ``dcp``), each rank
writing its shards, as without ZeRO."""

from __future__ import annotations

from torch import nn

from runner.layout import EMBED_KEY, HEAD_KEY, Layout, splits_differ


def fsdp_misfit(layout: Layout) -> str | None:
    """Why FSDP2 does not run this sharded plan's ZeRO (``runner.zero`` does), or None where it does."""
    ranks = layout.ranks
    if any(r.offload == "optimizer" for r in ranks):
        return "optimizer-only offload; FSDP2 offloads all or nothing"
    if layout.zero not in (1, 2, 3):
        return f"zero {layout.zero} (nothing sharded)"
    if layout.zero != 3 and any(r.offload == "all" for r in ranks):
        return f"offload all with zero {layout.zero}; FSDP2 offloads sharded weights, zero 3"
    if len({(r.stage, r.offload) for r in ranks}) > len({r.stage for r in ranks}):
        return "replicas offloading a stage differently"
    if layout.mixed or any(r.layerwise for r in ranks):
        return "mixed stages or layer-wise execution (their ranks run different micro-batch counts)"
    if layout.sync_every_steps > 1 or any(not r.trains(k) for r in ranks for k in r.holds()):
        return "SPES (experts trained by some of their holders, or averaged every few steps)"
    if any(r.moe_layers and r.tp_degree > 1 for r in ranks):
        return "MoE blocks split by tensor parallelism (runner.moe splits each expert itself)"
    if len({(r.stage, r.tp_degree) for r in ranks}) > len({r.stage for r in ranks}):
        return "replicas sharding a stage at different tensor-parallel degrees"
    if splits_differ(layout) or len({r.num_microbatches for r in ranks}) > 1:
        what = "replicas of other layer splits or micro-batch counts"
        if layout.zero != 1:  # a reduce-scatter per micro-batch (zero 3: a gather per use) at other positions
            return f"zero {layout.zero} over {what} (their collectives per micro-batch)"
        if any(len(r.chunks) > 1 or r.tp_degree > 1 or r.moe_layers for r in ranks):  # not tested there
            return f"interleaved, tensor-parallel or MoE {what}"
    return None


def loss_scale(layout: Layout) -> float | None:
    """Zero 1 over replicas of other micro-batch counts: what every micro-batch's mean loss is multiplied by
    before its backward, ``P * micro_batch_size / B`` over ``P`` replicas and the global batch ``B`` (the same on
    every rank), in place of the schedule's division by its own micro-batch count (``scale_grads``), which after
    FSDP2's reduce-scatter would divide each shard by its holder's count. FSDP2's average over the ``P`` replicas
    then gives the global batch's gradient, ``sum_p (B_p / B) grad_p``. None where the counts agree (the schedule
    divides, FSDP2 averages: equal shares)."""
    ranks = layout.ranks
    if len({r.num_microbatches for r in ranks}) < 2:
        return None
    shares = {r.pipeline: r.batch_size for r in ranks}
    return len(shares) * (ranks[0].batch_size // ranks[0].num_microbatches) / sum(shares.values())


def stage_groups(layout: Layout) -> tuple[tuple[int, ...], ...]:
    """Per stage and tensor-parallel index, the ranks holding those layers (the stage's chunks, with virtual
    stages) and that shard of them, one per pipeline: the data-parallel groups FSDP2 shards over."""
    return _ranks_by(layout, lambda r: (r.stage, r.tp_index))


def _ranks_by(layout: Layout, key, keep=lambda r: True) -> tuple[tuple[int, ...], ...]:
    """The ranks ``keep`` takes, grouped by ``key(rank plan)``, each group in pipeline order, the groups by key."""
    groups: dict[tuple, list[int]] = {}
    for r in sorted(layout.ranks, key=lambda r: (r.pipeline, r.rank)):
        if keep(r):
            groups.setdefault(key(r), []).append(r.rank)
    return tuple(tuple(v) for _, v in sorted(groups.items()))


def _my_group(groups: tuple[tuple[int, ...], ...], rank: int):
    """A process group for each of ``groups`` (every rank creates every one, in one order); ``rank``'s, or None."""
    import torch.distributed as dist

    mine = None
    for ranks in groups:
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = group
    return mine


def stage_mesh(layout: Layout, rank: int, device_type: str, tp_group=None):
    """This rank's stage as a device mesh: ``dp`` (its data-parallel group, one rank per pipeline) by ``tp`` (its
    tensor-parallel group, where the stage has one), so that FSDP2 shards the tensor-parallel DTensors over
    ``dp`` (both meshes one root, as FSDP2 needs). Every rank creates every data-parallel group, in one order."""
    from torch.distributed.device_mesh import DeviceMesh

    mine = _my_group(stage_groups(layout), rank)
    if tp_group is None:
        return DeviceMesh.from_group(mine, device_type, mesh_dim_names=("dp",))
    me = layout.ranks[rank]
    grid: dict[int, list[tuple[int, int]]] = {}
    for r in layout.ranks:
        if r.stage == me.stage:
            grid.setdefault(r.pipeline, []).append((r.tp_index, r.rank))
    mesh = [[rank_ for _, rank_ in sorted(row)] for _, row in sorted(grid.items())]
    return DeviceMesh.from_group([mine, tp_group], device_type, mesh=mesh, mesh_dim_names=("dp", "tp"))


def key_meshes(layout: Layout, rank: int, device_type: str) -> dict:
    """Where the replicas split the layers otherwise (zero 1 on one-device stages: ``fsdp_misfit``),
    for each weight key this rank holds, the mesh of that key's holders, one rank per replica
    (``Layout.grad_groups``): FSDP2 shards the key's unit over it. Empty where they split alike (every unit over
    its stage's mesh, ``stage_mesh``). Every rank creates every group, in one order."""
    from torch.distributed.device_mesh import DeviceMesh

    if not splits_differ(layout):
        return {}
    mine = {}
    for ranks, keys in layout.grad_groups().items():
        group = _my_group((ranks,), rank)
        if group is not None:
            mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=("dp",))
            mine.update(dict.fromkeys(keys, mesh))
    return mine


def expert_groups(layout: Layout) -> tuple[tuple[int, ...], ...]:
    """Under expert parallelism, per stage and held experts, the ranks holding those experts, one per
    expert-parallel group: the data-parallel groups FSDP2 shards the experts over (none without it)."""
    return _ranks_by(
        layout, lambda r: (r.stage, r.tp_index, r.held_experts or ()), lambda r: r.moe_layers and r.expert_parallel > 1
    )


def expert_mesh(layout: Layout, rank: int, device_type: str):
    """This rank's expert data-parallel mesh (``edp``: the ranks holding its experts, ``expert_groups``), or
    None where it holds no expert-parallel MoE block. Every rank creates every group, in one order."""
    from torch.distributed.device_mesh import DeviceMesh

    mine = _my_group(expert_groups(layout), rank)
    return None if mine is None else DeviceMesh.from_group(mine, device_type, mesh_dim_names=("edp",))


def shard_chunks(chunks: list, mesh, zero: int, offload: str = "none", experts=None, by_key=None) -> None:
    """``fully_shard`` this rank's chunks over ``mesh``'s data-parallel dimension (``stage_mesh``); with
    ``offload`` ``all`` (zero 3) under FSDP2's ``CPUOffloadPolicy``: the weights' shards, the gradients' and the
    optimizer state in host memory, each unit's shards copied to the device for its gather, the step on the CPU.
    ``experts`` (``expert_mesh``): the held experts of each MoE block are one unit over it, inside the block's.
    ``by_key`` (``key_meshes``, replicas of other layer splits): each unit over its weight key's holders, the
    chunk's root (no weights of its own there but learned positions, held by every first stage) over ``mesh``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    dp = mesh["dp"] if mesh.ndim > 1 else mesh
    policy = CPUOffloadPolicy(pin_memory=dp.device_type == "cuda") if offload == "all" else OffloadPolicy()
    for chunk in chunks:
        for key, unit in units_of(chunk):
            held = getattr(getattr(unit, "mlp", None), "experts", None) if experts is not None else None
            if held:  # its holder's gradient sums its expert-parallel group's tokens: averaged over dp, not edp
                fully_shard(list(held.values()), mesh=experts, reshard_after_forward=zero >= 3, offload_policy=policy)
                unit_ = next(iter(held.values()))
                unit_.set_gradient_divide_factor(float(dp.size()))
                # gloo has no PREMUL_SUM: a sum, then the division; not on a mesh of one rank, where torch 2.13
                # already divides as it copies (forcing the sum there divides twice)
                unit_.set_force_sum_reduction_for_comms(experts.device_type != "cuda" and experts.size() > 1)
            fully_shard(
                unit, mesh=by_key[key] if by_key else dp, reshard_after_forward=zero >= 3, offload_policy=policy
            )
        fully_shard(chunk, mesh=dp, reshard_after_forward=zero >= 3, offload_policy=policy)


def tp_copies(params, tp_degree: int) -> dict:
    """How many ranks hold each element of each FSDP2 shard (its share of the clipping norm): one, or
    ``tp_degree`` for a weight the tensor-parallel ranks keep whole: replicated on the mesh's ``tp`` dimension,
    or not tensor-parallel at all (sharded over ``dp`` alone, the same shard on each tensor-parallel rank)."""
    copies = {}
    for p in params:
        split = p.device_mesh.ndim > 1 and p.placements[-1].is_shard()
        copies[p] = 1 if split else tp_degree
    return copies


def units_of(chunk) -> list[tuple[str, nn.Module | list[nn.Module]]]:
    """A chunk's FSDP units but its root, each with its weight key (``RankPlan.holds``): each block, the
    embedding, the final norm with an untied head (a tied head multiplies by the embedding, so both stay in the
    root unit, gathered for the whole forward)."""
    units: list[tuple[str, nn.Module | list[nn.Module]]] = [(f"layer{i}", b) for i, b in chunk.blocks.items()]
    tied = chunk.head is not None and not isinstance(chunk.head, nn.Linear)
    if chunk.embed is not None and not tied:
        units.insert(0, (EMBED_KEY, chunk.embed))
    if chunk.head is not None and not tied:
        units.append((HEAD_KEY, [chunk.norm, chunk.head]))
    return units
