"""Data parallelism in one iteration: the runs of layers held by the same stages in every replica
(``segments``) and their peers (every rank of those stages, several in a mixed stage), the gradient
all-reduce or ZeRO's reduce-scatter and all-gather among them (``synchronise``), and ZeRO's and CPU
offload's per-micro-batch traffic folded into each unit's passes (``sharded_costs``,
``autotune.simulator.zero`` for the terms)."""

from __future__ import annotations

import bisect

from autotune.simulator import layerwise, moe
from autotune.simulator import zero as zr
from autotune.simulator.collectives import collective_s
from autotune.simulator.cost_model import CostModel
from autotune.simulator.engine_terms import head_group
from autotune.specs import ModelSpec, ParallelConfig, TimelineEvent
from autotune.specs.execution import LAYERWISE


def segments(model: ModelSpec, config: ParallelConfig) -> list[tuple[tuple[int, ...], float]]:
    """Runs of layers held by the same stage in every replica, first layers first: (the stage index
    in each replica, parameters of the run)."""
    L = model.num_layers
    starts = []
    cuts = {0, L}
    for pipe in config.pipelines:
        acc, st = 0, []
        for stage in pipe.stages:
            st.append(acc)
            cuts.add(acc)
            acc += stage.layers
        starts.append(st)
    cuts_sorted = sorted(cuts)
    segments: list[tuple[tuple[int, ...], float]] = []
    per_layer = model.params_per_layer  # a property that counts: read once
    for x, y in zip(cuts_sorted, cuts_sorted[1:]):
        owners = tuple(bisect.bisect_right(st, x) - 1 for st in starts)
        params = (y - x) * per_layer + (model.end_params(x == 0, y == L) if x == 0 or y == L else 0)
        if segments and segments[-1][0] == owners:
            segments[-1] = (owners, segments[-1][1] + params)
        else:
            segments.append((owners, params))
    return segments


def ranks_by_stage(units: list) -> list[dict[int, list[tuple[int, int, tuple[str, ...]]]]]:
    """Per replica: stage -> its ranks as (replica, unit, devices) (``peers_of`` looks them up)."""
    out: list[dict[int, list]] = []
    for r, row in enumerate(units):
        by: dict[int, list] = {}
        for u, unit in enumerate(row):
            by.setdefault(unit.stage, []).append((r, u, unit.view.devices))
        out.append(by)
    return out


def peers_of(by_stage: list[dict[int, list]], owners: tuple[int, ...]) -> list[tuple[int, int, tuple[str, ...]]]:
    """The data-parallel peers of a run of layers held by stage ``owners[r]`` of each replica ``r``: every
    rank of those stages, as (replica, unit, devices) (``by_stage``: ``ranks_by_stage`` of the units)."""
    return [m for r, s in enumerate(owners) for m in by_stage[r].get(s, ())]


def synchronise(
    costs: CostModel,
    model: ModelSpec,
    config: ParallelConfig,
    cursor: list[list[float]],
    units: list,
    events: list[TimelineEvent] | None,
    zero: int = 0,
    phase: str = "allreduce",
) -> None:
    """Advance each rank's clock through its gradient all-reduces (in place in ``cursor``, per unit), last
    layers first (backward order), among every rank holding the layers: the ranks of their stage in
    every replica (several in a mixed stage). With ``zero`` > 0: the reduce-scatter
    (``phase="allreduce"``) or the all-gather of the updated weights (``phase="allgather"``) of ZeRO
    (``zero.sync_s``, ``zero.gather_s``)."""
    split = costs.state_split
    by_stage = ranks_by_stage(units)
    for owners, params in reversed(segments(model, config)):
        members = peers_of(by_stage, owners)
        n = len(members)
        if n < 2:
            continue
        stages = tuple(devs for _, _, devs in members)
        bw, lat, kind = costs.dp_ring(stages)
        if zero == 0:
            t = collective_s("allreduce", costs.grad_bytes * params, n, bw, lat, kind)
        elif phase == "allreduce":
            t = zr.sync_s(params, n, zero, (bw, lat), split)
        else:
            t = zr.gather_s(params, n, zero, (bw, lat), split)
        start = max(cursor[r][u] for r, u, _ in members)
        for r, u, _ in members:
            cursor[r][u] = start + t
        if events is not None and t > 0:
            events.extend(TimelineEvent(d, phase, start, start + t) for _, _, devs in members for d in devs)


def stage_rings(
    costs: CostModel, model: ModelSpec, config: ParallelConfig, units: list
) -> dict[tuple[int, int], tuple[float, float]]:
    """Per (replica, unit): (GB/s, latency us) per device of the slowest data-parallel ring its layers take."""
    rings: dict[tuple[int, int], tuple[float, float]] = {}
    if len(config.pipelines) < 2 and not config.has_mixed_stages:
        return rings
    by_stage = ranks_by_stage(units)
    for owners, _ in segments(model, config):
        for members in moe.stepping_together(config, peers_of(by_stage, owners)):
            if len(members) < 2:
                continue
            bw, lat = costs.dp_bandwidth(tuple(devs for _, _, devs in members))
            for r, u, devs in members:
                old = rings.get((r, u))
                ring = (bw / len(devs), lat)
                if old is None or ring[0] < old[0]:
                    rings[(r, u)] = ring
    return rings


def host_links(costs: CostModel, config: ParallelConfig) -> dict[str, tuple[float, float]]:
    """Per node: (GB/s, latency us) of each offloading device's host link, shared when the node's
    ``host.bandwidth_GBps`` caps them."""
    count: dict[str, int] = {}
    for pipe in config.pipelines:
        for st in pipe.stages:
            if st.offload != "none":
                for d in st.devices:
                    count[costs.node[d].name] = count.get(costs.node[d].name, 0) + 1
    links = {}
    for name, spec in costs.node_spec.items():
        links[name] = (spec.host.shared_bandwidth_GBps(count.get(name, 0)), spec.host.link.latency_us)
    return links


def sharded_costs(
    costs: CostModel,
    model: ModelSpec,
    config: ParallelConfig,
    stage_costs: list,
    units: list,
    peers: dict[tuple[int, int], int],
    cache: dict[tuple, tuple],
) -> tuple[list, dict]:
    """Per-unit costs with ZeRO's and offload's per-micro-batch traffic folded into forward and backward
    (``zero.chunk_comm``), and the per-device optimizer seconds (``zero.optimizer_s``). A stage's
    ranks are data-parallel peers like the replicas (``zero.peer_degrees``)."""
    v = config.virtual_stages
    rings = stage_rings(costs, model, config, units)
    hosts = host_links(costs, config)
    split = costs.state_split
    offloaded: dict[str, float] = {}  # node -> parameters its host CPU steps
    for r in range(len(config.pipelines)):
        for u, unit in enumerate(units[r]):
            dp = peers[(r, unit.stage)]
            n_os = dp if config.zero >= 1 and dp > 1 else 1
            if unit.view.offload != "none":
                for d in unit.view.devices:
                    node = costs.node[d].name
                    offloaded[node] = offloaded.get(node, 0.0) + stage_costs[r][u][1] / n_os
    out = []
    for r, pipe in enumerate(config.pipelines):
        p = len(pipe.stages)
        row = []
        for u, unit in enumerate(units[r]):
            s, st = unit.stage, unit.view
            durs, params, opt_s = stage_costs[r][u]
            dp = peers[(r, s)]
            ring = rings.get((r, u), (1.0, 0.0))
            node = costs.node[st.devices[0]].name
            host = hosts[node]
            spread = unit.share if pipe.execution == LAYERWISE else 0  # layer-wise: traffic once per step
            key = (
                spread,
                st.devices,
                st.layers,
                s == 0,
                s == p - 1,
                v,
                config.zero,
                st.offload,
                dp,
                ring,
                host,
                tuple(durs),
                params,
            )  # params: an MoE stage steps only the experts it trains
            hit = cache.get(key)
            if hit is None:
                tp = len(st.devices)
                new = list(durs)
                per_chunk = st.layers // v if v > 1 else st.layers
                for c in range(v):
                    ends = (s == 0 and c == 0, s == p - 1 and c == v - 1)
                    parts = zr.stage_units(model, per_chunk, tp, *ends, head_group(costs.engine, tp, model.vocab_size))
                    comm = zr.chunk_comm(parts, config.zero, st.offload, dp, ring, host, split)
                    if spread:
                        comm = comm.spread(spread)
                    new[2 * c], new[2 * c + 1] = comm.apply(durs[2 * c], durs[2 * c + 1])
                if spread and st.offload != "none":  # its activations to host memory and back
                    first, last = s == 0, s == p - 1
                    mbs = config.micro_batch_size
                    act = layerwise.activation_transfer_s(costs, st, first, last, mbs, v, dp, config.zero, host)
                    new = [max(t, act) for t in new]
                per_param = opt_s / params if params else 0.0
                opt = zr.optimizer_s(
                    params,
                    dp,
                    config.zero,
                    st.offload,
                    per_param,
                    host,
                    zr.host_step_s(offloaded.get(node, 0.0)),
                    split,
                )
                hit = (new, params, opt)
                cache[key] = hit
            row.append(hit)
        out.append(row)
    return out, offloaded
