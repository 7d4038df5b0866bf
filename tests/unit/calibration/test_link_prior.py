"""A run slowed by a PCIe node's links is read as slow links, not as slow GPUs (issue 45: the structured lie
of three-gen-24's H100 node; ``OnlineCalibrator``'s link prior and its second starting point)."""

import pytest

from autotune.calibration.online import OnlineCalibrator
from autotune.planning.planner import plan_candidates
from autotune.planning.space import SearchSpace
from autotune.policy.scenarios import heldout_scenarios
from autotune.simulator import Simulator
from autotune.simulator.perturbation import ClusterErrors, perturb


@pytest.mark.slow
def test_a_zero3_run_over_a_pcie_node_corrects_its_links_not_its_gpus():
    s = next(x for x in heldout_scenarios() if x.name == "three-gen-24")
    node = next(n.name for n in s.cluster.nodes if n.device.name.startswith("H100"))
    reality = Simulator(perturb(s.cluster, ClusterErrors(intra_node_bandwidth={node: 0.05})), s.model)
    nominal = Simulator(s.cluster, s.model)
    plans = [c.config for c in plan_candidates(SearchSpace(s.cluster, s.model), None, limit=64)]
    slowed = next(
        c
        for c in plans
        if c.zero == 3 and reality.evaluate(c).iteration_time_s > 2 * nominal.evaluate(c).iteration_time_s
    )
    cal = OnlineCalibrator(nominal)
    cal.update(slowed, reality.evaluate(slowed))
    link, compute = dict(cal.corrections.link), dict(cal.corrections.compute)
    assert link["intra:H100-80GB"] > 10 and compute["H100-80GB"] < 1.3, (link, compute)
