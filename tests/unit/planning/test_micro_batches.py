"""The planner's micro-batch correction (``autotune.planning.micro_batches``, issue 25)."""

from __future__ import annotations

from autotune import load_cluster, load_model
from autotune.planning import micro_batches
from autotune.planning.candidate import Candidate
from autotune.planning.space import SearchSpace
from autotune.simulator import Simulator
from autotune.specs import ParallelConfig, PipelineConfig, StageConfig

CLUSTER = load_cluster("mixed-a100-v100")
MODEL = load_model("gpt2-xl", global_batch_size=64)


def _plan(mbs: int) -> ParallelConfig:
    pipes = tuple(
        PipelineConfig(32 // mbs, (StageConfig((f"v100:{i}",), 20, False), StageConfig((f"a100:{i}",), 28, False)))
        for i in range(2)
    )
    return ParallelConfig(mbs, pipes, "1f1b")


def test_the_fastest_other_micro_batch_size_of_the_same_plan_when_it_is_faster():
    space, sim = SearchSpace(CLUSTER, MODEL), Simulator(CLUSTER, MODEL)
    config = _plan(1)
    start = sim.evaluate(config).iteration_time_s
    got = micro_batches.variants(space, sim, Candidate(config, start, "test"), 50)
    # every other size of the space, timed directly: the function must return exactly the fastest one that beats it
    times = {}
    for mbs in space._dims["mbs"].choices:
        if mbs != 1 and 32 % mbs == 0:
            m = sim.evaluate(_plan(mbs))
            if m.ok:
                times[mbs] = m.iteration_time_s
    faster = {k: v for k, v in times.items() if v < start}
    assert faster  # micro-batch 1 wastes the GPUs here: the test needs a size that beats it
    best = min(faster, key=faster.get)
    assert len(got) == 1 and got[0].config.micro_batch_size == best
    assert got[0].estimate_s == faster[best] and got[0].family == f"test+mbs{best}"
    assert [[s.layers for s in p.stages] for p in got[0].config.pipelines] == [[20, 28], [20, 28]]
    assert [p.num_microbatches for p in got[0].config.pipelines] == [32 // best] * 2


def test_nothing_when_no_other_size_beats_the_plan_and_the_cap_holds():
    space, sim = SearchSpace(CLUSTER, MODEL), Simulator(CLUSTER, MODEL)
    config = _plan(1)
    fastest = micro_batches.variants(space, sim, Candidate(config, sim.evaluate(config).iteration_time_s, "t"), 50)[0]
    assert micro_batches.variants(space, sim, fastest, 50) == []
    assert micro_batches.variants(space, sim, Candidate(config, 0.0, "t"), 1) == []  # no call left to time one
