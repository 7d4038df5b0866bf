"""Which rank does what: a ``ParallelConfig`` turned into one ``RankPlan`` per rank (pure Python, no torch).

Rank order is the config's device order: pipelines in order, their stages in order, each stage's
devices in order (``ParallelConfig.devices``). So rank ``r`` runs device ``config.devices[r]``.

Pipelines are data-parallel replicas. Pipeline ``p`` takes ``num_microbatches * micro_batch_size``
consecutive sequences of the global batch, starting after those of pipelines ``0..p-1``; its
gradients are weighted by its share of the global batch before they are summed, so the update is
the one a single process makes on the whole global batch (loss = mean over all its tokens).

A stage of several data-parallel ranks (Zorse, ``ranks``) gives each of its ranks its own ``stage_rank``
and ``share`` of the pipeline's micro-batches; a plan with such a stage runs on ``runner.mixed`` (every
pipeline of it), which weights each micro-batch's loss by its part of the global batch instead.

With ``interleaved-1f1b`` and ``virtual_stages = v`` each stage's layers split into ``v`` equal
chunks placed Megatron-style: virtual stage ``c * S + s`` (chunk ``c`` of stage ``s`` of ``S``)
holds the next ``layers_s / v`` blocks, so a rank's chunks are not contiguous in the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.errors import SpecError
from autotune.simulator.engine_terms import vocab_split
from autotune.specs import ClusterSpec, ModelSpec, ParallelConfig
from autotune.specs.execution import LAYERWISE

EMBED_KEY, HEAD_KEY = "embed", "head"
#: the part of a key that replicas shard at different tensor-parallel degrees which every holder keeps whole
#: (norms, row-parallel biases; ``runner.reshard``)
WHOLE_PART = -1


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """One (virtual) pipeline stage held by a rank."""

    stage_index: int  # virtual stage index in its pipeline, 0..num_stages-1
    num_stages: int  # virtual stages of the pipeline (stages x virtual_stages)
    layers: tuple[int, ...]  # global block indices, in model order

    @property
    def first(self) -> bool:
        return self.stage_index == 0

    @property
    def last(self) -> bool:
        return self.stage_index == self.num_stages - 1


@dataclass(frozen=True, slots=True)
class RankPlan:
    rank: int
    device_id: str
    pipeline: int
    stage: int  # physical stage index in the pipeline
    tp_index: int
    tp_degree: int
    chunks: tuple[ChunkPlan, ...]
    recompute: bool | str  # a mode of autotune.specs.recompute
    slowdown: float
    num_microbatches: int
    batch_offset: int  # first sequence of this pipeline in the global batch
    batch_size: int  # sequences this pipeline takes per step
    grad_weight: float  # batch_size / global batch size
    # mixture of experts (runner.moe): MoE blocks of this rank's chunks, the experts it holds and trains
    # (None = all), its expert-parallel group (index and this rank's position in it, group size)
    moe_layers: tuple[int, ...] = ()
    held_experts: tuple[int, ...] | None = None
    trains_experts: tuple[int, ...] | None = None
    expert_group: int = 0
    expert_position: int = 0
    expert_parallel: int = 1
    sequence_parallel: bool = False  # Megatron sequence parallelism in this rank's tensor-parallel group
    # mixed stages (runner.mixed): this rank's index among its stage's data-parallel ranks, and its share
    # of the pipeline's micro-batches (num_microbatches for a stage of one rank)
    stage_rank: int = 0
    share: int = 0
    offload: str = "none"  # the stage's CPU offload (runner.zero)
    layerwise: bool = False  # the pipeline runs Zorse's layer-wise execution (runner.layerwise)

    @property
    def first(self) -> bool:
        return any(c.first for c in self.chunks)

    @property
    def last(self) -> bool:
        return any(c.last for c in self.chunks)

    def holds(self) -> tuple[str, ...]:
        """Keys of the weights this rank holds: ``embed``, ``layer<i>`` (an MoE block's shared part),
        ``layer<i>.expert<e>`` (each expert of an MoE block it holds), ``head``."""
        keys = [EMBED_KEY] if self.first else []
        moe = set(self.moe_layers)
        for i in (i for c in self.chunks for i in c.layers):
            keys.append(f"layer{i}")
            if i in moe:
                keys += [f"layer{i}.expert{e}" for e in self.held_experts or ()]
        return tuple(keys + ([HEAD_KEY] if self.last else []))

    def trains(self, key: str) -> bool:
        """Whether this rank trains the weights of holder key ``key`` (only experts can be untrained)."""
        _, _, expert = key.partition(".expert")
        return not expert or self.trains_experts is None or int(expert) in self.trains_experts


@dataclass(frozen=True, slots=True)
class Layout:
    ranks: tuple[RankPlan, ...]
    sync_every_steps: int = 1  # SPES (runner.moe): replicas synchronise every this many steps
    # some stage has several data-parallel ranks, or the stages of a pipeline hold the activation differently
    # (tensor-parallel degree, sequence parallelism): every pipeline runs on runner.mixed
    mixed: bool = False
    zero: int = 0  # the plan's ZeRO stage (runner.zero)
    total_microbatches: int = 0  # over all pipelines: the gradient of a micro-batch counts 1 / this

    @property
    def sharded(self) -> bool:
        """Whether the ranks keep ZeRO-sharded or offloaded training state (``runner.zero``)."""
        return (self.zero > 0 and (len({r.pipeline for r in self.ranks}) > 1 or self.mixed)) or any(
            r.offload != "none" for r in self.ranks
        )

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def pipeline_groups(self) -> tuple[tuple[int, ...], ...]:
        """Point-to-point groups: for each pipeline and tensor-parallel index, its ranks in stage order."""
        groups: dict[tuple[int, int], list[int]] = {}
        for r in self.ranks:
            groups.setdefault((r.pipeline, r.tp_index), []).append(r.rank)
        return tuple(tuple(v) for _, v in sorted(groups.items()))

    def tp_groups(self) -> tuple[tuple[int, ...], ...]:
        groups: dict[tuple[int, int, int], list[int]] = {}
        for r in self.ranks:
            groups.setdefault((r.pipeline, r.stage, r.stage_rank), []).append(r.rank)
        return tuple(tuple(v) for _, v in sorted(groups.items()) if len(v) > 1)

    def _degrees(self) -> dict[str, set[int]]:
        degrees: dict[str, set[int]] = {}
        for r in self.ranks:
            for key in r.holds():
                degrees.setdefault(key, set()).add(r.tp_degree)
        return degrees

    def grad_groups(self) -> dict[tuple[int, ...], tuple[str, ...]]:
        """Ranks that hold the same weights (one per pipeline, same tensor-parallel shard) -> those
        weight keys. Each group all-reduces exactly the gradients of its keys. Keys that replicas shard
        with different tensor-parallel degrees are ``resharded``'s instead."""
        mixed = {k for k, d in self._degrees().items() if len(d) > 1}
        holders: dict[tuple[str, int], list[int]] = {}
        for r in self.ranks:
            for key in r.holds():
                if key not in mixed:
                    holders.setdefault((key, r.tp_index), []).append(r.rank)
        groups: dict[tuple[int, ...], list[str]] = {}
        for (key, _), ranks in holders.items():
            groups.setdefault(tuple(sorted(ranks)), []).append(key)
        return {g: tuple(keys) for g, keys in sorted(groups.items())}

    def resharded(self) -> dict[str, tuple[int, tuple[tuple[int, ...], ...], tuple[int, ...]]]:
        """Keys whose replicas shard them with different tensor-parallel degrees (powers of two) -> (``t``
        the largest degree, for each of the ``t`` equal parts of a sharded weight the ranks holding it,
        one per replica, and every rank holding the key). A replica of degree ``d`` keeps parts
        ``i t/d .. (i+1) t/d - 1`` on its tensor-parallel rank ``i``: each part's gradient is all-reduced
        among its holders, a replicated weight's among every holder (``runner.engine``)."""
        out = {}
        for key, degrees in sorted(self._degrees().items()):
            if len(degrees) < 2:
                continue
            t = max(degrees)
            holders = [r for r in self.ranks if key in r.holds()]
            parts = tuple(
                tuple(sorted(r.rank for r in holders if r.tp_index == c // (t // r.tp_degree))) for c in range(t)
            )
            out[key] = (t, parts, tuple(sorted(r.rank for r in holders)))
        return out

    def expert_parallel_groups(self) -> tuple[tuple[int, ...], ...]:
        """Ranks that exchange tokens by all-to-all: per expert-parallel group, stage and tensor-parallel
        index, the group's replicas' ranks in position order (none without expert parallelism)."""
        groups: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
        for r in self.ranks:
            if r.expert_parallel > 1:
                groups.setdefault((r.expert_group, r.stage, r.tp_index), []).append((r.expert_position, r.rank))
        return tuple(tuple(rank for _, rank in sorted(v)) for _, v in sorted(groups.items()))

    def exchange_groups(self, local: bool = False) -> list[tuple]:
        """The exchange of an MoE / SPES plan (``runner.moe.ExpertSync``): (holders, trainers, keys, weight per
        trainer, part) for every set of weight keys held and trained by the same ranks. ``local``: only among
        the ranks of one expert-parallel group (a SPES plan's per-step exchange). A holder's gradient covers
        its pipeline's batch, an expert holder's its group's (its tokens came by all-to-all); each trainer's
        gradient weight is its pipeline's batch over the batch its key's trainers cover together, its weight
        in a parameter average (SPES) the batch it covers over that. ``part`` is None where the key's
        holders shard it alike (one group per tensor-parallel index), else ``(c, t)``: part ``c`` of the
        ``t`` parts of its sharded weights (``runner.reshard``; ``c`` = ``WHOLE_PART``: the weights every
        holder keeps whole, each rank's weights then over its tensor-parallel degree)."""
        degrees: dict[tuple[str, int], set[int]] = {}
        for r in self.ranks:
            for key in r.holds():
                degrees.setdefault((key, r.expert_group if local else -1), set()).add(r.tp_degree)
        holders: dict[tuple, list[RankPlan]] = {}
        for r in self.ranks:
            for key in r.holds():
                scope = r.expert_group if local else -1
                if len(degrees[(key, scope)]) == 1:  # one group per tensor-parallel index
                    holders.setdefault((key, None, r.tp_index, scope), []).append(r)
                    continue
                t = max(degrees[(key, scope)])
                per_rank = t // r.tp_degree
                for c in (WHOLE_PART, *range(r.tp_index * per_rank, (r.tp_index + 1) * per_rank)):
                    holders.setdefault((key, (c, t), -1, scope), []).append(r)
        merged: dict[tuple, list[str]] = {}
        weights: dict[tuple, dict[int, float]] = {}
        for (key, part, _, _), plans in holders.items():
            trainers = [r for r in plans if r.trains(key)]
            expert = ".expert" in key
            # a weight every rank of a replica keeps whole: each of them counts 1 / degree of the replica
            copies = {r.rank: r.tp_degree if part is not None and part[0] == WHOLE_PART else 1 for r in trainers}
            covered = sum(r.batch_size * (r.expert_parallel if expert else 1) / copies[r.rank] for r in trainers)
            # (gradient weight, weight in a parameter average) per trainer
            w = {
                r.rank: (
                    # under runner.mixed each micro-batch's loss is already its part of the global mean
                    (1.0 if self.mixed else r.batch_size / covered) / copies[r.rank],
                    r.batch_size * (r.expert_parallel if expert else 1) / covered / copies[r.rank],
                )
                for r in trainers
            }
            ident = (
                tuple(r.rank for r in plans),
                tuple(r.rank for r in trainers),
                tuple(sorted(w.items())),
                part or (),  # () sorts before every part
            )
            merged.setdefault(ident, []).append(key)
            weights[ident] = w
        return [
            (ident[0], ident[1], tuple(keys), weights[ident], ident[3] or None)
            for ident, keys in sorted(merged.items())
        ]

    def key_holders(self) -> tuple[tuple[str, int, tuple[int, ...]], ...]:
        """(weight key, tensor-parallel index, ranks holding that shard), in one fixed order: the unit
        of ZeRO sharding (``runner.zero``)."""
        holders: dict[tuple[str, int], list[int]] = {}
        for r in self.ranks:
            for key in r.holds():
                holders.setdefault((key, r.tp_index), []).append(r.rank)
        return tuple(
            (k, t, tuple(sorted(v))) for (k, t), v in sorted(holders.items(), key=lambda kv: _key_order(*kv[0]))
        )

    def key_trainers(self) -> tuple[tuple, ...]:
        """The units of ZeRO sharding of an MoE / SPES plan (``runner.zero``): (weight key, label, the ranks
        that train it together every step, each one's gradient weight, part), in ``key_holders``' order.
        Those ranks are ``exchange_groups``' trainers (under SPES with ``sync_every_steps`` > 1 the trainers
        inside one expert-parallel group: one unit per group), the weights and the part theirs (a key its
        holders shard at different degrees: a unit per part, ``label`` ``part<c>of<t>`` or ``whole``); a key a
        rank holds but does not train is no unit (frozen, updated by the exchange)."""
        local = self.sync_every_steps > 1
        units: dict[tuple[str, int], list[tuple]] = {}
        for _, trainers, keys, weights, part in self.exchange_groups(local=local):
            if not trainers:
                continue
            tp_index = self.ranks[trainers[0]].tp_index if part is None else 0
            label = unit_label(part, tp_index)
            for key in keys:
                unit = (trainers, {r: w for r, (w, _) in weights.items()}, part, label)
                units.setdefault((key, tp_index), []).append(unit)
        return tuple(
            (key, label, trainers, weights, part)
            for key, tp_index, _ in self.key_holders()
            for trainers, weights, part, label in sorted(units.pop((key, tp_index), ()), key=lambda u: (u[3], u[0]))
        )


def unit_label(part: tuple[int, int] | None, tp_index: int) -> str:
    """A ZeRO unit's name in a sharded checkpoint: its tensor-parallel shard, or its part of a key that
    replicas shard at different degrees (``Layout.exchange_groups``' ``part``)."""
    if part is None:
        return f"tp{tp_index}"
    return "whole" if part[0] == WHOLE_PART else f"part{part[0]}of{part[1]}"


def _key_order(key: str, tp_index: int) -> tuple[int, int, int]:
    """Weight keys in model order: the embedding, each layer's shared part then its experts, the head."""
    if key == EMBED_KEY:
        return (-1, 0, tp_index)
    if key == HEAD_KEY:
        return (1 << 30, 0, tp_index)
    layer, _, expert = key.removeprefix("layer").partition(".expert")
    return (int(layer), int(expert) + 1 if expert else 0, tp_index)


def build_layout(cluster: ClusterSpec, model: ModelSpec, config: ParallelConfig) -> Layout:
    """Validate ``config`` against ``cluster`` and ``model`` and place it on ranks.

    Raises SpecError for an invalid plan and for plan shapes the runner does not support.
    """
    config.validate(cluster, model)
    layerwise = any(p.execution == LAYERWISE for p in config.pipelines)
    ranks: list[RankPlan] = []
    offset = 0
    for p, pipe in enumerate(config.pipelines):
        batch = pipe.num_microbatches * config.micro_batch_size
        ranks += _pipeline_ranks(cluster, model, config, p, len(ranks), offset)
        offset += batch
    check_vocabulary_split(model, ranks)
    layout = Layout(
        tuple(ranks),
        config.sync_every_steps,
        config.has_mixed_stages or uneven_handoffs(config) or layerwise,
        config.zero,
        sum(p.num_microbatches for p in config.pipelines),
    )
    return layout


def _chunk_layers(pipe, v: int) -> dict[tuple[int, int], tuple[int, ...]]:
    """(stage, chunk) -> its layers: chunk ``c`` of every stage, then chunk ``c + 1`` (interleaving)."""
    chunk_layers: dict[tuple[int, int], tuple[int, ...]] = {}
    next_layer = 0
    for c in range(v):
        for s, stage in enumerate(pipe.stages):
            n = stage.layers // v
            chunk_layers[(s, c)] = tuple(range(next_layer, next_layer + n))
            next_layer += n
    return chunk_layers


def _pipeline_ranks(
    cluster: ClusterSpec, model: ModelSpec, config: ParallelConfig, p: int, first_rank: int, offset: int
) -> list[RankPlan]:
    """The ranks of pipeline ``p`` (numbered from ``first_rank``; its batch from sequence ``offset``)."""
    pipe = config.pipelines[p]
    v, ep = config.virtual_stages, config.expert_parallel
    num_virtual = len(pipe.stages) * v
    chunk_layers = _chunk_layers(pipe, v)
    batch = pipe.num_microbatches * config.micro_batch_size
    ranks: list[RankPlan] = []
    for s, stage in enumerate(pipe.stages):
        chunks = tuple(ChunkPlan(c * len(pipe.stages) + s, num_virtual, chunk_layers[(s, c)]) for c in range(v))
        moe_layers = tuple(i for ch in chunks for i in ch.layers if model.is_moe_layer(i))
        per = model.num_experts // ep if model.is_moe else 0
        held = tuple(range((p % ep) * per, (p % ep + 1) * per)) if model.is_moe else None
        for k, stage_rank in enumerate(stage.ranks_of(pipe.num_microbatches)):
            for j, device in enumerate(stage_rank.devices):
                ranks.append(
                    RankPlan(
                        rank=first_rank + len(ranks),
                        device_id=device,
                        pipeline=p,
                        stage=s,
                        tp_index=j,
                        tp_degree=stage_rank.tp,
                        chunks=chunks,
                        recompute=stage.recompute,
                        slowdown=cluster.node_of(device).slowdown,
                        num_microbatches=pipe.num_microbatches,
                        batch_offset=offset,
                        batch_size=batch,
                        grad_weight=batch / model.global_batch_size,
                        moe_layers=moe_layers,
                        held_experts=held,
                        trains_experts=pipe.trains_experts,
                        expert_group=p // ep,
                        expert_position=p % ep,
                        expert_parallel=ep,
                        sequence_parallel=stage.sequence_parallel and stage_rank.tp > 1,
                        stage_rank=k,
                        share=stage_rank.num_microbatches,
                        offload=stage.offload,
                        layerwise=pipe.execution == LAYERWISE,
                    )
                )
    return ranks


# --------------------------------------------------------------------------------------------------
# Plan shapes the runner does not run (one clear error before launch)


def splits_differ(layout: Layout) -> bool:
    """Whether some replicas split the layers otherwise than others (their ranks' stages and chunk layers)."""
    splits: dict[int, set] = {}
    for r in layout.ranks:
        splits.setdefault(r.pipeline, set()).add((r.stage, tuple(c.layers for c in r.chunks)))
    return len({frozenset(v) for v in splits.values()}) > 1


def replicas_out_of_step(layout: Layout) -> bool:
    """Whether the replicas' schedules reach the weight keys in different orders: mixed stages, different
    layer splits, or different micro-batch counts in pipelines of several stages. Zero 2/3's per-micro-batch
    reduce-scatters are then issued without waiting and zero 3's gathers served point to point
    (``runner.zero``)."""
    if layout.mixed or splits_differ(layout):
        return True
    several_stages = any(r.stage > 0 for r in layout.ranks)
    return several_stages and len({r.num_microbatches for r in layout.ranks}) > 1


def uneven_handoffs(config: ParallelConfig) -> bool:
    """Whether the stages of some pipeline hold the activation differently (tensor-parallel degree or
    sequence parallelism): their hand-offs are ``autotune.specs.handoff``'s, run by ``runner.mixed``."""
    for pipe in config.pipelines:
        layouts = {
            (r.tp, s.sequence_parallel and r.tp > 1) for s in pipe.stages for r in s.ranks_of(pipe.num_microbatches)
        }
        if len(layouts) > 1:
            return True
    return False


def check_vocabulary_split(model: ModelSpec, ranks: list[RankPlan]) -> None:
    """An embedding or head on stages of different tensor-parallel degrees, some splitting the vocabulary and
    some not (so their parts cannot be averaged part by part), is not run."""
    for key in (EMBED_KEY, HEAD_KEY):
        degrees = {(r.tp_degree) for r in ranks if key in r.holds()}
        if len({vocab_split(model.vocab_size, d) for d in degrees if d > 1}) > 1:
            raise SpecError(
                "runner",
                "pipelines",
                f"the {key} sits on stages of tensor-parallel degrees {sorted(degrees)}, some of which divide the "
                f"vocabulary ({model.vocab_size}) and split it, some not: replicas must hold it alike (pad the "
                "vocabulary to a multiple of the largest degree)",
            )


def check_supported(plan: RankPlan, model: ModelSpec) -> None:
    """Plan shapes the runner cannot run, beyond ``ParallelConfig.validate`` and ``build_layout``."""
    tp = plan.tp_degree
    if tp > 1 and model.qk_norm:
        raise SpecError(
            "runner",
            f"pipelines[{plan.pipeline}].stages[{plan.stage}].devices",
            "qk_norm with tensor parallelism is not run by the runner (each rank's heads would train the "
            "shared query/key norm apart)",
        )
    if tp > 1 and model.num_kv_heads % tp:
        raise SpecError(
            "runner",
            f"pipelines[{plan.pipeline}].stages[{plan.stage}].devices",
            f"tensor-parallel degree {tp} must divide num_kv_heads={model.num_kv_heads} in the runner "
            "(replicating key/value heads across tensor-parallel ranks is not implemented)",
        )
