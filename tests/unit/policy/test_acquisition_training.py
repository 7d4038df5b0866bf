"""Training the chooser of real runs: a few hundred PPO steps on a tiny scenario improve its own score."""

from __future__ import annotations

import numpy as np
import pytest

from autotune import load_model
from autotune.loading import cluster_from_dict
from autotune.policy import policy_file
from autotune.policy.acquisition_training import (
    CHOOSERS,
    load_episodes,
    save_episodes,
    scenario_episodes,
    score,
    train,
)
from autotune.policy.scenarios import Scenario
from envs.acquisition import LAYOUT


def tiny_scenario() -> Scenario:
    def node(name: str, gpu: str) -> dict:
        return {
            "name": name,
            "gpu": gpu,
            "count": 2,
            "intra_node": {"bandwidth_GBps": 16, "latency_us": 5},
            "network": {"bandwidth_GBps": 0.5, "latency_us": 50},
        }

    cluster = cluster_from_dict({"name": "tiny", "nodes": [node("a", "RTX-4090"), node("b", "RTX-3090")]}, "tiny")
    return Scenario("tiny", cluster, load_model("gpt2-xl", global_batch_size=32))


@pytest.mark.slow
def test_a_few_hundred_steps_improve_the_choosers_own_validation_score(tmp_path) -> None:
    episodes = scenario_episodes(tiny_scenario(), 24, np.random.default_rng(0))
    assert len(episodes) == 24 and all(len(ep.table) == len(episodes[0].table) > 8 for ep in episodes)
    path = tmp_path / "episodes.npz"
    save_episodes(path, episodes)
    again = load_episodes(path)  # plain arrays, read without pickle
    assert np.array_equal(again[5].truth_s, episodes[5].truth_s, equal_nan=True)
    assert np.array_equal(again[5].table.sensitivity, episodes[5].table.sensitivity)

    record = train(episodes, episodes, 512, tmp_path / "p.safetensors", seed=1, validate_every=256, n_steps=256)
    untrained, *trained = (row["regret"] for row in record["validation"])
    assert record["steps"] == 512 and len(trained) == 2
    assert min(trained) < 0.7 * untrained, record["validation"]
    _, meta = policy_file.read(tmp_path / "p.safetensors")  # the best checkpoint, a policy file of its layout
    assert meta["layout"] == LAYOUT and meta["validation_regret"] == round(min(trained), 5)
    # the fixed rules it is compared with: the posterior's greedy gain beats the simulator's order here
    rules = {name: score(episodes, fn)["regret"] for name, fn in CHOOSERS.items()}
    assert rules["greedy gain"] < rules["simulator order"]
