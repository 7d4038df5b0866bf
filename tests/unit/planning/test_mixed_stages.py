"""The planner's family ``mixed-stages`` (Zorse's stages of several ranks of different GPU types, issue 25)."""

from __future__ import annotations

import pytest

from autotune.loading import cluster_from_dict, load_cluster, load_model, model_from_dict
from autotune.planning import encoding, mixed_stages
from autotune.planning.planner import Planner
from autotune.planning.space import SearchSpace
from autotune.simulator import Simulator

P40 = {"name": "P40", "peak_tflops": 11.76, "memory_GiB": 22.5, "memory_bandwidth_GBps": 346.0, "pcie_gen": 3}


@pytest.fixture(scope="module")
def zorse():
    """Zorse's README example (experiments/data/zorse_example.json): one PCIe machine of 2 x L4, an RTX A6000
    and a Tesla P40, Llama 1B, global batch 128; the datasheet simulator."""
    gpus = (("l4-0", "L4"), ("l4-1", "L4"), ("a6000-0", "A6000"), ("p40-0", P40))
    cluster = cluster_from_dict(
        {
            "nodes": [{"name": name, "gpu": gpu, "count": 1} for name, gpu in gpus],
            "network": {"bandwidth_GBps": 11.08, "latency_us": 4.0},
        },
        source="test",
        default_name="zorse-example",
    )
    model = model_from_dict(
        dict(
            name="zorse-llama-1b",
            num_layers=22,
            hidden_size=2048,
            num_heads=32,
            num_kv_heads=32,
            ffn_hidden_size=5632,
            mlp="swiglu",
            vocab_size=49152,
            seq_len=512,
            global_batch_size=128,
            precision="fp16",
        ),
        "test",
    )
    space = SearchSpace(cluster, model, restrict={"mbs": [1, 2, 4]})
    sim = Simulator(cluster, model)
    return space, sim, Planner(space, sim).plan(64)


def test_every_plan_of_the_family_has_a_stage_of_several_ranks_is_valid_fits_and_is_timed_right(zorse):
    space, sim, plans = zorse
    family = mixed_stages.candidates(space, sim, plans, mixed_stages.simulations(space.cluster.num_devices))
    assert len(family) >= 5
    assert [c.estimate_s for c in family] == sorted(c.estimate_s for c in family)
    kinds = set()
    for c in family:
        assert c.family == mixed_stages.FAMILY
        assert any(s.mixed for p in c.config.pipelines for s in p.stages)
        assert space.check(c.config) is None
        assert sim.memory_estimate(c.config).ok
        m = sim.evaluate(c.config)
        assert m.ok and m.iteration_time_s == pytest.approx(c.estimate_s)
        kinds.add(tuple(len(s.ranks) for p in c.config.pipelines for s in p.stages))
    assert len(kinds) >= 2  # several stage widths / depths, not one plan repeated


def test_the_planner_returns_the_family(zorse):
    _, _, plans = zorse
    assert mixed_stages.FAMILY in [c.family for c in plans]
    mixed = [c for c in plans if c.family.startswith(mixed_stages.FAMILY)]
    others = [c for c in plans if not c.family.startswith(mixed_stages.FAMILY)]
    # Zorse's example: a plan with mixed stages beats every plan of the other families (datasheet simulator)
    assert min(c.estimate_s for c in mixed) < min(c.estimate_s for c in others)


def test_the_simulation_cap_holds_and_shrinks_with_the_cluster(zorse):
    space, sim, plans = zorse
    assert mixed_stages.simulations(4) == mixed_stages.MAX_SIMULATIONS
    assert mixed_stages.simulations(128) == 32 and mixed_stages.simulations(1024) == 4

    class Counting:
        calls = 0

        def memory_estimate(self, config):
            Counting.calls += 1
            return sim.memory_estimate(config)

        def evaluate(self, config):
            Counting.calls += 1
            return sim.evaluate(config)

    few = mixed_stages.candidates(space, Counting(), plans, 7)
    assert Counting.calls <= 7 and len(few) <= 3


def test_none_on_a_cluster_of_one_node_class():
    space = SearchSpace(load_cluster("cpu-4"), load_model("tiny"))
    sim = Simulator(space.cluster, space.model)
    plans = Planner(space, sim).plan(8)
    assert plans and mixed_stages.candidates(space, sim, plans, 50) == []


def test_a_mixed_stage_plan_encodes_at_its_stage_width_and_moves_from_there(zorse):
    space, _, plans = zorse
    for c in (c for c in plans if c.family.startswith(mixed_stages.FAMILY)):
        point = encoding.nearest(space.context, c.config)
        widths = {len(s.ranks) or 1 for p in c.config.pipelines for s in p.stages}
        want = next(iter(widths)) if len(widths) == 1 and next(iter(widths)) in (2, 4) else "bandwidth"
        assert point["stage_ranks"] == want
    best = next(c for c in plans if c.family.startswith(mixed_stages.FAMILY))
    params = space.encode(best.config)
    assert space.decode(params).config == best.config
    other = next(z for z in space._dims["zero"].choices if z != best.config.zero)
    moved = space.decode(dict(params, zero=other)).config
    assert moved is None or (moved.zero == other and moved.pipelines == best.config.pipelines)
