"""Search over Zorse's mixed stages (stage_ranks): stage width, mixed-type stages, bandwidth grouping, share moves."""

from __future__ import annotations

import pytest

from autotune.loading import cluster_from_dict, load_cluster, load_model
from autotune.planning import mixed_space
from autotune.planning.space import SearchSpace
from autotune.simulator.simulator import Simulator
from envs.layout import MIXED_ACTIONS, actions_for
from envs.parallel_config import ParallelConfigEnv


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
            # Zorse's rule: shares inversely proportional to the cost model's per-layer latency
            lat_a, lat_v = (
                mixed_space.layer_latency_s(space.context, r.devices, cfg.micro_batch_size) for r in st.ranks
            )
            assert a100 + v100 == pipe.num_microbatches
            assert abs(a100 / pipe.num_microbatches - lat_v / (lat_a + lat_v)) <= 1 / pipe.num_microbatches
    # grouped: stages of one type where the counts allow
    g = space.decode(base(space, stage_ranks=2, assign="grouped", pp=2)).config
    assert {tuple(sorted({d.split(":")[0] for d in st.devices})) for p in g.pipelines for st in p.stages} == {
        ("a100",),
        ("v100",),
    }


def test_zorse_shares_are_inverse_to_the_cost_models_per_layer_latency():
    """Hand cases: a rank emulated 2x slower takes a third (12 -> 8 + 4); a card of the same peak TFLOP/s but
    1/20 of the memory bandwidth is slower per layer (memory-bound), so it takes fewer micro-batches than
    the peak rule's half."""
    cpu = cluster_from_dict(
        {
            "name": "t",
            "nodes": [{"name": "f", "gpu": "cpu", "count": 2}, {"name": "s", "gpu": "cpu", "count": 2, "slowdown": 2}],
            "network": {"bandwidth_GBps": 10},
        },
        "t",
    )
    space = SearchSpace(cpu, load_model("tiny"))
    assert mixed_space.layer_latency_s(space.context, ["s:0"], 1) == pytest.approx(
        2 * mixed_space.layer_latency_s(space.context, ["f:0"], 1)
    )
    assert mixed_space.zorse_shares(space.context, [["f:0"], ["s:0"]], 12, 1) == [8, 4]
    assert mixed_space.zorse_shares(space.context, [["f:0"], ["s:0"], ["s:1"]], 12, 1) == [6, 3, 3]
    gpu = lambda name, bw: dict(name=name, peak_tflops=100, memory_GiB=40, memory_bandwidth_GBps=bw)  # noqa: E731
    cluster = cluster_from_dict(
        {
            "name": "t",
            "nodes": [
                {"name": "f", "count": 2, "gpu": gpu("F", 2000)},
                {"name": "m", "count": 2, "gpu": gpu("M", 100)},
            ],
            "network": {"bandwidth_GBps": 10},
        },
        "t",
    )
    space = SearchSpace(cluster, load_model("gpt2-xl"))
    assert space.group_speed(["f:0"]) == space.group_speed(["m:0"])  # the peak rule would split 6 + 6
    sim = Simulator(cluster, space.model)
    lat = [
        sum((e.forward_s, e.backward_s))
        for e in (sim.costs.stage_estimate((d,), 1, False, False, False, 1, 1) for d in ("f:0", "m:0"))
    ]
    assert lat[1] > 2 * lat[0]
    expected = mixed_space.shares(12, [1 / lat[0], 1 / lat[1]])
    assert mixed_space.zorse_shares(space.context, [["f:0"], ["m:0"]], 12, 1) == expected and expected[1] < 6
    # the decoder's mixed stages take these shares
    d = space.decode(dict(space.heuristic_params()[0], stage_ranks=2, assign="mixed", pp=1, mbs=1))
    assert d.ok, d.reason
    pipe = d.config.pipelines[0]
    assert [r.devices[0][0] for r in pipe.stages[0].ranks] == ["f", "m"]
    assert [r.num_microbatches for r in pipe.stages[0].ranks] == mixed_space.zorse_shares(
        space.context, [r.devices for r in pipe.stages[0].ranks], pipe.num_microbatches, 1
    )


def test_zero_is_kept_for_one_replica_whose_stages_have_several_ranks(space):
    """The ranks of a mixed stage are ZeRO peers: a one-replica plan with stage_ranks 2 keeps its zero; one
    with one rank per stage (no peers) decodes as zero 0."""
    one = base(space, stage_ranks="bandwidth", pp=2, zero=2)
    d = space.decode(one)
    assert d.ok, d.reason
    assert len(d.config.pipelines) == 1 and d.config.has_mixed_stages and d.config.zero == 2
    plain = space.decode(base(space, stage_ranks=1, pp=8, zero=2))
    assert plain.ok and len(plain.config.pipelines) == 1 and plain.config.zero == 0
    starts = space.heuristic_params()
    assert any(p.get("stage_ranks") == "bandwidth" and p.get("zero") == 2 for p in starts)  # Zorse: ZeRO-2


def test_too_wide_or_too_few_micro_batches_is_a_reason(space):
    d = space.decode(base(space, stage_ranks=8, pp=2))
    assert not d.ok and "pp=2 stages of width 8 need 16 TP groups, the used devices form 8" in d.reason
    d = space.decode(base(space, stage_ranks=4, pp=1, mbs=space._dims["mbs"].choices[-1]))
    total = space.model.global_batch_size // space._dims["mbs"].choices[-1]
    if total < 4:
        assert not d.ok and "cannot feed a stage of 4 ranks" in d.reason


def test_bandwidth_grouping_cuts_the_slow_links_between_stages():
    cluster = cluster_from_dict(
        {
            "name": "t",
            "nodes": [
                {"name": "a", "gpu": "A100-80GB", "count": 2, "intra_node": {"bandwidth_GBps": 300, "latency_us": 2}},
                {"name": "v", "gpu": "V100-32GB", "count": 4, "intra_node": {"bandwidth_GBps": 16, "latency_us": 5}},
            ],
            "network": {"bandwidth_GBps": 12.5, "latency_us": 10},
        },
        "test",
    )
    space = SearchSpace(cluster, load_model("gpt2-xl"))
    d = space.decode(dict(space.heuristic_params()[0], stage_ranks="bandwidth", pp=2, order="slow-first"))
    assert d.ok, d.reason
    (pipe,) = d.config.pipelines
    # stages of different width and type: 4 V100s in stage 0, 2 A100s in stage 1; only the network between
    assert [[r.devices for r in st.ranks] for st in pipe.stages] == [
        [("v:0",), ("v:1",), ("v:2",), ("v:3",)],
        [("a:0",), ("a:1",)],
    ]
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
    env = ParallelConfigEnv(
        space, Simulator(space.cluster, space.model), max_steps=8, actions=actions_for(space, mixed=True)
    )
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


def test_with_a_profile_the_shares_follow_the_measured_layer_times():
    """Two cards with the same datasheet split 6 + 6; a profile that measures one 3x slower per layer makes
    a search (``tune``) with that profile split 9 + 3 (Zorse's rule on the calibrated latency)."""
    from autotune.profile import CalibrationProfile, DeviceProfile, LayerTiming
    from autotune.search.api import tune

    gpu = lambda name: dict(name=name, peak_tflops=100, memory_GiB=40, memory_bandwidth_GBps=2000)  # noqa: E731
    cluster = cluster_from_dict(
        {
            "name": "t",
            "nodes": [{"name": "f", "count": 1, "gpu": gpu("F")}, {"name": "m", "count": 1, "gpu": gpu("M")}],
            "network": {"bandwidth_GBps": 10},
        },
        "t",
    )
    model = load_model("tiny", 12)
    space = SearchSpace(cluster, model)
    assert mixed_space.zorse_shares(space.context, [["f:0"], ["m:0"]], 12, 1) == [6, 6]

    def timing(device: str, seconds: float) -> DeviceProfile:
        m = model
        layer = LayerTiming(
            m.hidden_size, m.num_heads, m.num_kv_heads, m.ffn_hidden_size, m.mlp, m.seq_len, 1, 1, seconds, 2 * seconds
        )
        return DeviceProfile(device, (), layers=(layer,))

    profile = CalibrationProfile((timing("F", 0.01), timing("M", 0.03)), cluster="t")
    sim = Simulator(cluster, model, profile=profile)
    seen = []
    tune(
        cluster,
        model,
        method="random",
        budget=4,
        track=False,
        evaluator=sim,
        restrict={"mbs": [1], "stage_ranks": [2], "pp": [1], "roundpipe": [False]},
        on_evaluation=lambda ev: seen.append(ev.config),
    )
    ranks = [st.ranks for cfg in seen for p in cfg.pipelines for st in p.stages if st.mixed]
    assert ranks, [c.describe() for c in seen]
    assert all(sorted(r.num_microbatches for r in rs) == [3, 9] for rs in ranks)
