"""The planner's family ``roundpipe`` (RoundPipe's settings around its own pick, issue 25)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autotune import load_cluster, load_model
from autotune.planning import roundpipe_plans
from autotune.planning.space import SearchSpace
from autotune.simulator import Simulator


@pytest.fixture(scope="module")
def box():
    cluster = load_cluster("examples/8x4090.yaml")
    model = replace(load_model("llama3-8b"), seq_len=4096, global_batch_size=64)
    return SearchSpace(cluster, model), Simulator(cluster, model)


def test_every_plan_is_a_roundpipe_plan_that_fits_timed_by_the_simulator_and_its_own_pick_is_among_them(box):
    space, sim = box
    family = roundpipe_plans.candidates(space, sim, [], roundpipe_plans.MAX_SIMULATIONS)
    assert len(family) >= 10 and [c.estimate_s for c in family] == sorted(c.estimate_s for c in family)
    for c in family:
        assert c.config.is_roundpipe and c.family == roundpipe_plans.FAMILY
        assert space.check(c.config) is None and sim.memory_estimate(c.config).ok
        assert sim.evaluate(c.config).iteration_time_s == pytest.approx(c.estimate_s)
    own = space.decode(space.roundpipe_start()).config
    assert own in {c.config for c in family}
    assert len({c.config.micro_batch_size for c in family}) >= 2  # settings RoundPipe's pick fixes, varied


def test_the_cap_holds_and_no_plans_where_roundpipe_does_not_apply(box):
    space, sim = box
    calls = []

    class Counting:
        def memory_estimate(self, config):
            calls.append(1)
            return sim.memory_estimate(config)

        def evaluate(self, config):
            calls.append(1)
            return sim.evaluate(config)

    roundpipe_plans.candidates(space, Counting(), [], 9)
    assert 8 <= len(calls) <= 9
    cpu = SearchSpace(load_cluster("cpu-4"), load_model("tiny"))
    assert roundpipe_plans.candidates(cpu, Simulator(cpu.cluster, cpu.model), [], 50) == []
