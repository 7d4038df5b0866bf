"""The shared search space: decoding, validity reasons, uniform grid, heuristics, enumeration limits."""

from __future__ import annotations

import numpy as np
import pytest

from autotune import SpecError, load_cluster, load_model
from autotune.planning.space import SearchSpace, apportion, head_extra_layers
from autotune.specs import ParallelConfig, PipelineConfig, StageConfig


@pytest.fixture(scope="module")
def mixed():
    return SearchSpace(load_cluster("mixed-a100-v100"), load_model("gpt2-xl"))


@pytest.fixture(scope="module")
def big():
    return SearchSpace(load_cluster("mixed-h100-a100-32"), load_model("llama2-7b"))


def test_apportion_sums_and_minimum():
    assert apportion(10, [1, 1]) == [5, 5]
    assert apportion(10, [3, 1]) in ([8, 2], [7, 3])
    split = apportion(48, [5.0, 1.0, 0.001], minimum=1)
    assert sum(split) == 48 and min(split) >= 1 and split[0] > split[1]
    assert apportion(8, [1, 2, 3], minimum=2, quantum=2) == [2, 2, 4]
    assert apportion(3, [1, 1, 1, 1]) is None  # fewer units than parts
    assert apportion(7, [1, 1], quantum=2) is None


@pytest.mark.parametrize("fixture", ["mixed", "big"])
def test_every_decoded_plan_is_valid_or_says_why(fixture, request):
    space: SearchSpace = request.getfixturevalue(fixture)
    from autotune.simulator import Simulator

    sim = Simulator(space.cluster, space.model)
    rng = np.random.default_rng(0)
    valid = 0
    for _ in range(300):
        params = space.sample(rng)
        d = space.decode(params)
        if d.ok:
            valid += 1
            assert space.check(d.config) is None
            if valid <= 60:  # the simulator agrees that the plan is valid (it may not fit in memory)
                m = sim.evaluate(d.config)
                assert m.status != "invalid", m.error
            assert (
                sum(p.num_microbatches for p in d.config.pipelines) * d.config.micro_batch_size
                == space.model.global_batch_size
            )
            for pipe in d.config.pipelines:
                if pipe.roundpipe is not None:  # a roundpipe plan: its partitions, its pool on one node
                    rp = pipe.roundpipe
                    assert sum(rp.forward_layers) + rp.fused_layers == space.model.num_layers
                    assert len({space.cluster.node_of(x).name for x in rp.devices}) == 1
                    continue
                assert sum(s.layers for s in pipe.stages) == space.model.num_layers
                for stage in pipe.stages:  # a TP group (each rank of a mixed stage) never leaves its node
                    for rank in stage.ranks_of(pipe.num_microbatches):
                        assert len({space.cluster.node_of(x).name for x in rank.devices}) == 1
        else:
            assert d.reason
    assert valid > 50


def test_decode_is_deterministic(mixed):
    params = mixed.heuristic_params()[0]
    assert mixed.decode(params).config == mixed.decode(dict(params)).config


def test_speed_proportional_split_gives_fast_stages_more_layers(mixed):
    params = dict(mixed.heuristic_params()[0], assign="mixed", order="fast-first", pp=2, layer_split=1.0)
    cfg = mixed.decode(params).config
    a100, v100 = cfg.pipelines[0].stages
    assert a100.devices[0].startswith("a100") and v100.devices[0].startswith("v100")
    assert a100.layers > v100.layers
    even = mixed.decode(dict(params, layer_split=0.0)).config
    # even split in work: the LM head on the last stage counts as head_extra_layers of work
    assert (
        abs(even.pipelines[0].stages[0].layers - even.pipelines[0].stages[1].layers)
        <= round(head_extra_layers(mixed.model)) + 1
    )


def test_batch_split_follows_replica_speed(mixed):
    params = dict(mixed.heuristic_params()[0], assign="grouped", pp=2, batch_split=1.0)
    cfg = mixed.decode(params).config
    counts = [p.num_microbatches for p in cfg.pipelines]
    fast = [c for p, c in zip(cfg.pipelines, counts) if p.stages[0].devices[0].startswith("a100")]
    slow = [c for p, c in zip(cfg.pipelines, counts) if p.stages[0].devices[0].startswith("v100")]
    assert min(fast) > max(slow)
    equal = mixed.decode(dict(params, batch_split=0.0)).config
    assert len({p.num_microbatches for p in equal.pipelines}) == 1


def test_invalid_choices_give_reasons(mixed):
    params = dict(mixed.heuristic_params()[0])
    assert "no node class" in mixed.decode(dict(params, **{"use.a100": False, "use.v100": False})).reason
    assert "needs 8 TP groups" in mixed.decode(dict(params, **{"use.v100": False, "pp": 8})).reason
    assert "interleaved-1f1b needs pp >= 2" in mixed.decode(dict(params, pp=1, schedule="interleaved-1f1b")).reason
    assert "missing choice" in mixed.decode({"pp": 2}).reason


def test_check_names_the_broken_rule(mixed, big):
    spans = ParallelConfig(1, (PipelineConfig(512, (StageConfig(("h100-0:0", "a100-0:0"), 32),)),))
    assert "spans nodes" in big.check(spans)
    L = mixed.model.num_layers
    short = ParallelConfig(1, (PipelineConfig(512, (StageConfig(("a100:0",), L - 1),)),))
    assert "layers sum to" in mixed.check(short)
    twice = ParallelConfig(
        1, (PipelineConfig(256, (StageConfig(("a100:0",), L),)), PipelineConfig(256, (StageConfig(("a100:0",), L),)))
    )
    assert "more than once" in mixed.check(twice)


def test_uniform_plans_are_heterogeneity_blind(big):
    plans = big.uniform_plans()
    assert plans
    for cfg in plans:
        assert cfg.schedule == "1f1b"
        shapes = {tuple((s.tp, s.layers, s.recompute) for s in p.stages) for p in cfg.pipelines}
        assert len(shapes) == 1  # every replica identical
        (shape,) = shapes
        assert len({layers for _, layers, _ in shape}) == 1  # layers even
        assert len({tp for tp, _, _ in shape}) == 1
        assert len({p.num_microbatches for p in cfg.pipelines}) == 1  # equal batch
        assert big.check(cfg) is None
    # the grid covers several degrees and micro-batch sizes
    assert len({p.stages[0].tp for c in plans for p in c.pipelines}) >= 3
    assert len({c.micro_batch_size for c in plans}) >= 3


def test_exhaustive_refuses_large_spaces_with_the_size(big):
    # pipeline plans' combinations (x 12 for zero x offload) + roundpipe plans' (4 pools x 5 x 5 x 2 x 5 x 6 mbs)
    with pytest.raises(SpecError, match=r"combinations.*seq_parallel:2.*zero:4 x offload:3.*exceed the limit"):
        big.enumerate()


def test_enumerate_small_space_is_distinct_and_valid():
    space = SearchSpace(
        load_cluster("cpu-hetero"),
        load_model("tiny"),
        restrict={
            "schedule": ["1f1b"],
            "recompute": ["none"],
            "mbs": [1, 2],
            "zero": [0, 3],
            "offload": ["none"],
            "execution": ["microbatch"],
            "seq_parallel": [False],  # half the points to decode (73,728 -> 36,864); the rest still varies
        },
    )
    plans = space.enumerate()
    configs = [c for _, c in plans]
    assert len(configs) == len(set(configs)) > 10
    assert all(space.check(c) is None for c in configs)


def test_restrict_rejects_unknown_dimension_and_choice():
    cluster, model = load_cluster("cpu-hetero"), load_model("tiny")
    with pytest.raises(SpecError, match="unknown dimension"):
        SearchSpace(cluster, model, restrict={"nope": [1]})
    with pytest.raises(SpecError, match="none of"):
        SearchSpace(cluster, model, restrict={"schedule": ["zigzag"]})


def test_heuristic_params_decode_and_use_every_class(big):
    starts = big.heuristic_params()
    assert starts
    for params in starts:
        cfg = big.decode(params).config
        assert cfg is not None
        used = {big.cluster.node_of(d).device.name for d in cfg.devices}
        assert used == {"H100-80GB", "A100-40GB"}


def test_restrict_matches_command_line_text_to_each_dimensions_choices():
    """``--restrict`` gives text: ``false`` names False, ``2`` names 2, ``0.5`` names 0.5; the space keeps
    the restriction as its own values, and a malformed item is refused."""
    from autotune.planning.vocabulary import parse_restrictions

    cluster, model = load_cluster("mixed-a100-v100"), load_model("gpt2-xl")
    text = parse_restrictions(["pp=2,4", "layer_split=0.5", "roundpipe=false", "pp=8"])
    assert text == {"pp": ["2", "4", "8"], "layer_split": ["0.5"], "roundpipe": ["false"]}
    space = SearchSpace(cluster, model, restrict=text)
    assert space.restrict == {"pp": [2, 4, 8], "layer_split": [0.5], "roundpipe": [False]}
    assert space._dims["pp"].choices == (2, 4, 8) and "roundpipe" not in space._dims
    typed = SearchSpace(cluster, model, restrict={"pp": [2, 4, 8], "layer_split": [0.5], "roundpipe": [False]})
    assert typed.dimensions == space.dimensions
    with pytest.raises(SpecError, match="is not name=value"):
        parse_restrictions(["pp"])
