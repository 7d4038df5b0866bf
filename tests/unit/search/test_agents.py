"""Agents under one budget rule, each checked against the optimum ``exhaustive`` finds (real Simulator)."""

from __future__ import annotations

import pytest

from autotune import load_cluster, load_model
from autotune.planning.budget import BudgetedEvaluator, BudgetExhausted
from autotune.planning.space import SearchSpace
from autotune.search.agents import run_exhaustive, run_random, run_uniform
from autotune.search.agents.rl import make_model, run_rl
from autotune.search.agents.shared_study import open_study
from autotune.search.agents.tpe import run_optuna
from autotune.simulator import Simulator
from autotune.specs import ParallelConfig

# A tiny heterogeneous space: 2 fast + 2 (emulated 2x) slow CPU ranks, the tiny model.
TINY = dict(
    schedule=["1f1b"],
    recompute=["none"],
    mbs=[1],
    layer_split=[0.0, 1.0],
    batch_split=[0.0, 1.0],
    zero=[0],
    offload=["none"],
)  # the agents on a small space (ZeRO / offload: tests/unit/planning/test_zero_search.py)


class CountingSimulator(Simulator):
    calls = 0

    def evaluate(self, config):
        type(self).calls += 1
        return super().evaluate(config)


@pytest.fixture(scope="module")
def tiny():
    cluster, model = load_cluster("cpu-hetero"), load_model("tiny")
    space = SearchSpace(cluster, model, restrict=TINY)
    plans = space.enumerate()
    sim = Simulator(cluster, model)
    optimum = max(sim.evaluate(cfg).score() for _, cfg in plans)
    return space, len(plans), optimum


def fresh(space: SearchSpace, budget: int) -> BudgetedEvaluator:
    return BudgetedEvaluator(Simulator(space.cluster, space.model), space, budget)


def test_exhaustive_evaluates_every_distinct_plan_once(tiny):
    space, n, optimum = tiny
    ev = fresh(space, 10 * n)
    run_exhaustive(space, ev)
    assert ev.used == n
    assert ev.best.score == optimum > 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["random", "optuna", "rl"])
def test_method_finds_the_exhaustive_optimum_on_a_tiny_space(tiny, method):
    space, n, optimum = tiny
    ev = fresh(space, n)
    if method == "random":
        run_random(space, ev, seed=0)
    elif method == "optuna":
        run_optuna(space, ev, seed=0, study=open_study(space, "tiny", "memory", 0))
    else:
        run_rl(space, ev, seed=0)
    assert ev.used <= n
    # rl edits plans beyond the encoding (finer layer and batch moves), so it may even beat it
    assert ev.best.score >= optimum * (1 - 1e-9)


def test_uniform_finds_the_optimum_on_a_homogeneous_cluster():
    cluster, model = load_cluster("cpu-4"), load_model("tiny")
    # without ZeRO / offload (their variants would take the grid past the budget of 100)
    space = SearchSpace(
        cluster, model, restrict={"schedule": ["1f1b"], "recompute": ["none"], "zero": [0], "offload": ["none"]}
    )
    sim = Simulator(cluster, model)
    optimum = max(sim.evaluate(cfg).score() for _, cfg in space.enumerate())
    ev = fresh(space, 100)
    run_uniform(space, ev)
    assert ev.used == len(space.uniform_plans())
    assert ev.best.score == pytest.approx(optimum)


def test_uniform_on_a_mixed_cluster_loses_to_the_heterogeneity_aware_optimum(tiny):
    space, n, optimum = tiny
    ev = fresh(space, 100)
    run_uniform(space, ev)
    assert 0 < ev.best.score < optimum


def test_budget_counts_distinct_plans_and_repeats_are_free(tiny):
    space, _, _ = tiny
    CountingSimulator.calls = 0
    ev = BudgetedEvaluator(CountingSimulator(space.cluster, space.model), space, budget=5)
    run_random(space, ev, seed=1)
    assert ev.used == 5 == CountingSimulator.calls
    first = ev.history[0].config
    assert ev.evaluate(first) == ev.history[0].measurement  # cached: free even with no budget left
    assert CountingSimulator.calls == 5
    with pytest.raises(BudgetExhausted):
        new = next(c for _, c in space.enumerate() if c not in ev)
        ev.evaluate(new)


def test_invalid_plans_cost_nothing(tiny):
    space, _, _ = tiny
    ev = fresh(space, 2)
    bad = ParallelConfig.from_dict(
        {
            "micro_batch_size": 1,
            "pipelines": [{"num_microbatches": 8, "stages": [{"devices": ["fast:0"], "layers": 3}]}],
        }
    )
    m = ev.evaluate(bad)
    assert m.status == "invalid" and "layers sum to 3" in m.error
    assert ev.used == 0 and ev.invalid == 1


def test_every_method_respects_the_budget(tiny):
    space, n, _ = tiny
    for run in (run_random, run_uniform, run_exhaustive):
        ev = fresh(space, 7)
        run(space, ev, 0)
        assert ev.used == 7
    ev = fresh(space, 7)
    run_optuna(space, ev, 0, study=open_study(space, "b", "memory", 0))
    assert ev.used == 7
    ev = fresh(space, 7)
    run_rl(space, ev, seed=0)
    assert ev.used == 7


@pytest.mark.slow
def test_rl_smoke_learn_and_act(tiny):
    from envs.parallel_config import ParallelConfigEnv

    space, _, optimum = tiny
    env = ParallelConfigEnv(space, Simulator(space.cluster, space.model), max_steps=16)
    model = make_model(env, seed=0, n_steps=64)
    model.learn(total_timesteps=256)
    assert model.num_timesteps >= 256
    obs, _ = env.reset(seed=0)
    mask = env.action_masks()
    assert mask[int(model.predict(obs, action_masks=mask, deterministic=True)[0])]


def test_rl_s_chooser_spends_the_budget_on_the_simulator(tiny):
    from autotune.search.agents.acquire import run_acquire

    space, _, _ = tiny
    ev = fresh(space, 5)
    why = run_acquire(space, ev, 0)
    assert ev.used == 5 and "budget of 5 runs is spent" in why and ev.best.score > 0


def test_rl_leaves_no_log_folder_in_the_temporary_directory(tiny, tmp_path, monkeypatch):
    """Each Stable-Baselines3 ``learn()`` without a logger of its own creates an empty
    ``<tmp>/SB3-<date>`` folder and never removes it: 264 of them had piled up on a dev machine."""
    import tempfile

    space, _, _ = tiny
    monkeypatch.delenv("SB3_LOGDIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run_rl(space, fresh(space, 6), seed=0)  # online PPO from nothing
    model = make_model(parallel_config_env(space), seed=0, n_steps=16)
    model.learn(total_timesteps=16)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("SB3-")) == []


def parallel_config_env(space: SearchSpace):
    from envs.parallel_config import ParallelConfigEnv

    return ParallelConfigEnv(space, Simulator(space.cluster, space.model), max_steps=8)


class _NoisyMachine:
    """A stand-in for the real runner on a loaded machine: each run of a plan takes the simulator's time
    times the next factor of ``factors`` (what a real run's noise does to the measurement)."""

    def __init__(self, cluster, model, factors):
        from autotune.simulator import Simulator

        self.cluster, self.model = cluster, model
        self.sim = Simulator(cluster, model)
        self.factors = list(factors)
        self.runs = 0

    def evaluate(self, config):
        from dataclasses import replace

        m = self.sim.evaluate(config)
        f = self.factors[self.runs % len(self.factors)]
        self.runs += 1
        return replace(m, iteration_time_s=m.iteration_time_s * f, tokens_per_s=m.tokens_per_s / f)


def test_a_real_run_far_from_its_prediction_is_measured_again_and_the_median_kept():
    """A run 40% off the prediction is repeated; two runs that disagree by more than the noise seen get a
    third; the plan's measurement is the median run and its spread is reported. A run the prediction
    explains is not repeated."""
    from autotune.loading import load_cluster, load_model
    from autotune.planning.space import SearchSpace
    from autotune.search.screen import CalibrationScreen
    from autotune.simulator import Simulator

    cluster, model = load_cluster("mixed-a100-v100"), load_model("gpt2-xl")
    config = SearchSpace(cluster, model).decode(SearchSpace(cluster, model).heuristic_params()[0]).config
    machine = _NoisyMachine(cluster, model, [1.4, 1.0, 1.2])
    screen = CalibrationScreen(machine, Simulator(cluster, model))
    m = screen.evaluate(config)
    predicted = Simulator(cluster, model).evaluate(config).iteration_time_s
    (report,) = screen.reports
    assert machine.runs == 3 and m.iteration_time_s == pytest.approx(1.2 * predicted)  # the median of 1.4, 1.0, 1.2
    assert report.spread == pytest.approx(0.4) and report.error == pytest.approx(1 / 1.2 - 1)
    assert "3 runs spread 40%" in report.line() and screen.noise == pytest.approx(0.4)
    screen.spreads += [0.1, 0.36]  # the median over the plans measured more than once
    assert screen.median_spread == pytest.approx(0.36) and screen.noise == pytest.approx(0.36)
    quiet = _NoisyMachine(cluster, model, [1.02])
    calm = CalibrationScreen(quiet, Simulator(cluster, model))
    calm.evaluate(config)
    assert quiet.runs == 1 and calm.reports[0].spread is None
    assert calm.median_spread is None and calm.noise == pytest.approx(0.10)  # nothing measured twice yet
