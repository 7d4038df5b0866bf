"""``autotune/ParallelConfig-v0``: Gymnasium contract, masks, rewards and penalties, budget, size independence."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import envs
from autotune import load_cluster, load_model
from autotune.planning.budget import BudgetedEvaluator
from autotune.planning.space import SearchSpace
from autotune.simulator import Simulator
from autotune.specs import Measurement, ParallelConfig
from envs.layout import ACTIONS, FAIL_PENALTY, INVALID_PENALTY
from envs.parallel_config import ParallelConfigEnv

SCENARIOS = [("cpu-hetero", "tiny"), ("mixed-a100-v100", "gpt2-xl"), ("mixed-h100-a100-32", "llama2-7b")]


def make_env(cluster: str, model: str, **kw) -> ParallelConfigEnv:
    c, m = load_cluster(cluster), load_model(model)
    return ParallelConfigEnv(SearchSpace(c, m), Simulator(c, m), **kw)


class ToyEvaluator:
    """Deterministic stand-in for the agent-logic tests: tokens/s = 1000 / layers of the fullest stage,
    and out of memory whenever the micro-batch size is above 1."""

    def __init__(self, cluster, model):
        self.cluster, self.model = cluster, model
        self.calls = 0

    def evaluate(self, config: ParallelConfig) -> Measurement:
        self.calls += 1
        if config.micro_batch_size > 1:
            return Measurement.failure("oom", "toy: too big", oom=True)
        worst = max(s.layers for p in config.pipelines for s in p.stages)
        return Measurement(tokens_per_s=1000.0 / worst, iteration_time_s=worst / 1000.0, oom=False)


def test_registered_and_passes_check_env():
    env = gym.make(envs.ENV_ID, cluster="mixed-a100-v100", model="gpt2-xl")
    check_env(env.unwrapped, skip_render_check=True)
    env.close()


@pytest.mark.slow
@pytest.mark.parametrize("cluster,model", SCENARIOS)
def test_masks_never_leave_the_agent_without_a_valid_action(cluster, model):
    env = make_env(cluster, model, max_steps=16, random_start=True)
    rng = np.random.default_rng(0)
    obs, _ = env.reset(seed=0)
    for _ in range(120):
        mask = env.action_masks()
        assert mask.shape == (len(env.actions),) and mask.any()  # ACTIONS + the zero / offload moves
        action = int(rng.choice(np.flatnonzero(mask)))
        obs, reward, terminated, truncated, info = env.step(action)
        assert env.observation_space.contains(obs)
        assert not info.get("invalid_action")
        assert -1.0 <= reward <= 1.0
        assert env.space.check(env.config) is None
        if terminated or truncated:
            obs, _ = env.reset()


def test_observation_size_is_the_same_on_every_cluster():
    shapes = {make_env(c, m).reset(seed=0)[0].shape for c, m in SCENARIOS}
    assert len(shapes) == 1


def test_reset_is_seeded():
    env = make_env("mixed-h100-a100-32", "llama2-7b", random_start=True)
    a, _ = env.reset(seed=3)
    cfg_a = env.config
    env.reset(seed=4)
    b, _ = env.reset(seed=3)
    assert env.config == cfg_a and np.array_equal(a, b)


def test_reward_is_relative_gain_and_failures_cost_a_penalty():
    c, m = load_cluster("mixed-a100-v100"), load_model("gpt2-xl")
    space = SearchSpace(c, m)
    toy = ToyEvaluator(c, m)
    env = ParallelConfigEnv(space, toy)
    env.reset(seed=0)
    assert env.config.micro_batch_size == 1 and env.score > 0
    before, score = env.config, env.score
    # a larger micro-batch is out of memory for the toy: penalty, and the env stays on the old plan
    mbs_up = ACTIONS.index(("mbs", +1))
    assert env.action_masks()[mbs_up]
    _, reward, _, _, info = env.step(mbs_up)
    assert reward == FAIL_PENALTY and info["status"] == "oom" and env.config == before and env.score == score
    # a masked action changes nothing and costs the invalid penalty, without raising
    mask = env.action_masks()
    bad = int(np.flatnonzero(~mask)[0])
    _, reward, _, _, info = env.step(bad)
    assert reward == INVALID_PENALTY and info["invalid_action"] and env.config == before
    # a valid layer move: reward is (new - old) / old
    move = next(i for i, a in enumerate(ACTIONS) if a[0] == "layer" and env.action_masks()[i])
    _, reward, _, _, _ = env.step(move)
    assert reward == pytest.approx(max(-1.0, min(1.0, (env.score - score) / score)))


def test_budgeted_backend_truncates_instead_of_exceeding_the_budget():
    c, m = load_cluster("mixed-a100-v100"), load_model("gpt2-xl")
    space = SearchSpace(c, m)
    budgeted = BudgetedEvaluator(Simulator(c, m), space, budget=3)
    env = ParallelConfigEnv(space, budgeted, max_steps=100)
    env.reset(seed=0)
    rng = np.random.default_rng(1)
    exhausted = False
    for _ in range(100):
        action = int(rng.choice(np.flatnonzero(env.action_masks())))
        _, _, _, truncated, info = env.step(action)
        assert budgeted.used <= 3
        if info.get("budget_exhausted"):
            exhausted = truncated
            break
    assert exhausted and budgeted.used == 3 and env.evaluations == 3


def test_env_with_plain_evaluator_is_cached():
    c, m = load_cluster("cpu-hetero"), load_model("tiny")
    toy = ToyEvaluator(c, m)
    env = ParallelConfigEnv(SearchSpace(c, m), toy)
    env.reset(seed=0)
    calls = toy.calls
    env.reset(seed=0)  # the same start plan again: served from the cache
    assert toy.calls == calls and env.evaluations == calls
