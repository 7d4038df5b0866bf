"""MLflow record of searches (one real SQLite store per module; the tests before the re-run tests
see the fixture's first searches): parent + children, artifacts, best
plan read back, methods side by side in one experiment, Optuna resume without duplicated children."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import autotune
from autotune.search.api import tune
from autotune.search.result import TuneResult
from autotune.search.tracking import BEST_TAG, ROLE_TAG, config_key
from autotune.specs import ParallelConfig

CLUSTER, MODEL = "mixed-a100-v100", "gpt2-xl"
EXPERIMENT = f"{CLUSTER}__{MODEL}"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root}/mlflow.db"
    storage = f"sqlite:///{root}/optuna.db"
    optuna_result = tune(CLUSTER, MODEL, method="optuna", budget=12, seed=0, tracking_uri=uri, storage=storage)
    random_result = tune(CLUSTER, MODEL, method="random", budget=6, seed=0, tracking_uri=uri)
    return {"uri": uri, "storage": storage, "root": root, "optuna": optuna_result, "random": random_result}


def _client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _children(client, run_id):
    exp = client.get_run(run_id).info.experiment_id
    return client.search_runs([exp], filter_string=f"tags.mlflow.parentRunId = '{run_id}'", max_results=1000)


def test_one_parent_and_budget_children_with_artifacts(store):
    client = _client(store["uri"])
    result: TuneResult = store["optuna"]
    parent = client.get_run(result.run_id)
    assert parent.data.params["method"] == "optuna" and parent.data.params["budget"] == "12"
    assert parent.data.params["cluster"] == CLUSTER and parent.data.params["backend"] == "sim"
    assert parent.data.tags[ROLE_TAG] == "search" and parent.info.status == "FINISHED"
    children = _children(client, result.run_id)
    assert len(children) == 12 == result.evaluations
    assert len({c.data.tags["autotune.config_key"] for c in children}) == 12
    for child in children:
        assert {"tokens_per_s", "iteration_time_s", "mfu", "bubble_fraction", "oom"} <= set(child.data.metrics)
        assert child.data.tags["status"] in ("ok", "oom", "failed", "timeout")  # never "invalid": those are free
        # the readable shape as params; the encoding (what a resume reloads) in one tag, not 21 params
        assert {"dp", "pp", "tp", "mbs", "layers", "eval_index"} <= set(child.data.params)
        assert not any(k.startswith("x.") for k in child.data.params)
        assert any(k.startswith("x.") for k in json.loads(child.data.tags["autotune.params"]))
    best_child = max(children, key=lambda c: c.data.metrics["tokens_per_s"] * c.data.metrics["ok"])
    assert best_child.data.metrics["tokens_per_s"] == pytest.approx(result.best_measurement.tokens_per_s)
    artifacts = {a.path for a in client.list_artifacts(result.run_id)}
    assert {"best_config.json", "best_timeline.png", "search_progress.png"} <= artifacts
    local = client.download_artifacts(result.run_id, "best_config.json", str(store["root"]))
    doc = json.loads(Path(local).read_text())
    assert doc["measurement"]["tokens_per_s"] == pytest.approx(result.best_measurement.tokens_per_s)
    del doc["measurement"]
    assert ParallelConfig.from_dict(doc) == result.best_config
    assert ParallelConfig.from_json(parent.data.tags[BEST_TAG]) == result.best_config
    history = client.get_metric_history(result.run_id, "best_tokens_per_s")
    assert len(history) == 12 and history[-1].value == pytest.approx(result.best_measurement.tokens_per_s)


def test_the_experiment_opens_on_training_runs_and_describes_itself(store):
    exp = _client(store["uri"]).get_experiment_by_name(EXPERIMENT)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # not the GenAI traces view
    assert "gpt2-xl" in exp.tags["mlflow.note.content"] and "mixed-a100-v100" in exp.tags["mlflow.note.content"]


def test_children_are_finished_whatever_the_plan_did_and_say_it(store):
    client = _client(store["uri"])
    children = _children(client, store["optuna"].run_id) + _children(client, store["random"].run_id)
    assert {c.info.status for c in children} == {"FINISHED"}
    named = {c.info.run_name for c in children}
    assert any(n.startswith("optuna #0001: ") and "tokens/s" in n for n in named), named


def test_an_out_of_memory_plan_is_a_finished_child_that_says_so(store, tmp_path):
    """Out of memory is an answer, not a failure. The simulator's searches answer most such plans
    from the memory model without a child run (``memory_screened``); a real run that runs out of
    memory is logged as a child: FINISHED, tagged ``status=oom``, metric ``ok`` 0."""
    from autotune.planning.budget import Evaluation
    from autotune.search.tracking import SearchTracker
    from autotune.specs import Measurement

    uri = f"sqlite:///{tmp_path}/mlflow.db"  # a store of its own: the module's has no other experiment
    tracker = SearchTracker(uri, "oom-children")
    parent = tracker.start("random, 1 plans, seed 0 (real runs)", params={"method": "random"})
    oom = Measurement.failure("oom", "device a100:0 used 81.2 GiB, more than its 80 GiB", oom=True)
    tracker.log_evaluation(Evaluation(1, store["random"].best_config, oom), {"dp": 1})
    client = _client(uri)
    (child,) = _children(client, parent)
    assert child.info.status == "FINISHED"
    assert child.data.tags["status"] == "oom" and child.data.metrics["ok"] == 0.0 and child.data.metrics["oom"] == 1.0
    assert child.info.run_name.startswith("random #0001: out of memory")


def test_the_parent_has_the_comparison_columns_and_a_readable_name(store):
    result: TuneResult = store["optuna"]
    parent = _client(store["uri"]).get_run(result.run_id)
    assert parent.info.run_name == "optuna, 12 plans, seed 0 (simulator)"
    m = parent.data.metrics
    s = result.summary
    assert m["best_tokens_per_s"] == pytest.approx(result.best_measurement.tokens_per_s)
    assert m["found_at"] == s.found_at >= 1 and m["evaluations"] == 12
    assert m["oom_plans"] == s.oom and m["evaluations_per_s"] > 0
    # the speedup over a fixed uniform yardstick: the grid, or the same sample of it, whatever the budget
    from autotune.search.summary import UNIFORM_BASELINE_PLANS

    assert s.uniform_evaluations == min(UNIFORM_BASELINE_PLANS, s.uniform_grid)
    assert m["speedup_vs_uniform"] == pytest.approx(result.best_measurement.tokens_per_s / s.uniform_best_tokens_per_s)
    assert result.run_url.endswith(
        f"/#/experiments/{parent.info.experiment_id}/runs/{result.run_id}?workflowType=machine_learning"
    )  # opens on model training, not GenAI


def test_the_summary_ranks_the_top_plans(store):
    s = store["optuna"].summary
    scores = [ev.score for ev in s.top]
    assert 1 <= len(scores) <= 5 and scores == sorted(scores, reverse=True)
    assert scores[0] == pytest.approx(store["optuna"].best_measurement.tokens_per_s)
    assert s.top[0].index == s.found_at


def test_methods_share_one_experiment(store):
    client = _client(store["uri"])
    exp = client.get_experiment_by_name(EXPERIMENT)
    parents = client.search_runs([exp.experiment_id], filter_string=f"tags.`{ROLE_TAG}` = 'search'")
    assert {p.data.params["method"] for p in parents} == {"optuna", "random"}


def test_best_config_reads_the_best_plan_of_the_experiment(store):
    expected = max((store["optuna"], store["random"]), key=lambda r: r.best_measurement.tokens_per_s)
    assert autotune.best_config(experiment=EXPERIMENT, tracking_uri=store["uri"]) == expected.best_config
    assert autotune.best_config(tracking_uri=store["uri"]) == expected.best_config  # latest experiment


def test_best_config_names_a_missing_experiment(store):
    with pytest.raises(autotune.SpecError, match="no experiment 'nope'"):
        autotune.best_config(experiment="nope", tracking_uri=store["uri"])


def test_tune_result_round_trips_through_json(store):
    result = store["optuna"]
    again = TuneResult.from_json(result.to_json())
    assert again == result
    assert again.best_curve[-1] == pytest.approx(result.best_measurement.tokens_per_s)


def test_optuna_rerun_continues_the_same_study_and_parent(store):
    import optuna

    first: TuneResult = store["optuna"]
    done = tune(CLUSTER, MODEL, method="optuna", budget=12, seed=0, tracking_uri=store["uri"], storage=store["storage"])
    assert done.run_id == first.run_id and done.evaluations == 12
    more = tune(CLUSTER, MODEL, method="optuna", budget=20, seed=0, tracking_uri=store["uri"], storage=store["storage"])
    assert more.run_id == first.run_id and more.evaluations == 20
    client = _client(store["uri"])
    children = _children(client, first.run_id)
    assert len(children) == 20 == len({c.data.tags["autotune.config_key"] for c in children})
    study = optuna.load_study(study_name=f"{EXPERIMENT}__optuna__seed0", storage=store["storage"])
    evaluated = [t for t in study.trials if t.user_attrs.get("evaluated")]
    assert len(evaluated) == 20
    assert {t.user_attrs["config_key"] for t in evaluated} == {c.data.tags["autotune.config_key"] for c in children}
    assert more.best_measurement.tokens_per_s >= first.best_measurement.tokens_per_s
    curve = client.get_metric_history(first.run_id, "best_tokens_per_s")
    assert sorted(m.step for m in curve) == list(range(1, 21))  # each step once across the three runs
    assert config_key(more.best_config) in {c.data.tags["autotune.config_key"] for c in children}


def test_optuna_study_resumed_into_a_new_mlflow_store_keeps_one_budget(store, tmp_path):
    """The study is the budget's memory: a new MLflow store gets the earlier plans logged, not re-evaluated."""
    storage = f"sqlite:///{tmp_path}/optuna.db"
    first = tune(CLUSTER, MODEL, method="optuna", budget=6, seed=5, tracking_uri=store["uri"], storage=storage)
    other = f"sqlite:///{tmp_path}/other.db"
    again = tune(CLUSTER, MODEL, method="optuna", budget=9, seed=5, tracking_uri=other, storage=storage)
    assert again.evaluations == 9 and again.run_id != first.run_id
    children = _children(_client(other), again.run_id)
    assert len(children) == 9 == len({c.data.tags["autotune.config_key"] for c in children})


def test_optuna_resume_after_a_kill_mid_mlflow_write_reaches_exactly_the_budget(store, tmp_path, monkeypatch):
    """A kill between creating a plan's child run and writing its params leaves a half-written child
    (no params, still RUNNING) and a RUNNING trial; the resumed search must still end with exactly
    ``budget`` plans in the study and in MLflow (CI once saw 39 of 40)."""
    import optuna
    from mlflow.tracking import MlflowClient

    class Killed(BaseException):  # like SIGKILL: no `except Exception` handler may swallow it
        pass

    real_log_batch = MlflowClient.log_batch
    calls = {"children": 0}

    def dying_log_batch(self, run_id, metrics=(), params=(), tags=(), *a, **kw):
        if any(p.key == "eval_index" for p in params):
            calls["children"] += 1
            if calls["children"] == 5:
                raise Killed()
        return real_log_batch(self, run_id, metrics, params, tags, *a, **kw)

    storage, budget = f"sqlite:///{tmp_path}/optuna.db", 9
    monkeypatch.setattr(MlflowClient, "log_batch", dying_log_batch)
    with pytest.raises(Killed):  # the MLflow record written in this process, where the patch applies
        tune(
            CLUSTER,
            MODEL,
            method="optuna",
            budget=budget,
            seed=11,
            tracking_uri=store["uri"],
            storage=storage,
            background_record=False,
        )
    monkeypatch.setattr(MlflowClient, "log_batch", real_log_batch)

    client = _client(store["uri"])
    study = optuna.load_study(study_name=f"{EXPERIMENT}__optuna__seed11", storage=storage)
    parent_id = study.user_attrs["mlflow_run_id"]
    half = [c for c in _children(client, parent_id) if c.info.status == "RUNNING"]
    assert len(half) == 1 and not half[0].data.params  # the state a kill leaves behind

    again = tune(CLUSTER, MODEL, method="optuna", budget=budget, seed=11, tracking_uri=store["uri"], storage=storage)
    assert again.run_id == parent_id and again.evaluations == budget
    study = optuna.load_study(study_name=f"{EXPERIMENT}__optuna__seed11", storage=storage)
    evaluated = [t for t in study.trials if t.user_attrs.get("evaluated")]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in evaluated)
    children = _children(client, parent_id)
    assert len(evaluated) == budget == len(children)
    assert {t.user_attrs["config_key"] for t in evaluated} == {c.data.tags["autotune.config_key"] for c in children}
    assert all(c.info.status != "RUNNING" and c.data.params for c in children)
