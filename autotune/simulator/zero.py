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

    def scaled_to(self, total: float) -> "StateBytes":
        """The same split with ``total`` bytes per parameter (a calibration profile's measured figure)."""
        f = total / self.total
        return StateBytes(self.weights * f, self.grads * f, self.optimizer * f)


MIXED_PRECISION_ADAM = StateBytes()
#: fp32 training (no separate master copy): 4 + 4 + 8 (two fp32 moments)
FP32_ADAM = StateBytes(4.0, 4.0, 8.0)


def state_bytes_for(model: ModelSpec) -> StateBytes:
    """The per-parameter split for ``model``'s precision (``precision: fp32`` when the model has the
    field; mixed-precision Adam otherwise)."""
    return FP32_ADAM if getattr(model, "precision", "bf16") == "fp32" else MIXED_PRECISION_ADAM


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


def offload_state_bytes(params: float, dp: int, zero: int, offload: str,
                        state: StateBytes = MIXED_PRECISION_ADAM) -> tuple[float, float]:
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


def working_bytes(units: list[float], zero: int, offload: str, dp: int,
                  state: StateBytes = MIXED_PRECISION_ADAM) -> float:
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


def stage_units(model: ModelSpec, layers: int, tp: int, first: bool, last: bool) -> list[float]:
    """Parameters of each unit of a stage on one of its ``tp`` devices: its blocks, the embedding on the
    first stage, the final norm + LM head on the last."""
    units = [model.params_per_layer / tp] * layers
    if first:
        units.append(model.embedding_params / tp)
    if last:
        units.append((model.embedding_params + model.hidden_size) / tp)
    return units


def data_parallel_degree(config: ParallelConfig, pipeline: int, stage: int) -> int:
    """How many ranks hold the layers of ``config.pipelines[pipeline].stages[stage]`` (its shard of
    them): one stage per replica, since every replica holds every layer once."""
    return len(config.pipelines)


@dataclass(frozen=True, slots=True)
class StageStates:
    """One device's model-state memory under a plan's zero and offload settings."""

    device_bytes: float  # resident on the device
    working_bytes: float  # transient on the device (gathered / streamed units, whole gradients)
    host_bytes: float  # in its node's host memory


def stage_states(model: ModelSpec, layers: int, tp: int, first: bool, last: bool, dp: int, zero: int,
                 offload: str, state: StateBytes = MIXED_PRECISION_ADAM) -> StageStates:
    units = stage_units(model, layers, tp, first, last)
    params = sum(units)
    device, host = offload_state_bytes(params, dp, zero, offload, state)
    return StageStates(device, working_bytes(units, zero, offload, dp, state), host)
