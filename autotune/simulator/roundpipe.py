"""RoundPipe's dispatch schedule, simulated: ``simulate(costs, config) -> Measurement`` for ``"schedule": "roundpipe"``.

What is simulated is what the ``roundpipe`` library (0.1.x: ``RoundPipe.forward_backward``, ``device.py``,
``transfer.py``, ``scheduler.py``) does with an execute plan; the plan's fields are in
``autotune.specs.roundpipe``.

**Stages.** One pass (``forward_backward`` call) hands out, in order, the forward stages (layer order),
the fused stage (the last ``fused_layers`` blocks with the final norm, LM head and loss: forward, then
backward, per micro-batch) and the backward stages from the last layers down. Each stage goes to the
*next GPU of the pool in turn* (one global round-robin cursor that carries on across passes and
iterations, as ``device.get_next_device``), and that GPU runs the stage for all of the pass's micro-batches,
in order, after the stages it was handed before. Per micro-batch a stage costs (``CostModel.unit_costs``,
no tensor parallelism): a forward stage its blocks' forwards (and the embedding's); the fused stage its
blocks' forwards and backwards and the head's; a backward stage its blocks' recomputation and backward
(and the embedding's), at either recompute grain (the compute is the same).

**Host link.** Each GPU has its own link to host memory, one channel per direction (PCIe is full
duplex), at ``host.link`` bandwidth, or ``host.bandwidth_GBps / pool size`` when the node caps its
devices' traffic as a whole (a shared PCIe root). Over it go:

- host -> GPU: each stage's 16-bit parameters before its first micro-batch (with accumulation, a backward
  stage's gradient accumulated so far too), and per micro-batch the stage's input (activations; for a
  backward stage the gradient of its output and the stage input it recomputes from, every block's input
  at grain ``layer``);
- GPU -> host: per micro-batch the stage's output (activation or gradient) and, from forward stages, the
  inputs the backward stages will recompute from; each backward and fused stage's 16-bit gradients after
  its last micro-batch.

Activations have priority: they take the channel when they are ready, and parameter uploads and
gradient downloads fill the time between them (RoundPipe splits a parameter upload into chunks queued
behind the activation uploads). A GPU uploads the next stage handed to it while it computes the current
one (prefetch), but not earlier than the end of the stage before the current one, whose buffers it
reuses: two stages' parameters at most are on a GPU. A micro-batch starts when its input is on the GPU,
the stage's parameters are, and the GPU finished the previous micro-batch. Transfers cost their latency
plus bytes over bandwidth.

**Passes and the optimizer.** The next pass is handed out once the fused stage's last loss is back on the
host (``forward_backward`` synchronises on it) while the backward stages still run. The optimizer steps
on the host CPU after the iteration's gradients are down (``zero.HOST_ADAM_PARAMS_PER_S``, all parameters,
plus a ring all-reduce of the 16-bit gradients over the network between replicas), asynchronously, as
RoundPipe's ``step(is_async=True)`` default: the next iteration runs meanwhile (on weights one step old),
and the one after waits for it. Consecutive iterations therefore overlap their fill and drain, and the
simulation runs ``WARMUP_ITERATIONS`` and then a cycle of them back to back and reports the mean time
between the ends of the last ones (one round-robin cycle, ``measured_iterations``). Bubbles are whatever idle time that leaves.

**Memory.** Per GPU: for every stage it runs, that stage's 16-bit parameters (and gradients, backward and
fused stages) plus those of the next stage it was handed (being uploaded), plus the stage's activations
for one micro-batch (forward stage: one block's, outputs are detached after each block; fused stage:
all its blocks' plus one loss chunk's logits (``LOSS_CHUNK_TOKENS``); backward stage: all its
blocks' at grain ``stage``, one block's at grain ``layer``) and an input and an output buffer; the peak
over its stages against the usable memory (``memory.usable_memory_GiB``). Per stage, parameters and
gradients together must stay under half the plan's ``memory_limit_GiB`` (RoundPipe's own rule for its
partitions), else the plan is invalid. Per node, host memory holds ``host_bytes_per_param`` for every
parameter and one pass's kept stage inputs and in-flight activations.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autotune.simulator.communication import ring_allreduce_s
from autotune.simulator.cost_model import CostModel
from autotune.simulator.memory import GiB, layer_activation_bytes, usable_memory_GiB
from autotune.simulator.zero import HOST_ADAM_PARAMS_PER_S
from autotune.specs import Measurement, ParallelConfig, TimelineEvent
from autotune.specs.roundpipe import RoundPipeStages

#: host memory per parameter besides the model's own weights and their pinned gradient buffer (each
#: ``ModelSpec.bytes_per_element``: 2 in 16-bit training): the optimizer's fp32 master weights (4), fp32
#: gradient (4) and Adam moments (8) (``RoundPipe(optim_dtype=float32)`` with ``roundpipe.optim.Adam``, as
#: the paper's scripts run it): 20 bytes per parameter in all for bf16 / fp16 models
HOST_OPTIMIZER_BYTES_PER_PARAM = 16


def host_bytes_per_param(model) -> float:
    """Host memory per parameter of a roundpipe plan (weights, gradient buffer, optimizer state)."""
    return 2 * model.bytes_per_element + HOST_OPTIMIZER_BYTES_PER_PARAM


#: token ids (int64) are the embedding's input
TOKEN_BYTES = 8
#: RoundPipe's model presets compute the LM head and the loss this many tokens at a time
#: (``roundpipe.models.function.TOKEN_CHUNK_SIZE``, ``ChunkedCompileLinearForCausalLMLoss``): only one
#: chunk's logits are ever on the GPU
LOSS_CHUNK_TOKENS = 4096
#: iterations simulated before the measured ones (the overlap of iterations settles)
WARMUP_ITERATIONS = 2


# --------------------------------------------------------------------------------------------------
# Stages of one pass


@dataclass(frozen=True, slots=True)
class StageWork:
    """One stage of a pass, whichever GPU takes it; bytes and seconds per micro-batch unless named."""

    label: str  # "F0", "FB", "B3" (forward and backward stages numbered in layer order)
    compute_s: float
    param_bytes: float  # uploaded before the first micro-batch
    grad_bytes: float  # downloaded after the last (backward and fused stages)
    in_bytes: float
    out_bytes: float
    activation_bytes: float  # working set for one micro-batch besides parameters and gradients
    saved_bytes: float  # stage inputs kept in host memory for the backward (forward stages)


def pass_stages(costs: CostModel, rp: RoundPipeStages, mbs: int, device: str) -> list[StageWork]:
    """The stages of one pass in the order they are handed out: forward, fused, backward (last first)."""
    model = costs.model
    L, s, h = model.num_layers, model.seq_len, model.hidden_size
    lf, lb, lbr, ef, eb, hf, hb = costs.unit_costs(device, mbs)
    w = model.bytes_per_element  # weights, gradients and activations in the model's precision
    act = w * mbs * s * h
    ids = TOKEN_BYTES * mbs * s
    layer_act = layer_activation_bytes(model, mbs, 1)
    # one chunk's logits in the model's precision, fp32 softmax and its gradient (memory.py's rule)
    logits = (w + 8.0) * min(s * mbs, LOSS_CHUNK_TOKENS) * model.vocab_size
    P = model.params_per_layer * w
    emb = model.end_params(True, False) * w
    head = model.end_params(False, True) * w
    layer_grain = rp.recompute_grain == "layer"
    fwd = rp.forward_ranges(L)[:-1]
    bwd = rp.backward_ranges(L)[:-1]
    starts = {a for a, _ in bwd}  # blocks whose input a backward stage recomputes from (0: the embedding's)

    def kept(a: int, b: int, embedding: bool) -> float:
        """Inputs of units in [a, b) the backward pass recomputes from."""
        if layer_grain:
            return (ids if embedding else 0.0) + (b - a) * act
        out = ids if embedding else 0.0  # backward stage 0 starts at the embedding
        return out + sum(act for x in range(a, b) if x in starts and x > 0)

    stages = []
    for k, (a, b) in enumerate(fwd):
        e = k == 0
        saved = kept(a, b, e)
        stages.append(
            StageWork(
                f"F{k}",
                (b - a) * lf + (ef if e else 0.0),
                (b - a) * P + (emb if e else 0.0),
                0.0,
                ids if e else act,
                act + saved,
                layer_act + 2 * act,
                saved,
            )
        )
    f = rp.fused_layers
    fused_params = f * P + head
    stages.append(
        StageWork(
            "FB", f * (lf + lb) + hf + hb, fused_params, fused_params, act, act, f * layer_act + logits + 2 * act, 0.0
        )
    )
    for j in range(len(bwd) - 1, -1, -1):
        a, b = bwd[j]
        e = j == 0
        params = (b - a) * P + (emb if e else 0.0)
        saved_in = ((ids if e else 0.0) + (b - a) * act) if layer_grain else (ids if e else act)
        acts = (layer_act if b > a else 0.0) if layer_grain else (b - a) * layer_act
        stages.append(
            StageWork(
                f"B{j}",
                (b - a) * lbr + ((ef + eb) if e else 0.0),
                params,
                params,
                act + saved_in,
                0.0 if e else act,
                acts + 2 * act,
                0.0,
            )
        )
    return stages


# --------------------------------------------------------------------------------------------------
# One direction of one GPU's host link


_ARANGE: dict[int, np.ndarray] = {}


def _arange(n: int) -> np.ndarray:
    a = _ARANGE.get(n)
    if a is None:
        a = _ARANGE[n] = np.arange(n, dtype=float)
    return a


class _Channel:
    """Busy intervals of one link direction: ``reserve`` places a transfer whole in the first gap at
    or after its ready time (activations), ``fill`` spreads one over the free time from its ready time
    on (parameter and gradient streams, which yield to activations)."""

    __slots__ = ("starts", "ends", "busy_s")

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.busy_s = 0.0

    def forget_before(self, t: float) -> None:
        """Drop the intervals that end before ``t``: no transfer is ready before ``t`` any more."""
        i = bisect.bisect_left(self.ends, t)
        if i:
            del self.starts[:i]
            del self.ends[:i]

    def reserve(self, t: float, d: float) -> float:
        if d <= 0.0:
            return t
        starts, ends = self.starts, self.ends
        if not ends or t >= ends[-1] - 1e-12:  # the usual case: after everything placed so far
            t = max(t, ends[-1]) if ends else t
            self.busy_s += d
            if ends and t <= ends[-1] + 1e-12:
                ends[-1] = t + d
            else:
                starts.append(t)
                ends.append(t + d)
            return t + d
        i = bisect.bisect_right(ends, t)
        while i < len(starts):
            if starts[i] > t and starts[i] - t >= d:
                break
            if ends[i] > t:
                t = ends[i]
            i += 1
        self._put([(t, t + d)], i, i)
        return t + d

    def reserve_many(self, ready: np.ndarray, d: float) -> np.ndarray:
        """``reserve`` for transfers ready at non-decreasing times, in order; returns their ends. Those
        ready before the last busy interval ends look for gaps one by one; the rest queue at the end:
        ``e_i = d + max(e_(i-1), r_i)``, a running maximum (``g_i = e_i - (i + 1) d = max(g_(i-1), r_i - i d)``)."""
        if d <= 0.0:
            return ready.copy()
        n = len(ready)
        j = 0
        ends = self.ends
        if ends and ready[0] < ends[-1] - 1e-12:
            out = np.empty(n)
            while j < n and ready[j] < ends[-1] - 1e-12:
                out[j] = self.reserve(float(ready[j]), d)
                j += 1
            if j == n:
                return out
        else:
            out = None
        r = ready[j:] if j else ready
        k = _arange(len(r))
        base = self.ends[-1] if self.ends else -math.inf
        g = np.maximum.accumulate(np.maximum(r - k * d, base))
        e = g + (k + 1) * d
        self.starts.extend((e - d).tolist())
        self.ends.extend(e.tolist())
        self.busy_s += len(r) * d
        if out is None:
            return e
        out[j:] = e
        return out

    def fill(self, t: float, d: float) -> float:
        if d <= 0.0:
            return t
        starts, ends = self.starts, self.ends
        if not ends or t >= ends[-1] - 1e-12:  # nothing placed after t: one piece at the end
            return self.reserve(t, d)
        n = len(starts)
        i0 = i = bisect.bisect_right(ends, t)  # the first interval ending after t
        t0 = t
        if i < n and starts[i] <= t:  # t is inside interval i: start after it
            t0, t = starts[i], ends[i]
            i += 1
        left = d
        while True:  # consume the gaps from t on; everything between t0 and the end becomes busy
            gap = (starts[i] if i < n else math.inf) - t
            if gap >= left:
                t += left
                break
            left -= gap
            t = ends[i]
            i += 1
        self.busy_s += d
        self._cover(i0, i, t0, t)
        return t

    def _put(self, pieces: list[tuple[float, float]], i0: int, i1: int) -> None:
        """Insert one piece ``pieces[0]`` that lies in the gap before interval ``i0`` (``i0 == i1``)."""
        ((a, b),) = pieces
        self.busy_s += b - a
        self._cover(i0, i1, a, b)

    def _cover(self, i0: int, i1: int, a: float, b: float) -> None:
        """Replace intervals ``i0 .. i1 - 1`` by ``[a, b]`` (which spans them), merging with touching
        neighbours."""
        starts, ends = self.starts, self.ends
        if i0 > 0 and ends[i0 - 1] >= a - 1e-12:
            i0 -= 1
            a = starts[i0]
        if i1 < len(starts) and starts[i1] <= b + 1e-12:
            b = max(b, ends[i1])
            i1 += 1
        starts[i0:i1] = [a]
        ends[i0:i1] = [b]


# --------------------------------------------------------------------------------------------------
# The dispatch simulation


@dataclass(frozen=True, slots=True)
class PipelineResult:
    period_s: float  # steady-state time per iteration, host optimizer included
    gpu_period_s: float  # the GPUs' part (what the iterations' overlap leaves)
    host_s: float  # the host's per-step work (gradient all-reduce between replicas, optimizer step)
    busy_s: dict[str, float]  # compute per GPU per iteration (mean over the measured cycle)
    stage_busy_s: tuple[float, ...]  # compute of each stage handed out in one iteration, in order
    events: tuple[TimelineEvent, ...]


def measured_iterations(num_devices: int, stages_per_iteration: int) -> int:
    """Iterations after which the round-robin hands every GPU the same stages again: the stream moves
    ``stages_per_iteration mod N`` GPUs on per iteration, so ``N / gcd(N, stages)`` iterations make a cycle
    (each iteration of a cycle may differ; the cycle's mean is the steady state)."""
    return num_devices // math.gcd(num_devices, stages_per_iteration)


def run_dispatch(
    stages: Sequence[StageWork],
    devices: Sequence[str],
    m_pass: int,
    passes: int,
    bandwidth_GBps: float,
    latency_us: float,
    host_s: float = 0.0,
    timeline: bool = False,
    warmup: int = WARMUP_ITERATIONS,
) -> PipelineResult:
    """Simulate ``warmup`` iterations and then one round-robin cycle of them (``measured_iterations``),
    each of ``passes`` passes handing ``stages`` round-robin to ``devices`` with ``m_pass`` micro-batches
    per pass; the period is the cycle's mean time per iteration. See the module docstring for the rules."""
    N = len(devices)
    cycle = measured_iterations(N, len(stages) * passes)
    iterations = warmup + cycle
    bw = bandwidth_GBps * 1e9
    lat = latency_us * 1e-6

    def dur(nbytes: float) -> float:
        return lat + nbytes / bw if nbytes > 0 else 0.0

    h2d = [_Channel() for _ in range(N)]
    d2h = [_Channel() for _ in range(N)]
    gpu_free = [0.0] * N  # end of the last micro-batch handed to the GPU
    upload_free = [0.0] * N  # end of the GPU's last parameter upload
    stage_ends: list[list[float]] = [[] for _ in range(N)]  # compute end of each stage the GPU ran
    busy = [0.0] * N
    cursor = 0
    dispatch = 0.0  # when the current pass is handed out
    host_done = [0.0] * (iterations + 1)  # host_done[t + 1]: iteration t's optimizer step finished
    ends: list[float] = []  # per iteration: its last gradient on the host
    events: list[TimelineEvent] = []
    record_it = warmup
    for it in range(iterations):
        if it >= 2:  # step(t) waits for step(t - 2) before iteration t is handed out (async step)
            dispatch = max(dispatch, host_done[it - 1])
        grads_down = 0.0
        for p in range(passes):
            for ch in h2d + d2h:  # every transfer from here on is ready after this pass is handed out
                ch.forget_before(dispatch)
            ready = np.full(m_pass, dispatch)  # the token ids are on the host
            next_dispatch = dispatch
            for st in stages:
                g = cursor % N
                cursor += 1
                prior = stage_ends[g][-2] if len(stage_ends[g]) >= 2 else 0.0  # frees the buffer it reuses
                up = st.param_bytes + (st.grad_bytes if p > 0 else 0.0)
                up_end = h2d[g].fill(max(dispatch, upload_free[g], prior), dur(up))
                upload_free[g] = up_end
                t = max(gpu_free[g], up_end)
                # micro-batch j starts when its input is up and the GPU finished j - 1:
                # s_j = max(s_(j-1) + c, a_j), i.e. s_j - j c = max(s_(j-1) - (j-1) c, a_j - j c)
                arrive = h2d[g].reserve_many(ready, dur(st.in_bytes))
                c = st.compute_s
                k = _arange(m_pass)
                start = np.maximum.accumulate(np.maximum(arrive - k * c, t)) + k * c
                end = start + c
                t = float(end[-1])
                out = d2h[g].reserve_many(end, dur(st.out_bytes)) if st.out_bytes > 0 else end
                if timeline and it == record_it:
                    for j in range(m_pass):
                        events.append(
                            TimelineEvent(
                                devices[g],
                                f"{st.label}.{j}" if passes == 1 else f"{st.label}.p{p}.{j}",
                                float(start[j]),
                                float(end[j]),
                            )
                        )
                if it >= warmup:
                    busy[g] += m_pass * st.compute_s
                gpu_free[g] = t
                stage_ends[g].append(t)
                if st.grad_bytes > 0:
                    grads_down = max(grads_down, d2h[g].fill(t, dur(st.grad_bytes)))
                if timeline and it == record_it and up > 0:
                    events.append(TimelineEvent(devices[g], f"upload {st.label}", max(dispatch, prior), up_end))
                if st.label == "FB":
                    next_dispatch = float(out[-1])  # forward_backward waits for the last loss on the host
                ready = out
            dispatch = next_dispatch
        ends.append(max(grads_down, max(gpu_free)))
        host_done[it + 1] = max(host_done[it], grads_down) + host_s
    gpu_period = (ends[-1] - ends[warmup - 1]) / cycle if warmup >= 1 else ends[-1] / cycle
    period = max(gpu_period, host_s)
    per_stage = tuple(m_pass * passes * st.compute_s for st in stages)
    if timeline:  # the recorded iteration, from its first operation (it overlaps its neighbours)
        t0 = min((e.start_s for e in events), default=0.0)
        events = [TimelineEvent(e.device, e.op, e.start_s - t0, e.end_s - t0) for e in events]
    return PipelineResult(
        period, gpu_period, host_s, {d: busy[i] / cycle for i, d in enumerate(devices)}, per_stage, tuple(events)
    )


# --------------------------------------------------------------------------------------------------
# Measurement of a plan


def simulate(
    costs: CostModel, config: ParallelConfig, timeline: bool = False, memory_only: bool = False
) -> Measurement:
    """One roundpipe plan's steady-state iteration, memory per GPU and host memory per node; ``memory_only``
    (``Simulator.memory_estimate``): the memory and the stage-size rule only, nothing scheduled."""
    plans = _pool_plans(costs, config)
    if isinstance(plans, Measurement):
        return plans
    peak, host, pools = plans
    if memory_only:
        return Measurement(
            tokens_per_s=0.0, iteration_time_s=0.0, oom=False, peak_memory_GiB=peak, host_memory_GiB=host, status="ok"
        )
    return _iteration(costs, config, peak, host, pools, timeline)


def _pool_plans(costs: CostModel, config: ParallelConfig):
    """Each pool's stages and memory: (GPU peaks, host GiB per node, [(pool, node, stages, micro-batches per
    pass)]), or the ``invalid`` / ``oom`` measurement."""
    model = costs.model
    cluster = costs.effective_cluster
    mbs = config.micro_batch_size
    peak: dict[str, float] = {}
    host: dict[str, float] = {}
    oom = []
    plans = []
    for r, pipe in enumerate(config.pipelines):
        rp = pipe.roundpipe
        assert rp is not None
        node = cluster.node_of(rp.devices[0])
        slowest = max(rp.devices, key=lambda d: sum(costs.unit_costs(d, mbs)))
        stages = pass_stages(costs, rp, mbs, slowest)
        limit = rp.memory_limit_for(min(cluster.device(d).memory_GiB for d in rp.devices))
        for st in stages:
            state = (st.param_bytes + st.grad_bytes) / GiB
            if state > limit / 2 + 1e-9:
                return Measurement.failure(
                    "invalid",
                    f"config: pipelines[{r}]: stage {st.label} holds {state:.2f} GiB of parameters and "
                    f"gradients, over half of memory_limit_GiB {limit:.2f} (RoundPipe keeps the running "
                    f"stage and the prefetched one within the limit): cut it smaller",
                )
        usage = _gpu_peaks(stages, rp.devices)
        for d, gib in usage.items():
            peak[d] = gib
            if gib > usable_memory_GiB(cluster.device(d).memory_GiB):
                oom.append(d)
        m_pass = pipe.num_microbatches // rp.accumulation_steps
        host_gib = (
            host_bytes_per_param(model) * model.num_params
            + m_pass
            * (sum(st.saved_bytes for st in stages) + model.bytes_per_element * mbs * model.seq_len * model.hidden_size)
        ) / GiB
        host[node.name] = host.get(node.name, 0.0) + host_gib
        plans.append((rp, node, stages, m_pass))
    error = _oom_error(cluster, oom, peak, host)
    if error is not None:
        return Measurement(
            tokens_per_s=0.0,
            iteration_time_s=0.0,
            oom=True,
            peak_memory_GiB=peak,
            status="oom",
            host_memory_GiB=host,
            error=error,
        )
    return peak, host, plans


def _oom_error(cluster, oom: list[str], peak: dict[str, float], host: dict[str, float]) -> str | None:
    """What does not fit: the first GPU over its memory, else the first node's host over its own."""
    if oom:
        d = oom[0]
        cap = cluster.device(d).memory_GiB
        return (
            f"{len(oom)} device(s) out of memory, e.g. {d} needs {peak[d]:.1f} GiB of {cap:g} GiB "
            f"(usable {usable_memory_GiB(cap):.1f}) for its largest stage and the one prefetched "
            "behind it: smaller stages, recompute_grain 'layer' or a smaller micro_batch_size"
        )
    for name, gib in host.items():
        cap = next(n for n in cluster.nodes if n.name == name).host.memory_GiB
        if gib > cap:
            return (
                f"host memory of node {name!r} out of memory: RoundPipe's state and kept "
                f"activations need {gib:.1f} GiB of its {cap:g} GiB (host.memory_GiB)"
            )
    return None


def _iteration(
    costs: CostModel,
    config: ParallelConfig,
    peak: dict[str, float],
    host: dict[str, float],
    plans: list,
    timeline: bool,
) -> Measurement:
    """The pools' dispatch schedules (``run_dispatch``), the replicas' host all-reduce and Adam step."""
    model, cluster = costs.model, costs.effective_cluster
    n_rep = len(plans)
    allreduce = 0.0
    if n_rep > 1:
        bw = min(n.network.bandwidth_GBps for _, n, _, _ in plans)
        lat = max(n.network.latency_us for _, n, _, _ in plans)
        allreduce = ring_allreduce_s(model.bytes_per_element * model.num_params, n_rep, bw, lat)
    host_s = allreduce + model.num_params / HOST_ADAM_PARAMS_PER_S
    results = []
    for rp, node, stages, m_pass in plans:
        link = node.host.link
        share = node.host.shared_bandwidth_GBps(len(rp.devices))
        results.append(
            run_dispatch(
                stages, rp.devices, m_pass, rp.accumulation_steps, share, link.latency_us, host_s, timeline=timeline
            )
        )
    iteration = max(res.period_s for res in results)
    tokens = config.global_batch_size * model.seq_len
    busy_total = sum(sum(res.busy_s.values()) for res in results)
    n_dev = sum(len(res.busy_s) for res in results)
    bubble = max(0.0, 1.0 - busy_total / (n_dev * iteration)) if iteration > 0 else 0.0
    peak_flops = sum(cluster.device(d).peak_tflops / cluster.node_of(d).slowdown for d in peak) * 1e12
    mfu = costs.flops_per_token * tokens / (iteration * peak_flops) if iteration > 0 else 0.0
    slowest_res = max(results, key=lambda res: res.period_s)
    events = tuple(sorted((e for res in results for e in res.events), key=lambda e: (e.start_s, e.device)))
    return Measurement(
        tokens_per_s=tokens / iteration,
        iteration_time_s=iteration,
        oom=False,
        peak_memory_GiB=peak,
        host_memory_GiB=host,
        mfu=mfu,
        bubble_fraction=bubble,
        stage_busy_s=slowest_res.stage_busy_s,
        timeline=events if timeline else (),
    )


def _gpu_peaks(stages: Sequence[StageWork], devices: Sequence[str]) -> dict[str, float]:
    """GiB per GPU: the largest (stage state + activations + next stage's state) over the stages it runs.

    Position ``k`` of the endless round-robin stream is stage ``k mod S`` on GPU ``k mod N``, and the next
    stage that GPU gets is ``(k + N) mod S``; GPU ``g`` runs exactly the stages ``i`` with
    ``i = g (mod gcd(N, S))``."""
    N, S = len(devices), len(stages)
    G = math.gcd(N, S)
    out = {}
    for g, d in enumerate(devices):
        worst = 0.0
        for i in range(g % G, S, G):
            st, nxt = stages[i], stages[(i + N) % S]
            worst = max(worst, st.param_bytes + st.grad_bytes + st.activation_bytes + nxt.param_bytes + nxt.grad_bytes)
        out[d] = worst / GiB
    return out
