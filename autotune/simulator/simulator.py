"""The heterogeneous training simulator: ``Simulator(cluster, model).evaluate(config) -> Measurement``.

One training iteration of a plan, as Megatron-LM runs it, composed from the costs of its pieces
(``autotune.simulator.cost_model.CostModel``: layer passes, stage memory, sends, rings):

1. Every stage's forward and backward time per micro-batch and its peak memory (``CostModel.stage_costs``,
   ``CostModel.stage_memory_GiB``). A stage of several data-parallel ranks (``ranks``, Zorse) is simulated
   rank by rank, each at its own speed for its own share of the micro-batches
   (``autotune.simulator.mixed_stages``). A plan that does not fit comes back ``oom`` here.
2. The pipeline schedule per micro-batch (``schedule``), with the activation / gradient transfers
   between consecutive stages over the link between their devices (intra-node or network). Each
   data-parallel replica is simulated on its own. On GPUs a pipeline send blocks its sender (Megatron-LM's
   and DeepSpeed's synchronous 1F1B sends, ``_blocking_sends``).
3. The data-parallel gradient all-reduce: for every run of layers held by the same stages across the
   replicas (replicas may be split differently), a ring all-reduce of their 16-bit gradients among
   every rank of those stages (several in a mixed stage), starting when the last of them finishes its
   backward, at the pace of the slowest participant (``CostModel.dp_bandwidth``); a stage's all-reduces
   run one after another. ZeRO and offload fold their traffic into the passes (``autotune.simulator.zero``);
   MoE and SPES plans exchange as ``autotune.simulator.moe`` says.
4. The optimizer step (``CostModel``: memory-bandwidth bound).

RoundPipe plans (``schedule: roundpipe``) have their own schedule (``autotune.simulator.roundpipe``), over
the same cost model. The iteration ends when the last device finishes its optimizer step. ``evaluate``
never raises for a bad plan: invalid plans come back with status ``invalid``, plans that do not fit with
``oom``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from functools import partial

from autotune.errors import SpecError
from autotune.profile import CalibrationProfile
from autotune.simulator import data_parallel, error_bar, layerwise, moe, path_error, roundpipe
from autotune.simulator.cost_model import CostModel
from autotune.simulator.engine_terms import DEFAULT_ENGINE
from autotune.simulator.mixed_stages import Unit, compile_pipeline, pipeline_units, shares_key, transfer_seconds
from autotune.simulator.schedule import FORWARD, ScheduleDeadlock, run_program
from autotune.simulator.zero import peer_degrees
from autotune.specs import ClusterSpec, Measurement, ModelSpec, ParallelConfig, TimelineEvent
from autotune.specs.execution import MICROBATCH
from autotune.specs.recompute import checkpointed_blocks

log = logging.getLogger(__name__)

_PIPELINE_CACHE_SIZE = 50_000


@dataclass(slots=True)
class _Stages:
    """What the stage pass of one ``_simulate`` call finds, per replica and unit (a stage's rank)."""

    peers: dict[tuple[int, int], int]  # (replica, stage) -> ZeRO peers (``zero.peer_degrees``)
    costs: list = field(default_factory=list)  # [replica][unit] -> (durations, parameters, optimizer s)
    compiled: list = field(default_factory=list)  # [replica] -> the compiled schedule (``mixed_stages``)
    units: list[tuple[Unit, ...]] = field(default_factory=list)
    peak: dict[str, float] = field(default_factory=dict)  # device -> device view GiB
    allocated: dict[str, float] = field(default_factory=dict)  # device -> GiB of tensors
    host: dict[str, float] = field(default_factory=dict)  # node -> GiB of offloaded state
    oom_devices: list[str] = field(default_factory=list)


class Simulator:
    """Predicts a plan's iteration time, throughput and memory on a cluster (the simulator evaluator).

    ``costs`` is its ``CostModel`` (what each piece costs); the simulator composes those into one
    iteration. ``record_timeline=True`` makes ``evaluate`` also return every operation as a
    ``TimelineEvent`` (slower; the search leaves it off). ``evaluate_detailed`` does that for one call.
    ``engine``: which engine runs the plan, where engines differ (the loss's memory, whether the head is
    split across tensor parallelism: ``autotune.simulator.engine_terms``); autotune's runner when None.
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        model: ModelSpec,
        profile: CalibrationProfile | None = None,
        record_timeline: bool = False,
        engine: str | None = None,
    ) -> None:
        self.cluster = cluster
        self.model = model
        self.profile = profile
        self.record_timeline = record_timeline
        self.engine = engine or DEFAULT_ENGINE
        self.costs = CostModel(cluster, model, profile, self.engine)
        self._layerwise_memory = partial(layerwise.stage_memory_GiB, self.costs)  # one object: a cache key
        self._step_overhead_s = profile.step_overhead_s if profile is not None else 0.0
        self._rank_curves = profile is not None and any(
            d.pipeline_overhead or d.data_parallel_overhead for d in profile.devices
        )
        self._pipeline_cache: dict[tuple, list] = {}  # -> [when each unit is free, critical path or None]
        self._zero_cache: dict[tuple, tuple] = {}
        self._transfer_cache: dict[tuple, tuple] = {}
        #: the largest relative error any term of a plan on this cluster can carry (``path_error.sigma_bound``)
        self._sigma_bound = path_error.sigma_bound(self.costs, cluster, model.precision)

    # ---------------------------------------------------------------------------------------------
    # Evaluator interface

    def evaluate(self, config: ParallelConfig) -> Measurement:
        return self._evaluate(config, self.record_timeline)

    def evaluate_detailed(self, config: ParallelConfig) -> Measurement:
        """``evaluate`` with the per-operation timeline filled in."""
        return self._evaluate(config, True)

    def _evaluate(self, config: ParallelConfig, timeline: bool) -> Measurement:
        try:
            config.validate(self.cluster, self.model)
        except SpecError as e:
            return Measurement.failure("invalid", str(e))
        if config.schedule == "interleaved-1f1b":
            for r, pipe in enumerate(config.pipelines):
                if pipe.num_microbatches % len(pipe.stages):
                    return Measurement.failure(
                        "invalid",
                        f"config: pipelines[{r}].num_microbatches: interleaved-1f1b needs a multiple of "
                        f"the number of stages ({pipe.num_microbatches} % {len(pipe.stages)} != 0), "
                        "as in Megatron-LM",
                    )
        if config.is_roundpipe:  # RoundPipe's dispatch schedule: its own module; the bar of its GPUs' class
            m = roundpipe.simulate(self.costs, config, timeline)
            if not m.ok:
                return m
            rates = {self.costs.rates[self.costs.rate_key[d]] for d in config.devices}
            bars = [error_bar.compute_error(r.device.name, self.model.precision, r.profile is not None) for r in rates]
            expected, terms = error_bar.combine([max(bars)[::-1]])
            return replace(m, expected_error=expected, error_terms=terms)
        try:
            return self._simulate(config, timeline)
        except ScheduleDeadlock as e:
            return Measurement.failure("invalid", f"config: schedule: {e}")

    # ---------------------------------------------------------------------------------------------
    # The memory model alone (memory-first search: ``autotune.planning.budget``)

    def memory_estimate(self, config: ParallelConfig) -> Measurement | None:
        """The memory model's answer for ``config`` without simulating its schedule: a ``Measurement``
        with every used device's peak (``peak_memory_GiB``) and each node's offloaded state
        (``host_memory_GiB``); status ``oom`` (with the reason) when a device or a host does not hold
        it, else ``ok`` with ``tokens_per_s`` 0 (nothing was timed). None for an invalid plan."""
        try:
            config.validate(self.cluster, self.model)
        except SpecError:
            return None
        if config.is_roundpipe:  # its own memory model (autotune.simulator.roundpipe)
            m = roundpipe.simulate(self.costs, config, memory_only=True)
            return None if m.status == "invalid" else m
        try:
            return self._simulate(config, False, memory_only=True)
        except ScheduleDeadlock:
            return None

    def memory_check(self, config: ParallelConfig) -> Measurement | None:
        """The ``oom`` measurement when the memory model alone says ``config`` does not fit, else None."""
        m = self.memory_estimate(config)
        return m if m is not None and m.oom else None

    def memory_use(self, m: Measurement) -> float:
        """The fullest device's peak over its usable memory in ``m`` (``CostModel.memory_use``); > 1 does not fit."""
        return self.costs.memory_use(m)

    def _rank_overheads(self, config: ParallelConfig, curve: str) -> dict[str, float]:
        """Per device: a profile's runtime-overhead curve (``DeviceProfile.<curve>``: ``pipeline_overhead_s``
        per micro-batch and stage, ``data_parallel_overhead_s`` per step) at the plan's number of ranks of
        that device type (calibration)."""
        if not self._rank_curves:
            return {}
        ranks: dict[str, int] = {}
        for pipe in config.pipelines:
            for st in pipe.stages:
                for d in st.devices:
                    name = self.costs.node[d].device.name
                    ranks[name] = ranks.get(name, 0) + 1
        per_type = {}
        for name, n in ranks.items():
            prof = self.profile.device(name)
            if prof is not None:
                per_type[name] = getattr(prof, curve)(n)
        if not per_type:
            return {}
        return {
            d: per_type[self.costs.node[d].device.name]
            for pipe in config.pipelines
            for st in pipe.stages
            for d in st.devices
            if self.costs.node[d].device.name in per_type
        }

    def _shared_host_bound(self, config: ParallelConfig, stage_costs: list, units: list, iteration: float) -> float:
        """Lower bound on the iteration from a profile's host-contention curve (calibration): ranks of a
        device type with a ``contention`` curve share one host (CPU ranks on one machine), whose cores
        other programs may use too. The curve gives wall time per unit of compute when ``n`` ranks
        compute at once. So (a) no operation runs faster than ``stretch(1)`` times its compute time:
        the schedule as a whole takes at least ``stretch(1)`` times ``iteration``; (b) ``n`` such ranks
        (each weighted ``1 / slowdown``: an emulated slow rank sleeps most of its time) together do
        ``n / stretch(n)`` ranks' worth of work per second, and the plan's compute on that host cannot
        finish faster (processor sharing is work-conserving). 0 when no type has a curve."""
        if self.profile is None:
            return 0.0
        load: dict[str, float] = {}
        work: dict[str, float] = {}
        for r, _pipe in enumerate(config.pipelines):
            for u, unit in enumerate(units[r]):
                durs, _, opt = stage_costs[r][u]
                for d in unit.view.devices:
                    node = self.costs.node[d]
                    name = node.device.name
                    load[name] = load.get(name, 0.0) + 1.0 / node.slowdown
                    work[name] = work.get(name, 0.0) + (unit.share * sum(durs) + opt) / node.slowdown
        bound = 0.0
        for name, n in load.items():
            prof = self.profile.device(name)
            if prof is not None and prof.contention:
                bound = max(
                    bound, iteration * prof.contention_stretch(1.0), work[name] * prof.contention_stretch(n) / n
                )
        return bound

    @staticmethod
    def _blocking_sends(comp, durs: list[float], comms: list[float]) -> tuple[list[float], list[float]]:
        """Pipeline sends that block the sender: Megatron-LM's and DeepSpeed's 1F1B send each activation
        (and gradient) synchronously, so a stage cannot start its next operation until its send has
        completed. Each operation's duration absorbs the transfer it sends (``comp.sends``: to the next
        stage forward, the previous one backward, across chunks when interleaved, to the owning rank in
        a mixed stage); the receiver then waits for the sender's end (the transfers become part of the
        operations, ``comms`` all 0)."""
        return [d + comms[k] for d, k in zip(durs, comp.sends)], [0.0] * len(comms)

    # One iteration

    def _simulate(self, config: ParallelConfig, timeline: bool, memory_only: bool = False) -> Measurement:
        """One iteration: the stages' costs and memory, then (if everything fits) the pipelines, the
        data-parallel synchronisation and the optimizer step."""
        st = self._stage_pass(config)
        failed = self._out_of_memory(st)
        if failed is not None:
            return failed
        if memory_only:  # ``memory_estimate``: the memory model's answer, nothing simulated
            return Measurement(
                tokens_per_s=0.0,
                iteration_time_s=0.0,
                oom=False,
                peak_memory_GiB=st.peak,
                host_memory_GiB=st.host,
                status="ok",
            )
        stage_costs = st.costs
        sharded = config.zero > 0 and (len(config.pipelines) > 1 or config.has_mixed_stages) or config.offloads
        if sharded:  # ZeRO / offload traffic in forward and backward, and their optimizer step
            stage_costs, _ = data_parallel.sharded_costs(
                self.costs, self.model, config, stage_costs, st.units, st.peers, self._zero_cache
            )
        events: list[TimelineEvent] | None = [] if timeline else None
        finish, slowest, paths = self._pipelines(config, stage_costs, st, events, paths_within=self._sigma_bound)
        iteration, sync_s = self._synchronise_and_step(config, finish, stage_costs, st.units, sharded, events)
        # -- shared host: ranks that time-share one machine's cores (calibration profiles only) ----
        shared = self._shared_host_bound(config, stage_costs, st.units, iteration)
        stretch = shared / iteration if shared > iteration > 0 else 1.0
        iteration *= stretch
        # -- SPES: one synchronisation every sync_every_steps steps, amortised ------------------------
        iteration += sync_s / config.sync_every_steps
        m = self._measurement(config, st, stage_costs, slowest, stretch, iteration, sync_s, events)
        if not m.ok:
            return m
        expected, terms = self._error_bar(config, st, stage_costs, finish, paths, slowest[0], iteration)
        return replace(m, expected_error=expected, error_terms=terms)

    def _error_bar(
        self,
        config: ParallelConfig,
        st: _Stages,
        stage_costs: list,
        finish: list,
        paths: list,
        makespan: float,
        iteration: float,
    ) -> tuple[float, tuple[str, ...]]:
        """The prediction's expected relative error (``autotune.simulator.error_bar``) from the one schedule
        run (``autotune.simulator.path_error``): each class's error times its passes' seconds on each
        replica's critical path, the network's times the sends between nodes on it, a rerun only of
        replicas where a class may take over the bottleneck; the exposed data-parallel synchronisation
        stretched by its link's error. ``error_bar_by_rerun`` is the definition; this agrees with it within
        0.005 absolute on the pinned sweep's GPU clusters (tests/unit/simulator/test_error_bar.py)."""
        costs, out = self.costs, []
        compute, network = path_error.path_seconds(costs, config, st.compiled, st.units, stage_costs, paths)
        spans = [max(f) for f in finish]
        busiest = path_error.busiest_by_class(costs, st.units, stage_costs)
        for rk in {k for row in busiest for k in row}:
            sigma, label = path_error.class_error(costs, rk, self.model.precision)
            stretched = max(t + sigma * c.get(rk, 0.0) for t, c in zip(spans, compute))
            rerun = [r for r, row in enumerate(busiest) if path_error.may_take_over(row, rk, sigma)]
            if rerun:
                scaled = path_error.stretched(costs, st.units, stage_costs, rk, sigma)
                stretched = max(stretched, self._pipelines(config, scaled, st, None, replicas=rerun)[1][0])
            out.append((label, (stretched - makespan) / iteration))
        sigma, label, several_nodes = path_error.network_error(costs, config)
        if several_nodes:
            out.append((label, (max(t + sigma * n for t, n in zip(spans, network)) - makespan) / iteration))
        out += path_error.exposed_sync(
            costs, config, stage_costs, finish, iteration, self._step_overhead_s, sigma, label
        )
        return error_bar.combine(out)

    def error_bar_by_rerun(self, config: ParallelConfig) -> tuple[float, tuple[str, ...]]:
        """The error bar's definition, slow (``evaluate`` takes it from one schedule run): the schedule rerun
        with each class's passes stretched by its error, then the sends between nodes by the network's."""
        m = self.evaluate(config)
        if not m.ok or config.is_roundpipe:
            return (m.expected_error, m.error_terms)
        st = self._stage_pass(config)
        stage_costs = st.costs
        if config.zero > 0 and (len(config.pipelines) > 1 or config.has_mixed_stages) or config.offloads:
            stage_costs, _ = data_parallel.sharded_costs(
                self.costs, self.model, config, stage_costs, st.units, st.peers, self._zero_cache
            )
        finish, (makespan, _), _ = self._pipelines(config, stage_costs, st, None)
        costs, iteration, out = self.costs, m.iteration_time_s, []
        for rk in {costs.rate_key[unit.view.devices[0]] for units in st.units for unit in units}:
            sigma, label = path_error.class_error(costs, rk, self.model.precision)
            scaled = path_error.stretched(costs, st.units, stage_costs, rk, sigma)
            out.append((label, (self._pipelines(config, scaled, st, None)[1][0] - makespan) / iteration))
        sigma, label, several_nodes = path_error.network_error(costs, config)
        if several_nodes:
            stretched = self._pipelines(config, stage_costs, st, None, network_scale=1.0 + sigma)[1][0]
            out.append((label, (stretched - makespan) / iteration))
        out += path_error.exposed_sync(
            costs, config, stage_costs, finish, iteration, self._step_overhead_s, sigma, label
        )
        return error_bar.combine(out)

    def _stage_pass(self, config: ParallelConfig) -> _Stages:
        """Every unit's (a stage's rank: ``mixed_stages``) costs and memory, replica by replica."""
        model, costs = self.model, self.costs
        mbs, v = config.micro_batch_size, config.virtual_stages
        st = _Stages(peers=moe.zero_peers(config, peer_degrees(config)))
        ep = config.expert_parallel
        for r, pipe in enumerate(config.pipelines):
            p = len(pipe.stages)
            if pipe.execution == MICROBATCH:
                comp = compile_pipeline(config.schedule, p, pipe.num_microbatches, v, shares_key(pipe))
                stage_memory_GiB = costs.stage_memory_GiB
            else:  # Zorse's layer-wise execution (autotune.simulator.layerwise)
                shares = shares_key(pipe) or tuple((pipe.num_microbatches,) for _ in pipe.stages)
                comp = layerwise.compile_layerwise(pipe.num_microbatches, tuple(s.layers for s in pipe.stages), shares)
                stage_memory_GiB = self._layerwise_memory
            st.compiled.append(comp)
            st.units.append(pipeline_units(pipe))
            row = []
            # MoE: the experts this replica's devices hold (its position in its expert-parallel group) and train
            trained = moe.trained_in(model, pipe.trains_experts, moe.shard(model, ep, r % ep)) if model.is_moe else 0
            for u, unit in enumerate(st.units[r]):
                s, view = unit.stage, unit.view
                first, last = s == 0, s == p - 1
                dp = st.peers[(r, s)]
                c, gib, host_gib, device_gib = costs.rank_costs(
                    view, first, last, mbs, comp.in_flight[u], v, ep, dp, config.zero, stage_memory_GiB
                )
                if model.is_moe:
                    c, gib, host_gib = costs.moe_stage(c, gib, host_gib, view, trained, ep, dp, config.zero)
                    device_gib = costs.device_view(view.devices[0], gib)
                row.append(c)
                for d in view.devices:
                    st.peak[d] = device_gib
                    st.allocated[d] = gib
                    if device_gib > costs.usable[d]:
                        st.oom_devices.append(d)
                    if view.offload != "none":
                        node = costs.node[d].name
                        st.host[node] = st.host.get(node, 0.0) + host_gib
            st.costs.append(row)
        if model.is_moe and ep > 1:
            st.costs = self._expert_parallel_costs(config, st.costs)
        return st

    def _out_of_memory(self, st: _Stages) -> Measurement | None:
        """The ``oom`` measurement when a device or a node's host memory does not hold its part, else None."""
        error = self._oom_error(st)
        if error is None:
            return None
        return Measurement(
            tokens_per_s=0.0,
            iteration_time_s=0.0,
            oom=True,
            peak_memory_GiB=st.peak,
            status="oom",
            host_memory_GiB=st.host,
            allocated_memory_GiB=st.allocated,
            error=error,
        )

    def _oom_error(self, st: _Stages) -> str | None:
        """What does not fit: the first device over its memory, else the first node's host over its own."""
        if st.oom_devices:
            d = st.oom_devices[0]
            cap = self.costs.node[d].device.memory_GiB
            return (
                f"{len(st.oom_devices)} device(s) out of memory, e.g. {d} needs "
                f"{st.peak[d]:.1f} GiB of {cap:g} GiB ({st.allocated[d]:.1f} GiB of tensors "
                "at the peak, the rest CUDA context, library buffers and the allocator's pool)"
            )
        for name, gib in st.host.items():
            cap = self.costs.node_spec[name].host.memory_GiB
            if gib > cap:
                return (
                    f"host memory of node {name!r} out of memory: offloaded state needs "
                    f"{gib:.1f} GiB of its {cap:g} GiB (host.memory_GiB)"
                )
        return None

    def _pipelines(
        self,
        config: ParallelConfig,
        stage_costs: list,
        st: _Stages,
        events: list[TimelineEvent] | None,
        network_scale: float = 1.0,
        replicas: list[int] | None = None,
        paths_within: float | None = None,
    ) -> tuple[list[tuple[float, ...]], tuple[float, int], list[tuple | None]]:
        """Each replica's schedule: when each unit is free after its last backward, the slowest replica (its
        makespan, its index), and with ``paths_within`` each replica's critical path as ``(duration slot
        counts, transfer slot counts, the transfers' seconds before blocking sends absorb them, whether each
        crosses nodes)`` (``schedule.critical_path``: the error bar reads it), None for a replica that ends
        before the makespan by more than that fraction of its span (no term stretched by at most that much
        makes it the slowest, so the error bar does not need its path; the walk costs ~0.1 ms). ``network_scale`` stretches the sends between nodes (``error_bar_by_rerun``);
        ``replicas``: only those (the lists then hold theirs, in that order)."""
        mbs, v, schedule = config.micro_batch_size, config.virtual_stages, config.schedule
        finish: list[tuple[float, ...]] = []
        runs: list[tuple] = []
        slowest = (-1.0, 0)
        hand_off = self._rank_overheads(config, "pipeline_overhead_s")
        for r in range(len(config.pipelines)) if replicas is None else replicas:
            pipe = config.pipelines[r]
            p = len(pipe.stages)
            costs = stage_costs[r]
            comp = st.compiled[r]
            if hand_off and p > 1:  # a profile's measured hand-off overhead, half on each side
                extra = [
                    max((hand_off.get(d, 0.0) for d in unit.view.devices), default=0.0) / 2 for unit in st.units[r]
                ]
                scales = comp.scales or (1.0,) * len(comp.sources)  # layer-wise: each operation's part of a pass
                durs = [(costs[u][0][i] + extra[u]) * f for (u, i), f in zip(comp.sources, scales)]
            elif comp.scales:
                durs = [costs[u][0][i] * f for (u, i), f in zip(comp.sources, comp.scales)]
            else:
                durs = [costs[u][0][i] for u, i in comp.sources]
            comms, across = self._transfers(pipe, comp, mbs, v)
            if network_scale != 1.0:
                comms = tuple(c * network_scale if x else c for c, x in zip(comms, across))
            sent = comms  # before blocking sends fold them into the operations (the error bar's network part)
            if self.costs.node[pipe.stages[0].devices[0]].device.name != "cpu":  # NCCL sends block the sender
                durs, comms = self._blocking_sends(comp, durs, comms)
            end = None
            if events is not None:
                end, free = run_program(comp, durs, comms)
                self._pipeline_events(events, comp, st.units[r], end, durs, v)
                cached = [tuple(free), None]
            else:
                key = (schedule, pipe.execution, pipe.num_microbatches, v, comp.units, tuple(durs), tuple(comms))
                cached = self._pipeline_cache.get(key)
                if cached is None:
                    end, free = run_program(comp, durs, comms)
                    cached = [tuple(free), None]  # [when each unit is free, the critical path once walked]
                    if len(self._pipeline_cache) > _PIPELINE_CACHE_SIZE:
                        self._pipeline_cache.clear()
                    self._pipeline_cache[key] = cached
            finish.append(cached[0])
            runs.append((cached, comp, end, durs, comms, sent, across))
            makespan = max(cached[0])
            if makespan > slowest[0]:
                slowest = (makespan, r)
        if paths_within is None:
            return finish, slowest, []
        return finish, slowest, path_error.critical_paths(runs, slowest[0], paths_within)

    def _transfers(self, pipe, comp, mbs: int, v: int) -> tuple[tuple[float, ...], tuple[bool, ...]]:
        """``mixed_stages.transfer_seconds`` of a pipeline, cached per layout."""
        key = (pipe, mbs, v, comp.num_stages, len(comp.transfers))
        hit = self._transfer_cache.get(key)
        if hit is None:
            if len(self._transfer_cache) > _PIPELINE_CACHE_SIZE:
                self._transfer_cache.clear()
            hit = self._transfer_cache[key] = transfer_seconds(self.costs, pipe, comp, mbs, v)
        return hit

    def _synchronise_and_step(
        self,
        config: ParallelConfig,
        finish: list[tuple[float, ...]],
        stage_costs: list,
        units: list,
        sharded: bool,
        events: list[TimelineEvent] | None,
    ) -> tuple[float, float]:
        """The data-parallel gradient synchronisation, then the optimizer step (then ZeRO-1/2's all-gather of
        the updated weights): (the iteration's end, one SPES synchronisation's seconds)."""
        cursor = [list(f) for f in finish]
        sync_s = 0.0
        replicated = len(config.pipelines) > 1 or config.has_mixed_stages
        moe_exchange = len(config.pipelines) > 1 and (config.expert_parallel > 1 or config.spes)
        if moe_exchange:  # MoE / SPES plans (autotune.simulator.moe); ZeRO's RS + AG counted as the all-reduce
            sync_s = self._moe_exchange(config, cursor, events)
        elif replicated:
            data_parallel.synchronise(self.costs, self.model, config, cursor, units, events, config.zero)
        if replicated and config.sync_every_steps == 1:
            # measured runtime cost of a data-parallel step (calibration): the all-reduce call and the
            # wait for the slowest replica; every rank leaves the step's synchronisation together
            dp = self._rank_overheads(config, "data_parallel_overhead_s")
            extra = max(dp.values(), default=0.0)
            if extra > 0:
                cursor = [[t + extra for t in row] for row in cursor]
        iteration = self._step_overhead_s
        for r, _pipe in enumerate(config.pipelines):
            for u, unit in enumerate(units[r]):
                opt = stage_costs[r][u][2]
                t = cursor[r][u] + opt + self._step_overhead_s
                if events is not None:
                    events.extend(TimelineEvent(d, "optimizer", cursor[r][u], t) for d in unit.view.devices)
                if t > iteration:
                    iteration = t
                cursor[r][u] = t - self._step_overhead_s
        if sharded and config.zero in (1, 2) and replicated and not moe_exchange:
            # all-gather the updated weights
            data_parallel.synchronise(
                self.costs, self.model, config, cursor, units, events, config.zero, phase="allgather"
            )
            iteration = max(iteration, max(max(row) for row in cursor) + self._step_overhead_s)
        return iteration, sync_s

    def _measurement(
        self,
        config: ParallelConfig,
        st: _Stages,
        stage_costs: list,
        slowest: tuple[float, int],
        stretch: float,
        iteration: float,
        sync_s: float,
        events: list[TimelineEvent] | None,
    ) -> Measurement:
        """The iteration as a ``Measurement``: throughput, MFU, the slowest replica's stage busy times and bubble."""
        makespan, r = slowest
        per_stage = [0.0] * len(config.pipelines[r].stages)  # a stage of several ranks: its busiest rank
        for unit, c in zip(st.units[r], stage_costs[r]):
            per_stage[unit.stage] = max(per_stage[unit.stage], stretch * unit.share * sum(c[0]))
        busy = tuple(per_stage)
        makespan *= stretch
        bubble = 1.0 - sum(busy) / (len(busy) * makespan) if makespan > 0 else 0.0
        tokens = config.global_batch_size * self.model.seq_len
        if iteration <= 0.0:  # only a profile of zero times can do this
            return Measurement.failure("failed", "simulated iteration takes no time: check the calibration profile")
        costs = self.costs
        peak_flops = sum(costs.rates[costs.rate_key[d]].peak_tflops / costs.node[d].slowdown for d in st.peak) * 1e12
        mfu = costs.flops_per_token * tokens / (iteration * peak_flops)
        return Measurement(
            tokens_per_s=tokens / iteration,
            iteration_time_s=iteration,
            oom=False,
            peak_memory_GiB=st.peak,
            host_memory_GiB=st.host,
            mfu=mfu,
            bubble_fraction=max(0.0, bubble),
            stage_busy_s=busy,
            allocated_memory_GiB=st.allocated,
            timeline=tuple(sorted(events, key=lambda e: (e.start_s, e.device))) if events else (),
            sync_time_s=sync_s,
        )

    # ---------------------------------------------------------------------------------------------

    def _expert_parallel_costs(self, config: ParallelConfig, stage_costs: list) -> list:
        """Replicas of an expert-parallel group run in lockstep (every all-to-all needs all of them): each stage
        takes the slowest corresponding stage's durations, plus its MoE blocks' all-to-alls."""
        model, mbs, v, ep = self.model, config.micro_batch_size, config.virtual_stages, config.expert_parallel
        out = [list(c) for c in stage_costs]
        nbytes = moe.alltoall_bytes(model, mbs, ep)
        for group in config.expert_groups():
            for s, st in enumerate(config.pipelines[group[0]].stages):
                durs = [max(stage_costs[r][s][0][i] for r in group) for i in range(2 * v)]
                bw, lat = self.costs.dp_bandwidth(tuple(config.pipelines[r].stages[s].devices for r in group))
                a2a = moe.alltoall_s(nbytes, ep, st.tp, bw, lat)
                per_chunk = round(st.layers / v)
                fwd, bwd = moe.alltoalls_per_layer(checkpointed_blocks(st.recompute, per_chunk) / max(per_chunk, 1))
                blocks = st.layers / v * model.moe_layer_fraction  # MoE blocks per chunk
                for c in range(v):
                    durs[2 * c] += blocks * fwd * a2a
                    durs[2 * c + 1] += blocks * bwd * a2a
                for r in group:
                    out[r][s] = (durs, stage_costs[r][s][1], stage_costs[r][s][2])
        return out

    def _moe_exchange(
        self, config: ParallelConfig, cursor: list[list[float]], events: list[TimelineEvent] | None
    ) -> float:
        """The per-step data-parallel exchange of an MoE / SPES plan (in place in ``cursor``); returns one SPES
        synchronisation's own seconds (0 unless ``sync_every_steps > 1``)."""
        model = self.model

        def bandwidth(parts):
            return self.costs.dp_bandwidth(tuple(config.pipelines[p].stages[s].devices for p, s in parts))

        def nodes(part):
            return self.costs.dp_stage(config.pipelines[part[0]].stages[part[1]].devices)[0]

        scope = "local" if config.sync_every_steps > 1 else "step"
        clock = {(r, s): cursor[r][s] for r, pipe in enumerate(config.pipelines) for s in range(len(pipe.stages))}
        spans = moe.run_collectives(moe.exchange(model, config, scope, self.costs.grad_bytes), clock, bandwidth, nodes)
        for (r, s), t in clock.items():
            cursor[r][s] = t
        if events is not None:
            for parts, t0, t1 in spans:
                events.extend(
                    TimelineEvent(d, "allreduce", t0, t1)
                    for p, s in parts
                    for d in config.pipelines[p].stages[s].devices
                )
        if config.sync_every_steps == 1:
            return 0.0
        spans = moe.run_collectives(moe.exchange(model, config, "sync", moe.SYNC_BYTES_PER_PARAM), {}, bandwidth, nodes)
        return max((t1 for _, _, t1 in spans), default=0.0)

    @staticmethod
    def _pipeline_events(
        events: list[TimelineEvent], comp, units: tuple[Unit, ...], end: list[float], durs: list[float], v: int
    ) -> None:
        for k, ((_, _, _, di), u, (kind, c, j)) in enumerate(zip(comp.program, comp.unit_of, comp.labels)):
            t1 = end[k + 1]
            t0 = t1 - durs[di]
            # a layer-wise stage's middle layers over all its micro-batches: "F*" / "B*"
            name = ("F" if kind == FORWARD else "B") + (str(j) if j >= 0 else "*") + (f".c{c}" if v > 1 else "")
            events.extend(TimelineEvent(d, name, t0, t1) for d in units[u].view.devices)
