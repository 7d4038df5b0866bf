"""The walk's start plans (``autotune.policy.pretrained``): the speed-proportional plans of
``SearchSpace.heuristic_params`` ranked by a rough, evaluator-free estimate of their iteration time among
those whose memory estimate fits, and the space's most memory-frugal plan last."""

from __future__ import annotations

from autotune.planning.space import Params, SearchSpace
from autotune.specs import ParallelConfig


def estimated_memory_fraction(space: SearchSpace, config: ParallelConfig) -> float:
    """A rough, evaluator-free estimate of the fullest device's memory use / capacity.

    Weights, gradients and Adam states: 16 bytes per parameter (Rajbhandari et al. 2020, ZeRO sec.
    3.1) split over the TP group; activations per layer and micro-batch s*b*h*(10 + 24/t + 5*a*s/(h*t))
    bytes (Korthikanti et al. 2022, eq. 2), or 2*s*b*h with recomputation (only the layer input is
    kept), times the micro-batches in flight on the stage (p - i under 1F1B, all of them under GPipe).
    Used only to order the start plans; the evaluator decides what fits.
    """
    model = space.model
    s, h, a = model.seq_len, model.hidden_size, model.num_heads
    b = config.micro_batch_size
    worst = 0.0
    for pipe in config.pipelines:
        p = len(pipe.stages)
        for i, st in enumerate(pipe.stages):
            t = st.tp
            params = st.layers * model.params_per_layer
            if i == 0:
                params += model.embedding_params
            if i == p - 1:
                params += model.embedding_params
            weights = 16 * params / t
            per_layer = 2 * s * b * h if st.recompute else s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
            in_flight = pipe.num_microbatches if config.schedule == "gpipe" else min(p - i, pipe.num_microbatches)
            act = st.layers * per_layer * in_flight
            capacity = min(space.cluster.device(d).memory_GiB for d in st.devices) * 2**30
            worst = max(worst, (weights + act) / capacity)
    return worst


def estimated_iteration_s(space: SearchSpace, config: ParallelConfig) -> float:
    """A rough, evaluator-free iteration time, only to rank start plans (the evaluator decides).

    Per stage and micro-batch: 6 x block params + 12 x s x h flops per token and layer (fwd + bwd,
    Narayanan et al. 2021, appendix) at half the group's peak, plus Megatron's four TP all-reduces
    of the b x s x h activations (Shoeybi et al. 2019) over the node link, plus the activation and
    gradient transfer to the next stage. A replica takes (m + p - 1) x its slowest stage (1F1B/GPipe
    bubble); then a ring all-reduce of each stage's 16-bit gradients among the replicas, over the
    network when they sit on different nodes.
    """
    model, cluster = space.model, space.cluster
    s, h, b = model.seq_len, model.hidden_size, config.micro_batch_size
    tokens = s * b
    layer_flops = tokens * (6 * model.active_params_per_layer + 12 * s * h)  # MoE: routed experts only
    act_bytes = 2 * tokens * h
    worst = 0.0
    for pipe in config.pipelines:
        p = len(pipe.stages)
        slowest = 0.0
        for i, st in enumerate(pipe.stages):
            node = cluster.node_of(st.devices[0])
            rate = st.tp * 0.5 * node.device.peak_tflops * 1e12 / node.slowdown
            flops = st.layers * layer_flops * (4 / 3 if st.recompute else 1.0)
            if i == p - 1:
                flops += 6 * tokens * h * model.vocab_size
            t = flops / rate
            if st.tp > 1:
                t += 4 * st.layers * act_bytes * 2 * (st.tp - 1) / st.tp / (node.intra_node.bandwidth_GBps * 1e9)
            if i + 1 < p:
                t += 2 * act_bytes / (cluster.link(st.devices[0], pipe.stages[i + 1].devices[0]).bandwidth_GBps * 1e9)
            slowest = max(slowest, t)
        worst = max(worst, (pipe.num_microbatches + p - 1) * slowest)
    dp = len(config.pipelines)
    allreduce = 0.0
    if dp > 1:
        # each stage's gradients (16-bit) ring-all-reduced among the replicas; rings that leave a node
        # share its network link with every other stage of that node
        nic_bytes: dict[str, float] = {}
        nic_bw: dict[str, float] = {}
        first = config.pipelines[0]
        for k, st in enumerate(first.stages):
            params = st.layers * model.params_per_layer + (
                model.embedding_params if k in (0, len(first.stages) - 1) else 0
            )
            ring = 2 * 2 * params * (dp - 1) / dp
            peers = [p.stages[min(k, len(p.stages) - 1)].devices[0] for p in config.pipelines]
            nodes = {cluster.node_of(d).name: cluster.node_of(d) for d in peers}
            if len(nodes) == 1:
                node = next(iter(nodes.values()))
                allreduce = max(allreduce, ring / st.tp / (node.intra_node.bandwidth_GBps * 1e9))
            else:
                for name, node in nodes.items():
                    nic_bytes[name] = nic_bytes.get(name, 0.0) + ring
                    nic_bw[name] = node.network.bandwidth_GBps * 1e9
        for name, nbytes in nic_bytes.items():
            allreduce = max(allreduce, nbytes / nic_bw[name])
    return worst + allreduce / config.sync_every_steps  # SPES: one exchange every sync_every_steps steps


def start_candidates(space: SearchSpace, limit: int = 8) -> list[Params]:
    """Start plans from ``SearchSpace.heuristic_params`` (speed-proportional layers and batch) and their
    variants: pipeline depths that leave 1, 2 or 4 replicas besides the heuristic's own (on slow
    networks data parallelism costs more than a deep pipeline), with and without recomputation.
    Plans estimated to fit (``estimated_memory_fraction`` < 0.85) come first, fastest by
    ``estimated_iteration_s`` first; then the rest by estimated memory."""
    recompute = [r for r in ("none", "all") if r in space._dims["recompute"].choices]
    pps = space._dims["pp"].choices
    seen: set[ParallelConfig] = set()
    scored: list[tuple[int, float, Params]] = []
    for base in space.heuristic_params():
        tp_by_class = {c.name: int(base[f"tp.{c.name}"]) for c in space.node_classes}
        used = {c.name: bool(base.get(f"use.{c.name}", True)) for c in space.node_classes}
        groups = len(space.tp_groups(tp_by_class, used))
        depths = {base["pp"]}
        for dp in (1, 2, 4):
            fitting = [p for p in pps if groups // p == dp]
            if fitting:
                depths.add(fitting[0])
        for pp in sorted(depths):
            for r in recompute:
                params = dict(base, pp=pp, recompute=r)
                decoded = space.decode(params)
                if not decoded.ok or decoded.config in seen:
                    continue
                seen.add(decoded.config)  # type: ignore[arg-type]
                frac = estimated_memory_fraction(space, decoded.config)  # type: ignore[arg-type]
                if frac < 0.85:
                    scored.append((0, estimated_iteration_s(space, decoded.config), params))  # type: ignore[arg-type]
                else:
                    scored.append((1, frac, params))
    scored.sort(key=lambda x: x[:2])
    return [params for *_, params in scored[:limit]]


def with_frugal_start(space: SearchSpace, starts: list[Params], evaluator=None) -> list[Params]:
    """``starts`` and, last, the space's most memory-frugal plan (``autotune.planning.memory_first``) when
    it is not among them: the walk reaches it when no earlier start fits (memory first)."""
    from autotune.planning.memory_first import frugal_start

    frugal = frugal_start(space, evaluator)
    if frugal is None:
        return list(starts)
    config = space.decode(frugal).config
    if any(space.decode(p).config == config for p in starts):
        return list(starts)
    return list(starts) + [frugal]
