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
                network=_link(n.network, errors.network_bandwidth.get(n.name, 1.0)),
            )
        )
    return replace(cluster, nodes=tuple(nodes))
