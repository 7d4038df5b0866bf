"""The structured lies of a cluster file (``autotune.simulator.perturbation.structured_lie``): each kind changes
what it names, by the stated amount, and nothing else."""

from __future__ import annotations

import numpy as np
import pytest

from autotune import load_cluster
from autotune.simulator.perturbation import LIE_KINDS, perturb, structured_lie


@pytest.mark.parametrize("seed", range(4))
def test_each_lie_changes_what_it_names(seed: int) -> None:
    cluster = load_cluster("mixed-h100-a100-32")
    for kind in LIE_KINDS:
        real = perturb(cluster, structured_lie(cluster, kind, np.random.default_rng(seed)))
        changed = set()
        for a, b in zip(cluster.nodes, real.nodes):
            if a.device.peak_tflops != b.device.peak_tflops:
                changed.add("slow-class")
                assert 1.25 <= a.device.peak_tflops / b.device.peak_tflops <= 1.6
            if a.device.memory_GiB != b.device.memory_GiB:
                changed.add("memory")
                assert 0.8 <= b.device.memory_GiB / a.device.memory_GiB <= 0.9
            if a.intra_node != b.intra_node:
                changed.add("pcie")
                assert 12.0 <= b.intra_node.bandwidth_GBps <= 25.0
            if a.network.bandwidth_GBps != b.network.bandwidth_GBps:
                changed.add("network")
                assert 0.3 <= b.network.bandwidth_GBps / a.network.bandwidth_GBps <= 0.6
            elif a.network.latency_us != b.network.latency_us:
                changed.add("latency")
                assert 5.0 <= b.network.latency_us / a.network.latency_us <= 20.0
        if kind == "two":
            assert len(changed) == 2, changed
        else:
            assert changed == {kind}
    with pytest.raises(ValueError, match="lie kind must be one of"):
        structured_lie(cluster, "gravity", np.random.default_rng(0))
