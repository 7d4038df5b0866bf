"""A search on real runs spends its first run on the planner's best plan, not on RoundPipe's default start
(issue 45: every method's first real run was RoundPipe's own plan, 0.29-1.0 of the true best)."""

from __future__ import annotations

import pytest

from autotune import load_cluster, load_model
from autotune.planning.budget import BudgetedEvaluator
from autotune.planning.space import SearchSpace
from autotune.search.methods import run_agent
from autotune.simulator import Simulator


def _first(backend: str):
    cluster, model = load_cluster("examples/8x4090.yaml"), load_model("llama2-13b", global_batch_size=64)
    space = SearchSpace(cluster, model)
    budgeted = BudgetedEvaluator(Simulator(cluster, model), space, 2)
    run_agent("dp", space, budgeted, 0, backend=backend)
    return budgeted.history[0].config, space


@pytest.mark.slow
def test_the_first_real_run_is_the_planner_s_and_a_simulated_search_still_starts_from_roundpipe_s_plan():
    first_sim, space = _first("sim")
    assert first_sim == space.decode(space.roundpipe_start()).config  # free in the simulator
    first_real, _ = _first("real")
    from autotune.planning.planner import plan_candidates

    cluster, model = space.cluster, space.model
    planned = plan_candidates(space, BudgetedEvaluator(Simulator(cluster, model), space, 2))
    assert first_real == planned[0].config != first_sim
