"""One Optuna study shared by several searches (``shared_study.SharedStudy``): claims, the budget rule across
workers, abandoned claims, the MLflow parent-run election; then two real ``autotune search``
processes started together on one study and a fresh MLflow store."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from paths import REPO

from autotune import load_cluster, load_model
from autotune.planning.budget import BudgetedEvaluator
from autotune.planning.space import SearchSpace
from autotune.search import workers
from autotune.search.agents.shared_study import SharedStudy, evaluated_trials
from autotune.search.agents.tpe import run_optuna
from autotune.search.tracking import config_key
from autotune.simulator import Simulator

TINY = dict(
    schedule=["1f1b"],
    recompute=["none"],
    mbs=[1, 2],
    layer_split=[0.0, 1.0],
    batch_split=[0.0, 1.0],
    zero=[0],
    offload=["none"],
)  # the agents on a small space (ZeRO / offload: tests/unit/planning/test_zero_search.py)


@pytest.fixture(scope="module")
def space():
    return SearchSpace(load_cluster("cpu-hetero"), load_model("tiny"), restrict=TINY)


@pytest.fixture
def journal(tmp_path):
    return str(tmp_path / "study.journal")


def _plans(space, n):
    return [(dict(p), c) for p, c in space.enumerate()[:n]]


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_claim_of_a_killed_process_is_failed_and_not_counted(space, journal):
    study = SharedStudy(space, "s", journal, 0)
    ((params, config),) = _plans(space, 1)
    dead = f"{workers.machine()}:{_dead_pid()}:gone"
    claim = study.claim(params, config, config_key(config), dead, budget=5)
    assert claim is not None
    state = study.sync(worker="someone-else")
    assert (state.evaluated, state.live_claims) == (0, 0)
    (t,) = [t for t in study.trials() if t.user_attrs.get("claimed")]
    assert t.state.name == "FAIL" and not evaluated_trials(study)


def test_a_live_claim_holds_its_plan_and_its_share_of_the_budget(space, journal):
    first, second = SharedStudy(space, "s", journal, 0), SharedStudy(space, "s", journal, 1)
    (p1, c1), (p2, c2) = _plans(space, 2)
    with workers.live(workers.new_worker_id()) as me, workers.live(workers.new_worker_id()) as other:
        held = first.claim(p1, c1, config_key(c1), me, budget=1)
        assert held is not None
        assert second.sync(worker=other).live_claims == 1  # not taken for abandoned
        assert second.claim(p1, c1, config_key(c1), other, budget=5) is None  # same plan: first's
        assert second.claim(p2, c2, config_key(c2), other, budget=1) is None  # budget 1: spoken for
        assert second.claim(p2, c2, config_key(c2), other, budget=2) is not None


def test_another_machines_claim_is_abandoned_only_when_its_heartbeat_is_old(space, journal):
    study = SharedStudy(space, "s", journal, 0)
    (p1, c1), (p2, c2) = _plans(space, 2)
    remote = "other-machine:123:abc"
    study.claim(p1, c1, config_key(c1), remote, budget=5)
    old = study.claim(p2, c2, config_key(c2), remote, budget=5)
    study.storage.set_trial_user_attr(old.trial_id, "heartbeat", time.time() - 2 * workers.GRACE_S)
    assert study.sync(worker="me").live_claims == 1
    states = {t.user_attrs["config_key"]: t.state.name for t in study.trials() if t.user_attrs.get("claimed")}
    assert states == {config_key(c1): "RUNNING", config_key(c2): "FAIL"}


def test_two_searches_in_one_study_share_one_budget(space, journal):
    """Two agents at once (threads here; processes below) reach exactly the budget, no plan twice."""
    budget = 24
    errors: list[BaseException] = []

    def search(seed: int) -> None:
        try:
            ev = BudgetedEvaluator(Simulator(space.cluster, space.model), space, budget)
            run_optuna(space, ev, seed, study=SharedStudy(space, "shared", journal, seed), poll_s=0.02)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=search, args=(seed,)) for seed in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:  # a deadline for a hang only: under load the two searches take minutes
        t.join(900)
    assert not any(t.is_alive() for t in threads), "a search thread still runs after 900 s"
    assert not errors
    done = evaluated_trials(SharedStudy(space, "shared", journal, 0))
    assert len(done) == budget == len({t.user_attrs["config_key"] for t in done})
    assert len({t.user_attrs["worker"] for t in done}) == 2  # both worked


def test_the_first_elected_parent_run_wins(space, journal):
    a, b = SharedStudy(space, "s", journal, 0), SharedStudy(space, "s", journal, 1)
    runs = {"run-a", "run-b"}
    assert a.elect("run-a", runs.__contains__) == "run-a"
    assert b.elect("run-b", runs.__contains__) == "run-a"
    assert b.parent_run(runs.__contains__) == "run-a"
    assert b.parent_run({"run-b"}.__contains__) == "run-b"  # another MLflow store: its own run


AUTOTUNE = [sys.executable, "-m", "autotune.cli"]


@pytest.mark.slow
def test_two_search_processes_started_together_on_a_fresh_store_share_the_study(tmp_path):
    """Two ``autotune search`` runs of one study, started at once on a fresh MLflow store and
    journal: both finish, the study holds exactly ``--budget`` plans, MLflow one parent run with
    one child per plan."""
    import optuna
    from mlflow.tracking import MlflowClient

    budget = 30
    args = [
        "search",
        "--cluster",
        "mixed-a100-v100",
        "--model",
        "gpt2-xl",
        "--method",
        "optuna",
        "--budget",
        str(budget),
        "--storage",
        "optuna.journal",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), XDG_CACHE_HOME=str(tmp_path / "cache"))
    procs = [
        subprocess.Popen(
            [*AUTOTUNE, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=480) for p in procs]  # a hang guard, generous for a loaded machine
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "Traceback" not in err
    from autotune.search.agents.optuna_storage import open_storage

    study = optuna.load_study(
        study_name="mixed-a100-v100__gpt2-xl__optuna__seed0", storage=open_storage(str(tmp_path / "optuna.journal"))
    )
    done = [t for t in study.trials if t.user_attrs.get("evaluated")]
    assert len(done) == budget == len({t.user_attrs["config_key"] for t in done})
    assert all(t.state.name == "COMPLETE" for t in done)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("mixed-a100-v100__gpt2-xl")
    parents = client.search_runs([exp.experiment_id], filter_string="tags.`autotune.role` = 'search'")
    assert len(parents) == 1
    children = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'", max_results=1000
    )
    assert len(children) == budget == len({c.data.tags["autotune.config_key"] for c in children})


def test_default_study_names_keep_different_searches_apart(tmp_path):
    """A restricted search, another backend, start or global batch size of the same cluster, model and
    seed opens its own Optuna study: it does not resume (and count) the plans of the default search."""
    import optuna

    from autotune import tune
    from autotune.search.agents.optuna_storage import open_storage
    from autotune.search.api import study_variant

    assert study_variant("sim", None, "dp", None, None) == ""
    variants = {
        study_variant("real", None, "dp", None, None),
        study_variant("sim", {"schedule": ["1f1b"]}, "dp", None, None),
        study_variant("sim", None, "heuristic", None, None),
        study_variant("sim", None, "dp", "p.json", None),
        study_variant("sim", None, "dp", None, 64),
    }
    assert len(variants) == 5 and "" not in variants
    assert study_variant("sim", {"schedule": ["1f1b"]}, "dp", None, None) == study_variant(
        "sim", {"schedule": ("1f1b",)}, "dp", None, None
    )

    storage = str(tmp_path / "optuna.journal")
    tune("cpu-2", "tiny", method="optuna", budget=3, storage=storage, track=False)
    restricted = tune(
        "cpu-2", "tiny", method="optuna", budget=2, storage=storage, track=False, restrict={"schedule": ["1f1b"]}
    )
    assert restricted.evaluations == 2
    names = sorted(s.study_name for s in optuna.get_all_study_summaries(open_storage(storage)))
    assert names[0] == "cpu-2__tiny__optuna__seed0" and len(names) == 2
    assert names[1].startswith("cpu-2__tiny__optuna__seed0__")


def test_the_journal_is_read_back_at_once_and_synced_to_disk_at_most_once_a_second(journal, space, monkeypatch):
    """Every write reaches the OS before it returns (a second storage on the file reads it, as another
    worker or a resume after ``kill -9`` does); fsync is rationed (``JOURNAL_FSYNC_EVERY_S``) and done
    once more at exit (``sync``)."""
    import optuna

    from autotune.search.agents import optuna_storage

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    monkeypatch.setattr(optuna_storage, "JOURNAL_FSYNC_EVERY_S", 3600.0)
    storage = optuna_storage.open_storage(journal)
    sid = storage.create_new_study([optuna.study.StudyDirection.MAXIMIZE], "s")
    tid = storage.create_new_trial(sid)
    for i in range(20):
        storage.set_trial_user_attr(tid, "n", i)
    assert synced == []  # none of the 21 writes waited for the disk
    other = optuna_storage.open_storage(journal)  # a second reader: sees every write
    assert (
        other.get_trial(other.get_trial_id_from_study_id_trial_number(other.get_study_id_from_name("s"), 0)).user_attrs[
            "n"
        ]
        == 19
    )
    storage._backend.sync()
    assert len(synced) == 1
    monkeypatch.setattr(optuna_storage, "JOURNAL_FSYNC_EVERY_S", 0.0)  # due at once: every write syncs
    storage.set_trial_user_attr(tid, "n", 20)
    assert len(synced) == 2


def test_tpe_does_not_model_one_choice_dimensions_but_the_study_keeps_them(journal):
    """A dimension with one choice (here tp of the single-GPU nodes) is left out of TPE's model (its
    cost grows with the dimensions) and added back to every proposal and stored trial."""
    space = SearchSpace(load_cluster("cpu-hetero"), load_model("tiny"), restrict=dict(TINY, pp=[2]))
    study = SharedStudy(space, "s", journal, seed=0)
    one = {d.name for d in space.dimensions if len(d.choices) == 1}
    assert "pp" in one and one == set(study.fixed)
    assert not one & set(study.model_dists) and set(study.model_dists) | one == set(study.dists)
    b = BudgetedEvaluator(Simulator(space.cluster, space.model), space, 4)
    run_optuna(space, b, 0, study=study)
    stored = evaluated_trials(study.study)
    assert len(stored) == 4 and all(set(t.params) == set(study.dists) for t in stored)
    assert all(t.params["pp"] == 2 for t in stored)
    local = [t for t in study.local.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    assert local and all(not one & set(t.params) for t in local)


def test_an_edited_cluster_file_under_the_same_name_is_another_search_not_a_resume(tmp_path):
    """Issue 46, case 1: 8 V100s become 2 in the same file (same ``name:``). The re-run of the same optuna
    search must not resume the study of 8 V100s (whose best plan named ``v100:2``, a device that no longer
    exists): it works on a new generation of the study, and every plan it returns is valid on the new file;
    the old file's search resumes its own study again."""
    import optuna

    from autotune import load_config, simulate, tune
    from autotune.search.agents.optuna_storage import open_storage

    def cluster(v100s: int) -> str:
        path = tmp_path / "fleet.yaml"
        path.write_text(
            "name: fleet\nnodes:\n  - {name: a100, gpu: A100-80GB, count: 2}\n"
            f"  - {{name: v100, gpu: V100-32GB, count: {v100s}}}\nnetwork: {{bandwidth_GBps: 12.5}}\n"
        )
        return str(path)

    storage = str(tmp_path / "optuna.journal")
    first = tune(cluster(8), "gpt2-small", method="optuna", budget=6, storage=storage, track=False)
    assert first.evaluations == 6
    second = tune(cluster(2), "gpt2-small", method="optuna", budget=6, storage=storage, track=False)
    assert second.evaluations == 6  # a new study: nothing counted from the first
    devices = {d for p in second.best_config.pipelines for s in p.stages for d in s.devices}
    assert devices <= {"a100:0", "a100:1", "v100:0", "v100:1"}
    out = tmp_path / "best.json"
    out.write_text(second.best_config.to_json())
    assert simulate(cluster(2), "gpt2-small", load_config(str(out))).status in ("ok", "oom")
    names = sorted(s.study_name for s in optuna.get_all_study_summaries(open_storage(storage)))
    assert names == ["fleet__gpt2-small__optuna__seed0", "fleet__gpt2-small__optuna__seed0__fresh2"]
    # back to 8 V100s: the first study again, already holding its budget
    again = tune(cluster(8), "gpt2-small", method="optuna", budget=6, storage=storage, track=False)
    assert again.evaluations == 6 and again.best_config == first.best_config
