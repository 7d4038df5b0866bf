"""Search over Zorse's mixed stages (stage_ranks): stage width, mixed-type stages, bandwidth grouping, share moves."""

from __future__ import annotations

import pytest

from autotune.loading import cluster_from_dict, load_cluster, load_model
from autotune.search import mixed_space
from autotune.search.space import SearchSpace
from autotune.simulator.simulator import Simulator
from envs.parallel_config import MIXED_ACTIONS, ParallelConfigEnv, actions_for


@pytest.fixture(scope="module")
def space() -> SearchSpace:
    return SearchSpace(load_cluster("mixed-a100-v100"), load_model("gpt2-xl"))


def base(space: SearchSpace, **kw):
    return dict(space.heuristic_params()[0], **kw)


def test_dimensions_only_with_several_node_classes(space):
    names = [d.name for d in space.dimensions]
    assert "stage_ranks" in names  # after the MoE dimensions; the roundpipe dimensions (issue 11) follow it
    assert space._dims["stage_ranks"].choices == (1, 2, 4, 8, "bandwidth")
    homogeneous = SearchSpace(load_cluster("cpu-4"), load_model("tiny"))
    assert "stage_ranks" not in {d.name for d in homogeneous.dimensions}
    assert not set(MIXED_ACTIONS) & set(actions_for(homogeneous))


def test_params_without_the_dimensions_decode_as_before(space):
    p = base(space)
    old = {k: v for k, v in p.items() if k not in mixed_space.DIMENSIONS}
    assert space.decode(old).config == space.decode(dict(p, stage_ranks=1)).config
    assert not space.decode(old).config.has_mixed_stages


def test_mixed_type_stages_take_zorse_shares_by_speed(space):
    d = space.decode(base(space, stage_ranks=2, assign="mixed", pp=2))
    assert d.ok, d.reason
    cfg = d.config
    assert len(cfg.pipelines) == 2
    for pipe in cfg.pipelines:
        for st in pipe.stages:
            assert [r.devices[0].split(":")[0] for r in st.ranks] == ["a100", "v100"]
            a100, v100 = (r.num_microbatches for r in st.ranks)
            # shares proportional to speed (312 vs 125 TFLOP/s): Zorse's inverse per-layer latency rule
            assert a100 + v100 == pipe.num_microbatches
            assert abs(a100 / pipe.num_microbatches - 312 / 437) <= 1 / pipe.num_microbatches
    # grouped: stages of one type where the counts allow
    g = space.decode(base(space, stage_ranks=2, assign="grouped", pp=2)).config
    assert {tuple(sorted({d.split(":")[0] for d in st.devices})) for p in g.pipelines for st in p.stages} == \
        {("a100",), ("v100",)}


def test_too_wide_or_too_few_micro_batches_is_a_reason(space):
    d = space.decode(base(space, stage_ranks=8, pp=2))
    assert not d.ok and "pp=2 stages of width 8 need 16 TP groups, the used devices form 8" in d.reason
    d = space.decode(base(space, stage_ranks=4, pp=1, mbs=space._dims["mbs"].choices[-1]))
    total = space.model.global_batch_size // space._dims["mbs"].choices[-1]
    if total < 4:
        assert not d.ok and "cannot feed a stage of 4 ranks" in d.reason


def test_bandwidth_grouping_cuts_the_slow_links_between_stages():
    cluster = cluster_from_dict({"name": "t", "nodes": [
        {"name": "a", "gpu": "A100-80GB", "count": 2, "intra_node": {"bandwidth_GBps": 300, "latency_us": 2}},
        {"name": "v", "gpu": "V100-32GB", "count": 4, "intra_node": {"bandwidth_GBps": 16, "latency_us": 5}}],
        "network": {"bandwidth_GBps": 12.5, "latency_us": 10}}, "test")
    space = SearchSpace(cluster, load_model("gpt2-xl"))
    d = space.decode(dict(space.heuristic_params()[0], stage_ranks="bandwidth", pp=2, order="slow-first"))
    assert d.ok, d.reason
    (pipe,) = d.config.pipelines
    # stages of different width and type: 4 V100s in stage 0, 2 A100s in stage 1; only the network between
    assert [[r.devices for r in st.ranks] for st in pipe.stages] == [
        [("v:0",), ("v:1",), ("v:2",), ("v:3",)], [("a:0",), ("a:1",)]]
    s0, s1 = pipe.stages
    assert s0.layers < s1.layers  # 4 x 125 < 2 x 312 TFLOP/s
    # three stages from two nodes: the V100 node splits into two balanced parts
    d3 = space.decode(dict(space.heuristic_params()[0], stage_ranks="bandwidth", pp=3))
    widths = sorted(len(st.ranks) for st in d3.config.pipelines[0].stages)
    assert widths == [2, 2, 2]
    assert Simulator(cluster, space.model).evaluate(d.config).ok


def test_starts_include_bandwidth_and_mixed_type_stages(space):
    starts = space.heuristic_params()
    kinds = [p.get("stage_ranks") for p in starts]
    assert "bandwidth" in kinds and 2 in kinds
    assert kinds[0] == 1  # the speed-proportional plans still come first
    for p in starts:
        assert space.decode(p).ok


def test_env_share_moves_shift_micro_batches_between_a_stages_ranks(space):
    env = ParallelConfigEnv(space, Simulator(space.cluster, space.model), max_steps=8,
                            actions=actions_for(space, mixed=True))
    assert not set(MIXED_ACTIONS) & set(actions_for(space))  # off by default (policy files' move lists)
    env.reset(seed=0)
    env.params = base(space, stage_ranks=2, assign="mixed", pp=2)
    env.config = space.decode(env.params).config
    env._candidates = None
    before = [r.num_microbatches for r in env.config.pipelines[0].stages[0].ranks]
    a = env.actions.index(("share", 0, +1))
    b = env.actions.index(("share", 0, -1))
    mask = env.action_masks()
    assert mask[a] and mask[b]
    toward, _ = env._get_candidates()[a]
    away, _ = env._get_candidates()[b]
    # + from the rank with the most micro-batches per speed to the one with the least, - the other way
    after = [r.num_microbatches for r in toward.pipelines[0].stages[0].ranks]
    assert sum(after) == sum(before) and after != before
    assert [r.num_microbatches for r in away.pipelines[0].stages[0].ranks] != after
    assert space.check(toward) is None and space.check(away) is None
    assert not mask[env.actions.index(("share", 5, +1))]  # no stage 5
    # a batch move rescales the mixed stages' shares so they still sum to the pipeline's micro-batches
    mv = env.actions.index(("batch", 0, -1))
    moved, _ = env._get_candidates()[mv]
    for pipe in moved.pipelines:
        for st in pipe.stages:
            assert sum(r.num_microbatches for r in st.ranks) == pipe.num_microbatches
    obs, reward, *_ = env.step(a)
    assert env.config == toward and obs.shape == env.observation_space.shape
