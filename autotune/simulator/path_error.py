"""The pieces of a prediction's error bar read off one schedule run (``Simulator`` composes them).

The bar's definition (``autotune.simulator.error_bar``) reruns the schedule with one term stretched by its
error. Here the same is taken from the run already made: each replica's critical path
(``schedule.critical_path``) says how many seconds of each device class's passes and of sends between
nodes set its end, so stretching a term by ``sigma`` moves the replica's end by ``sigma`` times those
seconds (first order). A path that would overtake only once stretched is missed, except in the case that
matters most, balanced stages of different classes: where a class's busiest rank, stretched, may outgrow
the replica's bottleneck (``may_take_over``), the simulator reruns that replica.
"""

from __future__ import annotations

from autotune.simulator import error_bar
from autotune.simulator.cost_model import CostModel
from autotune.simulator.schedule import critical_path, run_program
from autotune.specs import ClusterSpec, ParallelConfig


def class_error(costs: CostModel, rate_key: str, precision: str) -> tuple[float, str]:
    """(relative error, label) of one device class's compute."""
    rates = costs.rates[rate_key]
    return error_bar.compute_error(rates.device.name, precision, rates.profile is not None)


def network_error(costs: CostModel, config: ParallelConfig) -> tuple[float, str, bool]:
    """(relative error, label) of the slowest network link among the plan's nodes, and whether the plan
    spans several nodes."""
    node = costs.node
    names = {node[d].name for pipe in config.pipelines for st in pipe.stages for d in st.devices}
    slowest = min(costs.node_spec[n].network.bandwidth_GBps for n in names)
    return (*error_bar.network_error(slowest), len(names) > 1)


def sigma_bound(costs: CostModel, cluster: ClusterSpec, precision: str) -> float:
    """The largest error any class's compute or any node's network link carries on this cluster: a replica
    ending before the makespan by more than this fraction of its span cannot set the stretched makespan."""
    sigmas = [class_error(costs, rk, precision)[0] for rk in set(costs.rate_key.values())]
    sigmas += [error_bar.network_error(n.network.bandwidth_GBps)[0] for n in cluster.nodes]
    return max(sigmas, default=0.0)


def critical_paths(runs: list[tuple], makespan: float, within: float) -> list[tuple | None]:
    """Per replica (``runs``: ``Simulator._pipelines``' (cache entry [free, path], program, end times or None,
    durations, transfers, transfers before blocking sends, whether each crosses nodes)): its critical path as
    ``path_seconds`` reads it, or None for a replica ending before ``makespan`` by more than ``within`` of its
    span, which no term stretched by at most that much makes the slowest. A path is walked once and kept in
    the cache entry; a cached run whose path was not needed before is run again to walk it."""
    out: list[tuple | None] = []
    for cached, comp, end, durs, comms, sent, across in runs:
        free = cached[0]
        if cached[1] is None and max(free) * (1.0 + within) > makespan:
            if end is None:
                end, _ = run_program(comp, durs, comms)
            cached[1] = critical_path(comp, end, comms, free.index(max(free)), len(durs))
        out.append(None if cached[1] is None else (*cached[1], sent, across))
    return out


def path_seconds(
    costs: CostModel, config: ParallelConfig, compiled: list, units: list, stage_costs: list, paths: list
) -> tuple[list[dict[str, float]], list[float]]:
    """Per replica: device class -> seconds of its passes on the critical path, and the seconds of sends
    between nodes on it (``paths[r]``: duration slot counts, transfer slot counts, the transfers' seconds,
    whether each crosses nodes). Where sends block the sender (GPUs) they sit inside the operations."""
    compute: list[dict[str, float]] = []
    network: list[float] = []
    for r, path in enumerate(paths):
        if path is None:  # a replica that cannot set the makespan (``Simulator._pipelines``)
            compute.append({})
            network.append(0.0)
            continue
        durations, transfers, comms, across = path
        comp, pipe = compiled[r], config.pipelines[r]
        per_class: dict[str, float] = {}
        net = 0.0
        blocking = costs.node[pipe.stages[0].devices[0]].device.name != "cpu"
        for di, n in enumerate(durations):
            if not n:
                continue
            u, i = comp.sources[di]
            rk = costs.rate_key[units[r][u].view.devices[0]]
            f = comp.scales[di] if comp.scales else 1.0
            per_class[rk] = per_class.get(rk, 0.0) + n * stage_costs[r][u][0][i] * f
            if blocking and across[comp.sends[di]]:
                net += n * comms[comp.sends[di]]
        for ci, n in enumerate(transfers):
            if n and across[ci]:
                net += n * comms[ci]
        compute.append(per_class)
        network.append(net)
    return compute, network


def busiest_by_class(costs: CostModel, units: list, stage_costs: list) -> list[dict[str, float]]:
    """Per replica: device class -> its busiest rank's seconds of passes in the step."""
    out = []
    for r, row_units in enumerate(units):
        row: dict[str, float] = {}
        for u, unit in enumerate(row_units):
            rk = costs.rate_key[unit.view.devices[0]]
            row[rk] = max(row.get(rk, 0.0), unit.share * sum(stage_costs[r][u][0]))
        out.append(row)
    return out


def may_take_over(busiest: dict[str, float], rate_key: str, sigma: float) -> bool:
    """Whether stretching class ``rate_key`` by ``sigma`` may make its busiest rank the replica's bottleneck
    when it is not already (``busiest``: class -> its busiest rank's seconds)."""
    own = busiest.get(rate_key, 0.0)
    others = max((t for k, t in busiest.items() if k != rate_key), default=0.0)
    return 0.0 < own <= others < own * (1.0 + sigma)


def stretched(costs: CostModel, units: list, stage_costs: list, rate_key: str, sigma: float) -> list:
    """``stage_costs`` with the passes and the optimizer step of class ``rate_key``'s ranks stretched by ``sigma``."""
    scaled = [list(row) for row in stage_costs]
    for r, row_units in enumerate(units):
        for u, unit in enumerate(row_units):
            if costs.rate_key[unit.view.devices[0]] == rate_key:
                durs, params, opt = scaled[r][u]
                scaled[r][u] = ([d * (1.0 + sigma) for d in durs], params, opt * (1.0 + sigma))
    return scaled


def exposed_sync(
    costs: CostModel,
    config: ParallelConfig,
    stage_costs: list,
    finish: list,
    iteration: float,
    step_overhead_s: float,
    sigma: float,
    label: str,
) -> list[tuple[str, float]]:
    """The data-parallel synchronisation past the last optimizer step, stretched by its link's error
    (``sigma`` and ``label``: the slowest network's, replaced by the in-node links' where every stage's
    replicas share a node)."""
    if not (len(config.pipelines) > 1 or config.has_mixed_stages):
        return []
    done = max(f + c[2] for row, costs_r in zip(finish, stage_costs) for f, c in zip(row, costs_r))
    exposed = max(0.0, iteration - done - step_overhead_s)
    across = any(
        len({costs.node[p.stages[s].devices[0]].name for p in config.pipelines if len(p.stages) > s}) > 1
        for s in range(max(len(p.stages) for p in config.pipelines))
    )
    if not across:
        sigma, label = error_bar.NETWORK_ERROR_VALIDATED, "links inside a node"
    return [(label, sigma * exposed / iteration)]
