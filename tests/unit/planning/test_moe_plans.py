"""The planner's family ``moe`` (SPES's expert subsets, expert parallelism and sync period, issue 25), and
``plan_candidates`` keeping to the search's limits."""

from __future__ import annotations

import pytest

from autotune import load_cluster, load_model
from autotune.planning import moe_plans
from autotune.planning.budget import BudgetedEvaluator
from autotune.planning.planner import Planner, plan_candidates
from autotune.planning.space import SearchSpace
from autotune.simulator import Simulator
from runner.jobs import plan_limits

MODEL = load_model("spes-2b")


@pytest.fixture(scope="module")
def spes():
    """SPES's setting (examples/spes-16-internet.yaml: 16 standalone GPUs over 1 Gbit/s), replicas allowed to
    drift 100 steps."""
    cluster = load_cluster("examples/spes-16-internet.yaml")
    space = SearchSpace(cluster, MODEL, max_sync_every=100)
    sim = Simulator(cluster, MODEL)
    return space, sim, Planner(space, sim).plan(64)


def test_the_planners_best_plan_is_spes_expert_subsets_at_the_users_sync_bound(spes):
    space, sim, plans = spes
    best = plans[0]
    assert best.family.startswith(moe_plans.FAMILY)
    assert best.config.sync_every_steps == 100
    assert all(p.trains_experts is not None for p in best.config.pipelines)  # each replica its own experts
    assert sim.memory_estimate(best.config).ok and space.check(best.config) is None
    # the composition: every replica training every expert and syncing every step, far slower here
    composed = Planner(space, sim).compose("none", 8)
    assert composed and all(c.config.sync_every_steps == 1 for c in composed)
    assert best.estimate_s < 0.5 * min(c.estimate_s for c in composed)


def test_every_plan_of_the_family_fits_and_is_timed_by_the_simulator(spes):
    space, sim, plans = spes
    family = moe_plans.candidates(space, sim, plans, 200)
    assert family and [c.estimate_s for c in family] == sorted(c.estimate_s for c in family)
    for c in family[:10]:
        assert c.family == moe_plans.FAMILY
        assert space.check(c.config) is None and sim.memory_estimate(c.config).ok
        assert sim.evaluate(c.config).iteration_time_s == pytest.approx(c.estimate_s)


def test_the_simulation_cap_holds(spes):
    space, sim, plans = spes
    calls = []

    class Counting:
        def memory_estimate(self, config):
            calls.append(1)
            return sim.memory_estimate(config)

        def evaluate(self, config):
            calls.append(1)
            return sim.evaluate(config)

    moe_plans.candidates(space, Counting(), plans, 25)
    assert 20 <= len(calls) <= 25
    assert moe_plans.simulations(16) == moe_plans.MAX_SIMULATIONS and moe_plans.simulations(128) == 187


def test_none_for_a_dense_model():
    space = SearchSpace(load_cluster("cpu-4"), load_model("tiny"))
    sim = Simulator(space.cluster, space.model)
    assert moe_plans.candidates(space, sim, Planner(space, sim).plan(8), 100) == []


@pytest.mark.slow
def test_plan_candidates_keep_to_the_searchs_limits(spes):
    space, sim, plans = spes
    runner = plan_limits(space.cluster, MODEL)
    assert all(runner(c.config) is None for c in plans[:20])  # the runner runs the planner's first plans (ZeRO too)

    def limits(config):  # a stand-in limit that refuses some of them (an engine's, say): sharded MoE state
        return "zero" if config.zero else None

    assert any(limits(c.config) is not None for c in plans[:20])
    budgeted = BudgetedEvaluator(sim, space, 20, limits=limits)
    kept = plan_candidates(space, budgeted, limit=20)
    assert len(kept) == 20 and all(limits(c.config) is None for c in kept)
    assert kept[0].family.startswith(moe_plans.FAMILY) and kept[0].config.sync_every_steps == 100
