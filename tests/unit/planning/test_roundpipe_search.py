"""RoundPipe plans in the shared search space (autotune.planning.roundpipe_space): dimensions where they
apply, RoundPipe's own start plan evaluated first by every method, the env on a roundpipe plan."""

from __future__ import annotations

import numpy as np
import pytest
from paths import EXAMPLES

from autotune import load_cluster, load_model
from autotune.planning import roundpipe_space as rs
from autotune.planning.budget import BudgetedEvaluator
from autotune.planning.space import SearchSpace
from autotune.simulator import Simulator
from autotune.simulator.roundpipe_partition import auto_stages

EXAMPLES = EXAMPLES


@pytest.fixture(scope="module")
def box():
    cluster, model = load_cluster(EXAMPLES / "8x4090.yaml"), load_model("llama2-13b", 64)
    return SearchSpace(cluster, model), Simulator(cluster, model)


def test_roundpipe_dimensions_exist_only_where_a_node_has_gpus():
    assert not set(rs.DIMENSION_NAMES) & {
        d.name for d in SearchSpace(load_cluster("cpu-2"), load_model("tiny")).dimensions
    }
    space = SearchSpace(load_cluster("mixed-h100-a100-32"), load_model("llama2-7b"))
    dims = {d.name: d.choices for d in space.dimensions}
    assert dims["roundpipe"] == (False, True)
    assert set(dims["rp.pool"]) == {"H100-80GB", "H100-80GBx2", "A100-40GB", "A100-40GBx2"}  # one node, or each
    off = SearchSpace(load_cluster("mixed-h100-a100-32"), load_model("llama2-7b"), restrict={"roundpipe": [False]})
    assert off.roundpipe_start() is None


def test_the_start_plan_is_what_roundpipe_picks_with_its_defaults(box):
    space, sim = box
    params = space.roundpipe_start()
    assert params["roundpipe"] is True and (params["rp.balance"], params["rp.memory"], params["rp.grain"]) == (
        1.1,
        0.6,
        "stage",
    )
    cfg = space.decode(params).config
    pipe = cfg.pipelines[0]
    # RoundPipe's default: at least pool + 1 = 9 micro-batches per pass; the largest micro-batch that gives them
    assert (cfg.micro_batch_size, pipe.num_microbatches, pipe.roundpipe.accumulation_steps) == (4, 16, 1)
    auto = auto_stages(sim.costs, space.cluster.device_ids(), 4, 1.1, 13.41)
    assert (pipe.roundpipe.forward_layers, pipe.roundpipe.fused_layers, pipe.roundpipe.backward_layers) == (
        auto.forward_layers,
        auto.fused_layers,
        auto.backward_layers,
    )
    assert sim.evaluate(cfg).ok
    shape = space.params_of(cfg)
    assert shape["schedule"] == "roundpipe" and shape["devices_idle"] == 0


@pytest.mark.slow
def test_exhaustive_counts_each_kind_of_plan_once(box):
    # micro-batch execution only: with layer-wise execution too the space exceeds exhaustive's limit
    space = SearchSpace(box[0].cluster, box[0].model, restrict={"execution": ["microbatch"]})
    pipeline = [d for d in space.dimensions if d.name not in rs.DIMENSION_NAMES]
    rp = [d for d in space.dimensions if d.name in rs.DIMENSION_NAMES[1:] or d.name == "mbs"]
    assert space.size == np.prod([len(d.choices) for d in pipeline]) + np.prod([len(d.choices) for d in rp])
    plans = space.enumerate()
    kinds = {c.is_roundpipe for _, c in plans}
    assert kinds == {True, False}
    assert len({c for _, c in plans}) == len(plans)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["random", "uniform", "optuna", "rl", "dp"])
def test_every_method_evaluates_roundpipes_own_plan_first(box, method):
    from autotune.search.api import tune

    space, _ = box
    start = space.decode(space.roundpipe_start()).config
    seen = []
    result = tune(
        space.cluster,
        space.model,
        method=method,
        budget=3,
        track=False,
        storage="memory",
        on_evaluation=lambda ev: seen.append(ev.config),
    )
    assert seen[0] == start
    # dp evaluates only the plans its planner builds, and uniform its grid: none of their pipeline plans fits
    # 13B on 24 GB cards, and the memory model answers those oom without spending the budget
    assert result.evaluations == 3 if method not in ("dp", "uniform") else 1 <= result.evaluations <= 3


def test_optuna_models_the_start_plan_and_still_warm_starts(box, tmp_path):
    from autotune.search.agents import shared_study
    from autotune.search.api import tune

    space = SearchSpace(box[0].cluster, load_model("gpt2-xl", 64))  # its pipeline plans fit: not screened out
    journal = str(tmp_path / "s.journal")
    tune(
        space.cluster,
        space.model,
        method="optuna",
        budget=4,
        track=False,
        storage=journal,
        start="heuristic",
        study_name="rp",
    )
    study = shared_study.open_study(space, "rp", journal, 0)
    trials = [t for t in study.trials() if t.user_attrs.get("evaluated")]
    first = next(t for t in trials if t.user_attrs.get("source") == shared_study.ROUNDPIPE_START)
    assert first.params["roundpipe"] is True  # a trial with its parameters: TPE learns from it
    heuristic = space.heuristic_params()[0]
    assert any(t.params == heuristic for t in trials)  # the speed-proportional warm start ran too


def test_the_env_stays_defined_on_a_roundpipe_plan(box):
    from envs.parallel_config import ParallelConfigEnv

    space, sim = box
    ev = BudgetedEvaluator(sim, space, 20)
    env = ParallelConfigEnv(space, ev, max_steps=10)
    params = space.roundpipe_start()
    env.reset(seed=0, options={"params": params})
    assert env.config == space.decode(params).config and env.config.is_roundpipe
    assert env.observation_space.contains(env._observation())
    moves = {env.actions[i][0] for i in np.flatnonzero(env.action_masks())}
    assert moves and moves <= {"mbs", "schedule", "dim"}  # RoundPipe cuts its stages itself
    a = int(np.flatnonzero(env.action_masks())[0])
    env.step(a)
    assert space.check(env.config) is None


@pytest.mark.slow
@pytest.mark.parametrize("method", ["optuna", "random"])
def test_a_search_restricted_to_one_kind_of_plan_stays_in_it(box, method):
    """restrict={"roundpipe": [True]}: the dp start plan and the heuristic warm starts are pipeline plans,
    answered invalid (no budget); [False]: RoundPipe's start plan is not evaluated at all."""
    from autotune.search.api import tune

    space = SearchSpace(box[0].cluster, load_model("gpt2-xl", 64))  # both kinds of plan fit on 24 GB cards
    only = SearchSpace(space.cluster, space.model, restrict={"roundpipe": [True]})
    pipeline = space.decode(space.heuristic_params()[0]).config
    assert not pipeline.is_roundpipe and "restricted to roundpipe plans" in only.check(pipeline)
    assert all(p["roundpipe"] is True for p in only.heuristic_params())  # inside the restricted choices
    never = SearchSpace(space.cluster, space.model, restrict={"roundpipe": [False]})
    rp = space.decode(space.roundpipe_start()).config
    assert "outside this search" in never.check(rp) and space.check(rp) is None
    for allowed in (True, False):
        seen = []
        res = tune(
            space.cluster,
            space.model,
            method,
            budget=4,
            seed=0,
            track=False,
            storage="memory",
            restrict={"roundpipe": [allowed]},
            on_evaluation=lambda e: seen.append(e.config.is_roundpipe),
        )
        assert seen and set(seen) == {allowed} and res.best_config.is_roundpipe is allowed
