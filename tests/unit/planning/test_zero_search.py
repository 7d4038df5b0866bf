"""ZeRO and offload as search dimensions: the shared space, env moves, memory-first starts."""

from __future__ import annotations

import numpy as np
import pytest
from paths import EXAMPLES

from autotune import load_cluster, load_model
from autotune.planning.budget import BudgetedEvaluator
from autotune.planning.space import SearchSpace
from autotune.simulator import Simulator
from envs.layout import ACTIONS, ZERO_ACTIONS, observation_features
from envs.parallel_config import ParallelConfigEnv

BOX = EXAMPLES / "8x4090.yaml"


@pytest.fixture(scope="module")
def box13():
    cluster, model = load_cluster(BOX), load_model("llama2-13b")
    return SearchSpace(cluster, model), Simulator(cluster, model)


def test_every_method_sees_zero_and_offload_dimensions(box13):
    space, _ = box13
    dims = {d.name: d.choices for d in space.dimensions}
    assert dims["zero"] == (0, 1, 2, 3) and dims["offload"] == ("none", "optimizer", "all")
    params = space.heuristic_params()[0]
    cfg = space.decode(dict(params, zero=2, offload="optimizer", pp=1)).config
    assert cfg.zero == 2 and {s.offload for p in cfg.pipelines for s in p.stages} == {"optimizer"}
    assert space.params_of(cfg)["zero"] == 2 and space.params_of(cfg)["offload"] == "optimizer"
    # with a single replica every zero stage is the same plan (one evaluation, not four)
    single = [space.decode(dict(params, pp=8, zero=z)).config for z in range(4)]
    assert len(single[0].pipelines) == 1 and len(set(single)) == 1 and single[0].zero == 0
    # a params dict from before these dimensions (an old study) still decodes, as zero 0, no offload
    old = {k: v for k, v in params.items() if k not in ("zero", "offload")}
    assert space.decode(old).ok and space.decode(old).config.zero == 0


def test_the_memory_first_start_fits_where_nothing_else_does(box13):
    space, sim = box13
    starts = space.heuristic_params()
    configs = [space.decode(p).config for p in starts]
    ran = [sim.evaluate(c).ok for c in configs]
    # on 8 x 24 GB with a 13B model the memory starts come first, and they run
    assert ran[0] and configs[0].zero == 3 and configs[0].offloads and len(configs[0].pipelines) == 8
    first = space.memory_first_params()
    mf = space.decode(first).config
    assert mf.offloads and all(s.recompute for p in mf.pipelines for s in p.stages) and mf.micro_batch_size == 1
    assert sim.evaluate(mf).ok
    # it is the smallest-memory pipeline plan among a sample of the space's plans (RoundPipe's, which takes
    # the loss in chunks and keeps the state in host memory, can need less: it is a start of its own)
    peak = max(sim.evaluate(mf).peak_memory_GiB.values())
    rng = np.random.default_rng(0)
    for _ in range(60):
        _, cfg = space.sample_valid(rng)
        if cfg.is_roundpipe:
            continue
        m = sim.evaluate(cfg)
        if m.peak_memory_GiB:
            assert max(m.peak_memory_GiB.values()) >= peak - 1e-9


def test_uniform_grid_includes_zero_and_offload(box13):
    space, sim = box13
    plans = space.uniform_plans()
    assert {c.zero for c in plans} == {0, 1, 2, 3}
    assert {s.offload for c in plans for p in c.pipelines for s in p.stages} == {"none", "optimizer", "all"}
    assert any(sim.evaluate(c).ok for c in plans if c.zero == 3)


def test_env_moves_change_zero_and_offload_and_keep_them_through_fine_edits(box13):
    space, sim = box13
    env = ParallelConfigEnv(space, sim)
    env.reset(seed=0)
    assert env.config.zero == 3 and env.config.offloads  # the memory-first start on this cluster
    names = {a: i for i, a in enumerate(env.actions)}
    assert (
        env.actions[len(ACTIONS) : len(ACTIONS) + len(ZERO_ACTIONS)] == ZERO_ACTIONS
    )  # after the first layout's moves
    for act in (("dim", "zero", -1), ("dim", "offload", +1), ("dim", "offload", -1)):
        assert act in names
    cands = env._get_candidates()
    down = cands[names[("dim", "zero", -1)]]
    assert down is not None and down[0].zero == 2
    # a fine edit (move a layer, toggle recompute) keeps the plan's zero and offload
    for i, cand in enumerate(cands):
        if cand is not None and env.actions[i][0] in ("layer", "recompute", "batch", "mbs", "schedule"):
            assert cand[0].zero == env.config.zero
            assert [s.offload for p in cand[0].pipelines for s in p.stages][0] == env.config.pipelines[0].stages[
                0
            ].offload
    obs = env._observation()
    feats = observation_features()
    assert obs[feats.index("zero")] == pytest.approx(1.0) and obs[feats.index("host_memory_used")] > 0


def test_the_shipped_chooser_finds_fitting_plans_on_a_memory_tight_box(box13):
    from autotune.search.agents.acquire import run_acquire

    space, sim = box13
    ev = BudgetedEvaluator(sim, space, 12)
    run_acquire(space, ev, 0)
    assert ev.used == 12 and ev.best is not None and ev.best.measurement.ok


def test_layerwise_execution_is_a_dimension_where_zero_or_offload_can_be_chosen(box13):
    """Zorse's layer-wise execution batches ZeRO-2/3's and offload's traffic per layer; without them it is
    the micro-batch plan itself, so the space decodes it so and drops the dimension when neither can be chosen."""
    from autotune.engines import check

    space, sim = box13
    assert {d.name: d.choices for d in space.dimensions}["execution"] == ("microbatch", "layerwise")
    params = dict(space.heuristic_params()[0], pp=1)
    assert params["execution"] == "microbatch"  # the starts are micro-batch plans
    layerwise = space.decode(dict(params, zero=2, offload="optimizer", execution="layerwise")).config
    assert layerwise is not None and {p.execution for p in layerwise.pipelines} == {"layerwise"}
    assert sim.evaluate(layerwise).status in ("ok", "oom")
    assert space.params_of(layerwise)["execution"] == "layerwise"
    assert "layer-wise execution" in check("torchtitan", layerwise)
    plain = space.decode(dict(params, zero=0, offload="none", execution="layerwise")).config
    assert plain == space.decode(dict(params, zero=0, offload="none", execution="microbatch")).config
    assert {p.execution for p in plain.pipelines} == {"microbatch"}
    unsharded = SearchSpace(space.cluster, space.model, restrict={"zero": [0, 1], "offload": ["none"]})
    assert "execution" not in {d.name for d in unsharded.dimensions}
    torchtitan = SearchSpace(space.cluster, space.model, engine="torchtitan")
    assert {d.name: d.choices for d in torchtitan.dimensions}.get("execution", ("microbatch",)) == ("microbatch",)
