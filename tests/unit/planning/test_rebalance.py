"""The simulator's correction of a plan's layer split (``autotune.planning.rebalance``, issue 25)."""

from __future__ import annotations

from autotune import load_cluster, load_model
from autotune.planning.candidate import Candidate
from autotune.planning.rebalance import SUFFIX, move_layer, rebalance
from autotune.planning.space import SearchSpace
from autotune.simulator import Simulator
from autotune.specs import ParallelConfig, PipelineConfig, StageConfig

CLUSTER = load_cluster("mixed-a100-v100")
MODEL = load_model("gpt2-xl", global_batch_size=64)  # 48 layers


def _even_split() -> ParallelConfig:
    """Two pipelines, each a V100 stage before an A100 stage, the layers split evenly (24 / 24): the V100
    stage is the bottleneck."""
    pipes = tuple(
        PipelineConfig(16, (StageConfig((f"v100:{i}",), 24, False), StageConfig((f"a100:{i}",), 24, False)))
        for i in range(2)
    )
    return ParallelConfig(2, pipes, "1f1b")


def test_layers_move_from_the_simulated_bottleneck_while_the_time_falls():
    space, sim = SearchSpace(CLUSTER, MODEL), Simulator(CLUSTER, MODEL)
    config = _even_split()
    start = sim.evaluate(config)
    assert start.ok and start.stage_busy_s[0] > start.stage_busy_s[1]
    out = rebalance(space, sim, Candidate(config, start.iteration_time_s, "test"), max_simulations=40)
    assert out.family == f"test+{SUFFIX}"
    layers = [[s.layers for s in p.stages] for p in out.config.pipelines]
    assert layers[0] == layers[1] and layers[0][0] < 24 and sum(layers[0]) == 48
    m = sim.evaluate(out.config)
    assert m.iteration_time_s == out.estimate_s < 0.9 * start.iteration_time_s
    # one more layer either way is no faster: the split is a local optimum of the simulator
    for src, dst in ((0, 1), (1, 0)):
        other = move_layer(out.config, src, dst)
        assert other is None or sim.evaluate(other).iteration_time_s >= out.estimate_s


def test_the_step_cap_holds_and_a_balanced_or_one_stage_plan_is_returned_as_it_is():
    space, sim = SearchSpace(CLUSTER, MODEL), Simulator(CLUSTER, MODEL)
    config = _even_split()
    one = rebalance(space, sim, Candidate(config, sim.evaluate(config).iteration_time_s, "test"), max_simulations=1)
    assert [s.layers for s in one.config.pipelines[0].stages] == [23, 25]
    again = rebalance(space, sim, one, max_simulations=0)
    assert again is one
    single = ParallelConfig(2, (PipelineConfig(32, (StageConfig(("a100:0",), 48, False),)),), "1f1b")
    cand = Candidate(single, sim.evaluate(single).iteration_time_s, "test")
    assert rebalance(space, sim, cand) is cand


def test_move_layer_keeps_every_pipeline_alike_and_refuses_to_empty_a_stage():
    config = _even_split()
    moved = move_layer(config, 1, 0)
    assert [[s.layers for s in p.stages] for p in moved.pipelines] == [[25, 23], [25, 23]]
    thin = ParallelConfig(
        2,
        (PipelineConfig(32, (StageConfig(("v100:0",), 1, False), StageConfig(("a100:0",), 47, False))),),
        "1f1b",
    )
    assert move_layer(thin, 0, 1) is None


def test_the_planners_last_step_adds_the_corrected_plan_ahead_of_its_source():
    from autotune.planning.refine import refine

    # without Zorse's stages and RoundPipe (whose families would bring faster plans of their own to correct first)
    space = SearchSpace(CLUSTER, MODEL, restrict={"stage_ranks": [1], "roundpipe": [False]})
    sim = Simulator(CLUSTER, MODEL)
    config = _even_split()
    out = refine(space, sim, [Candidate(config, sim.evaluate(config).iteration_time_s, "test")])
    families = [c.family for c in out]
    assert f"test+{SUFFIX}" in families and "test" in families
    assert families.index(f"test+{SUFFIX}") < families.index("test")
