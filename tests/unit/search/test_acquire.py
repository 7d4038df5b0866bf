"""``rl`` on real runs: the learned chooser spends the budget on the planner's candidates, stops and says why."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from simulator_cases import two_nodes

from autotune import load_model, tune
from autotune.evaluator import Evaluator
from autotune.planning.budget import BudgetedEvaluator
from autotune.planning.posterior import first_plans
from autotune.planning.space import SearchSpace
from autotune.policy import policy_file
from autotune.search.agents.acquire import GREEDY, default_acquisition_path, run_acquire, uses_acquisition
from autotune.simulator import Simulator
from autotune.simulator.perturbation import ClusterErrors, perturb
from envs.acquisition import LAYOUT, MAX_CANDIDATES, OBSERVATIONS


class Reality(Evaluator):
    """Real runs: the simulator of a perturbed cluster (not a ``Simulator``: no search ranks plans by it)."""

    def __init__(self, nominal, real, model) -> None:
        self.cluster, self.model = nominal, model
        self._truth = Simulator(real, model)
        self.runs = 0

    def evaluate(self, config):
        self.runs += 1
        return self._truth.evaluate(config)


MODEL = load_model("gpt2-xl", global_batch_size=16)
CLUSTER = two_nodes(1.0)
SLOW_NETWORK = perturb(CLUSTER, ClusterErrors(network_bandwidth={"a": 0.05, "b": 0.05}))


def test_the_shipped_chooser_is_a_policy_file_of_its_layout() -> None:
    _, meta = policy_file.read(default_acquisition_path())
    assert meta["layout"] == LAYOUT and (meta["obs_dim"], meta["n_actions"]) == (OBSERVATIONS, MAX_CANDIDATES)
    assert uses_acquisition(None) and uses_acquisition(default_acquisition_path()) and uses_acquisition(GREEDY)
    assert not uses_acquisition("scratch")  # online learning on the plan-editing env


@pytest.mark.slow
@pytest.mark.parametrize("policy", [None, GREEDY])
def test_rl_on_real_runs_stops_within_the_budget_and_says_why(policy, caplog) -> None:
    reality = Reality(CLUSTER, SLOW_NETWORK, MODEL)
    with caplog.at_level(logging.INFO, logger="autotune.search.agents.acquire"):
        result = tune(
            CLUSTER,
            MODEL,
            method="rl",
            budget=5,
            backend="real",
            policy=policy,
            track=False,
            storage="memory",
            evaluator=reality,
        )
    # a plan the corrected simulator mispredicts is run again (``autotune.search.screen``): not a new plan
    assert 1 <= result.evaluations <= 5 and result.evaluations <= reality.runs <= 3 * result.evaluations
    assert result.best_measurement.ok
    stopped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("real runs stopped after")]
    assert len(stopped) == 1, stopped
    assert any(why in stopped[0] for why in ("expected to beat", "budget of 5", "candidate plans ran"))


def test_a_resumed_chooser_reads_back_what_ran_and_spends_only_the_rest() -> None:
    space = SearchSpace(CLUSTER, MODEL)
    first = BudgetedEvaluator(Reality(CLUSTER, SLOW_NETWORK, MODEL), space, 3)
    run_acquire(space, first, policy_path=GREEDY)
    ran = [(ev.config, ev.measurement) for ev in first.history]
    assert len(ran) == 3
    reality = Reality(CLUSTER, SLOW_NETWORK, MODEL)
    again = BudgetedEvaluator(reality, space, 5)
    for config, m in ran:
        again.preload(config, m)
    run_acquire(space, again, policy_path=GREEDY)
    assert reality.runs <= 2 and again.used <= 5
    assert not {ev.config for ev in again.history[3:]} & {c for c, _ in ran}  # nothing run twice
    assert np.isclose(again.best.score, max(first.best.score, again.best.score))


@pytest.mark.slow
def test_the_chooser_predicts_with_the_simulator_the_search_began_with_and_replans_with_the_corrected_one(
    monkeypatch,
) -> None:
    """On real runs the closed loop corrects its simulator after every run; the chooser's first table is the
    uncorrected simulator's, and after every run from the first on its candidates are re-planned with the
    corrected one (plans it puts first join the table) and predicted by it, with the starting simulator's
    error bars (a corrected profile would pass for a measured one, with its small error bars)."""
    from autotune.search import screen as screen_module
    from autotune.search.agents import acquire

    screen = screen_module.CalibrationScreen(Reality(CLUSTER, SLOW_NETWORK, MODEL), Simulator(CLUSTER, MODEL))
    space = SearchSpace(CLUSTER, MODEL)
    budgeted = BudgetedEvaluator(screen, space, 4, screen=screen.screen)
    first = first_plans(space, Simulator(CLUSTER, MODEL), budgeted.refusal, 4)[0]
    budgeted.evaluate(first)
    assert screen.simulator.profile is not None and screen.start_simulator.profile is None  # corrected by the run
    corrected_first = first_plans(space, screen.simulator, budgeted.refusal, 64)
    seen = []
    real_table = acquire.candidate_table

    def spy(cluster, model, configs, factory, calibrated=frozenset()):
        seen.append((list(configs), calibrated, factory(cluster).profile))
        return real_table(cluster, model, configs, factory, calibrated)

    monkeypatch.setattr(acquire, "candidate_table", spy)
    corrected_profile = screen.simulator.profile
    run_acquire(space, budgeted, policy_path=GREEDY)
    # the start, then after every run but the last (the budget spent: nothing more to plan for)
    assert len(seen) == budgeted.used == 4, (len(seen), budgeted.used)
    assert all(calibrated == frozenset() for _, calibrated, _ in seen)  # no class profiled: the nominal bars
    assert seen[0][2] is None and seen[1][2] is corrected_profile  # predicted by the simulator that planned them
    assert all(profile is not None for _, _, profile in seen[1:])  # each time the correction of the runs so far
    assert all(configs[0] == first for configs, _, _ in seen)  # what ran stays a candidate
    assert set(corrected_first[:8]) <= set(seen[1][0])  # the corrected planner's first plans joined
    assert budgeted.screen == screen.screen  # the speed screen is back once the chooser is done


def test_the_first_run_is_the_planner_s_first_plan_whatever_the_chooser_prefers() -> None:
    """With nothing measured the chooser runs what every method runs first; its own choices start at run 2
    (here a chooser that always prefers the last candidate)."""
    from autotune.planning.posterior import candidate_table
    from autotune.search.agents import acquire

    space = SearchSpace(CLUSTER, MODEL)
    budgeted = BudgetedEvaluator(Reality(CLUSTER, SLOW_NETWORK, MODEL), space, 3)
    plans = first_plans(space, Simulator(CLUSTER, MODEL), budgeted.refusal, 16)
    table = candidate_table(CLUSTER, MODEL, plans, lambda c: Simulator(c, MODEL))

    def last(post, runs, budget):
        return int(np.flatnonzero(~post.run)[-1])

    acquire._spend(budgeted, table, last, None, lambda: None)
    ran = [ev.config for ev in budgeted.history]
    assert ran == [table.configs[0], table.configs[-1], table.configs[-2]]
