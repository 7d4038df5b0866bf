"""Closing the loop (``--backend real``): real runs refit the simulator, the corrected simulator
screens out plans before they are run, screened-out plans spend no budget, MLflow records it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.calibration.online import Corrections, apply_corrections, default_profile
from autotune.loading import load_cluster, load_model
from autotune.planning.budget import PRUNED, BudgetedEvaluator
from autotune.planning.space import SearchSpace
from autotune.profile import CalibrationProfile
from autotune.search.agents import run_random
from autotune.search.screen import CalibrationScreen
from autotune.search.tracking import config_key
from autotune.simulator import Simulator
from autotune.specs import Measurement

CLUSTER, MODEL = "mixed-consumer-16", "gpt2-xl"
#: the corrections are fitted to pipeline plans' terms; this cluster's GPU nodes also admit roundpipe plans
PIPELINE_PLANS = {"roundpipe": [False]}


class Recording:
    """The evaluator standing in for the real runs (the datasheet simulator), remembering the plans it ran
    (``calls``, each once, in order) and every run (``runs``: a plan far from its prediction runs again)."""

    def __init__(self, inner) -> None:
        self.inner, self.cluster, self.model = inner, inner.cluster, inner.model
        self.calls, self.runs = [], []

    def evaluate(self, config):
        self.runs.append(config)
        if config not in self.calls:
            self.calls.append(config)
        return self.inner.evaluate(config)


def wrong_profile(cluster):
    """The datasheet profile made deliberately wrong: compute 3x too slow, 2 GiB more memory per rank."""
    types = sorted({n.device.name for n in cluster.nodes})
    return apply_corrections(
        default_profile(cluster),
        cluster,
        Corrections(compute=tuple((t, 3.0) for t in types), memory_GiB=tuple((t, 2.0) for t in types)),
    )


#: the random draws these tests were written for: the space before the ZeRO / offload dimensions
NO_ZERO = {"zero": [0], "offload": ["none"]}


def test_screen_prunes_oom_and_clearly_worse_plans_without_spending_budget():
    cluster, model = load_cluster(CLUSTER), load_model(MODEL)
    truth = Simulator(cluster, model)
    real = Recording(truth)
    screen = CalibrationScreen(real, Simulator(cluster, model, wrong_profile(cluster)))
    space = SearchSpace(cluster, model, restrict=dict(PIPELINE_PLANS, **NO_ZERO))
    order = []
    budget = 12
    b = BudgetedEvaluator(screen, space, budget, [order.append], screen=screen.screen)
    memory_check, ok_runs_at = b.memory_check, {}

    def recording_check(config):  # remember how many real runs had calibrated the memory model
        m = memory_check(config)
        if m is not None:
            ok_runs_at[config] = sum(ev.measurement.ok for ev in b.history)
        return m

    b.memory_check = recording_check
    run_random(space, b, seed=0)

    assert b.used == budget == len(real.calls) == len(screen.real_runs)
    assert [ev.config for ev in b.history] == real.calls  # the history holds exactly the real runs
    # the 3x-wrong profile's first predictions are far off: those plans ran twice (equal runs: no third)
    assert len(real.runs) > len(real.calls) and all(len(r.runs_s) <= 2 for r in screen.reports)
    assert b.screened and all(ev.measurement.status == PRUNED and ev.score == 0.0 for ev in b.screened)
    assert not {ev.config for ev in b.screened} & set(real.calls)
    # memory first: the memory model answers from the first plan on (oom, no real run); nothing is
    # screened for speed before two real runs finished (status ok) and fitted the corrections
    first_pruned = next(i for i, ev in enumerate(order) if ev.measurement.status == PRUNED and not ev.measurement.oom)
    assert sum(ev.measurement.ok for ev in order[:first_pruned]) >= 2
    assert len(screen.calibrator.observations) == sum(ev.measurement.ok for ev in b.history)
    # the calibrator learnt the deliberate error: prediction error before each run falls
    errors = [screen.errors[c].time_error for c in real.calls if c in screen.errors]
    assert errors[0] > 1.5, errors
    # ... for every device type once a real run has used it (a run on a type not yet run is predicted
    # with the wrong profile's 3x, and its plan is never screened out for speed)
    seen, checked = set(), 0
    for c in real.calls:
        types = {cluster.device(d).name for d in c.devices}
        if c in screen.errors and types <= seen:
            assert screen.errors[c].time_error < 0.1, (c.describe(), screen.errors[c])
            checked += 1
        if truth.evaluate(c).ok:
            seen |= types
    assert checked >= budget // 2
    # pruned plans are truly out of memory or truly far below the best real run (both kinds occur)
    best = b.best.score
    kinds = set()
    for ev in b.screened:
        true = truth.evaluate(ev.config)
        if ev.measurement.oom:
            assert "screened out by the memory model" in ev.measurement.error
            # before the corrections the memory model is the deliberately wrong one (+2 GiB a rank)
            if ok_runs_at[ev.config] >= 2:
                assert true.oom, ev.config.describe()
            kinds.add("oom")
        else:
            assert true.ok and true.tokens_per_s < 0.6 * best, (ev.measurement.error, true.tokens_per_s, best)
            kinds.add("slow")
    assert kinds == {"oom", "slow"}
    # a repeat of a pruned plan is a cache hit: no real run, no new screening
    n_screened = len(b.screened)
    assert b.evaluate(b.screened[0].config).status == PRUNED
    assert len(b.screened) == n_screened and len(real.calls) == budget


def test_plans_the_real_runner_cannot_run_are_invalid_behind_the_screen_too():
    """``--backend real`` wraps the real evaluator in the screen: its ``check`` must still answer first,
    so a plan the runner refuses (here: 1F1B with fewer micro-batches than stages) spends no real run."""
    cluster, model = load_cluster("cpu-hetero"), load_model("small")

    class Checking(Recording):
        def check(self, config):
            if config.schedule == "1f1b" and any(p.num_microbatches < len(p.stages) for p in config.pipelines):
                return "1f1b needs at least as many micro-batches as stages"
            return None

    real = Checking(Simulator(cluster, model))
    screen = CalibrationScreen(real, Simulator(cluster, model))
    b = BudgetedEvaluator(
        screen, SearchSpace(cluster, model, restrict=dict(NO_ZERO, stage_ranks=[1])), 15, screen=screen.screen
    )
    run_random(b.space, b, seed=0)
    assert b.used == 15 and b.invalid > 0
    assert not [c for c in real.calls if real.check(c)], "a plan the runner refuses was run"


def test_screened_out_plans_are_capped_so_no_search_loops_forever():
    cluster, model = load_cluster("cpu-hetero"), load_model("small")
    real = Recording(Simulator(cluster, model))
    space = SearchSpace(cluster, model)

    def prune_all(config, best):
        return Measurement(tokens_per_s=1.0, iteration_time_s=1.0, oom=False, status=PRUNED, error="all")

    b = BudgetedEvaluator(real, space, 3, screen=prune_all, max_screened=7)
    run_random(space, b, seed=0)
    assert b.exhausted and len(b.screened) == 7 and b.used == 0 and real.calls == []


def test_tune_real_backend_closes_the_loop_and_records_it(tmp_path):
    """tune(backend="real") with a stand-in evaluator: budget = real runs, MLflow holds the pruned
    children, the error per real run, the corrections and a loadable corrected profile."""
    from mlflow.tracking import MlflowClient

    from autotune.search.api import tune

    cluster, model = load_cluster(CLUSTER), load_model(MODEL)
    real = Recording(Simulator(cluster, model))
    profile_path = tmp_path / "wrong.json"
    wrong_profile(cluster).save(profile_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    budget = 10
    result = tune(
        cluster,
        model,
        method="optuna",
        budget=budget,
        backend="real",
        evaluator=real,
        profile=profile_path,
        tracking_uri=uri,
        storage=f"sqlite:///{tmp_path}/optuna.db",
        restrict=PIPELINE_PLANS,
    )
    assert result.evaluations == budget == len(real.calls) and result.screened > 0
    client = MlflowClient(uri)
    parent = client.get_run(result.run_id)
    pruned_count = result.screened - result.memory_screened  # by the calibration screen (children)
    assert parent.data.metrics["pruned_plans"] == pruned_count
    assert parent.data.metrics["memory_screened"] == result.memory_screened
    assert parent.data.metrics["evaluations"] == budget
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{result.run_id}'", max_results=1000
    )
    pruned = [c for c in children if c.data.tags.get("autotune.pruned") == "true"]
    assert len(pruned) == pruned_count
    real_children = {c.data.tags["autotune.config_key"] for c in children if "autotune.pruned" not in c.data.tags}
    assert real_children == {config_key(c) for c in real.calls}
    history = client.get_metric_history(result.run_id, "calibration_time_error")
    assert history and all(1 <= h.step <= budget for h in history)
    assert sorted(history, key=lambda h: h.step)[0].value > 0.5  # the wrong profile, before any correction
    art = Path(client.download_artifacts(result.run_id, "calibrated_profile.json", str(tmp_path)))
    prof = CalibrationProfile.load(art)
    assert "online corrections" in prof.notes
    doc = json.loads(
        Path(client.download_artifacts(result.run_id, "calibration_corrections.json", str(tmp_path))).read_text()
    )
    assert doc["real_runs"] == [config_key(c) for c in real.calls] and doc["pruned_plans"] == pruned_count
    # compute corrected back from 3x: the saved profile predicts the truth within a few percent
    fixed = Simulator(cluster, model, prof)
    ok = [c for c in real.calls if real.inner.evaluate(c).ok]
    for c in ok:
        t, p = real.inner.evaluate(c).iteration_time_s, fixed.evaluate(c).iteration_time_s
        assert abs(p - t) / t < 0.1


@pytest.mark.slow
@pytest.mark.distributed
def test_real_runner_search_calibrates_from_exactly_the_real_runs(tmp_path):
    """Real profiled runs (torch.distributed, gloo) of the tiny model on two CPU ranks."""
    from mlflow.tracking import MlflowClient

    from autotune.search.api import tune
    from runner import RealEvaluator

    cluster, model = load_cluster("cpu-2"), load_model("tiny")
    real = Recording(RealEvaluator(cluster, model, steps=2, warmup=1, timeout_s=120))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    result = tune(cluster, model, method="random", budget=3, backend="real", evaluator=real, tracking_uri=uri)
    assert result.evaluations == 3 == len(real.calls)
    client = MlflowClient(uri)
    doc = json.loads(
        Path(client.download_artifacts(result.run_id, "calibration_corrections.json", str(tmp_path))).read_text()
    )
    assert doc["real_runs"] == [config_key(c) for c in real.calls]
    children = client.search_runs(
        [client.get_run(result.run_id).info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{result.run_id}'",
        max_results=100,
    )
    ok_real = [c for c in children if c.data.tags.get("status") == "ok"]
    assert doc["fitted_from_runs"] == len(ok_real) >= 1
    assert client.get_run(result.run_id).data.metrics["pruned_plans"] == result.screened
    prof = CalibrationProfile.load(
        Path(client.download_artifacts(result.run_id, "calibrated_profile.json", str(tmp_path)))
    )
    assert prof.devices and "online corrections" in prof.notes


def test_cli_table_says_how_many_plans_were_screened_out():
    from rich.console import Console

    from autotune.commands.search import _print_result
    from autotune.search.result import TuneResult

    cluster, model = load_cluster(CLUSTER), load_model(MODEL)
    sim = Simulator(cluster, model)
    space = SearchSpace(cluster, model)
    config = space.decode(space.heuristic_params()[0]).config
    result = TuneResult(config, sim.evaluate(config), 5, "random", cluster.name, model.name, 5, 0, "real", screened=7)
    assert TuneResult.from_json(result.to_json()).screened == 7
    console = Console(record=True, width=200)
    _print_result(console, result)
    text = console.export_text()
    assert "screened out" in text and "7 plans" in text
