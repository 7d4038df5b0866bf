"""``--restrict`` is honoured by every method and every start (issue 46, case 2): the planner's plans, optuna's
dp start and the rl chooser's first plans are held to it as sampled plans are, and a restriction of a
dimension of names (``offload=optimizer``) does not crash the starts."""

from __future__ import annotations

import pytest

from autotune import tune


def _stages(config):
    return [s for p in config.pipelines for s in p.stages]


@pytest.mark.parametrize("method", ["dp", "optuna", "rl"])
def test_every_method_returns_a_plan_inside_the_restriction(tmp_path, method):
    storage = {"storage": str(tmp_path / "optuna.journal")} if method == "optuna" else {}
    r = tune("mixed-a100-v100", "gpt2-small", method=method, budget=4, track=False, restrict={"pp": [2]}, **storage)
    assert not r.best_config.is_roundpipe and {len(p.stages) for p in r.best_config.pipelines} == {2}
    deep = tune(
        "mixed-a100-v100",
        "gpt2-small",
        method=method,
        budget=4,
        track=False,
        restrict={"pp": [4], "recompute": ["all"]},
        **({"storage": str(tmp_path / "deep.journal")} if storage else {}),
    )
    assert {len(p.stages) for p in deep.best_config.pipelines} == {4}
    assert {s.recompute for s in _stages(deep.best_config)} == {True}


def test_a_restriction_of_offload_starts_and_returns_offloading_plans(tmp_path):
    r = tune(
        "mixed-a100-v100",
        "gpt2-small",
        method="optuna",
        budget=3,
        track=False,
        storage=str(tmp_path / "optuna.journal"),
        restrict={"offload": ["optimizer"]},
    )
    assert {s.offload for s in _stages(r.best_config)} == {"optimizer"}
