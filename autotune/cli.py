"""The ``autotune`` command line (SPEC.md "Commands").

Each command's work lives in ``autotune.commands.<name>`` and is imported only when that command
runs, so ``autotune --help`` stays instant (no torch, sb3 or MLflow at import). Bad input raises
``SpecError``; ``main`` prints it as one line on stderr and exits 2, never a traceback. Usage errors
(missing or unknown option, unknown command, a value of the wrong type) are one line too, exit 2:
typer 0.29 raises the exceptions of the click it bundles (``typer._click``), older typer those of
``click`` itself, so ``main`` catches both. Anything else that escapes a command is one line, exit 1
(``AUTOTUNE_DEBUG=1`` shows the traceback).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import typer

from autotune.errors import is_interrupt

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Find and run the fastest training plan for an LLM on a mixed GPU cluster.",
)


def _flags_take_no_value() -> None:
    """typer 0.29's help shows ``<bool>`` beside a flag (``--json <bool>``) as if it took a value:
    show nothing there for flags (``tests/integration/cli/test_cli_usage.py`` checks every command's help)."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "_autotune", False):  # another typer: its help as it is
        return

    def display_type_rich(self, ctx):
        if getattr(self, "is_flag", False) and self.metavar is None:
            return None
        return shown(self, ctx)

    display_type_rich._autotune = True
    TyperOption.display_type_rich = display_type_rich


_flags_take_no_value()

ClusterOpt = typer.Option(..., "--cluster", help="Cluster YAML path or preset name.")
ModelOpt = typer.Option(
    ..., "--model", help="Model YAML path, preset name, or a Hugging Face config.json (or its directory)."
)
GbsOpt = typer.Option(None, "--global-batch-size", help="Override the model's global batch size (sequences).")
SeqLenOpt = typer.Option(None, "--seq-len", help="Override the model's training sequence length (tokens).")
ExperimentOpt = typer.Option(
    None, "--experiment", help="MLflow experiment (default: the one of the most recent search)."
)  # compare, best
StoreOpt = typer.Option(None, "--tracking-uri", help="MLflow store (default sqlite:///mlflow.db).")  # compare, best


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"autotune {version('autotune')}")
        except PackageNotFoundError:  # running from a source tree that was never installed
            typer.echo("autotune (not installed)")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Find and run the fastest training plan for an LLM on a mixed GPU cluster."""


def _model(model: str | None, global_batch_size: int | None, seq_len: int | None):
    """``--model`` as the command takes it: a Hugging Face config read here (its parameter count, what
    filled the values the file does not hold and what is not modelled said on stderr), a file or preset
    with ``--seq-len`` applied, else the reference itself (the command loads it)."""
    from autotune.loading import load_hf_model, load_model

    if model is None:  # train without --model or --init-from: the runner says what is missing
        return None
    hf = load_hf_model(model, seq_len, global_batch_size)
    if hf is None:  # --global-batch-size or --seq-len given: applied here, for every command alike
        return model if seq_len is None and global_batch_size is None else load_model(model, global_batch_size, seq_len)
    from rich.console import Console
    from rich.markup import escape

    err = Console(stderr=True, highlight=False)
    m = hf.model
    active = f", {_count(m.active_params)} active" if m.is_moe else ""
    err.print(
        escape(
            f"model {m.name} ({hf.family}): {_count(m.num_params)} parameters{active}; "
            f"the config implies {_count(hf.implied_params)}"
        )
    )
    for note in hf.notes:
        err.print(escape(f"  {note}"))
    for warning in hf.warnings:
        err.print(f"  [yellow]not modelled:[/yellow] {escape(warning)}")
    return m


def _count(n: int) -> str:
    """A parameter count as model cards write it: 8.030B, 124.4M, 98,304."""
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _run(module: str, **kwargs) -> None:
    try:
        code = importlib.import_module(f"autotune.commands.{module}").run(**kwargs)
    except (KeyboardInterrupt, Exception) as e:  # typer would turn Ctrl-C into a silent exit 130: say it
        if not is_interrupt(e):
            raise
        typer.echo("interrupted", err=True)
        raise typer.Exit(130) from None
    if code:
        raise typer.Exit(code)


@app.command()
def simulate(
    cluster: str = ClusterOpt,
    model: str = ModelOpt,
    config: Path = typer.Option(..., "--config", help="Parallel config JSON."),
    global_batch_size: int | None = GbsOpt,
    seq_len: int | None = SeqLenOpt,
    profile: Path | None = typer.Option(None, "--profile", help="Calibration profile from `autotune profile`."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    engine: str | None = typer.Option(
        None,
        "--engine",
        help="Predict the plan as this engine runs it: torchtitan | megatron | deepspeed (the loss's memory, a "
        "vocabulary-parallel head); without it, as `autotune train` runs it.",
    ),
) -> None:
    """Predict iteration time, throughput and memory of a plan with the simulator."""
    if engine is not None:  # before the model is read
        from autotune import engines

        engines.check_name(engine)
    _run(
        "simulate",
        cluster=cluster,
        model=_model(model, global_batch_size, seq_len),
        config=config,
        global_batch_size=global_batch_size,
        profile=profile,
        json_out=json_out,
        engine=engine,
    )


@app.command()
def measure(
    cluster: str = ClusterOpt,
    model: str = ModelOpt,
    config: Path = typer.Option(..., "--config", help="Parallel config JSON."),
    global_batch_size: int | None = GbsOpt,
    seq_len: int | None = SeqLenOpt,
    steps: int = typer.Option(3, "--steps", help="Timed steps (after warm-up)."),
    warmup: int = typer.Option(1, "--warmup", help="Warm-up steps, not timed."),
    timeout: float = typer.Option(300.0, "--timeout", help="Wall-clock limit for the whole run, seconds."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
) -> None:
    """Run a short profiled training run of a plan through the runner and report what it measured."""
    _run(
        "measure",
        cluster=cluster,
        model=_model(model, global_batch_size, seq_len),
        config=config,
        global_batch_size=global_batch_size,
        steps=steps,
        warmup=warmup,
        timeout=timeout,
        json_out=json_out,
    )


@app.command()
def profile(
    cluster: str = ClusterOpt,
    model: str | None = typer.Option(None, "--model", help="Model whose shapes to profile."),
    output: Path = typer.Option(Path("profile.json"), "--output", help="Where to write the profile."),
    quick: bool = typer.Option(False, "--quick", help="Fewer repetitions and micro-batch sizes (smoke runs, tests)."),
) -> None:
    """Micro-benchmark each device type and link of the cluster; write a calibration profile."""
    _run("profile", cluster=cluster, model=model, output=output, quick=quick)


@app.command()
def search(
    cluster: str = ClusterOpt,
    model: str = ModelOpt,
    method: str = typer.Option("rl", "--method", help="rl (default) | optuna | random | uniform | exhaustive | dp"),
    budget: int = typer.Option(100, "--budget", help="Number of evaluated plans."),
    global_batch_size: int | None = GbsOpt,
    seq_len: int | None = SeqLenOpt,
    backend: str = typer.Option("sim", "--backend", help="sim (simulator) or real (profiled runs)."),
    seed: int = typer.Option(
        0, "--seed", help="Seed of the method's random choices (0 to 2**32-1); another seed is another search."
    ),
    output: Path | None = typer.Option(
        None,
        "--output",
        help="Write the best config JSON here (the plan file measure and train take, plus its measurement).",
    ),
    tracking_uri: str | None = typer.Option(None, "--tracking-uri", help="MLflow store (default sqlite:///mlflow.db)."),
    experiment: str | None = typer.Option(None, "--experiment", help="MLflow experiment (default: cluster+model)."),
    storage: str | None = typer.Option(
        None,
        "--storage",
        help="Optuna storage: optuna.journal (the default, a journal file in the working directory), "
        "sqlite:///FILE or postgresql://USER@HOST/DB (several machines).",
    ),
    profile: Path | None = typer.Option(None, "--profile", help="Calibration profile for the simulator."),
    workers: int = typer.Option(1, "--workers", help="Optuna worker processes on one study."),
    policy: Path | None = typer.Option(
        None,
        "--policy",
        help="rl: the chooser's policy file (default: the shipped one); greedy-gain: the chooser's fixed rule; "
        "scratch: learn online, editing plans.",
    ),
    start: str = typer.Option(
        "dp",
        "--start",
        help="Where optuna (and rl --policy scratch) start: dp (the planner's best 3 "
        "plans, 3 evaluations) or heuristic (their own start plans).",
    ),
    max_sync_every: int = typer.Option(
        1,
        "--max-sync-every",
        help="MoE models: the largest sync_every_steps "
        "the search may choose (SPES; 1 = replicas synchronise every step).",
    ),
    run_timeout: float = typer.Option(
        300.0,
        "--run-timeout",
        help="--backend real: wall-clock limit of one "
        "profiled run, seconds (a plan that takes longer counts as status timeout).",
    ),
    fresh: bool = typer.Option(
        False,
        "--fresh",
        help="Start this search over instead of resuming it (the earlier "
        "one stays in the MLflow store and the Optuna storage).",
    ),
    engine: str | None = typer.Option(
        None,
        "--engine",
        help="Only plans this engine runs: torchtitan | megatron | deepspeed (docs/engines.md); the summary "
        "says how much faster the best plan without it is. Without it: only plans `autotune train` runs.",
    ),
    restrict: list[str] = typer.Option(
        [],
        "--restrict",
        help="Narrow one dimension of the search space to these choices: name=value[,value...], "
        "repeatable (e.g. --restrict pp=2,4 --restrict zero=0 --restrict roundpipe=false); the names are "
        "the dimensions of README's 'The search space'.",
    ),
) -> None:
    """Search for the fastest plan that fits; log every evaluation to MLflow.

    Re-running the same command resumes an interrupted search (or continues a finished one to a
    larger --budget); --fresh starts over."""
    _run(
        "search",
        cluster=cluster,
        model=_model(model, global_batch_size, seq_len),
        method=method,
        budget=budget,
        global_batch_size=global_batch_size,
        backend=backend,
        seed=seed,
        output=output,
        tracking_uri=tracking_uri,
        experiment=experiment,
        storage=storage,
        profile=profile,
        workers=workers,
        policy=policy,
        start=start,
        max_sync_every=max_sync_every,
        run_timeout=run_timeout,
        fresh=fresh,
        restrict=restrict,
        engine=engine,
    )


@app.command()
def export(
    plan: Path = typer.Argument(..., help="Plan JSON (search --output, or autotune best)."),
    to: str = typer.Option(..., "--to", help="torchtitan | megatron | deepspeed"),
    cluster: str | None = typer.Option(None, "--cluster", help="Check the plan against this cluster first."),
    model: str | None = typer.Option(
        None, "--model", help="Add the model's shape (YAML, preset or Hugging Face config.json)."
    ),
    global_batch_size: int | None = GbsOpt,
    seq_len: int | None = SeqLenOpt,
    output: Path | None = typer.Option(None, "--output", help="Write here instead of standard output."),
) -> None:
    """Write the plan as the engine's own configuration; exit 2 naming the part the engine cannot run."""
    _run(
        "export",
        plan=plan,
        engine=to,
        cluster=cluster,
        model=_model(model, global_batch_size, seq_len) if model is not None else None,
        output=output,
    )


@app.command()
def compare(
    experiment: str | None = ExperimentOpt,
    tracking_uri: str | None = StoreOpt,
    csv: bool = typer.Option(
        False, "--csv", help="Print CSV (one header line, one line per search) instead of a table."
    ),
) -> None:
    """One row per search in an experiment: method, budget, seed, backend, best tokens/s, found at, wall time."""
    _run("compare", experiment=experiment, tracking_uri=tracking_uri, csv=csv)


@app.command()
def best(
    experiment: str | None = ExperimentOpt,
    tracking_uri: str | None = StoreOpt,
) -> None:
    """Print the best config JSON recorded in MLflow."""
    _run("best", experiment=experiment, tracking_uri=tracking_uri)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train(
    ctx: typer.Context,
    cluster: str = ClusterOpt,
    model: str | None = typer.Option(
        None,
        "--model",
        help="Model YAML path, preset name, or a Hugging Face config.json (or its directory); default: --init-from.",
    ),
    config: Path = typer.Option(..., "--config", help="Parallel config JSON (e.g. from search --output)."),
    global_batch_size: int | None = GbsOpt,
    seq_len: int | None = SeqLenOpt,
    steps: int = typer.Option(
        10, "--steps", help="Train until this optimizer step (a resumed run counts the steps before its checkpoint)."
    ),
    checkpoint_dir: Path | None = typer.Option(
        None, "--checkpoint-dir", help="Directory for checkpoints (torch.distributed.checkpoint; one train at a time)."
    ),
    checkpoint_every: int = typer.Option(
        0, "--checkpoint-every", help="Checkpoint every K steps (0: only at the end)."
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue from the checkpoint in --checkpoint-dir (the one 'latest' names, else the newest complete one).",
    ),
    metrics_out: Path | None = typer.Option(None, "--metrics-out", help="Append one JSON line per step."),
    data: Path | None = typer.Option(
        None,
        "--data",
        help="Text file, JSONL file or a directory of them, tokenized with --init-from's tokenizer (without "
        "one: a text file as bytes); default synthetic.",
    ),
    tracking_uri: str | None = typer.Option(None, "--tracking-uri", help="Also log steps to MLflow."),
    seed: int = typer.Option(0, "--seed", help="Seed of the weights and the synthetic data."),
    init_from: Path | None = typer.Option(
        None, "--init-from", help="Start from this Hugging Face checkpoint directory (config, safetensors, tokenizer)."
    ),
    save_hf: Path | None = typer.Option(
        None, "--save-hf", help="Write the trained model here as a Hugging Face checkpoint directory."
    ),
    lr: float = typer.Option(1e-3, "--lr", help="Peak learning rate (AdamW)."),
    warmup_steps: int = typer.Option(0, "--warmup-steps", help="Steps of linear warm-up from 0."),
    lr_schedule: str = typer.Option("constant", "--lr-schedule", help="After warm-up: constant | cosine | linear."),
    min_lr_ratio: float = typer.Option(0.0, "--min-lr-ratio", help="cosine / linear end at this fraction of --lr."),
    weight_decay: float = typer.Option(0.1, "--weight-decay", help="AdamW weight decay."),
    clip_grad_norm: float = typer.Option(0.0, "--clip-grad-norm", help="Clip the global gradient norm (0: off)."),
    compile_blocks: bool = typer.Option(
        False, "--compile", help="torch.compile each transformer block (dense models; compiles on the first step)."
    ),
) -> None:
    """Train the model with a plan on torch.distributed (torchrun); extra args go to torchrun.

    Several machines: run the same command on each with torchrun's flags, e.g. --nnodes 2
    --node-rank 0 --nproc-per-node 4 --master-addr HOST --master-port 29500 (README)."""
    _run(
        "train",
        cluster=cluster,
        model=_model(model or (str(init_from) if init_from else None), global_batch_size, seq_len),
        config=config,
        global_batch_size=global_batch_size,
        steps=steps,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        resume=resume,
        metrics_out=metrics_out,
        data=data,
        tracking_uri=tracking_uri,
        seed=seed,
        torchrun_args=list(ctx.args),
        init_from=init_from,
        save_hf=save_hf,
        settings=dict(
            lr=lr,
            warmup_steps=warmup_steps,
            schedule=lr_schedule,
            min_lr_ratio=min_lr_ratio,
            weight_decay=weight_decay,
            clip_grad_norm=clip_grad_norm,
        ),
        compile_blocks=compile_blocks,
    )


@app.command()
def discover(
    output: Path = typer.Option(Path("cluster.yaml"), "--output", help="Where to write the cluster file."),
    name: str = typer.Option("discovered", "--name", help="The cluster's name in the file."),
) -> None:
    """Write the cluster file of this machine (under torchrun on several machines: all of them, links measured)."""
    _run("discover", output=output, name=name)


@app.command()
def ui(
    tracking_uri: str | None = typer.Option(
        None, "--tracking-uri", help="MLflow store to show (default sqlite:///mlflow.db)."
    ),
    port: int = typer.Option(5000, "--port", help="Port of the UI on 127.0.0.1."),
) -> None:
    """Start the MLflow UI on 127.0.0.1 for the local store."""
    _run("ui", tracking_uri=tracking_uri, port=port)


MAX_ERROR_CHARS = 600  # one line, whatever a message echoes


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + f"... ({len(text)} characters)"


def _click_modules() -> list:
    """The exception modules of both click flavours: typer's bundled copy and click itself."""
    mods = []
    for name in ("typer._click.exceptions", "click.exceptions"):
        try:
            mods.append(importlib.import_module(name))
        except ImportError:
            pass
    return mods


def _usage_error(e: BaseException) -> int | None:
    """Print a click usage error (either flavour) as one line; its exit code, or None if it is not one."""
    for mod in _click_modules():
        no_args = getattr(mod, "NoArgsIsHelpError", None)
        if no_args is not None and isinstance(e, no_args):  # bare `autotune`: the help, as --help prints it
            typer.echo(e.format_message())
            return 0
        if isinstance(e, mod.ClickException):
            ctx = getattr(e, "ctx", None)
            where = f"{ctx.command_path}: " if ctx is not None else ""
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            typer.echo(f"error: {_one_line(where + e.format_message())}{hint}", err=True)
            return e.exit_code
        exit_type = getattr(mod, "Exit", None)
        if exit_type is not None and isinstance(e, exit_type):
            return e.exit_code
        abort_type = getattr(mod, "Abort", None)
        if abort_type is not None and isinstance(e, abort_type):
            typer.echo("aborted", err=True)
            return 130
    return None


def main() -> None:
    import os

    from autotune.errors import SpecError

    try:
        code = app(standalone_mode=False)
        if isinstance(code, int) and code:  # click returns typer.Exit's code instead of raising here
            sys.exit(code)
    except SpecError as e:
        typer.echo(f"error: {_one_line(e)}", err=True)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as e:
        code = _usage_error(e)
        if code is not None:
            sys.exit(code)
        if os.environ.get("AUTOTUNE_DEBUG"):
            raise
        typer.echo(f"error: {_one_line(f'{type(e).__name__}: {e}')} (AUTOTUNE_DEBUG=1 shows the traceback)", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
