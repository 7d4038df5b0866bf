"""The heterogeneous training simulator: ``Simulator(cluster, model).evaluate(config) -> Measurement``.

One training iteration of a plan, as Megatron-LM runs it:

1. Every stage's forward and backward time per micro-batch (``_stage_costs``): per layer, its matmuls
   (``flops.layer_matmuls``) at the device's sustained rate for their size (``efficiency``), the
   memory-bound kernels (norms, softmax, dropout, activations, residual adds: approximated from the
   layer's stored activation bytes of Korthikanti et al. 2022, each written once and read once in the
   forward, and read, with a gradient of the same size written and read, in the backward: 2x forward,
   4x backward), and tensor parallelism's two all-reduces of the ``b s h``
   activations forward and two backward (Shoeybi et al. 2019, Megatron-LM, Sec. 3) over the stage's
   group link; recomputation adds one more forward to the backward. The embedding sits on the first
   stage, the final norm, LM head and loss on the last. A tensor-parallel group of mixed device types
   runs at the pace of its slowest type. A stage of several data-parallel ranks (``ranks``, Zorse)
   is simulated rank by rank, each at its own speed for its own share of the micro-batches
   (``autotune.simulator.mixed_stages``).
2. The pipeline schedule per micro-batch (``schedule``), with the activation / gradient transfers
   between consecutive stages over the link between their devices (intra-node or network). Each
   data-parallel replica is simulated on its own.
3. The data-parallel gradient all-reduce: for every run of layers held by the same stages across the
   replicas (replicas may be split differently), a ring all-reduce of their 16-bit gradients among
   every rank of those stages (several in a mixed stage), starting when the last of them finishes its backward, at the pace of the slowest
   participant (``_dp_bandwidth``); a stage's all-reduces run one after another.
4. The optimizer step, memory-bandwidth bound: 28 bytes of traffic per parameter (read the fp32 weight,
   both Adam moments and the 16-bit gradient; write the three fp32 tensors and the 16-bit weight).

On GPUs, on top of these (issue 13's datasheet cost model, each term in its own module): a layer pass
takes at least the host's time to issue it (``overheads``); collectives and sends cost what NCCL's
model says for their link kind (``collectives``); a pipeline send blocks its sender (Megatron-LM's and
DeepSpeed's synchronous 1F1B sends, ``_blocking_sends``), and a tensor-parallel stage's sends share
their node's network; ``peak_memory_GiB`` is the device's view (``device_memory``), the tensors alone
are ``allocated_memory_GiB``. CPU devices keep the calibrated gloo model.

The iteration ends when the last device finishes its optimizer step. ``evaluate`` never raises for a
bad plan: invalid plans come back with status ``invalid``, plans that do not fit with ``oom``.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from autotune.errors import SpecError
from autotune.loading import load_cluster, load_config, load_model
from autotune.profile import CalibrationProfile
from autotune.simulator import moe
from autotune.simulator.backward import backward_ratio
from autotune.simulator.collectives import collective_s, intra_node_kind, send_s
from autotune.simulator.communication import ring_allreduce_s
from autotune.simulator.device_memory import device_memory
from autotune.simulator.overheads import NO_HOST_COST, host_cost
from autotune.simulator.efficiency import DeviceRates
from autotune.simulator.flops import head_matmul, layer_matmuls, model_flops_per_token, score_traffic_bytes
from autotune.simulator.memory import (BYTES_PER_PARAM_STATE, GiB, layer_activation_bytes, stage_params,
                                       stage_peak_GiB, usable_memory_GiB)
from autotune.simulator.mixed_stages import Unit, compile_pipeline, pipeline_units, shares_key
from autotune.simulator.schedule import FORWARD, ScheduleDeadlock, run_program
from autotune.simulator import zero as zr
from autotune.simulator.zero import peer_degrees, stage_states, state_bytes_for
from autotune.specs import ClusterSpec, LinkSpec, Measurement, ModelSpec, NodeSpec, ParallelConfig, TimelineEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StageEstimate:
    """What ``Simulator.stage_estimate`` predicts for one stage (times per micro-batch)."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    memory_GiB: float  # peak per device
    usable_GiB: float  # capacity minus the reserve, smallest among the stage's devices
    host_memory_GiB: float = 0.0  # offloaded state per device, in its node's host memory

    @property
    def fits(self) -> bool:
        return self.memory_GiB <= self.usable_GiB


OPTIMIZER_BYTES_PER_PARAM = 28  # Adam step traffic: read 4+4+4+2, write 4+4+4+2 bytes per parameter (fp32: 4+4+4+4, 4+4+4)
_PIPELINE_CACHE_SIZE = 50_000
_NO_LINK = LinkSpec(1.0, 0.0)  # a group of one device communicates with nobody


def _apply_profile(cluster: ClusterSpec, profile: CalibrationProfile | None) -> ClusterSpec:
    """The cluster with the profile's measured links and memory bandwidths in place of the file's."""
    if profile is None:
        return cluster
    nodes = []
    for node in cluster.nodes:
        links = profile.node_links(node.name)
        dev = profile.device(node.device.name)
        new = node
        if links is not None:
            new = replace(new, intra_node=links.intra_node or node.intra_node, network=links.network or node.network)
        if dev is not None and dev.memory_bandwidth_GBps is not None:
            new = replace(new, device=replace(node.device, memory_bandwidth_GBps=dev.memory_bandwidth_GBps))
        nodes.append(new)
    return replace(cluster, nodes=tuple(nodes))


class Simulator:
    """Predicts a plan's iteration time, throughput and memory on a cluster (the simulator evaluator).

    ``record_timeline=True`` makes ``evaluate`` also return every operation as a ``TimelineEvent``
    (slower; the search leaves it off). ``evaluate_detailed`` does that for one call.
    The model's ``precision`` sets the matmul peak and the size of every activation, gradient and
    message; its ``attention`` says whether the ``s x s`` scores are stored (``standard``, the 2021
    Megatron-LM setting of Narayanan et al. and Korthikanti et al.) or not (``flash``, fused attention,
    Dao et al. 2022: the default, as the runner and current Megatron-LM train).
    """

    def __init__(self, cluster: ClusterSpec, model: ModelSpec, profile: CalibrationProfile | None = None,
                 record_timeline: bool = False) -> None:
        self.cluster = cluster
        self.model = model
        self.profile = profile
        self.record_timeline = record_timeline
        self._step_overhead_s = profile.step_overhead_s if profile is not None else 0.0
        self._rank_curves = profile is not None and any(d.pipeline_overhead or d.data_parallel_overhead
                                                        for d in profile.devices)
        self._eff = _apply_profile(cluster, profile)
        self._node: dict[str, NodeSpec] = {d: n for n in self._eff.nodes for d in n.device_ids()}
        self._node_spec: dict[str, NodeSpec] = {n.name: n for n in self._eff.nodes}
        self._rates: dict[str, DeviceRates] = {}
        for n in self._eff.nodes:
            key = f"{n.device.name}@{n.slowdown:g}"
            if key not in self._rates:
                self._rates[key] = DeviceRates(n.device, profile.device(n.device.name) if profile else None,
                                               n.slowdown, model.precision)
        self._rate_key = {d: f"{n.device.name}@{n.slowdown:g}" for d, n in self._node.items()}
        # a plan is oom when the device view of its memory (allocator peak, pool, CUDA context and library
        # buffers: autotune.simulator.device_memory) exceeds the device's capacity
        self._usable = {d: n.device.memory_GiB for d, n in self._node.items()}
        self._layer_cache: dict[tuple, tuple[float, ...]] = {}
        self._stage_cache: dict[tuple, tuple] = {}
        self._memory_cache: dict[tuple, float] = {}
        self._p2p_cache: dict[tuple, float] = {}
        self._dp_stage_cache: dict[tuple, tuple] = {}
        self._pipeline_cache: dict[tuple, tuple[float, ...]] = {}
        self._zero_cache: dict[tuple, tuple] = {}
        self._flops_per_token = model_flops_per_token(model)
        # gradients are all-reduced in the model's precision (16-bit in Megatron-LM's fp16/bf16 default)
        self._grad_bytes = max(r.elem_bytes for r in self._rates.values())

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
                        "invalid", f"config: pipelines[{r}].num_microbatches: interleaved-1f1b needs a multiple of "
                                   f"the number of stages ({pipe.num_microbatches} % {len(pipe.stages)} != 0), "
                                   "as in Megatron-LM")
        if config.is_roundpipe:  # RoundPipe's dispatch schedule: its own module
            from autotune.simulator import roundpipe

            return roundpipe.simulate(self, config, timeline)
        try:
            return self._simulate(config, timeline)
        except ScheduleDeadlock as e:
            return Measurement.failure("invalid", f"config: schedule: {e}")

    # ---------------------------------------------------------------------------------------------
    # The memory model alone (memory-first search: ``autotune.search.budget``)

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
            from autotune.simulator import roundpipe

            m = roundpipe.simulate(self, config, memory_only=True)
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
        """The fullest device's peak over its usable memory (capacity less the reserve) in ``m``; > 1
        does not fit. Offloaded state counts as its node's host use over the host's memory."""
        use = max((gib / self._usable[d] for d, gib in m.peak_memory_GiB.items() if d in self._usable),
                  default=0.0)
        for node, gib in m.host_memory_GiB.items():
            spec = self._node_spec.get(node)
            if spec is not None and spec.host.memory_GiB > 0:
                use = max(use, gib / spec.host.memory_GiB)
        return use

    # ---------------------------------------------------------------------------------------------
    # Cost queries for planners (``autotune.search.planner``): the same numbers ``evaluate`` composes

    def stage_estimate(self, devices: tuple[str, ...], layers: int, recompute: bool | str, first: bool, last: bool,
                       mbs: int, in_flight: int, dp: int = 1, zero: int = 0, offload: str = "none",
                       sequence_parallel: bool = False) -> "StageEstimate":
        """One stage of a 1F1B-style pipeline (one model chunk): its forward and backward time per
        micro-batch, its optimizer step, and its peak memory per device holding ``in_flight``
        micro-batches' activations (with ``dp`` data-parallel peers for ZeRO sharding), against the
        smallest usable memory among its devices. Time terms of ZeRO and offload are not included."""
        durs, _, opt = self._stage_costs(tuple(devices), layers, recompute, first, last, mbs, 1, sp=sequence_parallel)
        memory, host = self._stage_memory_GiB(tuple(devices), layers, recompute, first, last, mbs, in_flight, 1,
                                              dp, zero, offload, sequence_parallel)
        memory = self._device_view(devices[0], memory)
        return StageEstimate(durs[0], durs[1], opt, memory, min(self._usable[d] for d in devices), host)

    def unit_costs(self, device: str, mbs: int) -> tuple[float, ...]:
        """Seconds per micro-batch on ``device`` without tensor parallelism: (block forward, block backward,
        block backward with recomputation, embedding forward, embedding backward, head forward, head
        backward), calibrated by the profile where it has them (``autotune.simulator.roundpipe``)."""
        lf, lb, lbr, _, ef, eb, hf, hb, _ = self._layer_costs(self._rate_key[device], 1, mbs, _NO_LINK)
        return lf, lb, lbr, ef, eb, hf, hb

    @property
    def effective_cluster(self) -> ClusterSpec:
        """The cluster with the profile's measured links and memory bandwidths in place of the file's."""
        return self._eff

    @property
    def flops_per_token(self) -> float:
        """Model FLOPs per trained token (MFU's numerator)."""
        return self._flops_per_token

    def p2p_time_s(self, src: tuple[str, ...], dst: tuple[str, ...], mbs: int) -> float:
        """One micro-batch's activations (or their gradient) from stage ``src`` to stage ``dst``."""
        return self._p2p(tuple(src), tuple(dst), mbs)

    def allreduce_time_s(self, owners: tuple[tuple[str, ...], ...], params: float, ranks: int | None = None) -> float:
        """The data-parallel gradient all-reduce of a run of layers with ``params`` parameters (all its
        tensor-parallel shards: a stage's devices carry theirs in parallel) among the stages
        ``owners`` (one per replica), as ``evaluate`` times it; ``ranks`` members in the ring when
        ``owners`` lists only some of them (the slowest hop among those sets the pace)."""
        n = len(owners) if ranks is None else ranks
        if n < 2:
            return 0.0
        owners = tuple(tuple(o) for o in owners)
        bw, lat = self._dp_bandwidth(owners)
        return collective_s("allreduce", self._grad_bytes * params, n, bw, lat, self._dp_kind(owners))

    # ---------------------------------------------------------------------------------------------
    # Cost model

    def _layer_costs(self, rate_key: str, tp: int, mbs: int, link: LinkSpec, sp: bool = False,
                     ep: int = 1, kind: str = "nvlink") -> tuple[float, ...]:
        """Seconds on one device type for one micro-batch, tensor-parallel communication included:
        (layer forward, layer backward, layer backward with full recomputation, layer backward with
        selective recomputation, embedding forward, embedding backward, head forward, head backward,
        optimizer seconds per parameter). ``sp``: sequence parallelism in the tensor-parallel group;
        ``ep``: expert parallelism of an MoE model (its blocks' mean compute, ``moe.layer_matmul_s``);
        ``kind``: the tensor-parallel group's link kind (``collectives``). A pass takes the longer of its
        device time and the host's time to issue it (``overheads``). A block's backward device time comes
        from pass counts, or is a measured multiple of its forward where ``backward`` has one."""
        key = (rate_key, tp, mbs, link, sp, ep, kind)
        hit = self._layer_cache.get(key)
        if hit is not None:
            return hit
        rates = self._rates[rate_key]
        model = self.model
        e = rates.elem_bytes
        sp = sp and tp > 1
        s, h, V = model.seq_len, model.hidden_size, model.vocab_size
        tokens = mbs * s
        act_bytes = e * tokens * h
        # one all-reduce of the b s h activations (with sequence parallelism a reduce-scatter plus an
        # all-gather: the same bytes and steps, Korthikanti et al. 2022 Sec. 4.2.2)
        tp_ar = collective_s("allreduce", act_bytes, tp, link.bandwidth_GBps, link.latency_us, kind)
        mms = layer_matmuls(model, mbs, tp)
        if model.is_moe:
            mm = moe.layer_matmul_s(rates.matmul_s, model, mbs, tp, ep)
        else:
            mm = sum(rates.matmul_s(m) for m in mms)
        attn_mm = rates.matmul_s(mms[1]) + rates.matmul_s(mms[2])  # Q K^T and P V
        # memory-bound kernels: every stored activation byte outside the attention scores is written and
        # read once forward (2x) and read, with a gradient written and read, backward (4x) ...
        stored = layer_activation_bytes(model, mbs, tp, sequence_parallel=sp, elem_bytes=e)
        scores = stored - layer_activation_bytes(model, mbs, tp, True, sp, e)  # 0 with flash attention
        score_f, score_b = (rates.memory_s(b) for b in score_traffic_bytes(model, mbs, tp, e))
        elementwise = 2.0 * rates.memory_s(stored - scores)
        layer_f = mm + elementwise + score_f + 2 * tp_ar
        # ... and fused attention's backward also recomputes Q K^T: 5 attention matmuls for the forward's 2
        # (Dao 2023, FlashAttention-2)
        flash_extra = 0.5 * attn_mm if model.attention == "flash" else 0.0
        layer_b = 2 * mm + flash_extra + 2 * elementwise + score_b + 2 * tp_ar
        ratio = backward_ratio(rates.device.name, rates.precision, model.attention)
        if ratio is not None:  # measured in this regime (``backward``): replaces the pass counts
            layer_b = ratio * layer_f
        layer_br = layer_b + layer_f
        # selective recomputation reruns the attention core forward: its matmuls and its score traffic
        layer_bs = layer_b + (attn_mm + score_f if model.attention == "standard" else 0.0)
        # embedding: gather rows and write the output (2 e s b h bytes); vocab-parallel: one all-reduce
        emb_f = rates.memory_s(2.0 * act_bytes) + tp_ar
        emb_b = rates.memory_s(2.0 * act_bytes)
        # final norm, logits matmul, vocabulary-parallel cross-entropy (~e + 8 bytes per logit each way:
        # the logits and their fp32 softmax and gradient; 3 small fp32 all-reduces of b s values)
        head = rates.matmul_s(head_matmul(model, mbs, tp))
        logits = tokens * -(-V // tp)
        ce_ar = 3 * collective_s("allreduce", 4.0 * tokens, tp, link.bandwidth_GBps, link.latency_us, kind)
        head_f = head + rates.memory_s((e + 8.0) * logits + 2.0 * act_bytes) + ce_ar
        head_b = 2 * head + rates.memory_s((e + 8.0) * logits + 2.0 * act_bytes) + tp_ar
        opt = rates.memory_s(OPTIMIZER_BYTES_PER_PARAM)
        # the host issues every pass; small passes wait for it (launch-bound), large ones hide it
        hc = host_cost(rates.device.name, tp) if rates.slowdown == 1.0 else NO_HOST_COST
        layer_f, layer_b = max(layer_f, hc.layer_forward_s), max(layer_b, hc.layer_backward_s)
        layer_br, layer_bs = max(layer_br, hc.layer_forward_s + hc.layer_backward_s), max(layer_bs, hc.layer_backward_s)
        emb_f, emb_b = max(emb_f, hc.embedding_forward_s), max(emb_b, hc.embedding_backward_s)
        head_f, head_b = max(head_f, hc.head_forward_s), max(head_b, hc.head_backward_s)
        prof = rates.profile
        if prof is not None:  # measured times replace the model where the profile has them
            sd = rates.slowdown  # measured on the real device; an emulated slow node stretches them
            # a profile measures dense blocks: an MoE model's blocks keep the model's times
            measured = prof.layer_timing(model, mbs, tp) if not model.is_moe else None
            if measured is not None:
                layer_f, layer_b = measured.forward_s * sd, measured.backward_s * sd
                layer_br = layer_f + layer_b
                layer_bs = layer_b + (layer_bs - layer_b) * (layer_f / (mm + elementwise + score_f + 2 * tp_ar))
            measured = prof.layer_timing(model, mbs, tp, recompute=True) if not model.is_moe else None
            if measured is not None:
                layer_br = measured.backward_s * sd
            measured = prof.layer_timing(model, mbs, tp, recompute="selective") if not model.is_moe else None
            if measured is not None:
                layer_bs = measured.backward_s * sd
            edge = prof.edge_timing(model, mbs, tp)
            if edge is not None:
                emb_f, emb_b = edge.embedding_forward_s * sd, edge.embedding_backward_s * sd
                head_f, head_b = edge.head_forward_s * sd, edge.head_backward_s * sd
            if prof.optimizer_s_per_param is not None:
                opt = prof.optimizer_s_per_param * rates.slowdown
        out = (layer_f, layer_b, layer_br, layer_bs, emb_f, emb_b, head_f, head_b, opt)
        self._layer_cache[key] = out
        return out

    def _stage_costs(self, devices: tuple[str, ...], layers: int, recompute: bool | str, first: bool, last: bool,
                     mbs: int, v: int, ep: int = 1, sp: bool = False) -> tuple:
        """(durations [F, B per chunk], parameters per device, optimizer seconds) of one stage."""
        key = (devices, layers, recompute, first, last, mbs, v, ep, sp)
        hit = self._stage_cache.get(key)
        if hit is not None:
            return hit
        tp = len(devices)
        link = self._eff.group_link(devices) if tp > 1 else _NO_LINK
        lpc = layers / v
        params = stage_params(self.model, layers, tp, first, last)
        durs = [0.0] * (2 * v)
        opt_s = 0.0
        for rk in sorted({self._rate_key[d] for d in devices}):  # mixed types: the slowest sets the pace
            lf, lb, lbr, lbs, ef, eb, hf, hb, opt = self._layer_costs(rk, tp, mbs, link, sp, ep,
                                                                      self._group_kind(devices))
            lback = lbr if recompute is True else lbs if recompute == "selective" else lb
            # a profile's measured pipeline-runtime cost per micro-batch and stage chunk (calibration)
            prof = self._rates[rk].profile
            ovh = (prof.microbatch_overhead_s or 0.0) * self._rates[rk].slowdown / 2 if prof is not None else 0.0
            # and its measured fixed cost of tensor-parallel collectives per layer (calibration)
            tp_ovh = prof.tensor_parallel_overhead_s(tp) / 2 if prof is not None and tp > 1 else 0.0
            for c in range(v):
                f = lpc * (lf + tp_ovh) + ovh
                b = lpc * (lback + tp_ovh) + ovh
                if first and c == 0:
                    f += ef
                    b += eb
                if last and c == v - 1:
                    f += hf
                    b += hb
                durs[2 * c] = max(durs[2 * c], f)
                durs[2 * c + 1] = max(durs[2 * c + 1], b)
            opt_s = max(opt_s, opt * params)
        out = (durs, params, opt_s)
        self._stage_cache[key] = out
        return out

    def _stage_memory_GiB(self, devices: tuple[str, ...], layers: int, recompute: bool | str, first: bool,
                          last: bool, mbs: int, in_flight: int, v: int, dp: int = 1, zero: int = 0,
                          offload: str = "none", sp: bool = False) -> tuple[float, float]:
        """(device peak GiB, host GiB of offloaded state) of one device of a stage."""
        prof = self.profile.device(self._node[devices[0]].device.name) if self.profile is not None else None
        tp = len(devices)
        sp = sp and tp > 1
        elem = self._rates[self._rate_key[devices[0]]].elem_bytes
        key = (tp, layers, recompute, first, last, mbs, in_flight, v, prof.name if prof else None,
               dp if zero or offload != "none" else 1, zero, offload, sp, elem)
        hit = self._memory_cache.get(key)
        if hit is None:
            full = kept = per_param = None
            baseline, act_factor = 0.0, 1.0
            if prof is not None:  # calibration: measured activation bytes and per-process baseline
                dense = not self.model.is_moe  # a profile measures dense blocks only
                measured = prof.layer_timing(self.model, mbs, len(devices)) if dense else None
                full = measured.activation_bytes if measured is not None else None
                if recompute and dense:
                    measured = prof.layer_timing(self.model, mbs, len(devices), recompute=recompute)
                    kept = measured.activation_bytes if measured is not None else None
                # the CPU runner's measured process baseline is part of what it reports as allocated (RSS
                # growth); a GPU's is outside the allocator and joins the device view (_device_view)
                if self._node[devices[0]].device.name == "cpu":
                    baseline = prof.memory_baseline_GiB or 0.0
                per_param = prof.state_bytes_per_param
                act_factor = prof.activation_memory_factor or 1.0
            states_bytes, host_GiB = None, 0.0
            if (zero and dp > 1) or offload != "none":  # ZeRO sharding / CPU offload (autotune.simulator.zero)
                split = state_bytes_for(self.model)
                if per_param is not None:
                    split = split.scaled_to(per_param)
                st = stage_states(self.model, layers, len(devices), first, last, dp, zero, offload, split)
                states_bytes, host_GiB = st.device_bytes + st.working_bytes, st.host_bytes / 2**30
            dev = stage_peak_GiB(self.model, mbs, tp, layers, recompute, in_flight, v, first, last,
                                 full, kept, baseline, per_param, act_factor, states_bytes, sp, elem)
            hit = (dev, host_GiB)
            self._memory_cache[key] = hit
        return hit

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
                    name = self._node[d].device.name
                    ranks[name] = ranks.get(name, 0) + 1
        per_type = {}
        for name, n in ranks.items():
            prof = self.profile.device(name)
            if prof is not None:
                per_type[name] = getattr(prof, curve)(n)
        if not per_type:
            return {}
        return {d: per_type[self._node[d].device.name] for pipe in config.pipelines for st in pipe.stages
                for d in st.devices if self._node[d].device.name in per_type}

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
        for r, pipe in enumerate(config.pipelines):
            for u, unit in enumerate(units[r]):
                durs, _, opt = stage_costs[r][u]
                for d in unit.view.devices:
                    node = self._node[d]
                    name = node.device.name
                    load[name] = load.get(name, 0.0) + 1.0 / node.slowdown
                    work[name] = work.get(name, 0.0) + (unit.share * sum(durs) + opt) / node.slowdown
        bound = 0.0
        for name, n in load.items():
            prof = self.profile.device(name)
            if prof is not None and prof.contention:
                bound = max(bound, iteration * prof.contention_stretch(1.0), work[name] * prof.contention_stretch(n) / n)
        return bound

    def _p2p(self, src: tuple[str, ...], dst: tuple[str, ...], mbs: int, sp: bool = False) -> float:
        """One activation (or its gradient) from stage ``src`` to stage ``dst``: each tensor-parallel rank
        sends the ``e b s h`` tensor to its peer (``1 / tp`` of it with sequence parallelism, where the
        stage output is split along the sequence). Between nodes the ``tp`` ranks' sends share their
        node's network bandwidth; NCCL-like costs per link kind (``collectives.send_s``)."""
        key = (src[0], dst[0], mbs, sp and len(src) > 1, len(src))
        hit = self._p2p_cache.get(key)
        if hit is None:
            e = self._rates[self._rate_key[src[0]]].elem_bytes
            nbytes = e * mbs * self.model.seq_len * self.model.hidden_size
            if key[3]:
                nbytes /= len(src)
            link = self._eff.link(src[0], dst[0])
            a, b = self._node[src[0]], self._node[dst[0]]
            if a.device.name == "cpu":
                kind = "host"
            elif a.name == b.name:
                kind = intra_node_kind(link.bandwidth_GBps, a.device.name)
            else:
                kind = "network"
                nbytes *= sum(1 for d in src if self._node[d].name == a.name)  # the node's ranks share its NIC
            hit = send_s(nbytes, link.bandwidth_GBps, link.latency_us, kind)
            self._p2p_cache[key] = hit
        return hit

    def _group_kind(self, devices: tuple[str, ...]) -> str:
        """Link kind of a tensor-parallel group's collectives (``collectives``)."""
        node = self._node[devices[0]]
        if node.device.name == "cpu":
            return "host"
        if any(self._node[d].name != node.name for d in devices):
            return "network"
        return intra_node_kind(node.intra_node.bandwidth_GBps, node.device.name)

    def _dp_kind(self, owners: tuple[tuple[str, ...], ...]) -> str:
        """Link kind of a data-parallel ring among stages ``owners``."""
        nodes = {self._node[d].name for stage in owners for d in stage}
        first = self._node[owners[0][0]]
        if first.device.name == "cpu":
            return "host"
        if len(nodes) > 1:
            return "network"
        return intra_node_kind(first.intra_node.bandwidth_GBps, first.device.name)

    def _device_view(self, device: str, allocated_GiB: float) -> float:
        """The device's view of a stage's memory (``device_memory``). A profile's measured per-process
        baseline replaces the class's context term: on a GPU (memory outside the allocator, measured by
        ``autotune profile``) it is added here; on a CPU it is already in ``allocated_GiB``."""
        name = self._node[device].device.name
        prof = self.profile.device(name) if self.profile is not None else None
        dm = device_memory(name)
        if prof is not None and prof.memory_baseline_GiB is not None:
            if name == "cpu":
                return allocated_GiB
            return allocated_GiB * (1.0 + dm.fragmentation) + prof.memory_baseline_GiB
        return dm.device_GiB(allocated_GiB)

    @staticmethod
    def _blocking_sends(comp, durs: list[float], comms: list[float]) -> tuple[list[float], list[float]]:
        """Pipeline sends that block the sender: Megatron-LM's and DeepSpeed's 1F1B send each activation
        (and gradient) synchronously, so a stage cannot start its next operation until its send has
        completed. Each operation's duration absorbs the transfer it sends (``comp.sends``: to the next
        stage forward, the previous one backward, across chunks when interleaved, to the owning rank in
        a mixed stage); the receiver then waits for the sender's end (the transfers become part of the
        operations, ``comms`` all 0)."""
        return [d + comms[k] for d, k in zip(durs, comp.sends)], [0.0] * len(comms)

    def _dp_stage(self, devices: tuple[str, ...]) -> tuple:
        """(nodes, intra-node GB/s, network GB/s, intra latency us, network latency us) of one stage as a
        data-parallel ring member: its tensor-parallel ranks carry their shards in parallel."""
        hit = self._dp_stage_cache.get(devices)
        if hit is None:
            nodes = {self._node[d].name: self._node[d] for d in devices}
            hit = (frozenset(nodes), len(devices) * min(n.intra_node.bandwidth_GBps for n in nodes.values()),
                   sum(n.network.bandwidth_GBps for n in nodes.values()),
                   max(n.intra_node.latency_us for n in nodes.values()),
                   max(n.network.latency_us for n in nodes.values()))
            self._dp_stage_cache[devices] = hit
        return hit

    def _dp_bandwidth(self, owners: tuple[tuple[str, ...], ...]) -> tuple[float, float]:
        """(GB/s, latency us) of a ring among stages ``owners``: a stage moves ``tp x`` its devices'
        intra-node bandwidth, capped by its nodes' network bandwidth when the ring leaves the node; the
        slowest stage sets the pace."""
        infos = [self._dp_stage(stage) for stage in owners]
        first = infos[0][0]
        if len(first) == 1 and all(info[0] == first for info in infos):
            return min(info[1] for info in infos), max(info[3] for info in infos)
        return min(min(info[1], info[2]) for info in infos), max(info[4] for info in infos)

    # ---------------------------------------------------------------------------------------------
    # One iteration

    def _simulate(self, config: ParallelConfig, timeline: bool, memory_only: bool = False) -> Measurement:
        model = self.model
        mbs, v, schedule = config.micro_batch_size, config.virtual_stages, config.schedule
        usable = self._usable
        peak: dict[str, float] = {}
        allocated: dict[str, float] = {}
        host: dict[str, float] = {}  # node -> GiB of offloaded state
        oom_devices = []
        stage_costs = []  # per replica, per unit (a stage's rank: autotune.simulator.mixed_stages)
        compiled = []
        units: list[tuple[Unit, ...]] = []
        ep = config.expert_parallel
        peers = moe.zero_peers(config, peer_degrees(config))
        for r, pipe in enumerate(config.pipelines):
            p = len(pipe.stages)
            comp = compile_pipeline(schedule, p, pipe.num_microbatches, v, shares_key(pipe))
            compiled.append(comp)
            units.append(pipeline_units(pipe))
            costs = []
            # MoE: the experts this replica's devices hold (its position in its expert-parallel group) and train
            trained = moe.trained_in(model, pipe.trains_experts, moe.shard(model, ep, r % ep)) if model.is_moe else 0
            for u, unit in enumerate(units[r]):
                s, st = unit.stage, unit.view
                first, last = s == 0, s == p - 1
                c = self._stage_costs(st.devices, st.layers, st.recompute, first, last, mbs, v, ep,
                                      st.sequence_parallel)
                dp = peers[(r, s)]
                gib, host_gib = self._stage_memory_GiB(st.devices, st.layers, st.recompute, first, last, mbs,
                                                       comp.in_flight[u], v, dp, config.zero, st.offload,
                                                       st.sequence_parallel)
                if model.is_moe:
                    c, gib, host_gib = self._moe_stage(c, gib, host_gib, st, trained, ep, dp, config.zero)
                costs.append(c)
                device_gib = self._device_view(st.devices[0], gib)
                for d in st.devices:
                    peak[d] = device_gib
                    allocated[d] = gib
                    if device_gib > usable[d]:
                        oom_devices.append(d)
                    if st.offload != "none":
                        node = self._node[d].name
                        host[node] = host.get(node, 0.0) + host_gib
            stage_costs.append(costs)
        if model.is_moe and ep > 1:
            stage_costs = self._expert_parallel_costs(config, stage_costs)
        if oom_devices:
            d = oom_devices[0]
            cap = self._node[d].device.memory_GiB
            return Measurement(tokens_per_s=0.0, iteration_time_s=0.0, oom=True, peak_memory_GiB=peak,
                               status="oom", host_memory_GiB=host, allocated_memory_GiB=allocated,
                               error=f"{len(oom_devices)} device(s) out of memory, e.g. {d} needs {peak[d]:.1f} GiB "
                                     f"of {cap:g} GiB ({allocated[d]:.1f} GiB of tensors at the peak, the rest CUDA "
                                     "context, library buffers and the allocator's pool)")
        for name, gib in host.items():
            cap = self._node_spec[name].host.memory_GiB
            if gib > cap:
                return Measurement(tokens_per_s=0.0, iteration_time_s=0.0, oom=True, peak_memory_GiB=peak,
                                   status="oom", host_memory_GiB=host, allocated_memory_GiB=allocated,
                                   error=f"host memory of node {name!r} out of memory: offloaded state needs "
                                         f"{gib:.1f} GiB of its {cap:g} GiB (host.memory_GiB)")
        if memory_only:  # ``memory_estimate``: the memory model's answer, nothing simulated
            return Measurement(tokens_per_s=0.0, iteration_time_s=0.0, oom=False, peak_memory_GiB=peak,
                               host_memory_GiB=host, status="ok")

        sharded = config.zero > 0 and (len(config.pipelines) > 1 or config.has_mixed_stages) or config.offloads
        if sharded:  # ZeRO / offload traffic in forward and backward, and their optimizer step
            stage_costs, _ = self._sharded_costs(config, stage_costs, units, peers)

        # -- pipelines -----------------------------------------------------------------------------
        finish: list[tuple[float, ...]] = []
        slowest = (-1.0, 0)
        events: list[TimelineEvent] = []
        hand_off = self._rank_overheads(config, "pipeline_overhead_s")
        for r, pipe in enumerate(config.pipelines):
            p = len(pipe.stages)
            costs = stage_costs[r]
            comp = compiled[r]
            extra = [max((hand_off.get(d, 0.0) for d in unit.view.devices), default=0.0) / 2 if p > 1 else 0.0
                     for unit in units[r]]
            durs = [costs[u][0][i] + extra[u] for u, i in comp.sources]
            comms = [0.0] * (1 + len(comp.transfers))
            ranks = [pipe.stage_ranks(s) for s in range(p)]
            for i, (kind, s, k_src, k_dst) in enumerate(comp.transfers):
                if kind == FORWARD and (s > 0 or v > 1):  # activations from the previous (virtual) stage
                    comms[1 + i] = self._p2p(ranks[s - 1][k_src].devices, ranks[s][k_dst].devices, mbs,
                                             pipe.stages[s - 1].sequence_parallel)
                elif kind != FORWARD and (s < p - 1 or v > 1):  # gradients from the next one
                    comms[1 + i] = self._p2p(ranks[(s + 1) % p][k_src].devices, ranks[s][k_dst].devices, mbs,
                                             pipe.stages[(s + 1) % p].sequence_parallel)
            if self._node[pipe.stages[0].devices[0]].device.name != "cpu":  # NCCL sends block the sender
                durs, comms = self._blocking_sends(comp, durs, comms)
            if timeline:
                end, free = run_program(comp, durs, comms)
                self._pipeline_events(events, comp, units[r], end, durs, v)
                free_t = tuple(free)
            else:
                key = (schedule, pipe.num_microbatches, v, comp.units, tuple(durs), tuple(comms))
                free_t = self._pipeline_cache.get(key)
                if free_t is None:
                    free_t = tuple(run_program(comp, durs, comms)[1])
                    if len(self._pipeline_cache) > _PIPELINE_CACHE_SIZE:
                        self._pipeline_cache.clear()
                    self._pipeline_cache[key] = free_t
            finish.append(free_t)
            makespan = max(free_t)
            if makespan > slowest[0]:
                slowest = (makespan, r)

        # -- data-parallel gradient all-reduce, then the optimizer ---------------------------------
        cursor = [list(f) for f in finish]
        sync_s = 0.0
        moe_exchange = len(config.pipelines) > 1 and (ep > 1 or config.spes)
        if moe_exchange:  # MoE / SPES plans (autotune.simulator.moe); ZeRO's RS + AG counted as the all-reduce
            sync_s = self._moe_exchange(config, cursor, events if timeline else None)
        elif len(config.pipelines) > 1 or config.has_mixed_stages:
            self._data_parallel(config, cursor, units, events if timeline else None, config.zero)
        if (len(config.pipelines) > 1 or config.has_mixed_stages) and config.sync_every_steps == 1:
            # measured runtime cost of a data-parallel step (calibration): the all-reduce call and the
            # wait for the slowest replica; every rank leaves the step's synchronisation together
            dp = self._rank_overheads(config, "data_parallel_overhead_s")
            extra = max(dp.values(), default=0.0)
            if extra > 0:
                cursor = [[t + extra for t in row] for row in cursor]
        iteration = self._step_overhead_s
        for r, pipe in enumerate(config.pipelines):
            for u, unit in enumerate(units[r]):
                opt = stage_costs[r][u][2]
                t = cursor[r][u] + opt + self._step_overhead_s
                if timeline:
                    events.extend(TimelineEvent(d, "optimizer", cursor[r][u], t) for d in unit.view.devices)
                if t > iteration:
                    iteration = t
                cursor[r][u] = t - self._step_overhead_s
        if sharded and config.zero in (1, 2) and (len(config.pipelines) > 1 or config.has_mixed_stages) \
                and not moe_exchange:
            # all-gather the updated weights
            self._data_parallel(config, cursor, units, events if timeline else None, config.zero, phase="allgather")
            iteration = max(iteration, max(max(row) for row in cursor) + self._step_overhead_s)

        # -- shared host: ranks that time-share one machine's cores (calibration profiles only) ----
        shared = self._shared_host_bound(config, stage_costs, units, iteration)
        stretch = shared / iteration if shared > iteration > 0 else 1.0
        iteration *= stretch
        # -- SPES: one synchronisation every sync_every_steps steps, amortised ------------------------
        iteration += sync_s / config.sync_every_steps

        # -- measurement ---------------------------------------------------------------------------
        makespan, r = slowest
        costs = stage_costs[r]
        per_stage = [0.0] * len(config.pipelines[r].stages)  # a stage of several ranks: its busiest rank
        for unit, c in zip(units[r], costs):
            per_stage[unit.stage] = max(per_stage[unit.stage], stretch * unit.share * sum(c[0]))
        busy = tuple(per_stage)
        makespan *= stretch
        bubble = 1.0 - sum(busy) / (len(busy) * makespan) if makespan > 0 else 0.0
        tokens = config.global_batch_size * model.seq_len
        if iteration <= 0.0:  # only a profile of zero times can do this
            return Measurement.failure("failed", "simulated iteration takes no time: check the calibration profile")
        peak_flops = sum(self._rates[self._rate_key[d]].peak_tflops / self._node[d].slowdown for d in peak) * 1e12
        mfu = self._flops_per_token * tokens / (iteration * peak_flops)
        return Measurement(tokens_per_s=tokens / iteration, iteration_time_s=iteration, oom=False,
                           peak_memory_GiB=peak, host_memory_GiB=host, mfu=mfu, bubble_fraction=max(0.0, bubble),
                           stage_busy_s=busy, allocated_memory_GiB=allocated,
                           timeline=tuple(sorted(events, key=lambda e: (e.start_s, e.device))) if timeline else (),
                           sync_time_s=sync_s)

    # ---------------------------------------------------------------------------------------------
    # Mixture of experts and SPES (the cost terms live in autotune.simulator.moe)

    def _moe_stage(self, costs: tuple, gib: float, host_gib: float, stage, trained: int, ep: int, dp: int,
                   zero: int) -> tuple[tuple, float, float]:
        """A stage's (durations, parameters, optimizer seconds), device and host memory with its experts as
        held: ``E / ep`` of them, ``trained`` of those with gradients and optimizer state, ZeRO-sharded over
        the expert's own data-parallel peers (``moe.expert_state_delta_bytes``)."""
        durs, params, opt_s = costs
        prof = self.profile.device(self._node[stage.devices[0]].device.name) if self.profile is not None else None
        split = state_bytes_for(self.model)
        if prof is not None and prof.state_bytes_per_param:
            split = split.scaled_to(prof.state_bytes_per_param)
        dev, host = moe.expert_state_delta_bytes(self.model, stage.layers, stage.tp, ep, trained, dp, zero,
                                                 stage.offload, split)
        stepped = params + moe.optimizer_param_delta(self.model, stage.layers, stage.tp, trained)
        return (durs, stepped, opt_s * stepped / params if params > 0 else opt_s), gib + dev / GiB, host_gib + host / GiB

    def _expert_parallel_costs(self, config: ParallelConfig, stage_costs: list) -> list:
        """Replicas of an expert-parallel group run in lockstep (every all-to-all needs all of them): each stage
        takes the slowest corresponding stage's durations, plus its MoE blocks' all-to-alls."""
        model, mbs, v, ep = self.model, config.micro_batch_size, config.virtual_stages, config.expert_parallel
        out = [list(c) for c in stage_costs]
        nbytes = moe.alltoall_bytes(model, mbs, ep)
        for group in config.expert_groups():
            for s, st in enumerate(config.pipelines[group[0]].stages):
                durs = [max(stage_costs[r][s][0][i] for r in group) for i in range(2 * v)]
                bw, lat = self._dp_bandwidth(tuple(config.pipelines[r].stages[s].devices for r in group))
                a2a = moe.alltoall_s(nbytes, ep, st.tp, bw, lat)
                fwd, bwd = moe.alltoalls_per_layer(st.recompute is True)  # selective: attention only
                blocks = st.layers / v * model.moe_layer_fraction  # MoE blocks per chunk
                for c in range(v):
                    durs[2 * c] += blocks * fwd * a2a
                    durs[2 * c + 1] += blocks * bwd * a2a
                for r in group:
                    out[r][s] = (durs, stage_costs[r][s][1], stage_costs[r][s][2])
        return out

    def _moe_exchange(self, config: ParallelConfig, cursor: list[list[float]],
                      events: list[TimelineEvent] | None) -> float:
        """The per-step data-parallel exchange of an MoE / SPES plan (in place in ``cursor``); returns one SPES
        synchronisation's own seconds (0 unless ``sync_every_steps > 1``)."""
        model = self.model

        def bandwidth(parts):
            return self._dp_bandwidth(tuple(config.pipelines[p].stages[s].devices for p, s in parts))

        def nodes(part):
            return self._dp_stage(config.pipelines[part[0]].stages[part[1]].devices)[0]

        scope = "local" if config.sync_every_steps > 1 else "step"
        clock = {(r, s): cursor[r][s] for r, pipe in enumerate(config.pipelines) for s in range(len(pipe.stages))}
        spans = moe.run_collectives(moe.exchange(model, config, scope, self._grad_bytes), clock, bandwidth, nodes)
        for (r, s), t in clock.items():
            cursor[r][s] = t
        if events is not None:
            for parts, t0, t1 in spans:
                events.extend(TimelineEvent(d, "allreduce", t0, t1) for p, s in parts
                              for d in config.pipelines[p].stages[s].devices)
        if config.sync_every_steps == 1:
            return 0.0
        spans = moe.run_collectives(moe.exchange(model, config, "sync", moe.SYNC_BYTES_PER_PARAM), {}, bandwidth,
                                    nodes)
        return max((t1 for _, _, t1 in spans), default=0.0)

    def _segments(self, config: ParallelConfig) -> list[tuple[tuple[int, ...], float]]:
        """Runs of layers held by the same stage in every replica, first layers first: (the stage index
        in each replica, parameters of the run)."""
        model = self.model
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
        for x, y in zip(cuts_sorted, cuts_sorted[1:]):
            owners = tuple(bisect.bisect_right(st, x) - 1 for st in starts)
            params = (y - x) * model.params_per_layer
            if x == 0:
                params += model.embedding_params
            if y == L:
                params += model.embedding_params + model.hidden_size
            if segments and segments[-1][0] == owners:
                segments[-1] = (owners, segments[-1][1] + params)
            else:
                segments.append((owners, params))
        return segments

    @staticmethod
    def _peers(units: list, owners: tuple[int, ...]) -> list[tuple[int, int, tuple[str, ...]]]:
        """The data-parallel peers of a run of layers held by stage ``owners[r]`` of each replica ``r``: every
        rank of those stages, as (replica, unit, devices)."""
        return [(r, u, unit.view.devices) for r, s in enumerate(owners) for u, unit in enumerate(units[r])
                if unit.stage == s]

    def _data_parallel(self, config: ParallelConfig, cursor: list[list[float]], units: list,
                       events: list[TimelineEvent] | None, zero: int = 0, phase: str = "allreduce") -> None:
        """Advance each rank's clock through its gradient all-reduces (in place in ``cursor``, per unit), last
        layers first (backward order), among every rank holding the layers: the ranks of their stage in
        every replica (several in a mixed stage). With ``zero`` > 0: the reduce-scatter
        (``phase="allreduce"``) or the all-gather of the updated weights (``phase="allgather"``) of ZeRO
        (``zero.sync_s``, ``zero.gather_s``)."""
        split = state_bytes_for(self.model)
        for owners, params in reversed(self._segments(config)):
            members = self._peers(units, owners)
            n = len(members)
            if n < 2:
                continue
            stages = tuple(devs for _, _, devs in members)
            bw, lat = self._dp_bandwidth(stages)
            if zero == 0:
                t = collective_s("allreduce", self._grad_bytes * params, n, bw, lat, self._dp_kind(stages))
            elif phase == "allreduce":
                t = zr.sync_s(params, n, zero, (bw, lat), split)
            else:
                t = zr.gather_s(params, n, zero, (bw, lat), split)
            start = max(cursor[r][u] for r, u, _ in members)
            for r, u, _ in members:
                cursor[r][u] = start + t
            if events is not None and t > 0:
                events.extend(TimelineEvent(d, phase, start, start + t) for _, _, devs in members for d in devs)

    # ---------------------------------------------------------------------------------------------
    # ZeRO sharding and CPU offload (autotune.simulator.zero)

    def _stage_rings(self, config: ParallelConfig, units: list) -> dict[tuple[int, int], tuple[float, float]]:
        """Per (replica, unit): (GB/s, latency us) per device of the slowest data-parallel ring its layers take."""
        rings: dict[tuple[int, int], tuple[float, float]] = {}
        if len(config.pipelines) < 2 and not config.has_mixed_stages:
            return rings
        for owners, _ in self._segments(config):
            for members in moe.stepping_together(config, self._peers(units, owners)):
                if len(members) < 2:
                    continue
                bw, lat = self._dp_bandwidth(tuple(devs for _, _, devs in members))
                for r, u, devs in members:
                    old = rings.get((r, u))
                    ring = (bw / len(devs), lat)
                    if old is None or ring[0] < old[0]:
                        rings[(r, u)] = ring
        return rings

    def _host_links(self, config: ParallelConfig) -> dict[str, tuple[float, float]]:
        """Per node: (GB/s, latency us) of each offloading device's host link, shared when the node's
        ``host.bandwidth_GBps`` caps them."""
        count: dict[str, int] = {}
        for pipe in config.pipelines:
            for st in pipe.stages:
                if st.offload != "none":
                    for d in st.devices:
                        count[self._node[d].name] = count.get(self._node[d].name, 0) + 1
        links = {}
        for name, spec in self._node_spec.items():
            links[name] = (spec.host.shared_bandwidth_GBps(count.get(name, 0)), spec.host.link.latency_us)
        return links

    def _sharded_costs(self, config: ParallelConfig, stage_costs: list, units: list,
                       peers: dict[tuple[int, int], int]) -> tuple[list, dict]:
        """Per-unit costs with ZeRO's and offload's per-micro-batch traffic folded into forward and backward
        (``zero.chunk_comm``), and the per-device optimizer seconds (``zero.optimizer_s``). A stage's
        ranks are data-parallel peers like the replicas (``zero.peer_degrees``)."""
        model, v = self.model, config.virtual_stages
        rings = self._stage_rings(config, units)
        hosts = self._host_links(config)
        split = state_bytes_for(model)
        offloaded: dict[str, float] = {}  # node -> parameters its host CPU steps
        for r, pipe in enumerate(config.pipelines):
            for u, unit in enumerate(units[r]):
                dp = peers[(r, unit.stage)]
                n_os = dp if config.zero >= 1 and dp > 1 else 1
                if unit.view.offload != "none":
                    for d in unit.view.devices:
                        node = self._node[d].name
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
                node = self._node[st.devices[0]].name
                host = hosts[node]
                key = (st.devices, st.layers, s == 0, s == p - 1, v, config.zero, st.offload, dp, ring, host,
                       tuple(durs), params)  # params: an MoE stage steps only the experts it trains
                hit = self._zero_cache.get(key)
                if hit is None:
                    tp = len(st.devices)
                    new = list(durs)
                    per_chunk = st.layers // v if v > 1 else st.layers
                    for c in range(v):
                        parts = zr.stage_units(model, per_chunk, tp, s == 0 and c == 0, s == p - 1 and c == v - 1)
                        comm = zr.chunk_comm(parts, config.zero, st.offload, dp, ring, host, split)
                        new[2 * c], new[2 * c + 1] = comm.apply(durs[2 * c], durs[2 * c + 1])
                    per_param = opt_s / params if params else 0.0
                    opt = zr.optimizer_s(params, dp, config.zero, st.offload, per_param, host,
                                         zr.host_step_s(offloaded.get(node, 0.0)), split)
                    hit = (new, params, opt)
                    self._zero_cache[key] = hit
                row.append(hit)
            out.append(row)
        return out, offloaded

    @staticmethod
    def _pipeline_events(events: list[TimelineEvent], comp, units: tuple[Unit, ...], end: list[float],
                         durs: list[float], v: int) -> None:
        for k, ((_, _, _, di), u, (kind, c, j)) in enumerate(zip(comp.program, comp.unit_of, comp.labels)):
            t1 = end[k + 1]
            t0 = t1 - durs[di]
            name = ("F" if kind == FORWARD else "B") + str(j) + (f".c{c}" if v > 1 else "")
            events.extend(TimelineEvent(d, name, t0, t1) for d in units[u].view.devices)


_SIMULATORS: dict[tuple, Simulator] = {}


def _library_simulator(cluster: ClusterSpec, model: ModelSpec,
                       profile: CalibrationProfile | str | Path | None) -> Simulator:
    """One ``Simulator`` per (cluster, model, profile) for ``simulate``: a caller looping over plans
    gets the simulator's caches instead of a cold simulator per call (a few kept, oldest dropped).
    A profile path is keyed by its modification time and size, so an edited profile is re-read."""
    import os

    if profile is None:
        pkey: tuple = ()
    elif isinstance(profile, CalibrationProfile):
        pkey = ("object", id(profile))
    else:
        st = os.stat(profile) if os.path.exists(profile) else None
        pkey = ("path", os.path.abspath(profile), st.st_mtime_ns if st else 0, st.st_size if st else 0)
    key = (cluster, model, pkey)
    sim = _SIMULATORS.get(key)
    if sim is None:
        prof = profile if profile is None or isinstance(profile, CalibrationProfile) else \
            CalibrationProfile.load(Path(profile))
        sim = Simulator(cluster, model, prof)
        if len(_SIMULATORS) >= 8:
            _SIMULATORS.pop(next(iter(_SIMULATORS)))
        _SIMULATORS[key] = sim
    return sim


def simulate(cluster: ClusterSpec | str | Path, model: ModelSpec | str | Path,
             config: ParallelConfig | Mapping[str, Any] | str | Path,
             profile: CalibrationProfile | str | Path | None = None, global_batch_size: int | None = None,
             timeline: bool = False) -> Measurement:
    """Simulate one plan (SPEC.md "Library"): the same numbers as ``autotune simulate``.

    ``cluster``, ``model`` and ``config`` are paths, preset names or spec objects; ``profile`` a path or a
    ``CalibrationProfile``. Unlike ``Simulator.evaluate``, bad input raises ``SpecError`` naming the
    file, field and rule.
    """
    cluster_spec = load_cluster(cluster)
    model_spec = load_model(model, global_batch_size)
    cfg = load_config(config)
    cfg.validate(cluster_spec, model_spec, source=str(config) if isinstance(config, (str, Path)) else "config")
    sim = _library_simulator(cluster_spec, model_spec, profile)
    result = sim.evaluate_detailed(cfg) if timeline else sim.evaluate(cfg)
    if result.status == "invalid":
        raise SpecError("", "", result.error)
    return result
