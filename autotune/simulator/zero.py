"""ZeRO / FSDP sharding and CPU offload: what each device and each node's host memory holds.

Model states per parameter, mixed-precision Adam (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", Sec. 3.1 and 5.1): 2 bytes of 16-bit weights, 2 of 16-bit
gradients and ``K = 12`` of optimizer state (fp32 master weights and the two Adam moments). Across
``N_d`` data-parallel peers (the ranks that hold the same layers) ZeRO keeps per device

    zero 0:  (2 + 2 + K) Psi                     zero 2 (P_os+g):    2 Psi + (2 + K) Psi / N_d
    zero 1:  (2 + 2) Psi + K Psi / N_d           zero 3 (P_os+g+p):  (2 + 2 + K) Psi / N_d

(their Fig. 1: Psi = 7.5B, N_d = 64: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB; ``model_state_bytes``).

Working set on top of the resident states (``working_bytes``): with zero 3 the parameters of the unit
being computed are all-gathered, and the next unit's are prefetched (FSDP's forward/backward prefetch),
so two units' 16-bit weights are whole on the device, plus one unit's whole 16-bit gradient before its
reduce-scatter; with zero 2 (and offloaded gradients) one unit's whole gradient. A unit is what is
gathered at once: one transformer block, the embedding or the LM head (with its final norm).

CPU offload per stage (``offload``), each rank offloading only its shard (Ren et al. 2021,
"ZeRO-Offload", Sec. 4.1; Rajbhandari et al. 2021, "ZeRO-Infinity"):

- ``optimizer``: the ``K`` bytes of optimizer state and the 16-bit gradients the CPU step reads live in
  host memory: ``(2 + K) Psi / N_os`` per rank (``N_os = N_d`` with zero >= 1, else 1). The device keeps
  its 16-bit weights (sharded under zero 3). Gradients leave the device as each unit's backward
  produces them (every micro-batch, reduce-scattered first with zero >= 2) and accumulate in host
  memory, as in ZeRO-Offload, so only the working unit's stay; except with zero 0 or 1 among several
  replicas, where they accumulate on the device until the step's all-reduce / reduce-scatter
  (``gradients_resident``).
- ``all``: the 16-bit weights live there too (``2 Psi / N_p``, ``N_p = N_d`` with zero 3): nothing stays
  resident on the device; the working set is two streamed units' weights plus one unit's gradient.

A node's host memory holds the offloaded state of all its devices (``host_bytes`` summed per node) and
must fit in its ``host.memory_GiB``.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.simulator.engine_terms import DEFAULT_ENGINE, fp32_state
from autotune.specs import ModelSpec, ParallelConfig


@dataclass(frozen=True, slots=True)
class StateBytes:
    """Bytes per parameter of each model state (ZeRO's mixed-precision Adam: 2, 2, K = 12)."""

    weights: float = 2.0
    grads: float = 2.0
    optimizer: float = 12.0

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer

    def scaled_to(self, total: float) -> StateBytes:
        """The same split with ``total`` bytes per parameter (a calibration profile's measured figure)."""
        f = total / self.total
        return StateBytes(self.weights * f, self.grads * f, self.optimizer * f)


MIXED_PRECISION_ADAM = StateBytes()
#: fp32 training (no separate master copy): 4 + 4 + 8 (two fp32 moments)
FP32_ADAM = StateBytes(4.0, 4.0, 8.0)


def state_bytes_for(model: ModelSpec, engine: str = DEFAULT_ENGINE) -> StateBytes:
    """The per-parameter split for ``model``'s precision under ``engine``: fp32 training, or a bf16 plan on
    an engine that keeps fp32 weights and gradients under autocast (autotune's runner:
    ``engine_terms.EngineTerms.fp32_state``), hold 4 + 4 + 8; mixed-precision Adam 2 + 2 + 12 otherwise
    (fp16, which the runner does not run: the engines it is exported to keep 16-bit gradients)."""
    return FP32_ADAM if fp32_state(getattr(model, "precision", "bf16"), engine) else MIXED_PRECISION_ADAM


def model_state_bytes(params: float, dp: int, zero: int, state: StateBytes = MIXED_PRECISION_ADAM) -> float:
    """Resident model-state bytes per device holding ``params`` parameters, sharded ZeRO-``zero`` style
    across ``dp`` peers (Rajbhandari et al. 2020, Sec. 5.1; no offload)."""
    n = max(1, dp)
    w = state.weights / (n if zero >= 3 else 1)
    g = state.grads / (n if zero >= 2 else 1)
    o = state.optimizer / (n if zero >= 1 else 1)
    return params * (w + g + o)


def gradients_resident(zero: int, offload: str, dp: int) -> bool:
    """Whether a device keeps its whole (unsharded) accumulated gradient through the step."""
    if offload == "all":
        return False
    if offload == "optimizer":
        return dp > 1 and zero < 2
    return not (zero >= 2 and dp > 1)


def offload_state_bytes(
    params: float, dp: int, zero: int, offload: str, state: StateBytes = MIXED_PRECISION_ADAM
) -> tuple[float, float]:
    """(device-resident, host) model-state bytes of one device holding ``params`` parameters."""
    if offload == "none":
        return model_state_bytes(params, dp, zero, state), 0.0
    n = max(1, dp)
    n_os = n if zero >= 1 else 1
    host = params * (state.grads + state.optimizer) / n_os
    if offload == "optimizer":
        weights = state.weights / (n if zero >= 3 else 1)
        grads = state.grads if gradients_resident(zero, offload, dp) else 0.0
        return params * (weights + grads), host
    # "all": weights in host memory too, streamed per unit
    return 0.0, host + params * state.weights / (n if zero >= 3 else 1)


def working_bytes(
    units: list[float], zero: int, offload: str, dp: int, state: StateBytes = MIXED_PRECISION_ADAM
) -> float:
    """Transient bytes beyond the resident states: gathered / streamed units and whole gradients.
    ``units``: parameters of each unit the device holds (its tensor-parallel share)."""
    if not units:
        return 0.0
    largest = sorted(units, reverse=True)
    two = sum(largest[:2])
    if offload == "all" or (zero >= 3 and dp > 1):
        return two * state.weights + largest[0] * state.grads
    if not gradients_resident(zero, offload, dp):
        return largest[0] * state.grads
    return 0.0


def stage_units(
    model: ModelSpec, layers: int, tp: int, first: bool, last: bool, head_tp: int | None = None
) -> list[float]:
    """Parameters of each unit of a stage on one of its ``tp`` devices, in forward order: the embedding
    on the first stage, its blocks, the final norm + LM head on the last. The embedding and the head are
    split ``head_tp`` ways (default ``tp``; 1 where the engine keeps them whole)."""
    ht = head_tp or tp
    embedding = model.end_params(True, False) if first else 0
    units = [embedding / ht] if first else []
    units += [model.params_per_layer / tp] * layers
    if last:
        units.append((model.end_params(first, True) - embedding) / ht)
    return units


def data_parallel_degree(config: ParallelConfig, pipeline: int, stage: int) -> int:
    """How many ranks hold the layers of ``config.pipelines[pipeline].stages[stage]`` (its shard of
    them): every replica holds every layer once, on one stage of one or more data-parallel ranks
    (``StageConfig.ranks``, Zorse), so the peers of a layer are the ranks of its stage in every replica.
    Where the replicas cut the layers differently, the fewest peers any of the stage's layers has."""
    return peer_degrees(config)[(pipeline, stage)]


def peer_degrees(config: ParallelConfig) -> dict[tuple[int, int], int]:
    """``data_parallel_degree`` of every (pipeline, stage) at once."""
    if not config.has_mixed_stages:
        n = len(config.pipelines)
        return {(r, s): n for r, pipe in enumerate(config.pipelines) for s in range(len(pipe.stages))}
    total = sum(st.layers for st in config.pipelines[0].stages)
    count = [0] * (total + 1)  # difference array: ranks holding each layer
    for pipe in config.pipelines:
        a = 0
        for st in pipe.stages:
            width = max(1, len(st.ranks))
            count[a] += width
            count[a + st.layers] -= width
            a += st.layers
    per_layer, run = [], 0
    for c in count[:total]:
        run += c
        per_layer.append(run)
    out = {}
    for r, pipe in enumerate(config.pipelines):
        a = 0
        for s, st in enumerate(pipe.stages):
            out[(r, s)] = min(per_layer[a : a + st.layers], default=len(config.pipelines))
            a += st.layers
    return out


@dataclass(frozen=True, slots=True)
class StageStates:
    """One device's model-state memory under a plan's zero and offload settings."""

    device_bytes: float  # resident on the device
    working_bytes: float  # transient on the device (gathered / streamed units, whole gradients)
    host_bytes: float  # in its node's host memory


def stage_states(
    model: ModelSpec,
    layers: int,
    tp: int,
    first: bool,
    last: bool,
    dp: int,
    zero: int,
    offload: str,
    state: StateBytes = MIXED_PRECISION_ADAM,
    head_tp: int | None = None,
) -> StageStates:
    units = stage_units(model, layers, tp, first, last, head_tp)
    params = sum(units)
    device, host = offload_state_bytes(params, dp, zero, offload, state)
    return StageStates(device, working_bytes(units, zero, offload, dp, state), host)


# --------------------------------------------------------------------------------------------------
# Time: collectives and host traffic of sharded and offloaded stages
#
# Per micro-batch (folded into each stage's forward / backward duration, ``ChunkComm.apply``):
# - zero 3 (N_d > 1): every unit's 16-bit weights are all-gathered before its forward and again
#   before its backward (FSDP ``reshard_after_forward``), and its gradient is reduce-scattered after
#   its backward;
# - zero 2 (N_d > 1): every unit's gradient is reduce-scattered after its backward (ZeRO-2 as DeepSpeed
#   runs it under gradient accumulation: the whole gradient never accumulates on the device);
# - offload ``all``: every unit's weights come up over the host link before its forward and backward
#   (its shard, then all-gathered, with zero 3), its gradient goes down after its backward;
# - offload ``optimizer`` with gradients not resident (``gradients_resident``): the gradient goes down.
# Communication overlaps with compute as FSDP's prefetch and DeepSpeed's overlap_comm do, only as far
# as the links allow: a pass takes max(compute, weight traffic, gradient traffic). The weight channel
# (all-gather, host -> device) and the gradient channel (reduce-scatter, device -> host) run at the same
# time (full-duplex links). A pass's first gather is prefetched during the previous operation and its
# last gradient transfer overlaps the next one; only the step's very first and last unit transfers
# (one unit of m x units per step) would be exposed, and they are left out.
#
# Per step (``sync_s``, ``optimizer_s``, ``gather_s``):
# - zero 0: the all-reduce of the gradients (unchanged); zero 1: a reduce-scatter instead (half the
#   all-reduce's bytes); zero 2 / 3: gradients are already reduce-scattered: the peers only meet;
# - the optimizer step: on the device, on the shard (1 / N_d of the parameters with zero >= 1); with
#   offload, on the host CPU at ``HOST_ADAM_PARAMS_PER_S`` shared by all offloaded parameters of the
#   node, after the gradient shard went down (when it was resident) and before the updated 16-bit
#   shard comes up (not with ``all``: the next step streams it);
# - zero 1 / 2: an all-gather of the updated 16-bit weights among the peers (the other half of the
#   all-reduce's bytes); zero 3: none (the next step's forward gathers).
# ZeRO-1/2 thus move what an all-reduce moves, zero 3 1.5x that (Rajbhandari et al. 2020, Sec. 7).

#: DeepSpeed CPU-Adam on the host: Ren et al. 2021 (ZeRO-Offload), Table 4: 2.57 s for a 10B-parameter
#: Adam step on a DGX-2 host (2 x Xeon Platinum 8168, 48 cores), i.e. ~3.9e9 parameters per second per
#: node; shared by all the node's offloaded parameters.
HOST_ADAM_PARAMS_PER_S = 3.9e9


def collective_s(num_bytes: float, ranks: int, bandwidth_GBps: float, latency_us: float) -> float:
    """Ring reduce-scatter or all-gather of a ``num_bytes`` buffer among ``ranks``: half a ring
    all-reduce, ``(k - 1) / k * n / bandwidth + (k - 1) * latency``."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * num_bytes / (bandwidth_GBps * 1e9) + (ranks - 1) * latency_us * 1e-6


def transfer_s(num_bytes: float, bandwidth_GBps: float, latency_us: float) -> float:
    return latency_us * 1e-6 + num_bytes / (bandwidth_GBps * 1e9) if num_bytes > 0 else 0.0


@dataclass(frozen=True, slots=True)
class ChunkComm:
    """Communication of one (virtual) stage chunk per micro-batch, seconds."""

    forward_s: float = 0.0  # weight traffic of the forward (all units)
    weights_s: float = 0.0  # weight traffic of the backward
    grads_s: float = 0.0  # gradient traffic of the backward

    def apply(self, forward_s: float, backward_s: float) -> tuple[float, float]:
        return max(forward_s, self.forward_s), max(backward_s, self.weights_s, self.grads_s)

    def spread(self, microbatches: int) -> ChunkComm:
        """Traffic that happens once per iteration (layer-wise execution: each layer's gathers and
        reduce-scatters once for all micro-batches), as its share per micro-batch."""
        n = max(1, microbatches)
        return ChunkComm(self.forward_s / n, self.weights_s / n, self.grads_s / n)


def chunk_comm(
    units: list[float],
    zero: int,
    offload: str,
    dp: int,
    ring: tuple[float, float],
    host: tuple[float, float],
    state: StateBytes = MIXED_PRECISION_ADAM,
) -> ChunkComm:
    """``units``: parameters of the chunk's units on one device; ``ring``: (GB/s, latency us) of the
    data-parallel ring among the peers; ``host``: (GB/s, latency us) of this device's host link."""
    gather = zero >= 3 and dp > 1
    stream = offload == "all"
    scatter = zero >= 2 and dp > 1
    down = offload != "none" and not gradients_resident(zero, offload, dp)
    if not (gather or stream or scatter or down) or not units:
        return ChunkComm()
    n_p = dp if zero >= 3 else 1
    n_g = dp if zero >= 2 else 1

    def weight(u: float) -> float:
        t = collective_s(state.weights * u, dp, *ring) if gather else 0.0
        return t + (transfer_s(state.weights * u / n_p, *host) if stream else 0.0)

    def grad(u: float) -> float:
        t = collective_s(state.grads * u, dp, *ring) if scatter else 0.0
        return t + (transfer_s(state.grads * u / n_g, *host) if down else 0.0)

    w = [weight(u) for u in units]
    g = [grad(u) for u in units]
    return ChunkComm(sum(w), sum(w), sum(g))


def sync_s(
    params: float, dp: int, zero: int, ring: tuple[float, float], state: StateBytes = MIXED_PRECISION_ADAM
) -> float:
    """The step's gradient synchronisation of a run of layers with ``params`` parameters among ``dp``
    peers: all-reduce (zero 0), reduce-scatter (zero 1), nothing left (zero 2 / 3: reduce-scattered
    per micro-batch)."""
    if dp <= 1 or zero >= 2:
        return 0.0
    t = collective_s(state.grads * params, dp, *ring)
    return 2 * t if zero == 0 else t


def gather_s(
    params: float, dp: int, zero: int, ring: tuple[float, float], state: StateBytes = MIXED_PRECISION_ADAM
) -> float:
    """All-gather of the updated 16-bit weights after the sharded step (zero 1 / 2)."""
    return collective_s(state.weights * params, dp, *ring) if zero in (1, 2) and dp > 1 else 0.0


def optimizer_s(
    params: float,
    dp: int,
    zero: int,
    offload: str,
    device_opt_s_per_param: float,
    host: tuple[float, float],
    node_host_step_s: float,
    state: StateBytes = MIXED_PRECISION_ADAM,
) -> float:
    """The optimizer step of one device holding ``params`` parameters: on the device on its shard, or
    (offload) gradients down when they were resident, the node's host step, 16-bit weights up (not
    with ``all``: the next step streams them)."""
    n_os = dp if zero >= 1 and dp > 1 else 1
    if offload == "none":
        return device_opt_s_per_param * params / n_os
    down = transfer_s(state.grads * params / n_os, *host) if gradients_resident(zero, offload, dp) else 0.0
    up = transfer_s(state.weights * params / n_os, *host) if offload == "optimizer" else 0.0
    return down + node_host_step_s + up


def host_step_s(offloaded_params: float) -> float:
    """The host CPU's optimizer time for all of a node's offloaded parameters (shards)."""
    return offloaded_params / HOST_ADAM_PARAMS_PER_S
