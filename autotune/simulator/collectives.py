"""NCCL-like costs of collectives and point-to-point transfers, per kind of link.

``autotune.simulator.communication`` is the plain alpha-beta ring (what gloo on one host does, and what
the CPU runner's calibration measures). GPUs talk through NCCL, whose cost has three parts the plain
ring leaves out, each taken from NCCL's own performance model or from published nccl-tests numbers:

1. **A fixed cost per call and per ring step, per link kind and protocol.** NCCL's tuning model
   (``src/graph/tuning.cc``, NCCL 2.18-2.21; ring algorithm): a base latency per call of 6.6 us (LL),
   14 us (LL128), 8.4 us (Simple) plus, per step, 0.6 / 1.9 / 3.4 us over NVLink, 1.0 / 2.5 / 5.7 us over
   PCIe and 2.7 / 4.0 / 14 us over the network. A ring all-reduce among ``k`` ranks takes ``2 (k - 1)``
   steps, a reduce-scatter or all-gather ``k - 1``. The link's own ``latency_us`` (cluster file) is
   used per step where it is larger.
2. **Protocol bandwidth.** LL sends a flag with every 8 bytes (half the bandwidth), LL128 120 bytes of
   every 128, Simple all of it; NCCL picks per message size, so the cost is the cheapest protocol's
   (LL128 only over NVLink, as NCCL enables it by default only there).
3. **Achieved bus bandwidth per link kind**, as a fraction of the link's ``bandwidth_GBps``
   (``BUS_EFFICIENCY``): about 0.8 over NVLink (nccl-tests ``all_reduce_perf`` on DGX A100 reports
   ~230-240 GB/s bus bandwidth for 300 GB/s NVLink), 0.8 over PCIe with peer-to-peer, 0.9 over an
   InfiniBand-class network (~23 of 25 GB/s per HDR NIC), and 0.4 over PCIe **without** peer-to-peer,
   where NCCL stages every step through host memory (its SHM transport): each byte crosses PCIe twice.
   GeForce / TITAN cards (``NO_PCIE_P2P``) have peer-to-peer disabled over PCIe by the driver.

Link kinds: ``nvlink`` (an intra-node link of at least ``NVLINK_MIN_GBPS``), ``pcie`` and
``pcie-no-p2p`` (slower intra-node links), ``network`` (between nodes), ``host`` (CPU devices: gloo,
plain alpha-beta, as calibrated). ``bandwidth_GBps`` stays what the cluster file (or a profile's
measured links) says: these terms model what NCCL makes of it.
"""

from __future__ import annotations

from autotune.simulator.communication import ring_allreduce_s

NVLINK_MIN_GBPS = 100.0  # intra-node links at least this fast are NVLink / NVSwitch; slower ones PCIe
#: GPUs whose driver disables PCIe peer-to-peer (GeForce and TITAN cards; NVLink bridges aside)
NO_PCIE_P2P = frozenset({"RTX-4090", "RTX-3090", "RTX-2080-Ti", "RTX-2080", "TITAN-RTX"})

PROTOCOLS = ("LL", "LL128", "Simple")
#: NCCL tuning.cc, ring: base latency per call (us) ...
BASE_LATENCY_US = {"LL": 6.6, "LL128": 14.0, "Simple": 8.4}
#: ... and hardware latency per ring step (us), per link kind
STEP_LATENCY_US = {
    "nvlink": {"LL": 0.6, "LL128": 1.9, "Simple": 3.4},
    "pcie": {"LL": 1.0, "LL128": 2.5, "Simple": 5.7},
    "pcie-no-p2p": {"LL": 1.0, "LL128": 2.5, "Simple": 5.7},
    "network": {"LL": 2.7, "LL128": 4.0, "Simple": 14.0},
}
#: share of the link bandwidth each protocol carries as data
PROTOCOL_BANDWIDTH = {"LL": 0.5, "LL128": 120.0 / 128.0, "Simple": 1.0}
#: achieved bus bandwidth / link bandwidth (nccl-tests), per link kind
BUS_EFFICIENCY = {"nvlink": 0.8, "pcie": 0.8, "pcie-no-p2p": 0.4, "network": 0.9}

_STEPS = {"allreduce": (2.0, 2.0), "reduce_scatter": (1.0, 1.0), "all_gather": (1.0, 1.0)}


def intra_node_kind(bandwidth_GBps: float, gpu: str) -> str:
    """The kind of an intra-node link of ``bandwidth_GBps`` between GPUs of type ``gpu``."""
    if gpu == "cpu":
        return "host"
    if bandwidth_GBps >= NVLINK_MIN_GBPS:
        return "nvlink"
    return "pcie-no-p2p" if gpu in NO_PCIE_P2P else "pcie"


def _protocols(kind: str) -> tuple[str, ...]:
    return PROTOCOLS if kind == "nvlink" else ("LL", "Simple")


def collective_s(op: str, num_bytes: float, ranks: int, bandwidth_GBps: float, latency_us: float, kind: str) -> float:
    """Seconds of a ring ``op`` (``allreduce``, ``reduce_scatter``, ``all_gather``) of ``num_bytes`` per
    rank among ``ranks`` ranks over links of ``kind``."""
    if ranks <= 1:
        return 0.0
    if kind == "host":
        t = ring_allreduce_s(num_bytes, ranks, bandwidth_GBps, latency_us)
        return t if op == "allreduce" else t / 2
    step_mult, data_mult = _STEPS[op]
    steps = step_mult * (ranks - 1)
    data = data_mult * (ranks - 1) / ranks * num_bytes
    bw = bandwidth_GBps * 1e9 * BUS_EFFICIENCY[kind]
    best = float("inf")
    for p in _protocols(kind):
        lat = BASE_LATENCY_US[p] + steps * max(STEP_LATENCY_US[kind][p], latency_us)
        best = min(best, lat * 1e-6 + data / (bw * PROTOCOL_BANDWIDTH[p]))
    return best


def send_s(num_bytes: float, bandwidth_GBps: float, latency_us: float, kind: str) -> float:
    """Seconds of one point-to-point send of ``num_bytes`` (NCCL send/recv: one step of the ring model)."""
    if kind == "host":
        return latency_us * 1e-6 + num_bytes / (bandwidth_GBps * 1e9)
    bw = bandwidth_GBps * 1e9 * BUS_EFFICIENCY[kind]
    return min(
        (BASE_LATENCY_US[p] + max(STEP_LATENCY_US[kind][p], latency_us)) * 1e-6
        + num_bytes / (bw * PROTOCOL_BANDWIDTH[p])
        for p in _protocols(kind)
    )
