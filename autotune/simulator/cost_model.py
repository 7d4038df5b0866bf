"""The cost model: what each piece of a plan costs on a cluster (``CostModel``), as Megatron-LM runs it.

Per layer, its matmuls (``flops.layer_matmuls``) at the device's sustained rate for their size
(``efficiency``), the memory-bound kernels (norms, softmax, dropout, activations, residual adds:
approximated from the layer's stored activation bytes of Korthikanti et al. 2022, each written once and
read once in the forward, and read, with a gradient of the same size written and read, in the backward:
2x forward, 4x backward), and tensor parallelism's two all-reduces of the ``b s h`` activations forward
and two backward (Shoeybi et al. 2019, Megatron-LM, Sec. 3) over the stage's group link; recomputation
adds one more forward to the backward. The embedding sits on the first stage, the final norm, LM head and
loss on the last. A tensor-parallel group of mixed device types runs at the pace of its slowest type.

On GPUs, on top of these (each term in its own module): a layer pass takes at least the host's time to
issue it (``overheads``); collectives and sends cost what NCCL's model says for their link kind
(``collectives``); a tensor-parallel stage's sends share their node's network; the device's view of
memory (``device_memory``) adds the CUDA context, library buffers and the allocator's pool to the tensors.
CPU devices keep the calibrated gloo model. A calibration profile replaces modelled times, links and
memory terms by measured ones where it has them.

The optimizer step is memory-bandwidth bound: 28 bytes of traffic per parameter (read the fp32 weight,
both Adam moments and the 16-bit gradient; write the three fp32 tensors and the 16-bit weight).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autotune.profile import CalibrationProfile
from autotune.simulator import moe
from autotune.simulator.backward import backward_ratio
from autotune.simulator.collectives import collective_s, intra_node_kind, send_s
from autotune.simulator.device_memory import device_memory
from autotune.simulator.efficiency import DeviceRates
from autotune.simulator.engine_terms import DEFAULT_ENGINE, fp32_state, head_group, scatter_gather
from autotune.simulator.flops import (
    head_matmul,
    layer_matmuls,
    model_flops_per_token,
    op_recomputed_matmuls,
    score_traffic_bytes,
)
from autotune.simulator.memory import GiB, layer_activation_bytes, stage_params, stage_peak_GiB
from autotune.simulator.overheads import NO_HOST_COST, host_cost
from autotune.simulator.zero import stage_states, state_bytes_for
from autotune.specs import ClusterSpec, LinkSpec, Measurement, ModelSpec, NodeSpec
from autotune.specs.handoff import busiest_fraction, handoff
from autotune.specs.recompute import checkpointed_blocks, every_n


@dataclass(frozen=True, slots=True)
class StageEstimate:
    """What ``CostModel.stage_estimate`` predicts for one stage (times per micro-batch)."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    memory_GiB: float  # peak per device
    usable_GiB: float  # capacity minus the reserve, smallest among the stage's devices
    host_memory_GiB: float = 0.0  # offloaded state per device, in its node's host memory

    @property
    def fits(self) -> bool:
        return self.memory_GiB <= self.usable_GiB


OPTIMIZER_BYTES_PER_PARAM = (
    28  # Adam step traffic: read 4+4+4+2, write 4+4+4+2 bytes per parameter (fp32: 4+4+4+4, 4+4+4)
)
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


class CostModel:
    """The cost of each piece of a plan on a cluster: a layer pass, a stage's forward and backward per
    micro-batch, its memory, a pipeline send, a data-parallel ring, the optimizer step.

    Built once per (cluster, model, profile); every answer is cached. The ``Simulator`` composes these into
    one iteration; the structured planner (``stage_estimate``, ``p2p_time_s``, ``allreduce_time_s``), the
    mixed-stage shares and RoundPipe's schedule (``unit_costs``) ask it directly, so they price a plan the
    way ``evaluate`` does. The model's ``precision`` sets the matmul peak and the size of every activation,
    gradient and message; its ``attention`` says whether the ``s x s`` scores are stored (``standard``)
    or not (``flash``).
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        model: ModelSpec,
        profile: CalibrationProfile | None = None,
        engine: str = DEFAULT_ENGINE,
    ) -> None:
        self.cluster = cluster
        self.model = model
        self.profile = profile
        self.engine = engine  # the engine running the plan, where engines differ (autotune.simulator.engine_terms)
        self._eff = _apply_profile(cluster, profile)
        self.node: dict[str, NodeSpec] = {d: n for n in self._eff.nodes for d in n.device_ids()}
        self.node_spec: dict[str, NodeSpec] = {n.name: n for n in self._eff.nodes}
        self.rates: dict[str, DeviceRates] = {}
        for n in self._eff.nodes:
            key = f"{n.device.name}@{n.slowdown:g}"
            if key not in self.rates:
                self.rates[key] = DeviceRates(
                    n.device, profile.device(n.device.name) if profile else None, n.slowdown, model.precision
                )
        self.rate_key = {d: f"{n.device.name}@{n.slowdown:g}" for d, n in self.node.items()}
        # a plan is oom when the device view of its memory (allocator peak, pool, CUDA context and library
        # buffers: autotune.simulator.device_memory) exceeds the device's capacity
        self.usable = {d: n.device.memory_GiB for d, n in self.node.items()}
        self._layer_cache: dict[tuple, tuple[float, ...]] = {}
        self._stage_cache: dict[tuple, tuple] = {}
        self._unit_cache: dict[tuple, tuple] = {}
        self._memory_cache: dict[tuple, float] = {}
        self._p2p_cache: dict[tuple, float] = {}
        self._dp_stage_cache: dict[tuple, tuple] = {}
        self._dp_ring_cache: dict[tuple, tuple[float, float, str]] = {}
        self._flops_per_token = model_flops_per_token(model)
        # gradients are all-reduced in the model's precision (16-bit in Megatron-LM's fp16 default), in fp32
        # where the engine keeps fp32 gradients under bf16 autocast (autotune's runner: engine_terms.fp32_state)
        elem = max(r.elem_bytes for r in self.rates.values())
        self.grad_bytes = 4 if fp32_state(model.precision, engine) else elem
        self.state_split = state_bytes_for(model, engine)  # bytes per parameter: weights, gradients, optimizer

    def memory_use(self, m: Measurement) -> float:
        """The fullest device's peak over its usable memory (capacity less the reserve) in ``m``; > 1
        does not fit. Offloaded state counts as its node's host use over the host's memory."""
        use = max((gib / self.usable[d] for d, gib in m.peak_memory_GiB.items() if d in self.usable), default=0.0)
        for node, gib in m.host_memory_GiB.items():
            spec = self.node_spec.get(node)
            if spec is not None and spec.host.memory_GiB > 0:
                use = max(use, gib / spec.host.memory_GiB)
        return use

    # Cost queries for planners (``autotune.planning.planner``): the same numbers ``evaluate`` composes

    def stage_estimate(
        self,
        devices: tuple[str, ...],
        layers: int,
        recompute: bool | str,
        first: bool,
        last: bool,
        mbs: int,
        in_flight: int,
        dp: int = 1,
        zero: int = 0,
        offload: str = "none",
        sequence_parallel: bool = False,
    ) -> StageEstimate:
        """One stage of a 1F1B-style pipeline (one model chunk): its forward and backward time per
        micro-batch, its optimizer step, and its peak memory per device holding ``in_flight``
        micro-batches' activations (with ``dp`` data-parallel peers for ZeRO sharding), against the
        smallest usable memory among its devices. Time terms of ZeRO and offload are not included."""
        durs, _, opt = self.stage_costs(tuple(devices), layers, recompute, first, last, mbs, 1, sp=sequence_parallel)
        memory, host = self.stage_memory_GiB(
            tuple(devices), layers, recompute, first, last, mbs, in_flight, 1, dp, zero, offload, sequence_parallel
        )
        memory = self.device_view(devices[0], memory)
        return StageEstimate(durs[0], durs[1], opt, memory, min(self.usable[d] for d in devices), host)

    def unit_costs(self, device: str, mbs: int) -> tuple[float, ...]:
        """Seconds per micro-batch on ``device`` without tensor parallelism: (block forward, block backward,
        block backward with recomputation, embedding forward, embedding backward, head forward, head
        backward), calibrated by the profile where it has them (``autotune.simulator.roundpipe``)."""
        lf, lb, lbr, _, _, ef, eb, hf, hb, _ = self.layer_costs(self.rate_key[device], 1, mbs, _NO_LINK)
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
        return self.p2p(tuple(src), tuple(dst), mbs)

    def allreduce_time_s(self, owners: tuple[tuple[str, ...], ...], params: float, ranks: int | None = None) -> float:
        """The data-parallel gradient all-reduce of a run of layers with ``params`` parameters (all its
        tensor-parallel shards: a stage's devices carry theirs in parallel) among the stages
        ``owners`` (one per replica), as ``evaluate`` times it; ``ranks`` members in the ring when
        ``owners`` lists only some of them (the slowest hop among those sets the pace)."""
        n = len(owners) if ranks is None else ranks
        if n < 2:
            return 0.0
        owners = tuple(tuple(o) for o in owners)
        return self.ring_allreduce_s(self.dp_ring(owners), params, n)

    def ring_allreduce_s(self, ring: tuple[float, float, str], params: float, ranks: int) -> float:
        """``allreduce_time_s`` over a ring whose ``dp_ring`` (or ``ring_of``) is ``ring``."""
        bw, lat, kind = ring
        return collective_s("allreduce", self.grad_bytes * params, ranks, bw, lat, kind)

    # ---------------------------------------------------------------------------------------------

    def layer_costs(
        self, rate_key: str, tp: int, mbs: int, link: LinkSpec, sp: bool = False, ep: int = 1, kind: str = "nvlink"
    ) -> tuple[float, ...]:
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
        rates = self.rates[rate_key]
        model = self.model
        e = rates.elem_bytes
        sp = sp and tp > 1
        s, h = model.seq_len, model.hidden_size
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
        # per-op selective (torchtitan's policy) reruns every second linear matmul, the element-wise traffic
        # and, with standard attention, the attention core and its score traffic
        reruns = op_recomputed_matmuls(model, mbs, tp)
        layer_bo = layer_b + elementwise + score_f + (0.0 if model.is_moe else sum(rates.matmul_s(m) for m in reruns))
        emb_f, emb_b, head_f, head_b = self._end_costs(rates, tp, mbs, link, sp, kind, tp_ar)
        opt = rates.memory_s(OPTIMIZER_BYTES_PER_PARAM)
        # the host issues every pass; small passes wait for it (launch-bound), large ones hide it
        hc = host_cost(rates.device.name, tp) if rates.slowdown == 1.0 else NO_HOST_COST
        layer_f, layer_b = max(layer_f, hc.layer_forward_s), max(layer_b, hc.layer_backward_s)
        layer_br, layer_bs = max(layer_br, hc.layer_forward_s + hc.layer_backward_s), max(layer_bs, hc.layer_backward_s)
        layer_bo = max(layer_bo, hc.layer_backward_s)
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
                scale = layer_f / (mm + elementwise + score_f + 2 * tp_ar)
                layer_bs = layer_b + (layer_bs - layer_b) * scale
                layer_bo = layer_b + (layer_bo - layer_b) * scale
            measured = prof.layer_timing(model, mbs, tp, recompute=True) if not model.is_moe else None
            if measured is not None:
                layer_br = measured.backward_s * sd
            measured = prof.layer_timing(model, mbs, tp, recompute="selective") if not model.is_moe else None
            if measured is not None:
                layer_bs = measured.backward_s * sd
            measured = prof.layer_timing(model, mbs, tp, recompute="selective-op") if not model.is_moe else None
            if measured is not None:
                layer_bo = measured.backward_s * sd
            edge = prof.edge_timing(model, mbs, tp)
            if edge is not None:
                emb_f, emb_b = edge.embedding_forward_s * sd, edge.embedding_backward_s * sd
                head_f, head_b = edge.head_forward_s * sd, edge.head_backward_s * sd
            if prof.optimizer_s_per_param is not None:
                opt = prof.optimizer_s_per_param * rates.slowdown
        out = (layer_f, layer_b, layer_br, layer_bs, layer_bo, emb_f, emb_b, head_f, head_b, opt)
        self._layer_cache[key] = out
        return out

    def _end_costs(
        self, rates: DeviceRates, tp: int, mbs: int, link: LinkSpec, sp: bool, kind: str, tp_ar: float
    ) -> tuple[float, float, float, float]:
        """(embedding forward, embedding backward, head forward, head backward) seconds of one micro-batch
        (``layer_costs``; ``tp_ar``: one all-reduce of the b s h activations in the tensor-parallel group)."""
        model, e = self.model, rates.elem_bytes
        V, tokens = model.vocab_size, mbs * model.seq_len
        act_bytes = e * tokens * model.hidden_size
        # the embedding and the head split ``ht`` ways: vocabulary-parallel (ht = tp), or whole on every rank
        # (ht = 1, autotune's runner where tp does not divide the vocabulary: no all-reduce; with sequence
        # parallelism the head gathers the sequence and the embedding's gradient is gathered back, half an
        # all-reduce each)
        ht = head_group(self.engine, tp, self.model.vocab_size)
        vocab_ar = tp_ar if ht > 1 else 0.0
        gather = 0.5 * tp_ar if ht == 1 and sp else 0.0
        # embedding: gather rows and write the output (2 e s b h bytes); vocab-parallel: one all-reduce
        emb_f = rates.memory_s(2.0 * act_bytes) + vocab_ar
        emb_b = rates.memory_s(2.0 * act_bytes) + gather
        # final norm, logits matmul, cross-entropy (~e + 8 bytes per logit each way: the logits and their
        # fp32 softmax and gradient; vocabulary-parallel: 3 small fp32 all-reduces of b s values)
        head = rates.matmul_s(head_matmul(model, mbs, ht))
        logits = tokens * -(-V // ht)
        ce_ar = 3 * collective_s("allreduce", 4.0 * tokens, ht, link.bandwidth_GBps, link.latency_us, kind)
        head_f = head + rates.memory_s((e + 8.0) * logits + 2.0 * act_bytes) + ce_ar + gather
        head_b = 2 * head + rates.memory_s((e + 8.0) * logits + 2.0 * act_bytes) + vocab_ar
        return emb_f, emb_b, head_f, head_b

    def stage_costs(
        self,
        devices: tuple[str, ...],
        layers: int,
        recompute: bool | str,
        first: bool,
        last: bool,
        mbs: int,
        v: int,
        ep: int = 1,
        sp: bool = False,
    ) -> tuple:
        """(durations [F, B per chunk], parameters per device, optimizer seconds) of one stage."""
        key = (devices, layers, recompute, first, last, mbs, v, ep, sp)
        hit = self._stage_cache.get(key)
        if hit is not None:
            return hit
        tp = len(devices)
        link = self._eff.group_link(devices) if tp > 1 else _NO_LINK
        lpc = layers / v
        params = stage_params(self.model, layers, tp, first, last, head_group(self.engine, tp, self.model.vocab_size))
        durs = [0.0] * (2 * v)
        opt_s = 0.0
        for rk in sorted({self.rate_key[d] for d in devices}):  # mixed types: the slowest sets the pace
            lf, lb, lbr, lbs, lbo, ef, eb, hf, hb, opt = self.layer_costs(
                rk, tp, mbs, link, sp, ep, self.group_kind(devices)
            )
            lback = {True: lbr, "selective": lbs, "selective-op": lbo}.get(recompute, lb)
            # a profile's measured pipeline-runtime cost per micro-batch and stage chunk (calibration)
            prof = self.rates[rk].profile
            ovh = (prof.microbatch_overhead_s or 0.0) * self.rates[rk].slowdown / 2 if prof is not None else 0.0
            # and its measured fixed cost of tensor-parallel collectives per layer (calibration)
            tp_ovh = prof.tensor_parallel_overhead_s(tp) / 2 if prof is not None and tp > 1 else 0.0
            # every-N: the N-th blocks of each chunk rerun their forward
            rerun = checkpointed_blocks(recompute, round(lpc)) if recompute is not True else 0
            for c in range(v):
                f = lpc * (lf + tp_ovh) + ovh
                b = lpc * (lback + tp_ovh) + rerun * lf + ovh
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

    def stage_memory_GiB(
        self,
        devices: tuple[str, ...],
        layers: int,
        recompute: bool | str,
        first: bool,
        last: bool,
        mbs: int,
        in_flight: int,
        v: int,
        dp: int = 1,
        zero: int = 0,
        offload: str = "none",
        sp: bool = False,
    ) -> tuple[float, float]:
        """(device peak GiB, host GiB of offloaded state) of one device of a stage."""
        prof = self.profile.device(self.node[devices[0]].device.name) if self.profile is not None else None
        tp = len(devices)
        sp = sp and tp > 1
        elem = self.rates[self.rate_key[devices[0]]].elem_bytes
        key = (
            tp,
            layers,
            recompute,
            first,
            last,
            mbs,
            in_flight,
            v,
            prof.name if prof else None,
            dp if zero or offload != "none" else 1,
            zero,
            offload,
            sp,
            elem,
        )
        hit = self._memory_cache.get(key)
        if hit is None:
            full = kept = per_param = None
            baseline, act_factor = 0.0, 1.0
            if prof is not None:  # calibration: measured activation bytes and per-process baseline
                dense = not self.model.is_moe  # a profile measures dense blocks only
                measured = prof.layer_timing(self.model, mbs, len(devices)) if dense else None
                full = measured.activation_bytes if measured is not None else None
                if recompute and dense:  # every-N keeps what full recomputation keeps in its N-th blocks
                    rc = recompute if every_n(recompute) is None else True
                    measured = prof.layer_timing(self.model, mbs, len(devices), recompute=rc)
                    kept = measured.activation_bytes if measured is not None else None
                # the CPU runner's measured process baseline is part of what it reports as allocated (RSS
                # growth); a GPU's is outside the allocator and joins the device view (device_view)
                if self.node[devices[0]].device.name == "cpu":
                    baseline = prof.memory_baseline_GiB or 0.0
                per_param = prof.state_bytes_per_param
                act_factor = prof.activation_memory_factor or 1.0
            states_bytes, host_GiB = None, 0.0
            if (zero and dp > 1) or offload != "none":  # ZeRO sharding / CPU offload (autotune.simulator.zero)
                split = self.state_split
                if per_param is not None:
                    split = split.scaled_to(per_param)
                ht = head_group(self.engine, len(devices), self.model.vocab_size)
                st = stage_states(self.model, layers, len(devices), first, last, dp, zero, offload, split, ht)
                states_bytes, host_GiB = st.device_bytes + st.working_bytes, st.host_bytes / 2**30
            dev = stage_peak_GiB(
                self.model,
                mbs,
                tp,
                layers,
                recompute,
                in_flight,
                v,
                first,
                last,
                full,
                kept,
                baseline,
                per_param,
                act_factor,
                states_bytes,
                sp,
                elem,
                self.engine,
            )
            hit = (dev, host_GiB)
            self._memory_cache[key] = hit
        return hit

    def p2p(
        self, src: tuple[str, ...], dst: tuple[str, ...], mbs: int, sp: bool = False, dst_sp: bool | None = None
    ) -> float:
        """One activation (or its gradient) from stage ``src`` to stage ``dst`` (``sp``, ``dst_sp``: their
        sequence parallelism; ``dst_sp`` defaults to ``sp``): the transfers ``autotune.specs.handoff`` gives
        between their tensor-parallel ranks, the ``e b s h`` tensor or the parts of its sequence each
        receiver needs. Over per-rank links the busiest rank sets the time; between nodes every transfer
        from the sending node shares its network bandwidth; NCCL-like costs per link kind
        (``collectives.send_s``). Under an engine that scatters and gathers (``engine_terms.scatter_gather``)
        each rank sends its ``1/t`` and the receiving group all-gathers the activation over its own link."""
        dst_sp = sp if dst_sp is None else dst_sp
        key = (src[0], dst[0], mbs, len(src), len(dst), sp and len(src) > 1, dst_sp and len(dst) > 1)
        hit = self._p2p_cache.get(key)
        if hit is None:
            e = self.rates[self.rate_key[src[0]]].elem_bytes
            whole = e * mbs * self.model.seq_len * self.model.hidden_size
            t = len(src)
            split = scatter_gather(self.engine, t, len(dst), sp or dst_sp)
            transfers = handoff(t, sp, len(dst), dst_sp)
            link = self._eff.link(src[0], dst[0])
            a, b = self.node[src[0]], self.node[dst[0]]
            share = 1.0 / t if split else 1.0  # of each transfer, on the wire
            if a.device.name == "cpu":
                kind, nbytes = "host", whole * busiest_fraction(transfers) * share
            elif a.name == b.name:
                kind = intra_node_kind(link.bandwidth_GBps, a.device.name)
                nbytes = whole * busiest_fraction(transfers) * share
            else:  # the sending node's ranks share its NIC
                kind = "network"
                nbytes = whole * share * sum(x.fraction for x in transfers if self.node[src[x.src]].name == a.name)
            hit = send_s(nbytes, link.bandwidth_GBps, link.latency_us, kind)
            if split:  # the receiving stage puts the activation back together
                group = self._eff.group_link(dst)
                hit += collective_s(
                    "all_gather", whole, t, group.bandwidth_GBps, group.latency_us, self.group_kind(dst)
                )
            self._p2p_cache[key] = hit
        return hit

    def group_kind(self, devices: tuple[str, ...]) -> str:
        """Link kind of a tensor-parallel group's collectives (``collectives``)."""
        node = self.node[devices[0]]
        if node.device.name == "cpu":
            return "host"
        if any(self.node[d].name != node.name for d in devices):
            return "network"
        return intra_node_kind(node.intra_node.bandwidth_GBps, node.device.name)

    def rank_costs(
        self, view, first: bool, last: bool, mbs: int, in_flight: int, v: int, ep: int, dp: int, zero: int, memory
    ):
        """One stage rank's (``view``: its devices, layers, recompute, offload, sequence parallelism) ``stage_costs``,
        its memory by ``memory`` (``stage_memory_GiB`` or layer-wise execution's: ``(devices, layers, recompute,
        first, last, mbs, in_flight, v, dp, zero, offload, sp) -> (GiB, host GiB)``) and its device's view of
        that memory: (costs, GiB, host GiB, device GiB), cached (a search meets the same ranks again and again)."""
        key = (
            view.devices,
            view.layers,
            view.recompute,
            first,
            last,
            mbs,
            in_flight,
            v,
            ep,
            dp,
            zero,
            view.offload,
            view.sequence_parallel,
            memory,
        )
        hit = self._unit_cache.get(key)
        if hit is None:
            devices, sp = view.devices, view.sequence_parallel
            c = self.stage_costs(devices, view.layers, view.recompute, first, last, mbs, v, ep, sp)
            gib, host_gib = memory(
                devices, view.layers, view.recompute, first, last, mbs, in_flight, v, dp, zero, view.offload, sp
            )
            hit = self._unit_cache[key] = (c, gib, host_gib, self.device_view(devices[0], gib))
        return hit

    def device_view(self, device: str, allocated_GiB: float) -> float:
        """The device's view of a stage's memory (``device_memory``). A profile's measured per-process
        baseline replaces the class's context term: on a GPU (memory outside the allocator, measured by
        ``autotune profile``) it is added here; on a CPU it is already in ``allocated_GiB``."""
        name = self.node[device].device.name
        prof = self.profile.device(name) if self.profile is not None else None
        dm = device_memory(name)
        if prof is not None and prof.memory_baseline_GiB is not None:
            if name == "cpu":
                return allocated_GiB
            return allocated_GiB * (1.0 + dm.fragmentation) + prof.memory_baseline_GiB
        return dm.device_GiB(allocated_GiB)

    def dp_stage(self, devices: tuple[str, ...]) -> tuple:
        """(nodes, intra-node GB/s, network GB/s, intra latency us, network latency us, the first device's
        class, its node's intra-node GB/s) of one stage as a data-parallel ring member: its tensor-parallel
        ranks carry their shards in parallel."""
        hit = self._dp_stage_cache.get(devices)
        if hit is None:
            nodes = {self.node[d].name: self.node[d] for d in devices}
            node = self.node[devices[0]]
            hit = (
                frozenset(nodes),
                len(devices) * min(n.intra_node.bandwidth_GBps for n in nodes.values()),
                sum(n.network.bandwidth_GBps for n in nodes.values()),
                max(n.intra_node.latency_us for n in nodes.values()),
                max(n.network.latency_us for n in nodes.values()),
                node.device.name,
                node.intra_node.bandwidth_GBps,
            )
            self._dp_stage_cache[devices] = hit
        return hit

    def dp_bandwidth(self, owners: tuple[tuple[str, ...], ...]) -> tuple[float, float]:
        """(GB/s, latency us) of a ring among stages ``owners``: a stage moves ``tp x`` its devices'
        intra-node bandwidth, capped by its nodes' network bandwidth when the ring leaves the node; the
        slowest stage sets the pace (``dp_ring``)."""
        bw, lat, _ = self.dp_ring(owners)
        return bw, lat

    def dp_ring(self, owners: tuple[tuple[str, ...], ...]) -> tuple[float, float, str]:
        """(GB/s, latency us, link kind: ``collectives``) of a data-parallel ring among stages ``owners``
        (``dp_bandwidth`` without the kind), from each stage's ``dp_stage``, cached (a search meets the same
        rings again and again; the planner meets new ones all the time, so a miss is one pass over the
        stages)."""
        hit = self._dp_ring_cache.get(owners)
        if hit is None:
            hit = self._dp_ring_cache[owners] = self.ring_of([self.dp_stage(stage) for stage in owners])
        return hit

    def ring_of(self, infos: list[tuple]) -> tuple[float, float, str]:
        """``dp_ring`` of the stages whose ``dp_stage`` are ``infos`` (the first stage's first)."""
        first = infos[0]
        names = first[0]
        one_node = len(names) == 1
        if one_node:
            for info in infos:
                if info[0] != names:
                    one_node = False
                    break
        device = first[5]
        if one_node:  # every stage on the same single node: its intra-node links
            bw, lat = min(info[1] for info in infos), max(info[3] for info in infos)
            return bw, lat, "host" if device == "cpu" else intra_node_kind(first[6], device)
        bw, lat = min(min(info[1], info[2]) for info in infos), max(info[4] for info in infos)
        return bw, lat, "host" if device == "cpu" else "network"

    # ---------------------------------------------------------------------------------------------
    # One iteration

    def moe_stage(
        self, costs: tuple, gib: float, host_gib: float, stage, trained: int, ep: int, dp: int, zero: int
    ) -> tuple[tuple, float, float]:
        """A stage's (durations, parameters, optimizer seconds), device and host memory with its experts as
        held: ``E / ep`` of them, ``trained`` of those with gradients and optimizer state, ZeRO-sharded over
        the expert's own data-parallel peers (``moe.expert_state_delta_bytes``)."""
        durs, params, opt_s = costs
        prof = self.profile.device(self.node[stage.devices[0]].device.name) if self.profile is not None else None
        split = self.state_split
        if prof is not None and prof.state_bytes_per_param:
            split = split.scaled_to(prof.state_bytes_per_param)
        dev, host = moe.expert_state_delta_bytes(
            self.model, stage.layers, stage.tp, ep, trained, dp, zero, stage.offload, split
        )
        stepped = params + moe.optimizer_param_delta(self.model, stage.layers, stage.tp, trained)
        return (
            (durs, stepped, opt_s * stepped / params if params > 0 else opt_s),
            gib + dev / GiB,
            host_gib + host / GiB,
        )
