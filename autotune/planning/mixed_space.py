"""The search space's mixed-stage dimensions (Zorse): stages of several data-parallel ranks.

Present only on clusters with several node classes (as ``assign``, ``order`` and the splits):

``stage_ranks``  one dimension, choices ``1``, ``2``, ``4``, ``8`` (as many as the cluster has devices) and
                 ``bandwidth``. A number ``w`` is the ranks per stage. With ``w > 1`` every stage
                 is a data-parallel group of ``w`` TP groups: ``assign: grouped`` takes ``w`` consecutive
                 groups in speed order (stages of one type where the counts allow), ``assign: mixed``
                 deals the groups out in turn (stage ``i`` of ``S`` takes groups ``i, i + S, ...``), so every
                 stage mixes the speed tiers (Zorse's mixed-type stages). Replicas: as many as the groups
                 fill, the slowest left-over groups stay idle.
                 ``bandwidth``: Zorse's grouping of GPUs into stages by cutting the
                 cluster's bandwidth graph (``bandwidth_stages``): one pipeline whose ``pp`` stages are the
                 parts of the cut, each holding all the TP groups of its part as ranks (stages of different
                 width and type: 4 V100s in one, 2 A100s in the next), slow links between stages and fast
                 links inside (``assign`` does not apply).

Micro-batch shares inside a stage follow Zorse's rule: inversely proportional to each rank's per-layer
latency (``shares``; at least one each), the latency being the simulator's cost model for one transformer
block's forward plus backward at the plan's micro-batch size on the rank's GPU type and tensor-parallel degree
(``layer_latency_s``: datasheet rates, tensor-parallel all-reduces and launch overheads included; not the
peak TFLOP/s, which overrates a card whose memory bandwidth or kernel overheads bind). Layers per stage follow
the stage's total speed (``layer_split``) and micro-batches per replica the replicas' (``batch_split``), both
in the same cost-model rates (``effective_tflops``), so a stage of two fast ranks and one slow one gets
their sum's share. (Plans without mixed stages keep the peak-TFLOP/s splits of the space before.)

ZeRO (the ``zero`` dimension) shards training state among a layer's data-parallel peers: the ranks of its
stage in every replica (``autotune.simulator.zero.peer_degrees``). So a plan of one replica keeps its
``zero`` when a stage has several ranks (``has_peers``): Zorse's ZeRO-2 inside a stage, the small card of a
mixed stage holding a shard. Zorse's start plans come with zero 0 and with ZeRO-2 (``start_params``).

A params dict without the dimension (an older study, a stored start) decodes with ``stage_ranks: 1``: the
plans of the space before. ``restrict={"stage_ranks": [1]}`` is the space without mixed stages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autotune.planning.vocabulary import SpaceContext, TPGroup, apportion, group_speed
from autotune.specs import ClusterSpec, ModelSpec, StageConfig
from autotune.specs.mixed_stage import RankConfig

WIDTHS = (1, 2, 4, 8)
BANDWIDTH = "bandwidth"
DIMENSIONS = ("stage_ranks",)
DEFAULTS = {"stage_ranks": 1}
#: above this many TP groups the bandwidth cut starts from whole nodes (it is cubic in its vertices)
MAX_CUT_VERTICES = 64


@dataclass(frozen=True, slots=True)
class RankGroup:
    """A stage of several TP groups (its ranks), seen by the decoder like one TP group: the devices of
    every rank, the ranks' summed speed, the smallest device memory among them."""

    ranks: tuple[TPGroup, ...]
    devices: tuple[str, ...]
    node_class: str
    speed_tflops: float
    memory_GiB: float


def merge(ranks: Sequence[TPGroup]) -> TPGroup | RankGroup:
    """One TP group as it is; several as a ``RankGroup``."""
    if len(ranks) == 1:
        return ranks[0]
    classes = sorted({g.node_class for g in ranks})
    return RankGroup(
        tuple(ranks),
        tuple(d for g in ranks for d in g.devices),
        "+".join(classes),
        sum(g.speed_tflops for g in ranks),
        min(g.memory_GiB for g in ranks),
    )


def dimensions(cluster: ClusterSpec, model: ModelSpec, several_classes: bool) -> list[tuple[str, tuple, bool]]:
    """(name, choices, ordinal) of the mixed-stage dimension; none on a cluster of one node class."""
    if not several_classes or cluster.num_devices < 2:
        return []
    return [("stage_ranks", tuple(w for w in WIDTHS if w <= cluster.num_devices) + (BANDWIDTH,), False)]


def shares(total: int, speeds: Sequence[float]) -> list[int] | None:
    """``total`` micro-batches split in proportion to the ranks' ``speeds`` (largest remainder), at least one
    each; None when there are fewer micro-batches than ranks. Zorse's rule with speeds ``1 / latency``
    (``zorse_shares``)."""
    return apportion(total, list(speeds), minimum=1)


def layer_latency_s(ctx: SpaceContext, devices: Sequence[str], mbs: int) -> float:
    """Seconds of one transformer block's forward plus backward for one micro-batch of ``mbs`` on the rank
    (TP group) ``devices``: the simulator's cost model (``CostModel.stage_estimate`` of a one-block stage;
    datasheet rates, the cluster's slowdown, the TP group's all-reduces). Cached per space
    (``SpaceContext.cache``)."""
    cache = ctx.cache("rank_latency")
    key = (tuple(devices), mbs)
    hit = cache.get(key)
    if hit is None:
        est = ctx.costs.stage_estimate(tuple(devices), 1, False, False, False, mbs, 1)
        hit = cache[key] = est.forward_s + est.backward_s
    return hit


def zorse_shares(ctx: SpaceContext, ranks: Sequence[Sequence[str]], total: int, mbs: int) -> list[int] | None:
    """Zorse's rule: ``total`` micro-batches over the ranks (each a TP group's devices) inversely
    proportional to their per-layer latency (``layer_latency_s``), at least one each."""
    return shares(total, [1.0 / max(layer_latency_s(ctx, r, mbs), 1e-30) for r in ranks])


def effective_tflops(ctx: SpaceContext, devices: Sequence[str], mbs: int) -> float:
    """A rank's compute rate as the cost model sees it: one block's training flops (``6 x params x tokens``)
    over its per-layer latency (``layer_latency_s``), TFLOP/s. Plans with mixed stages split layers over
    stages and micro-batches over replicas by these rates (Zorse: layers proportional to the stage's
    compute), so a stage's rate is its ranks' sum in the same units as its shares."""
    m = ctx.model
    return 6.0 * m.params_per_layer * mbs * m.seq_len / max(layer_latency_s(ctx, devices, mbs), 1e-30) / 1e12


def has_peers(pipes: Sequence[Sequence[Any]]) -> bool:
    """Whether some stage of the decoded pipelines has several ranks (data-parallel peers for ZeRO even
    in a plan of one replica)."""
    return any(isinstance(g, RankGroup) for pipe in pipes for g in pipe)


def wanted(params: Mapping[str, Any]) -> bool:
    return params.get("stage_ranks", 1) != 1


def build_pipes(
    ctx: SpaceContext, groups: list[TPGroup], pp: int, params: Mapping[str, Any]
) -> tuple[list[list[Any]], int] | str:
    """Pipelines (lists of stages, each a TP group or a ``RankGroup``) and their count, or the reason
    there are none. ``groups``: the used TP groups, fastest first."""
    from dataclasses import replace

    mbs = int(params.get("mbs", 1))  # stage and replica speeds from the cost model (effective_tflops)
    groups = [replace(g, speed_tflops=effective_tflops(ctx, g.devices, mbs)) for g in groups]
    if params.get("stage_ranks", 1) == BANDWIDTH:
        stages = bandwidth_stages(ctx, groups, pp)
        if isinstance(stages, str):
            return stages
        return [[merge(s) for s in stages]], 1
    w = int(params.get("stage_ranks", 1))
    if len(groups) < pp * w:
        return f"pp={pp} stages of width {w} need {pp * w} TP groups, the used devices form {len(groups)}"
    dp = len(groups) // (pp * w)
    n_stages = dp * pp
    groups = groups[: n_stages * w]  # the slowest left-over groups stay idle
    if params["assign"] == "mixed":  # deal out in turn: every stage takes one group of each speed tier
        stages = [groups[i::n_stages] for i in range(n_stages)]
    else:
        stages = [groups[i * w : (i + 1) * w] for i in range(n_stages)]
    merged = [merge(s) for s in stages]
    return [merged[p * pp : (p + 1) * pp] for p in range(dp)], dp


def bandwidth_stages(ctx: SpaceContext, groups: list[TPGroup], pp: int) -> list[list[TPGroup]] | str:
    """Zorse's stage grouping: cut the bandwidth graph of the TP groups into ``pp`` parts.

    Agglomerative min-k-cut: every TP group starts as its own part; the two parts joined by the fastest
    link (complete linkage: the slowest link between their members, so a part never hides a slow link
    inside) merge, ties to the pair of least combined speed (balanced parts), until ``pp`` parts remain.
    Parts come out fastest first (the ``order`` dimension may reverse them). Groups of a node merge before
    nodes do, so with fewer stages than nodes the nodes joined by the fastest network form a stage, and
    with more stages than nodes a node's groups split into stages of balanced speed.
    """
    if len(groups) < pp:
        return f"pp={pp} needs {pp} TP groups, the used devices form {len(groups)}"
    cache = ctx.cache("bandwidth_cut")  # ~1 s on 1,024 GPUs; the search decodes the same cut many times
    key = (pp, tuple((g.devices, g.speed_tflops) for g in groups))
    if key not in cache:
        index = {g.devices: i for i, g in enumerate(groups)}
        cache[key] = [[index[g.devices] for g in part] for part in _cut(ctx, groups, pp)]
    return [[groups[i] for i in part] for part in cache[key]]


def _cut(ctx: SpaceContext, groups: list[TPGroup], pp: int) -> list[list[TPGroup]]:
    cluster = ctx.cluster
    n = len(groups)
    node = [cluster.node_of(g.devices[0]).name for g in groups]
    if n > MAX_CUT_VERTICES and len(set(node)) >= pp:  # large clusters: whole nodes are the vertices
        first: dict[str, int] = {}
        members = {}
        for i, name in enumerate(node):
            members.setdefault(first.setdefault(name, i), []).append(i)
    else:
        members = {i: [i] for i in range(n)}
    speed = {a: sum(groups[i].speed_tflops for i in m) for a, m in members.items()}
    leaders = sorted(members)
    # part leader pair -> complete linkage (the slowest link between their members); every vertex lies on one
    # node (a TP group, or a whole node's groups), so the link between two of them is their nodes' link
    link = {}
    for x, a in enumerate(leaders):
        for b in leaders[x + 1 :]:
            link[(a, b)] = cluster.link(groups[a].devices[0], groups[b].devices[0]).bandwidth_GBps
    while len(members) > pp:
        a, b = max(link, key=lambda k: (link[k], -(speed[k[0]] + speed[k[1]]), -k[0], -k[1]))
        members[a] += members.pop(b)
        speed[a] += speed.pop(b)
        for c in members:
            if c != a:
                ka, kb = (min(a, c), max(a, c)), (min(b, c), max(b, c))
                link[ka] = min(link[ka], link[kb])
        link = {k: v for k, v in link.items() if b not in k}
    parts = [sorted(m) for m in members.values()]
    parts.sort(key=lambda m: (-sum(groups[i].speed_tflops for i in m), m[0]))
    return [[groups[i] for i in m] for m in parts]


def stage_config(
    ctx: SpaceContext,
    group: Any,
    layers: int,
    recompute: bool | str,
    offload: str,
    num_microbatches: int,
    mbs: int,
    sequence_parallel: bool = False,
) -> StageConfig | str:
    """The plan's stage for a decoded TP group or ``RankGroup`` (ranks with Zorse's shares at micro-batch
    size ``mbs``), or why not; ``sequence_parallel`` where the stage (some rank of it) is tensor-parallel."""
    if not isinstance(group, RankGroup):
        return StageConfig(
            group.devices, layers, recompute, offload, sequence_parallel=sequence_parallel and len(group.devices) > 1
        )
    split = zorse_shares(ctx, [g.devices for g in group.ranks], num_microbatches, mbs)
    if split is None:
        return (
            f"{num_microbatches} micro-batches cannot feed a stage of {len(group.ranks)} ranks "
            "(each rank takes at least one)"
        )
    ranks = tuple(RankConfig(g.devices, m) for g, m in zip(group.ranks, split))
    return StageConfig(
        (),
        layers,
        recompute,
        offload,
        sequence_parallel=sequence_parallel and any(len(g.devices) > 1 for g in group.ranks),
        ranks=ranks,
    )


def stage_speed(ctx: SpaceContext, stage: StageConfig) -> float:
    """Nominal speed of a plan's stage: the sum over its ranks of tp x peak / slowdown."""
    if not stage.ranks:
        return group_speed(ctx.cluster, stage.devices)
    return sum(group_speed(ctx.cluster, r.devices) for r in stage.ranks)


def params_of(config) -> dict[str, Any]:
    """MLflow parameters of a plan with mixed stages: ``ranks_per_stage``, e.g. ``2-1|1-1``."""
    if not config.has_mixed_stages:
        return {}
    return {"ranks_per_stage": "|".join("-".join(str(len(s.ranks) or 1) for s in p.stages) for p in config.pipelines)}


# --------------------------------------------------------------------------------------------------
# The env's share moves


def shift_share(ctx: SpaceContext, config, stage: int, direction: int):
    """Move one micro-batch between two ranks of stage ``stage`` of every pipeline where it has several:
    ``+1`` from the rank with the most work (share x per-layer latency, ``layer_latency_s``) to the one with
    the least (towards Zorse's rule), ``-1`` the other way (away from it, e.g. to unload a rank short of
    memory). None when no pipeline has such a stage or a rank would be left with none."""
    from dataclasses import replace

    changed = False
    pipes = []
    for pipe in config.pipelines:
        if stage >= len(pipe.stages) or not pipe.stages[stage].mixed:
            pipes.append(pipe)
            continue
        st = pipe.stages[stage]
        load = [r.num_microbatches * layer_latency_s(ctx, r.devices, config.micro_batch_size) for r in st.ranks]
        hi = max(range(len(load)), key=lambda k: (load[k], -k))
        lo = min(range(len(load)), key=lambda k: (load[k], k))
        src, dst = (hi, lo) if direction > 0 else (lo, hi)
        if src == dst or st.ranks[src].num_microbatches <= 1:
            return None
        counts = [r.num_microbatches for r in st.ranks]
        counts[src] -= 1
        counts[dst] += 1
        ranks = tuple(replace(r, num_microbatches=c) for r, c in zip(st.ranks, counts))
        stages = tuple(replace(s, ranks=ranks) if i == stage else s for i, s in enumerate(pipe.stages))
        pipes.append(replace(pipe, stages=stages))
        changed = True
    return replace(config, pipelines=tuple(pipes)) if changed else None


def rescale_shares(pipe, num_microbatches: int):
    """A pipeline with ``num_microbatches`` and every mixed stage's shares rescaled to them (largest
    remainder, at least one each); None when a stage has more ranks than micro-batches."""
    from dataclasses import replace

    stages = []
    for st in pipe.stages:
        if not st.ranks:
            stages.append(st)
            continue
        counts = apportion(num_microbatches, [r.num_microbatches for r in st.ranks], minimum=1)
        if counts is None:
            return None
        stages.append(replace(st, ranks=tuple(replace(r, num_microbatches=c) for r, c in zip(st.ranks, counts))))
    return replace(pipe, num_microbatches=num_microbatches, stages=tuple(stages))


# --------------------------------------------------------------------------------------------------
# Start plans


def start_params(ctx: SpaceContext, candidates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Zorse's start plans, after the speed-proportional ones (``SearchSpace.heuristic_params``): the first
    of those with the stages cut from the bandwidth graph (``stage_ranks: bandwidth``), then with mixed-type
    stages of two ranks (``stage_ranks: 2``, ``assign: mixed``); both with Zorse's micro-batch shares, then
    both again with ZeRO-2 (Zorse's sharding inside a stage) where the space has it.
    The other candidates get ``stage_ranks: 1``. None without the dimension."""
    dim = ctx.dims.get("stage_ranks")
    if dim is None:
        return []
    for params in candidates:
        params.setdefault("stage_ranks", 1 if 1 in dim.choices else dim.choices[0])
    if not candidates:
        return []
    base = candidates[0]
    out = []
    if BANDWIDTH in dim.choices:
        out.append(dict(base, stage_ranks=BANDWIDTH))
    widths = [w for w in dim.choices if w != BANDWIDTH and w > 1]
    if widths:
        assign = "mixed" if "mixed" in ctx.dims["assign"].choices else base["assign"]
        out.append(dict(base, stage_ranks=widths[0], assign=assign))
    if 2 in ctx.dims["zero"].choices:  # Zorse shards each stage's state ZeRO-2 style among its ranks
        out += [dict(p, zero=2) for p in out]
    return out
