"""``autotune search``: run one search with a live progress bar, print the best plan and where it is
recorded in MLflow, optionally write it to ``--output``."""

from __future__ import annotations

import json
import time
from pathlib import Path

from autotune.commands.progress_bar import ProgressLines, step_bar
from autotune.errors import is_interrupt
from autotune.simulator.error_bar import describe as describe_error
from autotune.specs.recompute import label as recompute_label


def run(
    cluster: str,
    model: str,
    method: str,
    budget: int,
    global_batch_size: int | None,
    backend: str,
    seed: int,
    output: Path | None,
    tracking_uri: str | None,
    experiment: str | None,
    storage: str | None,
    profile: Path | None,
    workers: int,
    policy: Path | None,
    start: str = "dp",
    max_sync_every: int = 1,
    run_timeout: float = 300.0,
    fresh: bool = False,
    restrict: list[str] | None = None,
    engine: str | None = None,
) -> int:
    from rich.console import Console

    from autotune import prechecks
    from autotune.planning.vocabulary import parse_restrictions
    from autotune.search.tracking import quiet_libraries

    narrowed = parse_restrictions(restrict or [])  # a malformed --restrict: one line, before any work
    if engine is not None:
        from autotune.engines import restrictions

        restrictions(engine)  # an unknown --engine: one line, before any work
    if output is not None:
        prechecks.writable_file(output, "--output")  # before the search, not after it
    quiet_libraries()
    console = Console(stderr=True)
    started = time.monotonic()
    shown = _Progress(console, method, budget)
    if backend == "real":  # each real run: predicted vs measured, the simulator's error, repeats
        _print_real_runs(console)
        if engine is not None:
            _print_engine_runs(console, engine)
    from autotune.search.api import tune

    with shown.progress:
        shown.on_status("loading the cluster and model")
        try:
            result = tune(
                cluster,
                model,
                method=method,
                budget=budget,
                backend=backend,
                seed=seed,
                global_batch_size=global_batch_size,
                tracking_uri=tracking_uri,
                experiment=experiment,
                storage=storage,
                profile=profile,
                workers=workers,
                policy=policy,
                start=start,
                max_sync_every=max_sync_every,
                fresh=fresh,
                restrict=narrowed or None,
                on_evaluation=shown.on_evaluation,
                on_start=shown.on_start,
                on_status=shown.on_status,
                run_timeout_s=run_timeout,
                engine=engine,
            )
        except (KeyboardInterrupt, Exception) as e:
            if not is_interrupt(e):
                raise
            shown.progress.stop()
            console.print(
                f"interrupted: {shown.done} of {budget} plans are recorded. Re-run the same command "
                "to resume where it stopped (add --fresh to start over).",
                highlight=False,
            )
            raise SystemExit(130) from None
    code = _report(console, result, budget, time.monotonic() - started, output)
    if engine is not None and backend == "real":
        _print_engine_runs(console, engine)
    if engine is not None and result.best_measurement.ok:
        _print_unrestricted(console, cluster, model, global_batch_size, profile, engine, result)
    return code


def _print_engine_runs(console, engine: str) -> None:
    """With ``--engine`` and ``--backend real``: what measured the plans (said before and after the runs)."""
    from autotune.engines import ENGINES

    name = ENGINES[engine].NAME
    console.print(
        f"--engine {engine} --backend real: each real run is autotune's runner training the plan as {name} "
        f"would hold it (its grid), not {name} itself; `autotune export --to {engine}` gives {name}'s file",
        highlight=False,
        soft_wrap=True,
    )


#: evaluations of the unrestricted dp search ``--engine`` compares with (1-6 CPU seconds)
UNRESTRICTED_BUDGET = 20


def _print_unrestricted(console, cluster, model, global_batch_size, profile, engine: str, result) -> None:
    """How much faster the best plan without ``--engine`` is: the dp planner on the whole space, not
    recorded (``UNRESTRICTED_BUDGET`` simulator evaluations)."""
    from autotune.engines import ENGINES, check
    from autotune.search.api import tune

    free = tune(
        cluster,
        model,
        method="dp",
        budget=UNRESTRICTED_BUDGET,
        global_batch_size=global_batch_size,
        profile=profile,
        track=False,
    )
    ours, theirs = result.best_measurement.tokens_per_s, free.best_measurement.tokens_per_s
    name = ENGINES[engine].NAME
    if not free.best_measurement.ok or theirs <= ours:
        console.print(
            f"without --engine: dp finds no faster plan in {UNRESTRICTED_BUDGET} evaluations; {name} runs the best one",
            highlight=False,
            soft_wrap=True,
        )
        return
    reason = check(engine, free.best_config) or "it is outside this search's budget"
    console.print(
        f"without --engine: dp's best plan in {UNRESTRICTED_BUDGET} evaluations, {escape(free.best_config.describe())}, "
        f"is {theirs / ours:.2f}x faster ({theirs:,.0f} tokens/s); {name} cannot run it: {escape(reason)}",
        highlight=False,
        soft_wrap=True,
    )


def _print_real_runs(console) -> None:
    """Print ``autotune.search.screen``'s line per real run, and why the chooser of real runs stopped,
    above the progress bar."""
    import logging

    from rich.markup import escape

    class ToConsole(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith(("real run ", "real runs stopped")):
                console.print(escape(record.getMessage()), highlight=False, soft_wrap=True)

    for name in ("autotune.search.screen", "autotune.search.agents.acquire"):  # the runs, why the chooser stopped
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        for old in [h for h in logger.handlers if type(h).__name__ == "ToConsole"]:  # an earlier search's
            logger.removeHandler(old)
        logger.addHandler(ToConsole())


class _Progress:
    """The live progress bar of one search: evaluations done, the best so far, what is being opened."""

    def __init__(self, console, method: str, budget: int) -> None:
        self.console, self.budget = console, budget
        self.best, self.done = 0.0, 0
        self.progress = step_bar(console, "[bold]{task.fields[method]}")
        self.lines = ProgressLines(console, method)  # the same, as lines, where no bar is drawn
        self.task = self.progress.add_task(
            "search",
            total=budget,
            completed=0,
            method=method,
            what="loading the search libraries (optuna, the simulator)",
        )

    def _best_text(self) -> str:
        return f"evaluations  best {self.best:,.0f} tokens/s" if self.best else "evaluations  best -"

    def on_status(self, text: str) -> None:
        from rich.markup import escape

        self.progress.update(self.task, what=escape(text))
        self.lines(text)  # throttled: a bad input's error stays the only line

    def on_start(self, run_id: str, done: int, best: float) -> None:
        self.best, self.done = best, done
        self.progress.update(self.task, completed=done, what=self._best_text())
        if done:
            self.console.print(
                f"resuming: {done} of {self.budget} plans already evaluated"
                + (f", best so far {best:,.0f} tokens/s" if best else "")
            )

    def on_evaluation(self, ev) -> None:
        if ev.measurement.status == "pruned":  # screened out (backend real): no budget spent
            return
        self.best = max(self.best, ev.score)
        self.done += 1
        self.progress.update(self.task, advance=1, what=self._best_text())
        self.lines(f"{self.done:,}/{self.budget:,} {self._best_text()}")


def _report(console, result, budget: int, elapsed: float, output: Path | None) -> int:
    """The summary line, the best plan's table, the ``--output`` file; 1 when no evaluated plan runs."""
    from rich.console import Console
    from rich.markup import escape

    out = Console()
    console.print(
        f"{result.method}: {result.evaluations}/{budget} evaluations in {elapsed:.1f} s, best "
        f"{result.best_measurement.tokens_per_s:,.0f} tokens/s",
        highlight=False,
    )
    if result.summary is not None and result.summary.ended and result.evaluations < budget:
        console.print(
            f"{result.method} ended before its budget: {escape(result.summary.ended)}", highlight=False, soft_wrap=True
        )
    _print_result(out, result)
    if result.real_runs:
        from autotune.search.screen import real_run_summary

        console.print(real_run_summary(result.real_runs), highlight=False, soft_wrap=True)
    if output is not None:
        output.write_text(json.dumps(result.output_document(), indent=2) + "\n")
        out.print(f"best config written to [bold]{escape(str(output))}[/bold]", soft_wrap=True)
    if not result.best_measurement.ok:
        console.print(
            f"[red]no evaluated plan runs[/red] ({result.best_measurement.status}: "
            f"{escape(result.best_measurement.error or 'out of memory')}); try a larger budget or another "
            "method"
        )
        return 1
    return 0


def _print_result(out, result) -> None:
    from rich.markup import escape
    from rich.table import Table

    m = result.best_measurement
    summary = Table(title=escape(f"best plan: {result.method} on {result.cluster} / {result.model}"), show_header=False)
    summary.add_row("tokens/s", f"{m.tokens_per_s:,.0f}")
    summary.add_row("iteration time", f"{m.iteration_time_s:.3f} s")
    if m.expected_error:
        summary.add_row("expected error", escape(describe_error(m.expected_error, m.error_terms)))
    summary.add_row("MFU", f"{m.mfu:.1%}")
    summary.add_row("pipeline bubble" if result.backend == "sim" else "idle (measured)", f"{m.bubble_fraction:.1%}")
    summary.add_row("peak memory", f"{max(m.peak_memory_GiB.values(), default=0.0):.1f} GiB")
    summary.add_row("status", m.status if not m.oom else "oom")
    summary.add_row("evaluations", f"{result.evaluations} (budget {result.budget}, backend {result.backend})")
    if result.memory_screened:
        summary.add_row(
            "out of memory", f"{result.memory_screened} plans screened out by the memory model (no budget spent)"
        )
    if result.backend == "real":
        pruned = result.screened - result.memory_screened
        summary.add_row("screened out", f"{pruned} plans (corrected simulator; no budget spent)")
    cfg = result.best_config
    summary.add_row("micro-batch / schedule", f"{cfg.micro_batch_size} / {cfg.schedule}")
    if cfg.zero:  # ZeRO sharding
        summary.add_row("zero", f"{cfg.zero} across {len(cfg.pipelines)} replica(s)")
    if cfg.offloads:  # CPU offload: host memory per node (each stage's mode is in the plan table)
        for node, gib in m.host_memory_GiB.items():
            summary.add_row(escape(f"host memory {node}"), f"{gib:.1f} GiB")
    if cfg.expert_parallel > 1 or cfg.spes:
        summary.add_row(
            "expert parallel / sync every",
            f"{cfg.expert_parallel} / {cfg.sync_every_steps} steps"
            + (f" (sync {m.sync_time_s:.2f} s)" if m.sync_time_s else ""),
        )
    out.print(summary)
    plan = Table(title="pipelines (data-parallel replicas)")
    experts = any(p.trains_experts is not None for p in cfg.pipelines)
    offloads = cfg.offloads
    for col in (
        ("replica", "micro-batches", "stage", "devices", "layers", "recompute")
        + (("offload",) if offloads else ())
        + (("trains experts",) if experts else ())
    ):
        plan.add_column(col)
    for p, pipe in enumerate(cfg.pipelines):
        if pipe.roundpipe is not None:  # stages are not bound to devices: the pool and the partitions
            plan.add_row(
                str(p),
                str(pipe.num_microbatches),
                "roundpipe",
                ", ".join(pipe.roundpipe.devices),
                pipe.roundpipe.summary().split(" | ", 1)[1],
                pipe.roundpipe.recompute_grain,
            )
            continue
        for s, stage in enumerate(pipe.stages):
            row = [
                str(p) if s == 0 else "",
                str(pipe.num_microbatches) if s == 0 else "",
                str(s),
                escape(", ".join(stage.devices)),
                str(stage.layers),
                recompute_label(stage.recompute),
            ]
            if offloads:
                row.append(stage.offload)
            if experts:
                row.append(
                    ("all" if pipe.trains_experts is None else ",".join(map(str, pipe.trains_experts)))
                    if s == 0
                    else ""
                )
            plan.add_row(*row)
    out.print(plan)
    _print_summary(out, result)
    if result.run_id:
        uri = result.tracking_uri
        ui = "autotune ui" + ("" if uri == "sqlite:///mlflow.db" else f" --tracking-uri {uri}")
        out.print(f"MLflow: experiment [bold]{escape(result.experiment)}[/bold], store {escape(uri)}", soft_wrap=True)
        if result.run_url:
            out.print(f"        this search: {result.run_url}  (start the UI with `{ui}`)", soft_wrap=True)
        out.print(
            f"        compare the searches of this experiment: autotune compare --experiment "
            f"{escape(result.experiment)}",
            soft_wrap=True,
        )


def _print_summary(out, result) -> None:
    """The top plans and the numbers that sum a search up (``autotune.search.summary``)."""
    from rich.table import Table

    from autotune.search.tracking import config_key, plan_shape

    s = result.summary
    if s is None:
        return
    top = Table(title=f"top {len(s.top)} plans", title_justify="left")
    for col, just in (
        ("#", "right"),
        ("tokens/s", "right"),
        ("found at", "right"),
        ("iteration s", "right"),
        ("peak GiB", "right"),
        ("plan", "left"),
    ):
        top.add_column(col, justify=just)
    shapes = [plan_shape(ev.config) for ev in s.top]
    for rank, (ev, shape) in enumerate(zip(s.top, shapes), 1):
        m = ev.measurement
        if shapes.count(shape) > 1:  # same degrees: what else differs
            p = ev.config.pipelines
            if not ev.config.is_roundpipe:
                shape += f" layers {'-'.join(str(st.layers) for st in p[0].stages)} m {'-'.join(str(x.num_microbatches) for x in p)}"
            shape += f" #{config_key(ev.config)[:6]}"  # the plan's key (its child run's tag autotune.config_key)
        top.add_row(
            str(rank),
            f"{m.tokens_per_s:,.0f}",
            str(ev.index),
            f"{m.iteration_time_s:.3f}",
            f"{max(m.peak_memory_GiB.values(), default=0.0):.1f}",
            escape(shape[:90]),
        )
    out.print(top)
    lines = [
        f"best found at evaluation {s.found_at} of {s.evaluations}"
        + (
            f" ({s.evaluations - s.new_evaluations} of them before this run resumed)"
            if s.new_evaluations < s.evaluations
            else ""
        ),
        f"{s.new_evaluations} evaluations in {s.wall_time_s:.1f} s of searching (after loading): "
        + (
            f"{s.evaluations_per_s:.1f} per second"
            if s.evaluations_per_s >= 0.1 or not s.new_evaluations
            else f"{s.wall_time_s / s.new_evaluations:.0f} s per evaluation"
        ),
        f"{s.oom} evaluated plans out of memory"
        + (
            f" (and {result.memory_screened} more the memory model answered, no budget spent)"
            if result.memory_screened
            else ""
        )
        + f", {s.failed} failed, {s.invalid} invalid proposals (free: not evaluated"
        + (f"; {s.runner_limited} of them plans `autotune train` does not run" if s.runner_limited else "")
        + ")",
    ]
    if s.speedup_vs_uniform is not None:
        grid = (
            f"all {s.uniform_grid} plans of the uniform grid"
            if s.uniform_evaluations >= s.uniform_grid
            else f"a fixed sample of {s.uniform_evaluations} of the uniform grid's {s.uniform_grid} plans, the same "
            "for every budget and seed"
        )
        lines.append(
            f"{s.speedup_vs_uniform:.2f}x the best heterogeneity-blind uniform plan "
            f"({s.uniform_best_tokens_per_s:,.0f} tokens/s; {grid})"
        )
    elif result.backend == "real" and result.method != "uniform":
        lines.append(
            "speedup over uniform: not computed with --backend real (it would cost real runs; "
            "run --method uniform with the same budget to compare)"
        )
    for line in lines:
        out.print(line, highlight=False, soft_wrap=True)


def escape(text: str) -> str:
    from rich.markup import escape as rich_escape

    return rich_escape(str(text))
