"""Memory first: plans the memory model says do not fit cost no budget, every method starts from the
most memory-frugal plan among others, and on a memory-tight cluster every method returns a plan that
fits (issue 16)."""

from __future__ import annotations

import numpy as np
import pytest

from autotune.loading import cluster_from_dict, load_model
from autotune.planning.budget import PRUNED, BudgetedEvaluator
from autotune.planning.memory_first import frugal_candidates, frugal_params, memory_repairs
from autotune.planning.space import SearchSpace
from autotune.search.api import tune
from autotune.search.tracking import config_key
from autotune.simulator import Simulator

#: 4 T4 (16 GB) + 4 L4 (24 GB) training Llama-2-7B: only tensor parallel 4 in both nodes, two stages,
#: fits (the weight state alone is 105 GiB of the 140 usable); the uniform grid has no plan that fits
TIGHT = dict(
    nodes=[
        dict(name="t4", gpu="T4", count=4, intra_node=dict(bandwidth_GBps=12, latency_us=5)),
        dict(name="l4", gpu="L4", count=4, intra_node=dict(bandwidth_GBps=16, latency_us=5)),
    ],
    network=dict(bandwidth_GBps=3.125, latency_us=20),
)


def _tight():
    cluster = cluster_from_dict(TIGHT, source="test", default_name="tight-t4-l4")
    model = load_model("llama2-7b", 32)
    return cluster, model


#: roundpipe plans keep the state in host memory and fit here (issue 11): the memory-tight space is the
#: pipeline plans'
PIPELINES = {"roundpipe": [False]}


def _unsharded(cluster, model, **restrict) -> SearchSpace:
    """The pipeline plans without ZeRO sharding or offload (issue 9's dimensions, with which random plans
    fit here too): the tight case the memory screen and the frugal plan are checked on."""
    return SearchSpace(cluster, model, restrict={"zero": [0], "offload": ["none"], **PIPELINES, **restrict})


def test_the_tight_cluster_is_tight():
    """The control: without ZeRO sharding or offload (issue 9's dimensions, which make more plans fit),
    random plans of the space and the uniform grid do not fit; without the memory model's screen a
    search spends its budget on out-of-memory plans."""
    cluster, model = _tight()
    # one rank per stage: the draws this control was sized on (most stage_ranks draws do not decode here)
    space, sim = _unsharded(cluster, model, stage_ranks=[1]), Simulator(cluster, model)
    rng = np.random.default_rng(0)
    configs = [d.config for d in (space.decode(space.sample(rng)) for _ in range(600)) if d.ok]
    fits = [c for c in configs if sim.evaluate(c).ok]
    assert len(configs) > 100 and len(fits) <= len(configs) // 50  # (1 of 121 with seed 0)
    # the uniform grid fits nothing without sequence parallelism (with it, Megatron's tp 4 x pp 2 plan
    # with full recomputation fits: the checkpointed stage inputs are split 4 ways, issue 13)
    assert not any(
        sim.evaluate(c).ok
        for c in space.uniform_plans()
        if not any(s.sequence_parallel for p in c.pipelines for s in p.stages)
    )
    blind = BudgetedEvaluator(sim, space, 10, memory_first=False)
    for c in [c for c in configs if c not in fits][:10]:
        blind.evaluate(c)
    assert blind.used == 10 and blind.best.score == 0.0 and not blind.screened


def test_memory_screen_answers_oom_without_budget_and_caps_the_search():
    cluster, model = _tight()
    space, sim = _unsharded(cluster, model), Simulator(cluster, model)
    rng = np.random.default_rng(1)
    configs = [d.config for d in (space.decode(space.sample(rng)) for _ in range(300)) if d.ok]
    b = BudgetedEvaluator(sim, space, 2, max_screened=5)
    m = b.evaluate(configs[0])
    assert m.oom and m.status == PRUNED and not m.ok and m.score() == 0.0
    assert "screened out by the memory model" in m.error and m.peak_memory_GiB
    assert b.used == 0 and b.memory_screened == 1 and b.remaining == 2
    assert b.evaluate(configs[0]) is m and b.memory_screened == 1  # a repeat: cached, not counted again
    for c in configs[1:]:
        if b.exhausted:
            break
        b.evaluate(c)
    assert b.exhausted and len(b.screened) == 5 and b.used == 0  # the cap ends a search where nothing fits
    # the memory model is the simulator's own: a plan that fits is evaluated and spends the budget
    fitting = space.decode(frugal_params(space, sim)).config
    b2 = BudgetedEvaluator(sim, space, 2)
    assert b2.evaluate(fitting).ok and b2.used == 1


def test_the_frugal_plan_is_the_least_full_candidate_and_fits():
    cluster, model = _tight()
    space, sim = _unsharded(cluster, model), Simulator(cluster, model)
    params = frugal_params(space, sim)
    config = space.decode(params).config
    use = sim.memory_use(sim.memory_estimate(config))
    assert use <= 1.0 and sim.evaluate(config).ok
    assert params["recompute"] == "all" and params["mbs"] == 1
    assert all(params[f"tp.{c.name}"] == 4 for c in space.node_classes)  # the widest tensor parallelism
    uses = [sim.memory_use(sim.memory_estimate(d.config)) for d in map(space.decode, frugal_candidates(space)) if d.ok]
    assert use == pytest.approx(min(uses))
    # repairs head toward it: each step needs no more memory than the one before
    start = dict(space.heuristic_params()[0], recompute="none", mbs=space._dims["mbs"].choices[-1])
    assert sim.memory_check(space.decode(start).config) is not None  # the start does not fit
    steps = [space.decode(p) for p in memory_repairs(space, start)]
    assert len(steps) >= 3 and any(d.ok and sim.memory_check(d.config) is None for d in steps)
    # wider tensor parallelism takes the deepest pipeline that still decodes (8 stages of tp 1 -> 4 of 2)
    assert all(d.ok for d in steps)


@pytest.mark.parametrize("method", ["optuna", "rl", "random"])
@pytest.mark.parametrize("start", ["heuristic", "dp"])
def test_every_method_returns_a_plan_that_fits_on_a_memory_tight_cluster(method, start):
    if method == "random" and start == "dp":
        pytest.skip("random has no --start")
    cluster, model = _tight()
    paid = []
    result = tune(
        cluster,
        model,
        method=method,
        budget=10,
        restrict=PIPELINES,
        track=False,
        storage="memory",
        start=start,
        on_evaluation=paid.append,
    )
    assert result.best_measurement.ok and result.best_measurement.tokens_per_s > 0
    assert result.evaluations <= 10
    # optuna and random propose plans that do not fit and the memory model screens them; rl chooses among the
    # planner's candidates, which fit by construction
    assert result.memory_screened > 0 if method != "rl" else result.memory_screened == 0
    # no evaluation of the budget went to a plan the memory model rejects
    paid = [ev for ev in paid if ev.measurement.status != PRUNED]
    assert paid and not any(ev.measurement.oom for ev in paid)


#: the issue's cluster: 4 T4 + 4 L4 + 8 A10G training Llama-3-8B (global batch 128), where optuna, rl
#: and random at budget 60 used to end with "no evaluated plan runs (oom ...)"
CLOUD = dict(
    nodes=[
        dict(name="t4", gpu="T4", count=4, intra_node=dict(bandwidth_GBps=12, latency_us=5)),
        dict(name="l4", gpu="L4", count=4, intra_node=dict(bandwidth_GBps=16, latency_us=5)),
        dict(name="a10g", gpu="A10G", count=4, repeat=2, intra_node=dict(bandwidth_GBps=16, latency_us=5)),
    ],
    network=dict(bandwidth_GBps=3.125, latency_us=20),
)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["optuna", "rl", "random"])
def test_the_issues_cloud_cluster_gets_a_plan_that_fits_at_budget_10(method):
    cluster = cluster_from_dict(CLOUD, source="test", default_name="cloud-t4-l4-a10g")
    model = load_model("llama3-8b", 128)
    result = tune(cluster, model, method=method, budget=10, track=False, storage="memory", start="heuristic")
    assert result.best_measurement.ok and result.best_measurement.tokens_per_s > 0
    assert result.evaluations <= 10 and result.memory_screened > 0


def test_optuna_learns_the_memory_constraint_and_keeps_one_budget():
    from autotune.search.agents import shared_study, tpe

    cluster, model = _tight()
    space, sim = SearchSpace(cluster, model, restrict=PIPELINES), Simulator(cluster, model)
    b = BudgetedEvaluator(sim, space, 8)
    shared = shared_study.open_study(space, "tight", "memory", 0)
    tpe.run_optuna(space, b, 0, study=shared)
    assert b.used == len(shared_study.evaluated_trials(shared)) == 8 and b.best.measurement.ok
    assert b.memory_screened > 0
    # TPE's copy holds the screened-out proposals as infeasible trials, the evaluated ones as feasible
    trials = [t for t in shared.local.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    infeasible = [t for t in trials if t.constraints.get("memory", 0.0) > 0]
    feasible = [t for t in trials if t.value and t.value > 0]
    assert infeasible and all(t.value == 0.0 for t in infeasible)
    assert feasible and all(t.constraints["memory"] <= 0 for t in feasible)
    # the storage never saw a screened-out plan: its evaluated trials are the budget's plans
    assert {t.user_attrs["config_key"] for t in shared_study.evaluated_trials(shared)} == {
        config_key(ev.config) for ev in b.history
    }


@pytest.mark.slow
def test_a_resumed_search_on_a_tight_cluster_reaches_exactly_its_budget(tmp_path):
    """Screened-out plans are not budget: a second run continues the same study and MLflow parent and
    ends with exactly the new budget of evaluated plans (the memory model answers the old ones again)."""
    from mlflow.tracking import MlflowClient

    cluster, model = _tight()
    uri, storage = f"sqlite:///{tmp_path}/mlflow.db", f"journal:{tmp_path}/optuna.journal"
    first = tune(
        cluster,
        model,
        method="optuna",
        budget=4,
        restrict=PIPELINES,
        tracking_uri=uri,
        storage=storage,
        start="heuristic",
    )
    second = tune(
        cluster,
        model,
        method="optuna",
        budget=7,
        restrict=PIPELINES,
        tracking_uri=uri,
        storage=storage,
        start="heuristic",
    )
    assert first.run_id == second.run_id and second.evaluations == 7 and second.best_measurement.ok
    client = MlflowClient(uri)
    children = client.search_runs(
        [client.get_run(second.run_id).info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{second.run_id}'"
    )
    assert len(children) == 7 and all(c.data.tags["status"] != "oom" for c in children)


def test_an_moe_space_has_a_memory_frugal_plan_and_it_is_one_the_search_would_run() -> None:
    """The frugal candidates of an MoE space named no expert-parallel degree, expert subset or sync period,
    so none decoded: dp and rl then said "no plan fits" where a deep pipeline fits (issue 46, case 3). With
    the search's refusal (here: no ZeRO and no tensor parallelism, as the runner's limits were for MoE), the
    frugal plan is one it does not refuse."""
    from autotune import load_cluster, load_model
    from autotune.planning.memory_first import frugal_params
    from autotune.planning.space import SearchSpace
    from autotune.simulator import Simulator

    cluster, model = load_cluster("mixed-consumer-16"), load_model("mixtral-8x7b")
    space, sim = SearchSpace(cluster, model), Simulator(cluster, model)
    params = frugal_params(space, sim)
    assert params is not None and space.decode(params).ok

    def refusal(config):
        if config.zero or any(s.tp > 1 for p in config.pipelines for s in p.stages):
            return "no ZeRO or tensor parallelism with MoE"
        return None

    plain = space.decode(frugal_params(space, sim, refusal)).config
    assert refusal(plain) is None
