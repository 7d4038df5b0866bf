"""Labels that say what a plan is (issue 46, case 9)."""

from __future__ import annotations

from autotune.search.tracking import plan_shape
from autotune.specs import ParallelConfig


def test_a_mixed_stage_of_tp2_ranks_is_tp2_not_the_stage_s_device_count():
    ranks = [{"devices": [f"a:{2 * k}", f"a:{2 * k + 1}"], "num_microbatches": 1} for k in range(8)]
    plan = ParallelConfig.from_dict(
        {
            "micro_batch_size": 1,
            "zero": 3,
            "pipelines": [{"num_microbatches": 8, "stages": [{"ranks": ranks, "layers": 4}]}],
        }
    )
    assert plan_shape(plan) == "dp1 pp1 tp2 mbs1 1f1b r8 z3"


def test_plans_of_the_same_degrees_are_told_apart_by_their_state():
    def plan(**stage):
        return ParallelConfig.from_dict(
            {
                "micro_batch_size": 1,
                "pipelines": [{"num_microbatches": 4, "stages": [{"devices": ["a:0"], "layers": 4, **stage}]}],
            }
        )

    shapes = {plan_shape(plan()), plan_shape(plan(recompute=True)), plan_shape(plan(offload="optimizer"))}
    assert shapes == {"dp1 pp1 tp1 mbs1 1f1b", "dp1 pp1 tp1 mbs1 1f1b rc", "dp1 pp1 tp1 mbs1 1f1b off"}


def test_the_uniform_baseline_is_the_same_for_every_budget_and_seed():
    """Issue 46, case 9: "x faster than uniform" moved 1.50-2.47x for the same best plan with the budget and
    the seed; the baseline is now a fixed sample of the grid."""
    from autotune import load_cluster, load_model
    from autotune.planning.budget import BudgetedEvaluator
    from autotune.planning.space import SearchSpace
    from autotune.search.summary import uniform_baseline
    from autotune.simulator import Simulator

    space = SearchSpace(load_cluster("mixed-a100-v100"), load_model("gpt2-small"))
    sim = Simulator(space.cluster, space.model)
    got = {
        uniform_baseline(BudgetedEvaluator(sim, space, budget), seed) for budget, seed in ((5, 0), (60, 3), (400, 9))
    }
    assert len(got) == 1 and next(iter(got))[0] > 0
