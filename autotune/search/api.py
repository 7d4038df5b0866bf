"""The library call: ``autotune.tune(...) -> TuneResult`` and ``autotune.best_config(...)``.

``tune`` loads the cluster and model, builds the shared ``SearchSpace``, the evaluator for the
backend (``sim``: ``autotune.simulator.Simulator``; ``real``: ``runner.RealEvaluator``, one short
profiled run per plan), wraps it in the one ``BudgetedEvaluator``, opens the MLflow record, runs the
agent and returns the best plan. An Optuna search resumes from its study (same study name) and its
MLflow parent run.

With ``backend="real"`` the search closes the calibration loop (``autotune.search.screen``): every
real run refits the simulator's correction factors, and once two real runs succeeded, a plan the
corrected simulator predicts out of memory or below half the best measured plan's (predicted)
throughput is screened out (status ``"pruned"``, score 0) without a real run and without spending
the budget; at most ``20 x budget`` plans are screened out. MLflow gets ``pruned_plans``, the corrected
simulator's error before each real run (``calibration_time_error`` / ``calibration_memory_error``, step =
evaluation index), the fitted corrections (``calibration_corrections.json``) and the corrected profile
(``calibrated_profile.json``, usable as ``--backend sim --profile``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from autotune.errors import SpecError
from autotune.evaluator import BACKENDS, Evaluator, make_evaluator  # noqa: F401  (make_evaluator: re-exported)
from autotune.loading import load_cluster, load_model
from autotune.planning.budget import BudgetedEvaluator, Evaluation
from autotune.planning.space import SearchSpace
from autotune.search.agents import METHODS
from autotune.search.methods import plans_ahead, run_agent
from autotune.search.request import SearchRequest, study_variant  # noqa: F401 (study_variant: re-exported)
from autotune.search.result import TuneResult
from autotune.search.screen import log_prediction_error
from autotune.search.summary import SearchSummary
from autotune.specs import ClusterSpec, ModelSpec, ParallelConfig
from runner.jobs import plan_limits

log = logging.getLogger(__name__)

#: where optuna and rl start: the structured planner's best plans (``dp``), or only their own heuristic starts
STARTS = ("dp", "heuristic")
BACKGROUND_MIN_BUDGET = 64


def _load_profile(profile):
    from autotune.profile import CalibrationProfile

    if profile is not None and not isinstance(profile, CalibrationProfile):
        profile = CalibrationProfile.load(Path(profile))
    return profile


def tune(
    cluster: str | Path | ClusterSpec,
    model: str | Path | ModelSpec,
    method: str = "rl",
    budget: int = 100,
    backend: str = "sim",
    seed: int = 0,
    global_batch_size: int | None = None,
    tracking_uri: str | None = None,
    experiment: str | None = None,
    storage: str | None = None,
    profile: str | Path | None = None,
    *,
    workers: int = 1,
    policy: str | Path | None = None,
    study_name: str | None = None,
    evaluator: Evaluator | None = None,
    restrict: Mapping[str, Any] | None = None,
    on_evaluation: Callable[[Evaluation], None] | None = None,
    track: bool = True,
    on_start: Callable[[str, int, float], None] | None = None,
    start: str = "dp",
    max_sync_every: int = 1,
    on_status: Callable[[str], None] | None = None,
    background_record: bool | None = None,
    run_timeout_s: float = 300.0,
    fresh: bool = False,
    engine: str | None = None,
) -> TuneResult:
    """Search ``budget`` distinct plans with ``method``; log the search to MLflow; return the best.

    ``evaluator`` replaces the backend's evaluator (it must be for the same cluster and model);
    ``restrict`` narrows dimensions of the space; ``track=False`` skips MLflow (experiments);
    ``on_start(run_id, already_done, best_tokens_per_s_so_far)`` is called once the record is open
    (a resumed search, or one joining a study other searches work on, starts with evaluations);
    ``on_evaluation(evaluation)`` then hears of every evaluation the search counts, including those
    other processes on the same study make; ``on_status(text)`` says what is being opened.
    ``background_record`` writes MLflow from a second process (``autotune.search.writer``; default:
    simulator searches of ``BACKGROUND_MIN_BUDGET`` plans or more, where MLflow would otherwise take
    most of the time and the second process's start-up, ~3 s of imports, pays for itself; the
    environment variable ``AUTOTUNE_MLFLOW_WRITER=process|inline`` overrides the default).
    ``max_sync_every``: the largest ``sync_every_steps`` an MoE plan may get (SPES; default 1: replicas
    synchronise every step). A dense model's space has no such dimension.
    A re-run with the same arguments resumes the search (its Optuna study, or for the other methods
    the MLflow parent run with the same resume key); ``fresh=True`` starts a new one instead (a new
    study generation ``<name>__fresh<k>``, a new parent run; the earlier ones stay where they are).
    ``engine`` (``torchtitan``, ``megatron``, ``deepspeed``): only plans that engine runs
    (``autotune.engines``; the others are invalid proposals, not evaluated).
    ``start="dp"`` (default) makes ``optuna`` (and ``rl`` with ``policy="scratch"``) evaluate the structured
    planner's best 3 plans first (``autotune.planning.planner``; 3 evaluations of the budget), so they start
    from them: TPE sees them as trials; ``start="heuristic"`` leaves them to their own speed-proportional
    starts. ``rl``'s chooser starts with the planner's first plan whatever ``start`` says.

    ``backend="real"`` (one process) closes the calibration loop (the module docstring says how):
    ``budget`` counts real runs only, and ``on_evaluation`` also sees the plans screened out without a
    real run (status ``"pruned"``).
    """
    _check_arguments(method, backend, start, workers, seed, run_timeout_s, track, tracking_uri, storage, policy)
    cluster_spec = load_cluster(cluster)
    model_spec = load_model(model, global_batch_size)
    if max_sync_every > 1 and not model_spec.is_moe:
        log.warning("--max-sync-every %d has no effect: model %r is dense (MoE only)", max_sync_every, model_spec.name)
    name = experiment or f"{cluster_spec.name}__{model_spec.name}"
    args = (method, budget, backend, seed, global_batch_size, tracking_uri, name, storage, profile, workers, policy)
    space = SearchSpace(cluster_spec, model_spec, restrict=restrict, max_sync_every=max_sync_every, engine=engine)
    rest = (study_name, dict(space.restrict), start, max_sync_every, run_timeout_s, fresh, engine)
    req = SearchRequest(cluster_spec, model_spec, *args, *rest)
    inner, screen = _evaluator(req, evaluator)
    _calibrate(space, inner)
    say = on_status or (lambda text: None)
    tracker = _open_tracker(req, background_record, say) if track else None
    ahead = plans_ahead(req.method, req.start, req.policy, space, inner)  # while the MLflow writer starts
    study = _open_study(req, space, say) if method == "optuna" else None
    budgeted = _open_record(req, space, inner, screen, tracker, study)
    if on_evaluation is not None:
        budgeted.watchers.append(on_evaluation)
    if on_start is not None:
        best_before = budgeted.best.score if budgeted.best is not None else 0.0
        on_start(tracker.parent_id if tracker else "", budgeted.used, best_before)
    summary = _search(req, space, budgeted, tracker, study, screen, say, ahead)
    return _result(req, budgeted, tracker, summary, tuple(screen.reports) if screen is not None else ())


def _calibrate(space: SearchSpace, evaluator) -> None:
    """With a profile (``--profile``, or a simulator built with one), the space's families price their units
    (Zorse's per-rank shares) with the profile's measured per-layer times, as the evaluator does."""
    from autotune.planning.planner import simulator_of

    sim = simulator_of(evaluator)
    if sim is not None and sim.profile is not None:
        space.context.calibrate(sim.costs)


def _check_arguments(
    method: str,
    backend: str,
    start: str,
    workers: int,
    seed: int,
    run_timeout_s: float,
    track: bool,
    tracking_uri: str | None,
    storage: str | None,
    policy: str | Path | None,
) -> None:
    """Every argument that can be checked before any work, each refused with one line naming it."""
    if method not in METHODS:
        raise SpecError("search", "method", f"must be one of {' | '.join(METHODS)}, got {method!r}")
    if backend not in BACKENDS:
        raise SpecError("search", "backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if start not in STARTS:
        raise SpecError("search", "start", f"must be one of {', '.join(STARTS)}, got {start!r}")
    if workers < 1:
        raise SpecError("search", "workers", f"must be >= 1, got {workers}")
    if workers > 1 and method != "optuna":
        raise SpecError(
            "search",
            "workers",
            f"several workers share one Optuna study (--method optuna); --method {method} runs in one",
        )
    from autotune import prechecks

    prechecks.seed(seed, count=workers)
    prechecks.finite_positive(run_timeout_s, "--run-timeout")
    if track:
        prechecks.tracking_uri(tracking_uri)
    if method == "optuna":
        prechecks.optuna_storage(storage)
    if policy is not None and method != "rl":
        raise SpecError("--policy", "", f"applies to --method rl only, not {method}")
    if method == "rl":  # a bad policy file: before any work
        from autotune.search.agents.acquire import GREEDY, policy_for, uses_acquisition

        if uses_acquisition(policy) and str(policy) != GREEDY:
            from autotune.policy import policy_file

            policy_file.read(policy_for(policy))


def _evaluator(req: SearchRequest, evaluator: Evaluator | None):
    """(the evaluator the budget wraps, the calibration screen of a one-process real search or None)."""
    inner = (
        evaluator
        if evaluator is not None
        else make_evaluator(
            req.cluster, req.model, req.backend, req.profile, run_timeout_s=req.run_timeout_s, engine=req.engine
        )
    )
    if req.backend == "real" and req.workers == 1:
        from autotune.search.screen import CalibrationScreen
        from autotune.simulator import Simulator

        screen = CalibrationScreen(inner, Simulator(req.cluster, req.model, profile=_load_profile(req.profile)))
        return screen, screen
    if req.backend == "real":
        log.info("search: --workers %d runs real plans in separate processes; no online calibration", req.workers)
    return inner, None


def _open_tracker(req: SearchRequest, background_record: bool | None, say: Callable[[str], None]):
    """The MLflow record: written from a second process for long simulator searches (``writer``)."""
    from autotune.search import tracking

    say(f"opening the MLflow store {req.tracking_uri or tracking.DEFAULT_TRACKING_URI}")
    description = experiment_description(req.cluster, req.model)
    if background_record is None and os.environ.get("AUTOTUNE_MLFLOW_WRITER") in ("process", "inline"):
        background_record = os.environ["AUTOTUNE_MLFLOW_WRITER"] == "process"
    if (
        background_record
        if background_record is not None
        else (req.backend == "sim" and req.budget >= BACKGROUND_MIN_BUDGET)
    ):
        from autotune.search.writer import BackgroundTracker, wait_with

        tracker = BackgroundTracker(req.tracking_uri, req.experiment, description=description)
        wait_with(tracker, say)
        return tracker
    return tracking.SearchTracker(req.tracking_uri, req.experiment, description=description)


def _open_study(req: SearchRequest, space: SearchSpace, say: Callable[[str], None]):
    """The Optuna study of an optuna search (shared by every search of the same name)."""
    from autotune.search.agents import optuna_storage, shared_study

    sync = f"__sync{req.max_sync_every}" if req.max_sync_every > 1 and req.model.is_moe else ""  # its own space
    name = req.study_name or (
        f"{req.experiment}__optuna__seed{req.seed}{sync}"
        f"{study_variant(req.backend, req.restrict, req.start, req.profile, req.global_batch_size, req.engine)}"
    )
    storage = req.storage or optuna_storage.default_storage()
    say(f"opening the Optuna study {name} in {storage}")
    study = shared_study.open_study(space, name, storage, req.seed, fresh=req.fresh, fingerprint=req.fingerprint())
    if study.passed_over:
        log.warning(
            "Optuna study %s was made for another search (the cluster, model, batch, engine, restriction or "
            "profile differ, though the names are the same): working on %s instead",
            ", ".join(study.passed_over),
            study.study_name,
        )
    return study


def _open_record(req: SearchRequest, space: SearchSpace, inner: Evaluator, screen, tracker, study) -> BudgetedEvaluator:
    """The budget, with what the MLflow parent (or the study) already holds of this search preloaded."""
    from autotune.search import tracking

    listeners: list[Callable[[Evaluation], None]] = []
    if tracker is not None:
        listeners.append(lambda ev: tracker.log_evaluation(ev, space.params_of(ev.config)))
        if screen is not None:
            listeners.append(lambda ev: log_prediction_error(tracker, screen, ev))
    # the simulator's searches keep to what `autotune train` runs (--engine: to that engine's plans instead)
    limits = plan_limits(req.cluster, req.model) if req.backend == "sim" and req.engine is None else None
    budgeted = BudgetedEvaluator(
        inner, space, req.budget, listeners, screen=screen.screen if screen else None, limits=limits
    )
    if tracker is not None:
        tags = {
            "autotune.method": req.method,
            "autotune.backend": req.backend,
            "autotune.cluster": req.cluster.name,
            "autotune.model": req.model.name,
        }
        resume_id = None
        if req.method != "optuna":
            # every other method resumes from its MLflow parent: a re-run of the same search (same key)
            # reopens it, counts what it holds, and evaluates only the rest of the budget
            key = req.resume_key()
            tags[tracking.RESUME_TAG] = key
            resume_id = None if req.fresh else tracker.find_parent(key)
        if study is not None:
            tags["autotune.study"] = study.study_name
            resume_id = study.parent_run(tracker.run_exists)
        run_name = search_run_name(req.method, req.budget, req.seed, req.backend, req.variant())
        if resume_id:
            tracker.start(run_name, req.run_params(space), tags, resume_run_id=resume_id)
        else:
            candidate = tracker.start(run_name, req.run_params(space), tags)
            if study is not None:  # several searches on one study share the first one's parent run
                winner = study.elect(candidate, tracker.run_exists)
                if winner != candidate:
                    tracker.adopt(winner, candidate)
                    resume_id = winner
        if resume_id:
            for rec in tracker.recorded():
                budgeted.preload(rec.config, rec.measurement, rec.params)
    if study is not None:
        _recover_study(study, space, budgeted)
    return budgeted


def _recover_study(study, space: SearchSpace, budgeted: BudgetedEvaluator) -> None:
    """Join the study and the MLflow record: plans MLflow holds that the study lacks go into the study;
    plans the study holds that this record lacks are logged where their worker is gone (live workers log
    their own), else preloaded."""
    from autotune.search.agents import shared_study
    from autotune.search.workers import abandoned

    added = shared_study.sync_from_evaluator(study, space, budgeted)
    if added:
        log.info("optuna: recovered %d evaluated plans from MLflow into the study", added)
    now = time.time()
    for t in shared_study.evaluated_trials(study):
        found = shared_study.trial_evaluation(t)
        if found is None or found[0] in budgeted:
            continue
        config, m = found
        if abandoned(t.user_attrs.get("worker"), t.user_attrs.get("heartbeat"), now):
            budgeted.record(config, m, t.params)
        else:
            budgeted.preload(config, m, t.params)


def _search(
    req: SearchRequest,
    space: SearchSpace,
    budgeted: BudgetedEvaluator,
    tracker,
    study,
    screen,
    say: Callable[[str], None],
    ahead: list | None = None,
) -> SearchSummary:
    """Run the agent (``ahead``: the planner's plans its dp start filters, ``methods.plans_ahead``); whatever
    happens, summarise and finish the MLflow record."""
    preloaded = budgeted.used
    began = time.monotonic()
    status = "FAILED"
    try:
        run_agent(
            req.method,
            space,
            budgeted,
            req.seed,
            study=study,
            storage=req.storage,
            workers=req.workers,
            policy=req.policy,
            tracking_uri=req.tracking_uri,
            experiment=req.experiment,
            run_id=tracker.parent_id if tracker else None,
            cluster=req.cluster,
            model=req.model,
            backend=req.backend,
            profile=req.profile,
            study_name=study.study_name if study is not None else None,
            start=req.start,
            run_timeout_s=req.run_timeout_s,
            ahead=ahead,
        )
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        summary = _summarize(req, space, budgeted, status, time.monotonic() - began, preloaded, say)
        if screen is not None:
            log.info(
                "search: %d real runs, %d plans screened out by the corrected simulator",
                budgeted.used,
                len(budgeted.screened),
            )
            if tracker is not None:
                from autotune.search.screen import log_calibration

                log_calibration(tracker, screen, budgeted)
        if tracker is not None:
            _finish_record(req, tracker, budgeted, summary, status, say)
    return summary


def _summarize(
    req: SearchRequest,
    space: SearchSpace,
    budgeted: BudgetedEvaluator,
    status: str,
    wall: float,
    preloaded: int,
    say: Callable[[str], None],
) -> SearchSummary:
    from autotune.search.summary import summarize

    uniform = None
    if status == "FINISHED" and budgeted.best is not None:
        if req.backend == "sim":  # a fixed yardstick (summary.UNIFORM_BASELINE_PLANS), --method uniform's too
            from autotune.search.summary import uniform_baseline

            say("the uniform baseline (for the speedup)")
            uniform = uniform_baseline(budgeted)
    return summarize(budgeted, wall, preloaded, uniform)


def _finish_record(
    req: SearchRequest,
    tracker,
    budgeted: BudgetedEvaluator,
    summary: SearchSummary,
    status: str,
    say: Callable[[str], None],
) -> None:
    from autotune.search import tracking

    try:
        tracker.log_parent_metrics({"memory_screened": float(budgeted.memory_screened)}, step=0)
    except Exception as e:  # the count is a summary; never lose the search's result for it
        log.warning("could not log memory_screened to MLflow: %s", e)
    say("writing the best plan and the pictures to MLflow")
    tracker.finish(
        _best_with_timeline(budgeted),
        budgeted.best_curve(),
        [ev.score for ev in budgeted.history],
        title=f"{req.method} on {req.cluster.name} / {req.model.name}",
        status=status,
        summary=summary.metrics(),
        statuses=[tracking.status_of(ev.measurement) for ev in budgeted.history],
    )


def _result(
    req: SearchRequest, budgeted: BudgetedEvaluator, tracker, summary: SearchSummary, real_runs: tuple = ()
) -> TuneResult:
    best = _best_with_timeline(budgeted)
    where = f"{req.cluster.name} / {req.model.name}"
    # nothing evaluated, or (simulator) nothing valid that fits; a real search returns its failed run (what happened)
    if best is None or (req.backend == "sim" and not best.measurement.ok):
        limited = (
            f"; {len(budgeted.limited)} other plans were left out as `autotune train` does not run them (--engine "
            f"torchtitan, megatron or deepspeed plans for an engine instead; first: {budgeted.limited[0]})"
            if budgeted.limited
            else ""
        )
        if budgeted.memory_screened:
            raise SpecError(
                "search",
                "memory",
                f"no fitting plan found: the memory model says all {len(budgeted.screened)} "
                f"plans {req.method} tried on {where} run out of memory (the space's memory-frugal start "
                f"included); that does not prove none fits: --method optuna or a larger --budget searches "
                f"further, or try a smaller model, micro-batch or more devices{limited}",
            )
        if best is not None:
            raise SpecError(
                "search",
                "plan",
                f"no plan ran: none of the {budgeted.used} plans {req.method} evaluated on {where} is a plan "
                f"that runs and fits (the best: {best.measurement.status}, {best.measurement.error}){limited}",
            )
        raise SpecError(
            "search",
            "space",
            f"no plan was evaluated: the space of {where} has no valid plan the method could reach{limited}",
        )
    return TuneResult(
        best_config=best.config,
        best_measurement=best.measurement,
        evaluations=budgeted.used,
        method=req.method,
        cluster=req.cluster.name,
        model=req.model.name,
        budget=req.budget,
        seed=req.seed,
        backend=req.backend,
        experiment=req.experiment if tracker else "",
        run_id=tracker.parent_id or "" if tracker else "",
        tracking_uri=tracker.tracking_uri if tracker else "",
        best_curve=tuple(budgeted.best_curve()),
        screened=len(budgeted.screened),
        memory_screened=budgeted.memory_screened,
        summary=summary,
        experiment_id=(getattr(tracker, "experiment_id", "") or "") if tracker else "",
        real_runs=real_runs,
    )


def search_run_name(method: str, budget: int, seed: int, backend: str, variant: str = "") -> str:
    """The parent run's name: ``optuna, 200 plans, seed 0 (simulator)``, then what sets the search apart
    (``SearchRequest.variant``: ``optuna, 50 plans, seed 0 (simulator), start heuristic; pp=2,4``)."""
    name = f"{method}, {budget} plans, seed {seed} ({'simulator' if backend == 'sim' else 'real runs'})"
    return f"{name}, {variant}"[:250] if variant else name


def experiment_description(cluster: ClusterSpec, model: ModelSpec) -> str:
    """The experiment's description (MLflow's ``mlflow.note.content``, shown on its page)."""
    kinds: dict[str, int] = {}
    for node in cluster.nodes:
        kinds[node.device.name] = kinds.get(node.device.name, 0) + node.count
    gpus = ", ".join(f"{n} x {name}" for name, n in kinds.items())
    return (
        f"autotune searches for the fastest training plan of **{model.name}** (global batch "
        f"{model.global_batch_size} x {model.seq_len} tokens) on **{cluster.name}** ({gpus}, "
        f"{len(cluster.nodes)} nodes).\n\nEach parent run is one search (`autotune search`: method, budget, seed, "
        "backend); its child runs are the plans it evaluated, with their predicted or measured "
        "tokens/s, memory and status (`ok`, `oom`: out of memory, `failed`). Compare searches with "
        "the parent runs' `best_tokens_per_s`, `found_at` and `speedup_vs_uniform`, or with "
        "`autotune compare --experiment NAME`."
    )


def _best_with_timeline(budgeted: BudgetedEvaluator) -> Evaluation | None:
    """The best evaluation, its measurement re-done with the per-operation timeline when the backend
    can (the simulator's ``evaluate_detailed``; free: the plan was already evaluated)."""
    best = budgeted.best
    if best is None or best.measurement.timeline:
        return best
    detailed = getattr(budgeted.inner, "evaluate_detailed", None)
    if detailed is None:
        return best
    try:
        m = detailed(best.config)
    except Exception as e:  # the picture is optional
        log.warning("no timeline for the best plan: %s", e)
        return best
    return Evaluation(best.index, best.config, m, best.params) if m.ok else best


def best_config(experiment: str | None = None, tracking_uri: str | None = None) -> ParallelConfig:
    """The best plan recorded in MLflow (``autotune best`` prints the same)."""
    from autotune.search.history import read_best

    return read_best(experiment, tracking_uri)[0]
