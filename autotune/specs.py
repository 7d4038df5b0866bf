"""Typed, frozen domain values: devices, links, clusters, models, parallel configs, measurements.

Files are converted into these objects once, where they are loaded (``autotune.loading``); everything
else passes the objects. Each value validates itself in ``__post_init__`` and raises ``SpecError``
naming the field and the numbers. ``ParallelConfig.validate(cluster, model)`` checks the rules that
need the cluster and the model (SPEC.md, "Parallel config").
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from autotune import roundpipe_plan, stage_ranks
from autotune.errors import SpecError, shown
from autotune.roundpipe_plan import ROUNDPIPE, RoundPipeStages
from autotune.stage_ranks import RankConfig

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")
#: every schedule a plan may name: the pipeline schedules above and RoundPipe's dispatch (``roundpipe_plan``)
ALL_SCHEDULES = SCHEDULES + (ROUNDPIPE,)
MLP_KINDS = ("gelu", "swiglu")
#: ZeRO / FSDP stages (Rajbhandari et al. 2020): 0 none, 1 optimizer state, 2 + gradients, 3 + parameters
ZERO_STAGES = (0, 1, 2, 3)
#: per-stage CPU offload: nothing, optimizer state + master weights (ZeRO-Offload), everything (ZeRO-Infinity)
OFFLOAD_MODES = ("none", "optimizer", "all")
PRECISIONS = ("bf16", "fp16", "fp32")  # fp32: fp32 tensors, TF32 matmuls where the GPU has them
ATTENTION_KINDS = ("flash", "standard")  # flash: fused, scores never stored; standard: scores stored
RECOMPUTE_MODES = (False, True, "selective")  # none, full, attention core only (Korthikanti et al. 2022)
#: an inline GPU without its own TF32 / FP32 peaks gets ``peak_tflops`` divided by these (the ratios of the
#: A100 and H100 datasheets: TF32 dense = half the 16-bit dense rate, FP32 = 1/16 of it)
DEFAULT_TF32_RATIO, DEFAULT_FP32_RATIO = 2.0, 16.0


#: Upper bounds per field (docs/formats.md, "Limits"): a value above one is refused with the number in
#: the message, before anything is simulated, searched or launched. A field not listed here gets
#: ``DEFAULT_LIMIT``; a new field with a sharper natural bound adds it here.
LIMITS: dict[str, float] = {
    # cluster (rates such as peak_tflops or bandwidth_GBps cost nothing to compute with: DEFAULT_LIMIT)
    "count": 1024, "repeat": 4096, "latency_us": 100_000_000, "slowdown": 1000,
    # model
    "num_layers": 2048, "hidden_size": 131_072, "num_heads": 4096, "num_kv_heads": 4096,
    "ffn_hidden_size": 1_048_576, "vocab_size": 16_777_216, "seq_len": 4_194_304, "global_batch_size": 1_048_576,
    "num_experts": 4096, "experts_per_token": 4096, "expert_ffn_hidden_size": 1_048_576, "moe_layer_every": 2048,
    # plan
    "expert_parallel": 16_384, "sync_every_steps": 1_000_000, "micro_batch_size": 65_536, "num_microbatches": 65_536, "virtual_stages": 128, "layers": 2048,
}
DEFAULT_LIMIT = 1e18
#: devices in one cluster, over all nodes (after ``repeat``)
MAX_DEVICES = 16_384


def limit_of(name: str) -> float:
    """The upper bound of field ``name`` (``pipelines[0].num_microbatches`` -> that of ``num_microbatches``)."""
    return LIMITS.get(name.rsplit(".", 1)[-1].split("[", 1)[0], DEFAULT_LIMIT)


def _positive(source: str, name: str, value: float, *, integer: bool = False, minimum: float = 0.0,
              strict: bool = True, maximum: float | None = None) -> None:
    """A number (an integer with ``integer``) above ``minimum`` (or equal, without ``strict``) and at
    most ``maximum`` (default: the field's entry in ``LIMITS``)."""
    if integer and (isinstance(value, bool) or not isinstance(value, int)):
        raise SpecError(source, name, f"must be an integer, got {shown(value)}")
    if not integer and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
        raise SpecError(source, name, f"must be a number, got {shown(value)}")
    if strict and value <= minimum:
        raise SpecError(source, name, f"must be > {minimum:g}, got {shown(value)}")
    if not strict and value < minimum:
        raise SpecError(source, name, f"must be >= {minimum:g}, got {shown(value)}")
    top = limit_of(name) if maximum is None else maximum
    if value > top:
        shown_top = f"{int(top):,}" if float(top).is_integer() else f"{top:g}"
        raise SpecError(source, name, f"must be <= {shown_top} (the documented limit), got {shown(value)}")


# --------------------------------------------------------------------------------------------------
# Cluster


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One accelerator type. ``peak_tflops`` is dense 16-bit tensor throughput (datasheet);
    ``peak_tflops_tf32`` the dense TF32 tensor rate (equal to ``peak_tflops_fp32`` on GPUs without TF32,
    e.g. Volta and Turing) and ``peak_tflops_fp32`` the plain FP32 rate. 0 (not given) means
    ``peak_tflops / DEFAULT_TF32_RATIO`` and ``peak_tflops / DEFAULT_FP32_RATIO``."""

    name: str
    peak_tflops: float
    memory_GiB: float
    memory_bandwidth_GBps: float
    source: str = ""
    #: the host interface (datasheet): PCIe generation and lanes; generation 0 = no PCIe (the ``cpu``
    #: device, whose "host" is its own memory). Sets the default ``host.link`` (``default_host_link``).
    pcie_gen: int = 4
    pcie_lanes: int = 16
    peak_tflops_tf32: float = 0.0
    peak_tflops_fp32: float = 0.0

    def __post_init__(self) -> None:
        where = f"gpu {shown(self.name)}"
        _positive(where, "peak_tflops", self.peak_tflops)
        _positive(where, "memory_GiB", self.memory_GiB)
        _positive(where, "memory_bandwidth_GBps", self.memory_bandwidth_GBps)
        if isinstance(self.pcie_gen, bool) or self.pcie_gen not in PCIE_GB_PER_LANE:
            raise SpecError(where, "pcie_gen", f"must be one of {', '.join(map(str, PCIE_GB_PER_LANE))} "
                                               f"(0 = no PCIe), got {shown(self.pcie_gen)}")
        if isinstance(self.pcie_lanes, bool) or self.pcie_lanes not in (1, 2, 4, 8, 16):
            raise SpecError(where, "pcie_lanes", f"must be 1, 2, 4, 8 or 16, got {shown(self.pcie_lanes)}")
        for name, ratio in (("peak_tflops_tf32", DEFAULT_TF32_RATIO), ("peak_tflops_fp32", DEFAULT_FP32_RATIO)):
            value = getattr(self, name)
            _positive(where, name, value, strict=False)
            if value == 0:
                object.__setattr__(self, name, self.peak_tflops / ratio)

    def matmul_peak_tflops(self, precision: str) -> float:
        """Dense matmul peak for a model trained in ``precision``: the 16-bit tensor rate for bf16 and
        fp16, the TF32 tensor rate for fp32 (PyTorch's and cuBLAS's TF32 matmuls; GPUs without TF32 list
        their FP32 rate there)."""
        return self.peak_tflops_tf32 if precision == "fp32" else self.peak_tflops


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """A link in one direction: bandwidth in gigabytes (1e9 B) per second, latency in microseconds."""

    bandwidth_GBps: float
    latency_us: float = 0.0

    def __post_init__(self) -> None:
        _positive("link", "bandwidth_GBps", self.bandwidth_GBps)
        _positive("link", "latency_us", self.latency_us, strict=False)

    def transfer_time_s(self, num_bytes: float) -> float:
        """Alpha-beta time to send ``num_bytes`` over this link."""
        return self.latency_us * 1e-6 + num_bytes / (self.bandwidth_GBps * 1e9)


#: PCIe payload rate per lane and direction, GB/s: 3.0 8 GT/s, 4.0 16 GT/s, 5.0 32 GT/s, 128b/130b
#: encoding (PCI-SIG base specifications 3.0 / 4.0 / 5.0). Generation 0: no PCIe.
PCIE_GB_PER_LANE = {0: 0.0, 3: 8 * 128 / 130 / 8, 4: 16 * 128 / 130 / 8, 5: 32 * 128 / 130 / 8}
#: share of the PCIe payload rate a pinned-memory copy reaches: CUDA's bandwidthTest shows ~12.5 GB/s
#: host-to-device on 3.0 x16 (15.75 payload) and ~25 GB/s on 4.0 x16 (31.5): ~80%.
PCIE_EFFICIENCY = 0.8
#: per-transfer latency of a host <-> device copy (DMA set-up and launch), microseconds
HOST_LINK_LATENCY_US = 10.0
#: default host memory of a node: this many times its devices' memory together (servers are sized with
#: 2-4x GPU memory in DRAM: NVIDIA DGX A100 has 1-2 TB for 320-640 GB of GPU memory) ...
HOST_MEMORY_PER_DEVICE_MEMORY = 2.0
#: ... and at least this much
HOST_MEMORY_MIN_GiB = 64.0


def default_host_link(device: DeviceSpec) -> LinkSpec:
    """Each device's own link to host memory: its PCIe generation and width at ``PCIE_EFFICIENCY``
    (4.0 x16: 25.2 GB/s); a device without PCIe (``cpu``) copies within its own memory at half its
    memory bandwidth (a copy reads and writes)."""
    if device.pcie_gen == 0:
        return LinkSpec(device.memory_bandwidth_GBps / 2, 1.0)
    return LinkSpec(round(PCIE_GB_PER_LANE[device.pcie_gen] * device.pcie_lanes * PCIE_EFFICIENCY, 2),
                    HOST_LINK_LATENCY_US)


@dataclass(frozen=True, slots=True)
class HostSpec:
    """A node's host memory for offloaded state, and each device's link to it (SPEC "Extensions").

    ``memory_GiB`` is shared by the node's devices. ``link`` is each device's own link (PCIe).
    ``bandwidth_GBps`` caps the node's offload traffic as a whole (devices behind a shared PCIe
    switch or a narrow root complex); 0 means no cap beyond each device's link.
    """

    memory_GiB: float
    link: LinkSpec
    bandwidth_GBps: float = 0.0

    def __post_init__(self) -> None:
        _positive("host", "memory_GiB", self.memory_GiB)
        _positive("host", "bandwidth_GBps", self.bandwidth_GBps, strict=False)

    def shared_bandwidth_GBps(self, devices_transferring: int) -> float:
        """Each of ``devices_transferring`` devices' host bandwidth when they transfer at once."""
        bw = self.link.bandwidth_GBps
        if self.bandwidth_GBps > 0 and devices_transferring > 0:
            bw = min(bw, self.bandwidth_GBps / devices_transferring)
        return bw


def default_host(device: DeviceSpec, count: int) -> HostSpec:
    """``HOST_MEMORY_PER_DEVICE_MEMORY`` x the node's device memory (at least ``HOST_MEMORY_MIN_GiB``)
    and the device type's ``default_host_link``."""
    memory = max(HOST_MEMORY_MIN_GiB, HOST_MEMORY_PER_DEVICE_MEMORY * count * device.memory_GiB)
    return HostSpec(round(memory, 2), default_host_link(device))


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One machine: ``count`` devices of one type joined by ``intra_node``; ``network`` to other nodes."""

    name: str
    device: DeviceSpec
    count: int
    intra_node: LinkSpec
    network: LinkSpec
    slowdown: float = 1.0  # CPU runner emulation only: compute stretched by this factor
    host: HostSpec | None = None  # None: ``default_host(device, count)``

    def __post_init__(self) -> None:
        where = f"node {shown(self.name)}"
        if not self.name or ":" in self.name:
            raise SpecError(where, "name", "must be non-empty and contain no ':'")
        _positive(where, "count", self.count, integer=True)
        _positive(where, "slowdown", self.slowdown, minimum=1.0, strict=False)
        if self.host is None:
            object.__setattr__(self, "host", default_host(self.device, self.count))

    def device_ids(self) -> tuple[str, ...]:
        return tuple(f"{self.name}:{i}" for i in range(self.count))


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    name: str
    nodes: tuple[NodeSpec, ...]

    def __post_init__(self) -> None:
        if not self.nodes:
            raise SpecError(f"cluster {shown(self.name)}", "nodes", "must list at least one node")
        if sum(n.count for n in self.nodes) > MAX_DEVICES:
            raise SpecError(f"cluster {shown(self.name)}", "nodes", f"more than {MAX_DEVICES:,} devices in all "
                                                               "(the documented limit)")
        seen: set[str] = set()
        for node in self.nodes:
            if node.name in seen:
                raise SpecError(f"cluster {shown(self.name)}", "nodes", f"node name {shown(node.name)} is used twice")
            seen.add(node.name)

    @property
    def num_devices(self) -> int:
        return sum(n.count for n in self.nodes)

    def device_ids(self) -> tuple[str, ...]:
        return tuple(d for n in self.nodes for d in n.device_ids())

    def node_of(self, device_id: str) -> NodeSpec:
        node_name, _, index = device_id.rpartition(":")
        for node in self.nodes:
            if node.name == node_name and index.isdigit() and int(index) < node.count:
                return node
        raise SpecError(f"cluster {shown(self.name)}", "devices", f"unknown device id {shown(device_id)}")

    def device(self, device_id: str) -> DeviceSpec:
        return self.node_of(device_id).device

    def link(self, a: str, b: str) -> LinkSpec:
        """The link data takes from device ``a`` to device ``b``: intra-node, else the slower NIC."""
        na, nb = self.node_of(a), self.node_of(b)
        if na.name == nb.name:
            return na.intra_node
        return LinkSpec(min(na.network.bandwidth_GBps, nb.network.bandwidth_GBps),
                        max(na.network.latency_us, nb.network.latency_us))

    def group_link(self, device_ids: tuple[str, ...] | list[str]) -> LinkSpec:
        """The bottleneck link of a collective among ``device_ids`` (ring over the slowest hop)."""
        nodes = {self.node_of(d).name: self.node_of(d) for d in device_ids}
        if len(nodes) == 1:
            return next(iter(nodes.values())).intra_node
        bw = min(min(n.network.bandwidth_GBps, n.intra_node.bandwidth_GBps) for n in nodes.values())
        lat = max(n.network.latency_us for n in nodes.values())
        return LinkSpec(bw, lat)


# --------------------------------------------------------------------------------------------------
# Model


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A GPT/Llama-style decoder. ``global_batch_size`` is sequences per optimizer step."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_len: int
    global_batch_size: int
    num_kv_heads: int = 0  # 0 means num_heads
    mlp: str = "gelu"
    # mixture of experts (SPEC.md "Extensions"); num_experts 0 = dense. 0 in the next two = the default
    num_experts: int = 0
    experts_per_token: int = 0      # top-k routing [2 when num_experts > 0]
    expert_ffn_hidden_size: int = 0  # [ffn_hidden_size]
    moe_layer_every: int = 1        # blocks i with (i + 1) % moe_layer_every == 0 are MoE blocks
    precision: str = "bf16"  # bf16 | fp16 (16-bit mixed precision) | fp32 (TF32 matmuls where available)
    attention: str = "flash"  # flash (fused, scores never stored) | standard (scores stored)
    dropout: float = 0.0  # dropout probability on attention probabilities and residual branches

    def __post_init__(self) -> None:
        where = f"model {shown(self.name)}"
        for name in ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size", "seq_len",
                     "global_batch_size"):
            _positive(where, name, getattr(self, name), integer=True)
        _validate_experts(self, where)
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        _positive(where, "num_kv_heads", self.num_kv_heads, integer=True)
        if self.hidden_size % self.num_heads:
            raise SpecError(where, "hidden_size",
                            f"must be divisible by num_heads ({self.hidden_size} % {self.num_heads} != 0)")
        if self.num_heads % self.num_kv_heads:
            raise SpecError(where, "num_kv_heads",
                            f"must divide num_heads ({self.num_heads} % {self.num_kv_heads} != 0)")
        if self.mlp not in MLP_KINDS:
            raise SpecError(where, "mlp", f"must be one of {', '.join(MLP_KINDS)}, got {shown(self.mlp)}")
        if self.precision not in PRECISIONS:
            raise SpecError(where, "precision", f"must be one of {', '.join(PRECISIONS)}, got {shown(self.precision)}")
        if self.attention not in ATTENTION_KINDS:
            raise SpecError(where, "attention",
                            f"must be one of {', '.join(ATTENTION_KINDS)}, got {shown(self.attention)}")
        _positive(where, "dropout", self.dropout, strict=False)
        if self.dropout >= 1.0:
            raise SpecError(where, "dropout", f"must be a probability below 1, got {self.dropout}")

    @property
    def bytes_per_element(self) -> int:
        """Bytes of one activation, gradient or communicated element: 2 in 16-bit training, 4 in fp32."""
        return 4 if self.precision == "fp32" else 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    # -- mixture of experts ------------------------------------------------------------------------
    # A MoE block is a dense block whose MLP is replaced by a router (h x E) and E expert MLPs of width
    # expert_ffn_hidden_size, each token going to its top experts_per_token experts. Parameter counts
    # come in two kinds: *held* (every expert: what memory and gradient traffic see) and *active* (the
    # routed experts only: what FLOPs per token see). For a dense model both equal the dense count.

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Block ``layer`` (0-based) is an MoE block: every ``moe_layer_every``-th block, the last of each run."""
        return self.is_moe and (layer + 1) % self.moe_layer_every == 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers // self.moe_layer_every if self.is_moe else 0

    @property
    def moe_layer_fraction(self) -> float:
        """Share of the blocks that are MoE blocks (0 for a dense model)."""
        return self.num_moe_layers / self.num_layers

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.mlp == "swiglu" else 2

    @property
    def expert_params(self) -> int:
        """Weights of one expert MLP in one MoE block."""
        return self.mlp_matrices * self.hidden_size * self.expert_ffn_hidden_size if self.is_moe else 0

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_experts

    @property
    def attention_params(self) -> int:
        """Q, O, K, V projections and the block's two norms."""
        h = self.hidden_size
        return h * h * 2 + h * self.kv_hidden_size * 2 + 2 * h

    @property
    def dense_block_params(self) -> int:
        """Weights of one dense block (attention, norms, MLP)."""
        return self.attention_params + self.mlp_matrices * self.hidden_size * self.ffn_hidden_size

    @property
    def moe_block_shared_params(self) -> int:
        """Weights of one MoE block besides its experts: attention, norms, router."""
        return self.attention_params + self.router_params

    @property
    def expert_params_per_layer(self) -> float:
        """Expert weights per block, averaged over the blocks (every expert counted)."""
        return self.moe_layer_fraction * self.num_experts * self.expert_params

    @property
    def shared_params_per_layer(self) -> float:
        """Non-expert weights per block, averaged over the blocks (dense blocks and MoE blocks' shared part)."""
        f = self.moe_layer_fraction
        return (1.0 - f) * self.dense_block_params + f * self.moe_block_shared_params if self.is_moe \
            else self.dense_block_params

    @property
    def kv_hidden_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def params_per_layer(self) -> float:
        """Weights of one transformer block (attention + MLP matrices, biases ignored, 2 norms); for an MoE
        model the mean over blocks of what a block holds, every expert counted (so ``num_layers *
        params_per_layer`` is the blocks' total)."""
        if not self.is_moe:
            return self.dense_block_params
        return self.shared_params_per_layer + self.expert_params_per_layer

    @property
    def active_params_per_layer(self) -> float:
        """Weights one token passes through per block, averaged over the blocks: the routed experts only.
        Equals ``params_per_layer`` for a dense model."""
        if not self.is_moe:
            return self.dense_block_params
        return self.shared_params_per_layer + self.moe_layer_fraction * self.experts_per_token * self.expert_params

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Total weights with an untied LM head: embedding + blocks (every expert) + final norm + head."""
        return int(round(self.embedding_params * 2 + self.num_layers * self.params_per_layer + self.hidden_size))

    @property
    def active_params(self) -> int:
        """Weights one token passes through (routed experts only): Mixtral's "active parameters"."""
        return int(round(self.embedding_params * 2 + self.num_layers * self.active_params_per_layer
                         + self.hidden_size))

    def with_global_batch_size(self, global_batch_size: int | None) -> "ModelSpec":
        if global_batch_size is None:
            return self
        from dataclasses import replace

        return replace(self, global_batch_size=global_batch_size)


def _validate_experts(model: "ModelSpec", where: str) -> None:
    """The MoE fields' rules; fills in the defaults (experts_per_token 2, expert_ffn_hidden_size
    ffn_hidden_size) of an MoE model."""
    _positive(where, "num_experts", model.num_experts, integer=True, strict=False)
    for name in ("experts_per_token", "expert_ffn_hidden_size"):
        _positive(where, name, getattr(model, name), integer=True, strict=False)
    _positive(where, "moe_layer_every", model.moe_layer_every, integer=True)
    if not model.is_moe:
        for name, unset in (("experts_per_token", 0), ("expert_ffn_hidden_size", 0), ("moe_layer_every", 1)):
            if getattr(model, name) != unset:
                raise SpecError(where, name, f"applies only to mixture-of-experts models (num_experts > 0), got "
                                             f"{getattr(model, name)} with num_experts=0")
        return
    if model.experts_per_token == 0:
        object.__setattr__(model, "experts_per_token", min(2, model.num_experts))
    if model.expert_ffn_hidden_size == 0:
        object.__setattr__(model, "expert_ffn_hidden_size", model.ffn_hidden_size)
    if model.experts_per_token > model.num_experts:
        raise SpecError(where, "experts_per_token", f"top-{model.experts_per_token} routing needs at least that many "
                                                    f"experts, num_experts is {model.num_experts}")
    if model.moe_layer_every > model.num_layers:
        raise SpecError(where, "moe_layer_every", f"{model.moe_layer_every} > num_layers={model.num_layers}: "
                                                  "the model would have no MoE block")


# --------------------------------------------------------------------------------------------------
# Parallel config


@dataclass(frozen=True, slots=True)
class StageConfig:
    """One pipeline stage. ``recompute``: ``False``, ``True`` (full: keep each layer's input, recompute the
    layer in the backward) or ``"selective"`` (recompute only the attention core, Korthikanti et al.
    2022). ``sequence_parallel``: Megatron's sequence parallelism inside the stage's tensor-parallel
    group (norms and dropout split along the sequence; reduce-scatter + all-gather instead of
    all-reduce); no effect on a one-device stage.

    ``ranks`` (Zorse, ``autotune.stage_ranks``): the stage's data-parallel ranks, each a tensor-parallel
    group with its own share of the pipeline's micro-batches. Given, ``devices`` is derived from them
    (every rank's devices, in order); empty, the stage is one rank of ``devices`` holding every
    micro-batch (``ranks_of``)."""

    devices: tuple[str, ...]
    layers: int
    recompute: bool | str = False
    offload: str = "none"  # OFFLOAD_MODES: none | optimizer | all
    sequence_parallel: bool = False
    ranks: tuple[RankConfig, ...] = ()

    def __post_init__(self) -> None:
        if self.ranks:
            object.__setattr__(self, "devices", tuple(d for r in self.ranks for d in r.devices))

    @property
    def tp(self) -> int:
        """The tensor-parallel degree (of the widest rank in a stage of several ranks)."""
        return max(r.tp for r in self.ranks) if self.ranks else len(self.devices)

    @property
    def mixed(self) -> bool:
        """A stage of several data-parallel ranks (``ranks`` with two or more entries)."""
        return len(self.ranks) > 1

    def ranks_of(self, num_microbatches: int) -> tuple[RankConfig, ...]:
        """The stage's ranks; a ``devices`` stage is one rank holding all ``num_microbatches``."""
        return stage_ranks.ranks_of(self, num_microbatches)

    @property
    def full_recompute(self) -> bool:
        return self.recompute is True

    @property
    def selective_recompute(self) -> bool:
        return self.recompute == "selective"


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    num_microbatches: int
    stages: tuple[StageConfig, ...]
    #: expert indices this replica trains (SPES); None = "all". Only its gradients and optimizer state exist.
    trains_experts: tuple[int, ...] | None = None
    #: schedule "roundpipe": the device pool and the partitions (``autotune.roundpipe_plan``); stages is empty
    roundpipe: RoundPipeStages | None = None

    @property
    def devices(self) -> tuple[str, ...]:
        if self.roundpipe is not None:
            return self.roundpipe.devices
        return tuple(d for s in self.stages for d in s.devices)

    def stage_ranks(self, stage: int) -> tuple[RankConfig, ...]:
        """Stage ``stage``'s data-parallel ranks with their micro-batch shares (``StageConfig.ranks_of``)."""
        return self.stages[stage].ranks_of(self.num_microbatches)


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """A plan (SPEC.md "Parallel config"). Hashable, so it is a cache key."""

    micro_batch_size: int
    pipelines: tuple[PipelineConfig, ...]
    schedule: str = "1f1b"
    virtual_stages: int = 1
    zero: int = 0  # ZERO_STAGES: sharding across each set of data-parallel peers
    #: MoE experts split across groups of this many consecutive replicas (all-to-all inside each group)
    expert_parallel: int = 1
    #: > 1: replicas (expert-parallel groups) train locally and exchange what they trained every N steps (SPES)
    sync_every_steps: int = 1

    def __post_init__(self) -> None:
        where = "config"
        _positive(where, "micro_batch_size", self.micro_batch_size, integer=True)
        _positive(where, "virtual_stages", self.virtual_stages, integer=True)
        if isinstance(self.zero, bool) or self.zero not in ZERO_STAGES:
            raise SpecError(where, "zero", f"must be 0, 1, 2 or 3 (ZeRO stage), got {shown(self.zero)}")
        _positive(where, "expert_parallel", self.expert_parallel, integer=True)
        _positive(where, "sync_every_steps", self.sync_every_steps, integer=True)
        if self.schedule not in ALL_SCHEDULES:
            raise SpecError(where, "schedule", f"must be one of {', '.join(ALL_SCHEDULES)}, got {shown(self.schedule)}")
        if self.schedule == "interleaved-1f1b" and self.virtual_stages < 2:
            raise SpecError(where, "virtual_stages", "interleaved-1f1b needs virtual_stages >= 2 (model chunks per "
                                                     f"stage's devices), got {shown(self.virtual_stages)}")
        if self.schedule != "interleaved-1f1b" and self.virtual_stages != 1:
            raise SpecError(where, "virtual_stages", f"only applies to interleaved-1f1b, got {self.virtual_stages} "
                                                     f"with schedule {shown(self.schedule)}")
        if not self.pipelines:
            raise SpecError(where, "pipelines", "must list at least one pipeline")
        for p, pipe in enumerate(self.pipelines):
            _positive(where, f"pipelines[{p}].num_microbatches", pipe.num_microbatches, integer=True)
            if pipe.trains_experts is not None:
                te = pipe.trains_experts
                if not isinstance(te, tuple) or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0
                                                        for e in te):
                    raise SpecError(where, f"pipelines[{p}].trains_experts",
                                    f'must be "all" or a list of expert indices (integers >= 0), got {shown(te)}')
                if len(set(te)) != len(te):
                    raise SpecError(where, f"pipelines[{p}].trains_experts", f"lists an expert twice: {list(te)}")
        roundpipe_plan.check_shape(self, where)
        if self.schedule == ROUNDPIPE:
            return
        stage_ranks.check_shape(self, where)
        for p, pipe in enumerate(self.pipelines):
            if not pipe.stages:
                raise SpecError(where, f"pipelines[{p}].stages", "must list at least one stage")
            for s, stage in enumerate(pipe.stages):
                f = f"pipelines[{p}].stages[{s}]"
                if not stage.devices:
                    raise SpecError(where, f"{f}.devices", "must list at least one device")
                _positive(where, f"{f}.layers", stage.layers, integer=True, strict=False)
                if stage.offload not in OFFLOAD_MODES:
                    raise SpecError(where, f"{f}.offload",
                                    f"must be one of {', '.join(OFFLOAD_MODES)}, got {shown(stage.offload)}")
                if not (isinstance(stage.recompute, bool) or stage.recompute == "selective"):
                    raise SpecError(where, f"{f}.recompute",
                                    f"must be true, false or \"selective\", got {shown(stage.recompute)}")
                if not isinstance(stage.sequence_parallel, bool):
                    raise SpecError(where, f"{f}.sequence_parallel",
                                    f"must be true or false, got {shown(stage.sequence_parallel)}")

    # -- derived -----------------------------------------------------------------------------------
    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for p in self.pipelines for d in p.devices)

    @property
    def global_batch_size(self) -> int:
        return sum(p.num_microbatches for p in self.pipelines) * self.micro_batch_size

    @property
    def has_mixed_stages(self) -> bool:
        """Some stage has several data-parallel ranks (Zorse, ``autotune.stage_ranks``)."""
        return any(s.mixed for p in self.pipelines for s in p.stages)

    @property
    def offloads(self) -> bool:
        """True when any stage keeps state in host memory."""
        return any(s.offload != "none" for p in self.pipelines for s in p.stages)

    @property
    def is_roundpipe(self) -> bool:
        """RoundPipe's dispatch schedule (``autotune.roundpipe_plan``)."""
        return self.schedule == ROUNDPIPE

    def notes(self) -> list[str]:
        """Settings that are valid but do nothing (``describe`` shows them; nothing is rejected)."""
        out = roundpipe_plan.notes(self)
        if self.zero and len(self.pipelines) == 1 and not self.has_mixed_stages:
            out.append(f"zero {self.zero} with one replica does nothing (no data-parallel peers to shard across)")
        return out

    def validate(self, cluster: ClusterSpec, model: ModelSpec, source: str = "config") -> None:
        """Check the rules that need the cluster and model; raise SpecError naming the broken one."""
        _validate_expert_plan(self, model, source)
        if self.schedule == ROUNDPIPE:
            roundpipe_plan.validate(self, cluster, model, source)
            return
        known = set(cluster.device_ids())
        seen: set[str] = set()
        for p, pipe in enumerate(self.pipelines):
            if self.schedule == "interleaved-1f1b" and pipe.num_microbatches % len(pipe.stages):
                raise SpecError(source, f"pipelines[{p}].num_microbatches",
                                f"interleaved-1f1b needs num_microbatches divisible by the number of stages "
                                f"(Megatron-LM's rule): {pipe.num_microbatches} % {len(pipe.stages)} != 0")
            total = sum(s.layers for s in pipe.stages)
            if total != model.num_layers:
                raise SpecError(source, f"pipelines[{p}].stages",
                                f"layers sum to {total}, model {shown(model.name)} has num_layers={model.num_layers}")
            for s, stage in enumerate(pipe.stages):
                if stage.layers < 1 and len(pipe.stages) > 1:
                    raise SpecError(source, f"pipelines[{p}].stages[{s}].layers",
                                    "must be >= 1 in a pipeline of several stages")
                if self.schedule == "interleaved-1f1b" and stage.layers % self.virtual_stages:
                    raise SpecError(source, f"pipelines[{p}].stages[{s}].layers",
                                    f"{stage.layers} layers do not split into virtual_stages={self.virtual_stages} chunks")
                dev_field = f"pipelines[{p}].stages[{s}]." + ("ranks" if stage.ranks else "devices")
                for d in stage.devices:
                    if d not in known:
                        raise SpecError(source, dev_field,
                                        f"unknown device id {shown(d)} (cluster {shown(cluster.name)} has "
                                        f"{', '.join(n.name + ':0..' + str(n.count - 1) for n in cluster.nodes)})")
                    if d in seen:
                        raise SpecError(source, dev_field, f"device {shown(d)} is used more than once")
                    seen.add(d)
                for k, rank in enumerate(stage.ranks_of(pipe.num_microbatches)):
                    tp = rank.tp
                    where = f"pipelines[{p}].stages[{s}]." + (f"ranks[{k}].devices" if stage.ranks else "devices")
                    if model.num_heads % tp or (model.num_kv_heads % tp and tp % model.num_kv_heads):
                        raise SpecError(source, where,
                                        f"tensor-parallel degree {tp} must divide num_heads={model.num_heads} "
                                        f"and num_kv_heads={model.num_kv_heads} (or be a multiple of it)")
                    if model.ffn_hidden_size % tp:
                        raise SpecError(source, where, f"tensor-parallel degree {tp} must divide "
                                                       f"ffn_hidden_size={model.ffn_hidden_size}")
        if self.global_batch_size != model.global_batch_size:
            parts = " + ".join(f"{p.num_microbatches}" for p in self.pipelines)
            raise SpecError(source, "num_microbatches",
                            f"({parts}) x micro_batch_size {self.micro_batch_size} = {self.global_batch_size} "
                            f"sequences, global_batch_size is {model.global_batch_size}")

    # -- (de)serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"micro_batch_size": self.micro_batch_size, "schedule": self.schedule}
        if self.schedule == "interleaved-1f1b":
            out["virtual_stages"] = self.virtual_stages
        if self.zero:
            out["zero"] = self.zero
        if self.expert_parallel != 1:
            out["expert_parallel"] = self.expert_parallel
        if self.sync_every_steps != 1:
            out["sync_every_steps"] = self.sync_every_steps

        def stage(s: StageConfig) -> dict[str, Any]:
            d: dict[str, Any] = ({"ranks": stage_ranks.ranks_to_dict(s.ranks)} if s.ranks
                                 else {"devices": list(s.devices)})
            d.update(layers=s.layers, recompute=s.recompute)
            if s.offload != "none":
                d["offload"] = s.offload
            if s.sequence_parallel:
                d["sequence_parallel"] = True
            return d

        out["pipelines"] = []
        for p in self.pipelines:
            pipe: dict[str, Any] = {"num_microbatches": p.num_microbatches}
            if p.trains_experts is not None:
                pipe["trains_experts"] = list(p.trains_experts)
            if p.roundpipe is not None:
                pipe.update(roundpipe_plan.pipeline_to_dict(p.num_microbatches, p.roundpipe))
            else:
                pipe["stages"] = [stage(s) for s in p.stages]
            out["pipelines"].append(pipe)
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> "ParallelConfig":
        if not isinstance(data, Mapping):
            raise SpecError(source, "", f"must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - {"micro_batch_size", "schedule", "virtual_stages", "zero", "pipelines", "measurement",
                               "expert_parallel", "sync_every_steps"}
        if unknown:
            raise SpecError(source, str(sorted(unknown, key=str)[0]), "unknown field")
        try:
            pipelines_raw = data["pipelines"]
            mbs = data["micro_batch_size"]
        except KeyError as e:
            raise SpecError(source, str(e.args[0]), "is required") from None
        if not isinstance(pipelines_raw, list):
            raise SpecError(source, "pipelines", "must be a list")
        if data.get("schedule", "1f1b") not in ALL_SCHEDULES:
            raise SpecError(source, "schedule", f"must be one of {', '.join(ALL_SCHEDULES)}, "
                                                f"got {shown(data.get('schedule'))}")
        pipelines = []
        for p, raw in enumerate(pipelines_raw):
            if not isinstance(raw, Mapping):
                raise SpecError(source, f"pipelines[{p}]", "must be an object")
            if data.get("schedule") == ROUNDPIPE:
                m, rp, trains = roundpipe_plan.pipeline_from_dict(raw, source, p)
                pipelines.append(PipelineConfig(m, (), _trains_experts_from(trains, source, p), rp))
                continue
            if "forward_layers" in raw or "backward_layers" in raw:
                raise SpecError(source, f"pipelines[{p}].forward_layers",
                                'a device pool with forward/backward partitions needs "schedule": "roundpipe"')
            stages_raw = raw.get("stages")
            if not isinstance(stages_raw, list):
                raise SpecError(source, f"pipelines[{p}].stages", "is required and must be a list")
            stages = []
            for s, st in enumerate(stages_raw):
                f = f"pipelines[{p}].stages[{s}]"
                if not isinstance(st, Mapping):
                    raise SpecError(source, f, "must be an object")
                extra = set(st) - {"devices", "ranks", "layers", "recompute", "offload", "sequence_parallel"}
                if extra:
                    raise SpecError(source, f"{f}.{sorted(extra, key=str)[0]}", "unknown field")
                ranks: tuple[RankConfig, ...] = ()
                if "ranks" in st:  # Zorse: data-parallel ranks with their own shares (autotune.stage_ranks)
                    if "devices" in st:
                        raise SpecError(source, f"{f}.ranks", "give devices (one rank) or ranks, not both")
                    ranks = stage_ranks.ranks_from_dict(st["ranks"], source, f"{f}.ranks")
                    devices = []
                else:
                    devices = st.get("devices")
                    if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
                        raise SpecError(source, f"{f}.devices", "is required (or ranks) and must be a list of "
                                                                "device ids")
                if "layers" not in st:
                    raise SpecError(source, f"{f}.layers", "is required")
                stages.append(StageConfig(tuple(devices), st["layers"], st.get("recompute", False),
                                          st.get("offload", "none"), st.get("sequence_parallel", False), ranks))
            if "num_microbatches" not in raw:
                raise SpecError(source, f"pipelines[{p}].num_microbatches", "is required")
            extra = set(raw) - {"num_microbatches", "stages", "trains_experts"}
            if extra:
                raise SpecError(source, f"pipelines[{p}].{sorted(extra, key=str)[0]}", "unknown field")
            pipelines.append(PipelineConfig(raw["num_microbatches"], tuple(stages),
                                            _trains_experts_from(raw.get("trains_experts", "all"), source, p)))
        try:
            return cls(micro_batch_size=mbs, pipelines=tuple(pipelines), schedule=data.get("schedule", "1f1b"),
                       virtual_stages=data.get("virtual_stages", 1), zero=data.get("zero", 0),
                       expert_parallel=data.get("expert_parallel", 1),
                       sync_every_steps=data.get("sync_every_steps", 1))
        except SpecError as e:
            raise SpecError(source, e.field, e.rule) from None

    @classmethod
    def from_json(cls, text: str, source: str = "config") -> "ParallelConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(source, "", f"invalid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        return cls.from_dict(data, source)

    def describe(self) -> str:
        """A short human summary, e.g. ``mbs=2 1f1b | [a100:0-1 x20 | v100:0-3 x12 R] m=64``; ``zero=2``
        and a stage's ``off=optimizer`` / ``off=all`` when set, then any ``notes()``."""
        parts = []
        for p in self.pipelines:
            if p.roundpipe is not None:
                parts.append(f"[{p.roundpipe.summary()}] m={p.num_microbatches}")
                continue
            stages = " | ".join(f"{stage_ranks.summary(s)} x{s.layers}{_stage_flags(s)}"
                                f"{' off=' + s.offload if s.offload != 'none' else ''}" for s in p.stages)
            experts = "" if p.trains_experts is None else f" E={_ranges(p.trains_experts)}"
            parts.append(f"[{stages}] m={p.num_microbatches}{experts}")
        zero = f"zero={self.zero} " if self.zero else ""
        moe = (f"ep={self.expert_parallel} " if self.expert_parallel != 1 else "") + \
              (f"sync={self.sync_every_steps} " if self.sync_every_steps != 1 else "")
        notes = "".join(f" (note: {n})" for n in self.notes())
        return f"mbs={self.micro_batch_size} {self.schedule} {zero}{moe}" + " ; ".join(parts) + notes

    # -- experts (MoE plans) -------------------------------------------------------------------------
    def expert_groups(self) -> tuple[tuple[int, ...], ...]:
        """Pipelines of each expert-parallel group: consecutive runs of ``expert_parallel`` replicas."""
        g = self.expert_parallel
        n = len(self.pipelines)
        return tuple(tuple(range(i, min(i + g, n))) for i in range(0, n, g))

    @property
    def spes(self) -> bool:
        """Replicas train locally between syncs (SPES, ``sync_every_steps > 1``) or train expert subsets."""
        return self.sync_every_steps > 1 or any(p.trains_experts is not None for p in self.pipelines)


def _ranges(indices: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"``."""
    out, run = [], []
    for i in sorted(indices):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out) or "-"


def _expert_set(trains: tuple[int, ...] | None) -> frozenset[int] | None:
    return None if trains is None else frozenset(trains)


def _trains_experts_from(raw: Any, source: str, p: int) -> tuple[int, ...] | None:
    if raw == "all":
        return None
    if not isinstance(raw, list):
        raise SpecError(source, f"pipelines[{p}].trains_experts", f'must be "all" or a list of expert indices, got {shown(raw)}')
    return tuple(raw)


def _validate_expert_plan(config: ParallelConfig, model: ModelSpec, source: str) -> None:
    """The plan rules of MoE plans: expert parallelism, trained expert subsets, SPES sync (SPEC.md
    "Extensions"). Expert-parallel groups are consecutive runs of ``expert_parallel`` replicas; every
    all-to-all needs all of a group's replicas, so they must have the same shape and batch."""
    g, n = config.expert_parallel, len(config.pipelines)
    E = model.num_experts
    if g > 1:
        if not model.is_moe:
            raise SpecError(source, "expert_parallel", f"{g} needs a mixture-of-experts model (num_experts > 0); "
                                                       f"model {model.name!r} is dense")
        if E % g:
            raise SpecError(source, "expert_parallel", f"{g} must divide num_experts={E} (each of a group's "
                                                       f"replicas holds num_experts / expert_parallel experts)")
        if n % g:
            raise SpecError(source, "expert_parallel", f"{g} must divide the number of data-parallel replicas "
                                                       f"(pipelines), {n}")
        for group in config.expert_groups():
            first = config.pipelines[group[0]]
            shape = [(s.layers, s.tp) for s in first.stages]
            for p in group[1:]:
                pipe = config.pipelines[p]
                if [(s.layers, s.tp) for s in pipe.stages] != shape:
                    raise SpecError(source, f"pipelines[{p}].stages",
                                    f"replicas of one expert-parallel group (pipelines {group[0]}..{group[-1]}) "
                                    f"need the same stages (layers, tensor-parallel degree): "
                                    f"{[(s.layers, s.tp) for s in pipe.stages]} != {shape} in pipelines[{group[0]}]")
                if pipe.num_microbatches != first.num_microbatches:
                    raise SpecError(source, f"pipelines[{p}].num_microbatches",
                                    f"replicas of one expert-parallel group (pipelines {group[0]}..{group[-1]}) "
                                    f"need the same num_microbatches: {pipe.num_microbatches} != "
                                    f"{first.num_microbatches} in pipelines[{group[0]}]")
                if _expert_set(pipe.trains_experts) != _expert_set(first.trains_experts):
                    raise SpecError(source, f"pipelines[{p}].trains_experts",
                                    f"replicas of one expert-parallel group (pipelines {group[0]}..{group[-1]}) "
                                    "train one set of experts together: give them the same list")
    subsets = [(p, pipe.trains_experts) for p, pipe in enumerate(config.pipelines) if pipe.trains_experts is not None]
    if subsets:
        if not model.is_moe:
            raise SpecError(source, f"pipelines[{subsets[0][0]}].trains_experts",
                            f'needs a mixture-of-experts model (num_experts > 0); model {model.name!r} is dense: '
                            'leave it out or give "all"')
        for p, te in subsets:
            bad = [e for e in te if e >= E]
            if bad:
                raise SpecError(source, f"pipelines[{p}].trains_experts",
                                f"expert index {bad[0]} out of range: model {model.name!r} has num_experts={E} "
                                f"(indices 0..{E - 1})")
        covered: set[int] = set()
        for pipe in config.pipelines:
            covered |= set(range(E)) if pipe.trains_experts is None else set(pipe.trains_experts)
        missing = sorted(set(range(E)) - covered)
        if missing:
            raise SpecError(source, "trains_experts", f"expert(s) {_ranges(tuple(missing))} are trained by no "
                                                      "replica: together the replicas must cover every expert")
    if config.sync_every_steps > 1 and len(config.expert_groups()) < 2:
        raise SpecError(source, "sync_every_steps",
                        f"{config.sync_every_steps} needs at least two replicas (expert-parallel groups) to "
                        f"synchronise, the plan has {len(config.expert_groups())}")


def _stage_flags(stage: StageConfig) -> str:
    """`` R`` full recomputation, `` S`` selective, `` SP`` sequence parallel (``describe``)."""
    flags = " R" if stage.full_recompute else " S" if stage.selective_recompute else ""
    return flags + (" SP" if stage.sequence_parallel else "")


# --------------------------------------------------------------------------------------------------
# Measurement


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    device: str
    op: str  # e.g. "F3" (forward of micro-batch 3), "B3", "allreduce", "optimizer", "send"
    start_s: float
    end_s: float


MEASUREMENT_STATUSES = ("ok", "oom", "failed", "timeout", "invalid")


@dataclass(frozen=True, slots=True)
class Measurement:
    """What one evaluation of a plan returns: the simulator's prediction or a profiled run's reading."""

    tokens_per_s: float
    iteration_time_s: float
    oom: bool
    peak_memory_GiB: Mapping[str, float] = field(default_factory=dict)
    mfu: float = 0.0
    bubble_fraction: float = 0.0
    stage_busy_s: tuple[float, ...] = ()  # per stage of the slowest pipeline: forward + backward busy time
    timeline: tuple[TimelineEvent, ...] = ()
    status: str = "ok"
    error: str = ""
    host_memory_GiB: Mapping[str, float] = field(default_factory=dict)  # node -> GiB, when a plan offloads
    #: SPES plans (sync_every_steps > 1): seconds of one synchronisation round; iteration_time_s includes
    #: it amortised over sync_every_steps. 0 for every other plan.
    sync_time_s: float = 0.0
    #: device -> GiB of tensors at the peak (what ``torch.cuda.max_memory_allocated`` reports); absent where
    #: not known. ``peak_memory_GiB`` is the device's view (nvidia-smi: plus CUDA context, library buffers
    #: and the allocator's pool).
    allocated_memory_GiB: Mapping[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and not self.oom

    def score(self) -> float:
        """Throughput that counts for search: 0 for any plan that does not run."""
        return self.tokens_per_s if self.ok else 0.0

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tokens_per_s": self.tokens_per_s,
            "iteration_time_s": self.iteration_time_s,
            "oom": self.oom,
            "peak_memory_GiB": dict(self.peak_memory_GiB),
            "mfu": self.mfu,
            "bubble_fraction": self.bubble_fraction,
            "stage_busy_s": list(self.stage_busy_s),
            "status": self.status,
            "error": self.error,
        }
        if self.host_memory_GiB:
            out["host_memory_GiB"] = dict(self.host_memory_GiB)
        if self.sync_time_s:
            out["sync_time_s"] = self.sync_time_s
        if self.allocated_memory_GiB:
            out["allocated_memory_GiB"] = dict(self.allocated_memory_GiB)
        if timeline:
            out["timeline"] = [[e.device, e.op, e.start_s, e.end_s] for e in self.timeline]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Measurement":
        return cls(
            tokens_per_s=float(data.get("tokens_per_s", 0.0)),
            iteration_time_s=float(data.get("iteration_time_s", 0.0)),
            oom=bool(data.get("oom", False)),
            peak_memory_GiB={str(k): float(v) for k, v in dict(data.get("peak_memory_GiB", {})).items()},
            mfu=float(data.get("mfu", 0.0)),
            bubble_fraction=float(data.get("bubble_fraction", 0.0)),
            stage_busy_s=tuple(float(x) for x in data.get("stage_busy_s", ())),
            timeline=tuple(TimelineEvent(str(d), str(o), float(a), float(b)) for d, o, a, b in data.get("timeline", ())),
            status=str(data.get("status", "ok")),
            error=str(data.get("error", "")),
            host_memory_GiB={str(k): float(v) for k, v in dict(data.get("host_memory_GiB", {})).items()},
            sync_time_s=float(data.get("sync_time_s", 0.0)),
            allocated_memory_GiB={str(k): float(v) for k, v in dict(data.get("allocated_memory_GiB", {})).items()},
        )

    @classmethod
    def failure(cls, status: str, error: str, oom: bool = False) -> "Measurement":
        return cls(tokens_per_s=0.0, iteration_time_s=0.0, oom=oom, status=status, error=error)


def iter_stages(config: ParallelConfig) -> Iterator[tuple[int, int, StageConfig]]:
    for p, pipe in enumerate(config.pipelines):
        for s, stage in enumerate(pipe.stages):
            yield p, s, stage
