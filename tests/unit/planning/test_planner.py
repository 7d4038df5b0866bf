"""The structured planner (``--method dp``): its composed times against the simulator, its layer and
batch splits on hand-computed cases, memory as a constraint, and the budget rule."""

from __future__ import annotations

import pytest

from autotune import load_cluster, load_model
from autotune.loading import cluster_from_dict
from autotune.planning.budget import BudgetedEvaluator
from autotune.planning.planner import Planner, plan_candidates
from autotune.planning.space import SearchSpace
from autotune.search.agents import run_exhaustive
from autotune.search.agents.dp import run_dp
from autotune.simulator import Simulator


def _space(cluster, model, **kw):
    return SearchSpace(cluster, model, **kw)


@pytest.mark.slow
def test_composed_time_matches_the_simulator_on_a_mixed_cluster():
    cluster, model = load_cluster("mixed-a100-v100"), load_model("gpt2-xl")
    space = _space(cluster, model)
    sim = Simulator(cluster, model)
    cands = Planner(space, sim).plan(10)
    assert len(cands) == 10
    for c in cands:
        m = sim.evaluate(c.config)
        assert m.ok, m.error
        # the composition (1F1B makespan formula + ring all-reduce + optimizer) vs the full schedule
        assert c.estimate_s == pytest.approx(m.iteration_time_s, rel=0.05)


def test_split_batch_finishes_unequal_replicas_together():
    # replica A: 1 s per micro-batch after a 3 s fill, replica B: 2 s after 4 s; 10 micro-batches.
    # A with a micro-batches ends at (a - 1) + 3, B with b at 2 (b - 1) + 4: a = 7, b = 3 ends both at 9 / 8;
    # a = 6, b = 4 ends at 8 / 10. The best split is 7 / 3 (finish 9).
    shares = Planner.split_batch([(1, 1.0, 3.0), (1, 2.0, 4.0)], 10)
    assert shares == [7, 3]
    assert Planner.finish_time_s([(1, 1.0, 3.0), (1, 2.0, 4.0)], 10) == pytest.approx(9.0, abs=1e-6)
    assert Planner.split_batch([(3, 1.0, 1.0)], 2) is None  # more replicas than micro-batches


def test_partition_gives_a_faster_stage_more_layers():
    # one fast (A100) and one slow (V100) GPU; 48 layers of GPT-2 XL
    cluster = cluster_from_dict(
        {
            "nodes": [{"name": "a", "gpu": "A100-80GB", "count": 1}, {"name": "v", "gpu": "V100-32GB", "count": 1}],
            "network": {"bandwidth_GBps": 12.5},
        },
        source="test",
    )
    model = load_model("gpt2-xl", 64)
    space = _space(cluster, model)
    sim = Simulator(cluster, model)
    planner = Planner(space, sim)
    a = next(i for i, k in enumerate(planner.kinds) if k.node_class == "a")
    v = next(i for i, k in enumerate(planner.kinds) if k.node_class == "v")
    t = planner.partition((a, v), 1)
    assert t is not None and sum(t.layers) == 48
    assert t.layers[0] > 2 * t.layers[1]  # the A100 is ~2.5x the V100 (312 vs 125 TFLOP/s)
    # the split is the min-max one: moving one layer either way does not lower the slowest stage
    # (a GPU stage's time includes its blocking send: the activation forward, its gradient back)
    send = sim.costs.p2p_time_s(("a:0",), ("v:0",), 1)

    def slowest(layers):
        return max(
            sim.costs.stage_estimate(("a:0",), layers[0], False, True, False, 1, 2).forward_s
            + sim.costs.stage_estimate(("a:0",), layers[0], False, True, False, 1, 2).backward_s
            + send,
            sim.costs.stage_estimate(("v:0",), layers[1], False, False, True, 1, 1).forward_s
            + sim.costs.stage_estimate(("v:0",), layers[1], False, False, True, 1, 1).backward_s
            + send,
        )

    best = slowest(t.layers)
    assert best == pytest.approx(t.bottleneck_s)
    for shift in (-1, 1):
        assert slowest((t.layers[0] + shift, t.layers[1] - shift)) >= best - 1e-12


def test_recompute_only_where_memory_needs_it():
    # llama2-7b on 4 A100-40GB + 4 T4 (16 GB): the T4 stages cannot hold their layers' activations
    cluster = cluster_from_dict(
        {
            "nodes": [
                {"name": "a", "gpu": "A100-40GB", "count": 4, "intra_node": {"bandwidth_GBps": 300}},
                {"name": "t", "gpu": "T4", "count": 4, "intra_node": {"bandwidth_GBps": 16}},
            ],
            "network": {"bandwidth_GBps": 12.5},
        },
        source="test",
    )
    model = load_model("llama2-7b", 64)
    space = _space(cluster, model)
    sim = Simulator(cluster, model)
    cands = Planner(space, sim).plan(40)
    assert cands, "a plan fits (the uniform grid finds one)"
    # the slow T4s are worth using: the best plan puts them in a pipeline beside the A100s
    assert any(d.startswith("t:") for d in cands[0].config.devices)
    for c in cands[:6]:
        m = sim.evaluate(c.config)
        assert m.ok, m.error
    # recomputation per stage, only where needed: some plan recomputes the early stages of a pipeline
    # (they hold the most micro-batches in flight under 1F1B) and not the later ones
    assert any(len({st.recompute for st in p.stages}) == 2 for c in cands for p in c.config.pipelines)


@pytest.mark.slow
def test_dp_reaches_the_exhaustive_optimum_of_a_tiny_space_and_respects_the_budget():
    cluster, model = load_cluster("cpu-hetero"), load_model("tiny")
    # a space small enough to enumerate: no ZeRO / offload (the planner's plans here use neither)
    space = _space(cluster, model, restrict=dict(schedule=["1f1b"], recompute=["none"], zero=[0], offload=["none"]))
    ex = BudgetedEvaluator(Simulator(cluster, model), space, 10**6)
    run_exhaustive(space, ex)
    ev = BudgetedEvaluator(Simulator(cluster, model), space, 5)
    run_dp(space, ev)
    assert ev.used == 5
    # dp's plans may lie outside the encoding (any layer split), so it may beat the encoding's optimum
    assert ev.best.score >= 0.97 * ex.best.score


def test_plan_candidates_without_a_simulator_uses_the_datasheet_model():
    cluster, model = load_cluster("cpu-2"), load_model("tiny")
    cands = plan_candidates(_space(cluster, model), evaluator=None, limit=3)
    assert cands and all(c.estimate_s > 0 for c in cands)


def _standalone_nodes(n: int):
    """``n`` standalone nodes that are all different (GPU type or count): ``n`` node classes."""
    gpus = ["A100-80GB", "V100-32GB", "T4", "RTX-4090", "L4", "A10G"]
    nodes = [{"name": f"n{i}", "gpu": gpus[i % len(gpus)], "count": 2 if i < len(gpus) else 4} for i in range(n)]
    return cluster_from_dict({"nodes": nodes, "network": {"bandwidth_GBps": 1.25}}, source="test")


@pytest.mark.slow
def test_many_node_classes_are_planned_by_a_beam_close_to_the_exhaustive_plan(monkeypatch):
    """Per-class plans multiply (options + 1) per node class: 15 standalone nodes made 5^15 combinations
    and dp (the default start of optuna and rl) never returned. Past MAX_COMBINATIONS a beam over the
    classes keeps the best partial plans; on 6 classes it must come close to the exhaustive best."""
    from autotune.planning import planner as planner_mod

    cluster, model = _standalone_nodes(6), load_model("gpt2-small", 64)
    space = _space(cluster, model)
    sim = Simulator(cluster, model)
    monkeypatch.setattr(planner_mod, "MAX_MBS_CHOICES", 1)
    monkeypatch.setattr(planner_mod, "OPTIONS_PER_CLASS", 2)  # 3^6 = 729 combinations exhaustively
    exhaustive = Planner(space, sim)
    best_exhaustive = exhaustive.plan(1)[0].estimate_s
    monkeypatch.setattr(planner_mod, "MAX_COMBINATIONS", 50)
    monkeypatch.setattr(planner_mod, "BEAM_WIDTH", 8)
    beam = Planner(space, sim)
    best_beam = beam.plan(1)[0].estimate_s
    assert beam.composed < exhaustive.composed / 3
    assert best_beam <= 1.02 * best_exhaustive


@pytest.mark.slow
@pytest.mark.timeout(600)  # before the beam this never returned
def test_fifteen_node_classes_plan_with_a_bounded_number_of_compositions():
    from autotune.planning import planner as planner_mod

    cluster, model = _standalone_nodes(15), load_model("gpt2-small", 64)
    p = Planner(_space(cluster, model), Simulator(cluster, model))
    cands = p.plan(8)
    assert cands and all(c.config is not None for c in cands)
    per_mbs = 15 * (planner_mod.BEAM_WIDTH + 1) * planner_mod.OPTIONS_PER_CLASS + 2**15
    assert p.composed <= planner_mod.MAX_MBS_CHOICES * per_mbs


def test_sharded_data_parallel_plans_are_offered_where_zero_beats_pipelines():
    """On one node of 8 L4 (24 GB) a 7B model fits as data-parallel replicas only with its state sharded
    (ZeRO) or offloaded, which the pipeline families never compose while a pipeline fits; the sharded
    family offers such plans, timed by the simulator, each valid and fitting, ranked among the rest."""
    cluster = cluster_from_dict(
        {"nodes": [{"name": "l4", "gpu": "L4", "count": 8}], "network": {"bandwidth_GBps": 6.25}}, source="test"
    )
    model = load_model("llama2-7b", 32)
    space, sim = _space(cluster, model), Simulator(cluster, model)
    planner = Planner(space, sim)
    from autotune.planning import sharded_dp

    kinds = [(k.node_class, k.tp, k.groups, k.speed_tflops) for k in planner.kinds]
    sharded = sharded_dp.candidates(space, sim, kinds)
    assert sharded and all(c.family == "sharded-dp" for c in sharded)
    for c in sharded:
        assert c.config.zero > 0 and all(len(p.stages) == 1 for p in c.config.pipelines)
        m = sim.evaluate(c.config)
        assert m.ok and c.estimate_s == pytest.approx(m.iteration_time_s)
    ranked = planner.plan(64)
    assert {c.config for c in sharded} <= {c.config for c in ranked}
    assert [c.estimate_s for c in ranked] == sorted(c.estimate_s for c in ranked)
