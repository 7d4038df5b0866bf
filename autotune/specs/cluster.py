"""The cluster: devices (GPUs from the catalog or inline), links, host memory, nodes.

Device ids are ``<node>:<index>``; ``ClusterSpec`` answers which node a device is on and which link joins
two devices (docs/formats.md, "Cluster").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autotune.errors import SpecError, shown
from autotune.specs.limits import DEFAULT_FP32_RATIO, DEFAULT_TF32_RATIO, MAX_DEVICES, positive


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
        positive(where, "peak_tflops", self.peak_tflops)
        positive(where, "memory_GiB", self.memory_GiB)
        positive(where, "memory_bandwidth_GBps", self.memory_bandwidth_GBps)
        if isinstance(self.pcie_gen, bool) or self.pcie_gen not in PCIE_GB_PER_LANE:
            raise SpecError(
                where,
                "pcie_gen",
                f"must be one of {', '.join(map(str, PCIE_GB_PER_LANE))} (0 = no PCIe), got {shown(self.pcie_gen)}",
            )
        if isinstance(self.pcie_lanes, bool) or self.pcie_lanes not in (1, 2, 4, 8, 16):
            raise SpecError(where, "pcie_lanes", f"must be 1, 2, 4, 8 or 16, got {shown(self.pcie_lanes)}")
        for name, ratio in (("peak_tflops_tf32", DEFAULT_TF32_RATIO), ("peak_tflops_fp32", DEFAULT_FP32_RATIO)):
            value = getattr(self, name)
            positive(where, name, value, strict=False)
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
        positive("link", "bandwidth_GBps", self.bandwidth_GBps)
        positive("link", "latency_us", self.latency_us, strict=False)

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
    return LinkSpec(
        round(PCIE_GB_PER_LANE[device.pcie_gen] * device.pcie_lanes * PCIE_EFFICIENCY, 2), HOST_LINK_LATENCY_US
    )


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
        positive("host", "memory_GiB", self.memory_GiB)
        positive("host", "bandwidth_GBps", self.bandwidth_GBps, strict=False)

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
        positive(where, "count", self.count, integer=True)
        positive(where, "slowdown", self.slowdown, minimum=1.0, strict=False)
        if self.host is None:
            object.__setattr__(self, "host", default_host(self.device, self.count))

    def device_ids(self) -> tuple[str, ...]:
        return tuple(f"{self.name}:{i}" for i in range(self.count))


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    name: str
    nodes: tuple[NodeSpec, ...]
    #: node name -> node, for ``node_of`` (a planner asks it ~10^5 times on 1,024 GPUs)
    _by_name: dict[str, NodeSpec] = field(init=False, repr=False, compare=False, hash=False)
    _ids: tuple[str, ...] = field(init=False, repr=False, compare=False, hash=False)  # ``device_ids``, once
    _id_set: frozenset[str] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.nodes:
            raise SpecError(f"cluster {shown(self.name)}", "nodes", "must list at least one node")
        if sum(n.count for n in self.nodes) > MAX_DEVICES:
            raise SpecError(
                f"cluster {shown(self.name)}",
                "nodes",
                f"more than {MAX_DEVICES:,} devices in all (the documented limit)",
            )
        seen: set[str] = set()
        for node in self.nodes:
            if node.name in seen:
                raise SpecError(f"cluster {shown(self.name)}", "nodes", f"node name {shown(node.name)} is used twice")
            seen.add(node.name)
        object.__setattr__(self, "_by_name", {node.name: node for node in self.nodes})
        object.__setattr__(self, "_ids", tuple(d for n in self.nodes for d in n.device_ids()))
        object.__setattr__(self, "_id_set", frozenset(self._ids))

    @property
    def num_devices(self) -> int:
        return sum(n.count for n in self.nodes)

    def device_ids(self) -> tuple[str, ...]:
        return self._ids

    def has_device(self, device_id: str) -> bool:
        return device_id in self._id_set

    def node_of(self, device_id: str) -> NodeSpec:
        node_name, _, index = device_id.rpartition(":")
        node = self._by_name.get(node_name)
        if node is not None and index.isdigit() and int(index) < node.count:
            return node
        raise SpecError(f"cluster {shown(self.name)}", "devices", f"unknown device id {shown(device_id)}")

    def device(self, device_id: str) -> DeviceSpec:
        return self.node_of(device_id).device

    def link(self, a: str, b: str) -> LinkSpec:
        """The link data takes from device ``a`` to device ``b``: intra-node, else the slower NIC."""
        na, nb = self.node_of(a), self.node_of(b)
        if na.name == nb.name:
            return na.intra_node
        return LinkSpec(
            min(na.network.bandwidth_GBps, nb.network.bandwidth_GBps), max(na.network.latency_us, nb.network.latency_us)
        )

    def group_link(self, device_ids: tuple[str, ...] | list[str]) -> LinkSpec:
        """The bottleneck link of a collective among ``device_ids`` (ring over the slowest hop)."""
        nodes = {self.node_of(d).name: self.node_of(d) for d in device_ids}
        if len(nodes) == 1:
            return next(iter(nodes.values())).intra_node
        bw = min(min(n.network.bandwidth_GBps, n.intra_node.bandwidth_GBps) for n in nodes.values())
        lat = max(n.network.latency_us for n in nodes.values())
        return LinkSpec(bw, lat)
