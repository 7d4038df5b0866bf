"""The cluster as it may really be: the simulator's errors drawn from its error bars (domain randomisation).

A prediction is off by its terms' errors (``autotune.simulator.error_bar``). ``draw_errors`` draws one such
set of errors for a cluster, from the same validation table the error bars come from, and ``perturb``
applies it: simulating the perturbed cluster is one possible reality the nominal simulator does not see.

- per GPU class, its compute time x exp(N(0, s)), s = ``compute_error`` of that class and precision (3.5% for
  V100 fp32 ... 36% for A100 fp32; the largest, 36%, for classes with no measured run): the class's peak
  rates and memory bandwidth divided by that factor;
- per GPU class, its usable memory x exp(N(0, ``MEMORY_ERROR``)) (the memory model's 6-12% mean error);
- per node, its network and its intra-node bandwidth x exp(N(0, s)), s = ``network_error`` at that bandwidth
  (10% at 10 GB/s and above, growing to 15% at 1 Gbit/s), latency divided by the same factor.

Used to train the learned chooser of real runs (``autotune.policy.acquisition_training``) and by the
perturbed-reality benchmark (``experiments/quality/perturbed_reality.py``).

``structured_lie`` draws errors of another kind, the ones users make in a cluster file (a benchmark of the
developers' own design, ``perturbed_reality.py --lies structured``): one kind per draw, ``LIE_KINDS``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from autotune.simulator.error_bar import compute_error, network_error
from autotune.specs import ClusterSpec, LinkSpec

#: relative spread of the memory model (RESULTS.md: 6-12% mean error of peak memory)
MEMORY_ERROR = 0.10


@dataclass(frozen=True, slots=True)
class ClusterErrors:
    """Factors reality applies to the nominal cluster (1.0: as described)."""

    compute_time: Mapping[str, float] = field(default_factory=dict)  # GPU class -> compute time x
    memory: Mapping[str, float] = field(default_factory=dict)  # GPU class -> usable memory x
    network_bandwidth: Mapping[str, float] = field(default_factory=dict)  # node -> network bandwidth x
    intra_node_bandwidth: Mapping[str, float] = field(default_factory=dict)  # node -> intra-node bandwidth x
    network_latency: Mapping[str, float] = field(default_factory=dict)  # node -> network latency x (beyond the above)


def draw_errors(cluster: ClusterSpec, precision: str, rng: np.random.Generator) -> ClusterErrors:
    """One draw of the module docstring's errors for ``cluster`` (datasheet error bars: no profile)."""
    compute, memory, network, intra = {}, {}, {}, {}
    for n in cluster.nodes:
        if n.device.name not in compute:
            compute[n.device.name] = math.exp(rng.normal(0.0, compute_error(n.device.name, precision, False)[0]))
            memory[n.device.name] = math.exp(rng.normal(0.0, MEMORY_ERROR))
    for n in cluster.nodes:
        intra[n.name] = math.exp(rng.normal(0.0, network_error(n.intra_node.bandwidth_GBps)[0]))
        network[n.name] = math.exp(rng.normal(0.0, network_error(n.network.bandwidth_GBps)[0]))
    return ClusterErrors(compute, memory, network, intra)


def _link(spec: LinkSpec, factor: float) -> LinkSpec:
    return LinkSpec(spec.bandwidth_GBps * factor, spec.latency_us / factor)


def perturb(cluster: ClusterSpec, errors: ClusterErrors) -> ClusterSpec:
    """``cluster`` with ``errors`` applied (classes and nodes ``errors`` does not name stay as they are)."""
    nodes = []
    for n in cluster.nodes:
        d = n.device
        f = errors.compute_time.get(d.name, 1.0)
        device = replace(
            d,
            peak_tflops=d.peak_tflops / f,
            peak_tflops_tf32=(d.peak_tflops_tf32 or 0.0) / f,
            peak_tflops_fp32=(d.peak_tflops_fp32 or 0.0) / f,
            memory_bandwidth_GBps=d.memory_bandwidth_GBps / f,
            memory_GiB=d.memory_GiB * errors.memory.get(d.name, 1.0),
        )
        nodes.append(
            replace(
                n,
                device=device,
                intra_node=_link(n.intra_node, errors.intra_node_bandwidth.get(n.name, 1.0)),
                network=_latency(
                    _link(n.network, errors.network_bandwidth.get(n.name, 1.0)), errors.network_latency.get(n.name, 1.0)
                ),
            )
        )
    return replace(cluster, nodes=tuple(nodes))


def _latency(spec: LinkSpec, factor: float) -> LinkSpec:
    return LinkSpec(spec.bandwidth_GBps, spec.latency_us * factor)


#: what a cluster file gets wrong, one kind per draw (``structured_lie``): the network slower than written,
#: one GPU class slower (a power-capped or PCIe variant), one class with less usable memory, one node type's
#: GPUs joined by PCIe where the file says NVLink, a network of far higher latency, and two of these at once
LIE_KINDS = ("network", "slow-class", "memory", "pcie", "latency", "two")
PCIE_GBPS = (12.0, 25.0)  # a PCIe 3/4 x16 path between two GPUs of one node, one direction


def structured_lie(cluster: ClusterSpec, kind: str, rng: np.random.Generator) -> ClusterErrors:
    """Errors of ``kind`` (``LIE_KINDS``) for ``cluster``, their sizes drawn from ``rng``: ``network`` x 0.3-0.6
    on every node's network; ``slow-class`` one GPU class's compute time x 1.25-1.6; ``memory`` one class's usable
    memory x 0.8-0.9; ``pcie`` one node type's intra-node bandwidth down to 12-25 GB/s (if it is faster);
    ``latency`` every network latency x 5-20; ``two`` two different kinds of these."""
    if kind not in LIE_KINDS:
        raise ValueError(f"lie kind must be one of {', '.join(LIE_KINDS)}, got {kind!r}")
    if kind == "two":
        first, second = rng.choice(len(LIE_KINDS) - 1, size=2, replace=False)
        a = structured_lie(cluster, LIE_KINDS[first], rng)
        b = structured_lie(cluster, LIE_KINDS[second], rng)
        return ClusterErrors(
            {**a.compute_time, **b.compute_time},
            {**a.memory, **b.memory},
            {**a.network_bandwidth, **b.network_bandwidth},
            {**a.intra_node_bandwidth, **b.intra_node_bandwidth},
            {**a.network_latency, **b.network_latency},
        )
    classes = sorted({n.device.name for n in cluster.nodes})
    one = classes[int(rng.integers(len(classes)))]
    if kind == "network":
        f = float(rng.uniform(0.3, 0.6))
        return ClusterErrors(network_bandwidth={n.name: f for n in cluster.nodes})
    if kind == "slow-class":
        return ClusterErrors(compute_time={one: float(rng.uniform(1.25, 1.6))})
    if kind == "memory":
        return ClusterErrors(memory={one: float(rng.uniform(0.8, 0.9))})
    if kind == "latency":
        f = float(rng.uniform(5.0, 20.0))
        return ClusterErrors(network_latency={n.name: f for n in cluster.nodes})
    # pcie: the node type with the fastest intra-node link among those with several GPUs
    multi = [n for n in cluster.nodes if n.count > 1] or list(cluster.nodes)
    fastest = max(multi, key=lambda n: n.intra_node.bandwidth_GBps).device.name
    pcie = float(rng.uniform(*PCIE_GBPS))
    return ClusterErrors(
        intra_node_bandwidth={
            n.name: min(1.0, pcie / n.intra_node.bandwidth_GBps) for n in cluster.nodes if n.device.name == fastest
        }
    )
