"""``autotune discover``: the cluster file of the machines it runs on (docs/formats.md, "Discovering the cluster").

One process (no torchrun): this machine as one node. Its GPUs (``torch.cuda``: the name matched to the
catalog, the memory measured; a GPU the catalog does not know gets its bf16 matmul rate and copy
bandwidth measured), its host memory (``/proc/meminfo``), and its intra-node link measured: a copy
between GPU 0 and GPU 1 (``nvidia-smi topo -m`` says NVLink or PCIe), a host-to-device copy with one
GPU, and on a machine without GPUs two processes exchanging messages over gloo, as the runner's CPU
ranks do (``autotune profile``'s link benchmark; the ``cpu`` node, one rank per core).

Under torchrun (``--nnodes N --nproc-per-node K``): one node per torchrun agent (its ``GROUP_RANK``),
``K`` devices each; the intra-node link measured between local ranks 0 and 1 of every node, and each
node's network measured between its local rank 0 and global rank 0 (NCCL on GPUs, gloo on CPUs):
bandwidth from 16 MiB messages, latency from 1-element round trips. Rank 0 writes the file.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from autotune.catalog import GPU_CATALOG

log = logging.getLogger(__name__)

BANDWIDTH_BYTES = 16 * 2**20  # one bandwidth message
BANDWIDTH_ROUNDS = 4
LATENCY_ROUNDS = 20
#: torch.cuda device names (lower case) -> catalog names, the most specific first
_GPU_NAMES = (
    ("gh200", "GH200"),
    ("h200", "H200"),
    ("h100", "H100-80GB"),
    ("a800", "A800-80GB"),
    ("a100", "A100-80GB"),  # 40 GB parts: see _catalog_name
    ("v100", "V100-32GB"),
    ("a10g", "A10G"),
    ("l40s", "L40S"),
    ("l4", "L4"),
    ("t4", "T4"),
    ("rtx 4090", "RTX-4090"),
    ("rtx 3090", "RTX-3090"),
    ("a6000", "A6000"),
    ("titan rtx", "TITAN-RTX"),
    ("2080 ti", "RTX-2080-Ti"),
    ("2080", "RTX-2080"),
)


@dataclass(frozen=True, slots=True)
class Link:
    """A measured link: one direction's bandwidth and a small message's one-way latency."""

    bandwidth_GBps: float
    latency_us: float

    def as_dict(self) -> dict[str, float]:
        return {"bandwidth_GBps": round(self.bandwidth_GBps, 3), "latency_us": round(self.latency_us, 1)}


def catalog_name(device_name: str, memory_GiB: float) -> str | None:
    """The catalog entry of a ``torch.cuda.get_device_name`` string, None when the catalog lacks it."""
    lower = device_name.lower()
    for pattern, name in _GPU_NAMES:
        if re.search(rf"(^|[^a-z0-9]){re.escape(pattern)}($|[^a-z0-9])", lower):
            if name == "A100-80GB" and memory_GiB < 60:
                return "A100-40GB"
            return name
    return None


def host_memory_GiB() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / 2**30
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def gpu_description(index: int) -> dict[str, Any]:
    """The ``gpu:`` entry of CUDA device ``index``: a catalog name, inline with the measured memory where
    it differs from the catalog's, or inline with measured rates for a GPU the catalog does not know."""
    import torch

    props = torch.cuda.get_device_properties(index)
    memory = props.total_memory / 2**30
    name = catalog_name(props.name, memory)
    if name is not None:
        if abs(GPU_CATALOG[name].memory_GiB - memory) <= 0.1 * memory:
            return {"name": name}
        return {"name": name, "memory_GiB": round(memory, 1)}
    tflops, bandwidth = _measure_gpu(index)
    return {
        "name": props.name[:128],
        "peak_tflops": round(tflops, 1),
        "memory_GiB": round(memory, 1),
        "memory_bandwidth_GBps": round(bandwidth, 1),
        "source": "measured by autotune discover (bf16 matmul, device copy)",
    }


def _measure_gpu(index: int) -> tuple[float, float]:
    import torch

    dev = torch.device("cuda", index)
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    big = torch.empty(256 * 2**20, device=dev, dtype=torch.uint8)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize(dev)
    t = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize(dev)
    tflops = 20 * 2 * 4096**3 / (time.perf_counter() - t) / 1e12
    t = time.perf_counter()
    for _ in range(10):
        big.clone()
    torch.cuda.synchronize(dev)
    return tflops, 10 * 2 * big.numel() / (time.perf_counter() - t) / 1e9


def nvlink_between_gpus() -> bool | None:
    """True when ``nvidia-smi topo -m`` shows NVLink between GPUs, False when it shows none, None without it."""
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(re.search(r"\bNV\d+\b", out))


def _time_pair(send, recv, rounds: int) -> float:
    """Seconds of ``rounds`` round trips (``send`` then ``recv``), after one untimed."""
    send()
    recv()
    t = time.perf_counter()
    for _ in range(rounds):
        send()
        recv()
    return (time.perf_counter() - t) / rounds


def measure_pair(peer: int, leader: bool, device) -> Link | None:
    """Bandwidth and latency between this rank and ``peer`` over the default process group; the leader
    times (and returns the link), the other answers (and returns None)."""
    import torch
    import torch.distributed as dist

    small = torch.zeros(1, device=device)
    big = torch.zeros(BANDWIDTH_BYTES // 4, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if not leader:
        for payload, reply, rounds in ((small, small, LATENCY_ROUNDS), (big, small, BANDWIDTH_ROUNDS)):
            for _ in range(rounds + 1):
                dist.recv(payload, peer)
                dist.send(reply, peer)
        sync()
        return None
    latency_s = _time_pair(lambda: dist.send(small, peer), lambda: (dist.recv(small, peer), sync()), LATENCY_ROUNDS) / 2
    round_s = _time_pair(lambda: dist.send(big, peer), lambda: (dist.recv(small, peer), sync()), BANDWIDTH_ROUNDS)
    one_way = max(round_s - 2 * latency_s, 1e-9)
    return Link(BANDWIDTH_BYTES / one_way / 1e9, latency_s * 1e6)


def measure_cpu_processes() -> Link:
    """Two local processes exchanging point-to-point messages over gloo, what the runner's CPU ranks
    use: ``autotune profile``'s link benchmark (``autotune.calibration.bench.bench_links``, an
    alpha-beta fit over message sizes)."""
    from autotune.calibration.bench import bench_links

    p2p = bench_links().p2p
    return Link(p2p.bandwidth_GBps, p2p.latency_us)


def measure_gpu_copy(a: int, b: int | None) -> Link:
    """GPU ``a`` to GPU ``b`` (peer copy), or host to GPU ``a`` (pinned memory) when ``b`` is None."""
    import torch

    src = torch.empty(BANDWIDTH_BYTES, dtype=torch.uint8, device="cpu" if b is None else f"cuda:{a}")
    if b is None:
        src = src.pin_memory()
    dst_dev = torch.device("cuda", a if b is None else b)

    def copy(t):
        t.to(dst_dev, non_blocking=True)
        torch.cuda.synchronize(dst_dev)

    small = src[:4]
    latency_s = _time_pair(lambda: copy(small), lambda: None, LATENCY_ROUNDS)
    t = _time_pair(lambda: copy(src), lambda: None, BANDWIDTH_ROUNDS)
    return Link(BANDWIDTH_BYTES / max(t - latency_s, 1e-9) / 1e9, latency_s * 1e6)


def node_name(group_rank: int | None, names_seen: list[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0])[:60] or "node"
    return base if base not in names_seen and group_rank in (None, 0) else f"{base}-{group_rank or len(names_seen)}"


def describe_node(count: int | None, intra: Link | None) -> dict[str, Any]:
    """This machine as a node of the cluster file (``count`` devices: the CUDA devices, else CPU ranks);
    ``intra``: the measured intra-node link, measured here when None."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    node: dict[str, Any] = {"name": "", "gpu": "cpu", "count": count or gpus or (os.cpu_count() or 1)}
    if gpus:
        node["gpu"] = gpu_description(0)
        if intra is None:
            intra = measure_gpu_copy(0, 1) if gpus > 1 else measure_gpu_copy(0, None)
        if gpus > 1 and nvlink_between_gpus() is not None:
            node["links"] = "NVLink" if nvlink_between_gpus() else "PCIe"
    elif intra is None:
        intra = measure_cpu_processes()
    node["intra_node"] = intra.as_dict()
    node["host"] = {"memory_GiB": round(host_memory_GiB(), 1)}
    return node


def cluster_document(nodes: list[dict[str, Any]], networks: list[Link | None], name: str) -> dict[str, Any]:
    """The cluster file: every node with its own measured network, the slowest as the default (one node:
    the intra-node link, unused)."""
    measured = [n for n in networks if n is not None]
    out_nodes = []
    for node, net in zip(nodes, networks):
        entry = {k: v for k, v in node.items() if k != "links"}
        if net is not None and len(nodes) > 1:
            entry["network"] = net.as_dict()
        out_nodes.append(entry)
    default = min(measured, key=lambda n: n.bandwidth_GBps) if measured else None
    network = default.as_dict() if default is not None else dict(nodes[0]["intra_node"])
    return {"name": name, "nodes": out_nodes, "network": network}


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def discover_distributed(name: str) -> dict[str, Any] | None:
    """Every node of a torchrun job (module docstring); the document on global rank 0, None elsewhere."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    group_rank = int(os.environ.get("GROUP_RANK", 0))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=120))
    try:
        where: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(where, (group_rank, local_rank))
        leaders = {g: r for r, (g, lr) in enumerate(where) if lr == 0}
        seconds = {g: r for r, (g, lr) in enumerate(where) if lr == 1}
        intra: Link | None = None
        for g in sorted(leaders):  # one pair at a time: nothing else on the wires
            if g in seconds and rank in (leaders[g], seconds[g]):
                link = measure_pair(seconds[g] if rank == leaders[g] else leaders[g], rank == leaders[g], device)
                intra = link or intra
            dist.barrier()
        network: Link | None = None
        for g in sorted(leaders):
            if leaders[g] != 0 and rank in (0, leaders[g]):
                link = measure_pair(0 if rank == leaders[g] else leaders[g], rank == leaders[g], device)
                network = link or network
            dist.barrier()
        mine = None
        if local_rank == 0:
            mine = (group_rank, describe_node(local_world, intra), network)
        nodes: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, mine)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    found = sorted((n for n in nodes if n is not None), key=lambda n: n[0])
    names: list[str] = []
    for g, node, _ in found:
        node["name"] = node_name(g if len(found) > 1 else None, names)
        names.append(node["name"])
    return cluster_document([n for _, n, _ in found], [net for _, _, net in found], name)


def discover_local(name: str) -> dict[str, Any]:
    """This machine alone (module docstring)."""
    node = describe_node(None, None)
    node["name"] = node_name(None, [])
    return cluster_document([node], [None], name)
