"""Full training of a plan: ``train`` launches ``torchrun`` with one rank per device; ``train_rank`` is the
loop each rank runs (``runner.worker`` in ``train`` mode).

Per optimizer step rank 0 appends ``{"step", "loss", "tokens_per_s"}`` to ``--metrics-out`` and,
with a tracking URI, logs the same to MLflow. ``step`` counts optimizer steps done (1 = first).
Checkpoints every ``checkpoint_every`` steps and at the end; ``resume`` continues from the newest
one. The data of step ``k`` depends only on ``(seed, k)``, so a resumed run sees exactly the data
the uninterrupted run would have seen.

SIGTERM (sent to ``autotune train``, to torchrun, or to any rank) and Ctrl-C (SIGINT to ``autotune
train``; torchrun runs in its own session, so the terminal's SIGINT reaches only the launcher, which
passes it on as SIGTERM) stop the run cleanly: ranks agree on it in the step's closing all-reduce,
finish that step together, write a checkpoint and exit 0. A second Ctrl-C kills the ranks at once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from autotune.errors import SpecError
from autotune.loading import load_cluster, load_config, load_model
from autotune.specs import ModelSpec, ParallelConfig
from runner.metrics import MlflowLogger

log = logging.getLogger(__name__)

_MULTI_NODE_FLAGS = (
    "--nnodes",
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--master-addr",
    "--master_addr",
    "--rdzv-backend",
    "--rdzv_backend",
    "--node-rank",
    "--node_rank",
)


# --------------------------------------------------------------------------------------------------
# Each rank


def train_rank(
    job: dict, layout, model: ModelSpec, config: ParallelConfig, rank: int, device, fault: Callable[[int], None]
) -> None:
    import torch  # noqa: F401  (worker side only)

    from runner import checkpoint
    from runner.data import TokenSource
    from runner.engine import Engine
    from runner.optim import TrainSettings

    seed = int(job.get("seed", 0))
    settings = TrainSettings(**job.get("settings", {}))
    tokens = TokenSource(model, seed, job.get("data"), job.get("tokenizer"))
    resume = Path(job["resume_from"]) if job.get("resume_from") else None
    engine = Engine(
        layout,
        model,
        rank,
        device,
        schedule=config.schedule,
        seed=seed,
        tokens=tokens,
        settings=settings,
        init_from=job.get("init_from"),
        fsdp=not (resume and checkpoint.holds_zero_units(resume)),  # checkpointed by runner.zero: keep it
        compile_blocks=bool(job.get("compile_blocks")),
    )
    ckpt_dir = job.get("checkpoint_dir")
    every = int(job.get("checkpoint_every") or 0)
    start = 0
    if resume:  # chosen by the launcher (checkpoint.resume_point) before any rank started
        start = checkpoint.load(resume, engine)

    stop = {"requested": False}

    def on_stop(signum, frame):  # finish the step, checkpoint, exit
        stop["requested"] = True

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)  # torchrun passes on the signal it got
    metrics = open(job["metrics_out"], "a") if rank == 0 and job.get("metrics_out") else None
    progress = open(job["progress_out"], "a") if rank == 0 and job.get("progress_out") else None
    tracker = MlflowLogger(job, config, model) if rank == 0 and job.get("tracking_uri") else None
    fault(rank)
    tokens_per_step = model.global_batch_size * model.seq_len
    done = start
    saved_at = start if start else -1
    try:
        for index in range(start, int(job["steps"])):
            lr = settings.lr_at(index, int(job["steps"]))
            result = engine.step(index, stop_requested=stop["requested"], lr=lr)
            done = index + 1
            record = {"step": done, "loss": result.loss, "tokens_per_s": tokens_per_step / result.time_s}
            if result.grad_norm is not None:
                record["grad_norm"] = result.grad_norm
            if rank == 0:
                if job.get("log_steps", True):
                    log.info("step %d loss %.4f %.0f tokens/s", done, result.loss, record["tokens_per_s"])
                for f in (metrics, progress):
                    if f:
                        f.write(json.dumps(record) + "\n")
                        f.flush()
                if tracker:
                    tracker.log(record)
            if ckpt_dir and (result.stop or (every and done % every == 0)):
                checkpoint.save(ckpt_dir, engine, done, weights=bool(job.get("full_weights")))
                saved_at = done
            if result.stop:
                log.info("stopped by a signal after step %d", done)
                break
        if ckpt_dir and saved_at != done:
            checkpoint.save(ckpt_dir, engine, done, weights=bool(job.get("full_weights")))
        if rank == 0:
            Path(job["out_dir"], "result.json").write_text(
                json.dumps({"steps_done": done, "stopped": stop["requested"]})
            )
    finally:
        for f in (metrics, progress):
            if f:
                f.close()
        if tracker:
            tracker.close()


# --------------------------------------------------------------------------------------------------
# The launcher (`autotune train`)


@dataclass
class TrainOutcome:
    returncode: int
    steps_done: int = 0
    stopped: bool = False
    errors: list[dict] = field(default_factory=list)
    steps_run: int = 0  # optimizer steps this run did (a resumed run starts after the checkpoint's)
    mean_tokens_per_s: float = 0.0  # over this run's steps after the first (the first includes warm-up)
    final_loss: float | None = None
    wall_time_s: float = 0.0  # launch to exit, torchrun's start-up included
    rank0_here: bool = True  # False on the machines of a multi-node run that do not run rank 0 (no step report)
    stop_signal: str = ""  # "SIGINT" / "SIGTERM" when stopped before the requested steps (returncode 130 / 143)
    saved_hf: str = ""  # --save-hf: the Hugging Face checkpoint directory written
    output_tail: str = (
        ""  # a quiet run that failed with no rank's own error: the end of torchrun's and the ranks' output
    )

    @property
    def error(self) -> str:
        if self.stopped and not self.errors:
            return f"stopped by {self.stop_signal} after step {self.steps_done} (checkpoint written)"
        if not self.errors:
            if self.returncode == 0:
                return ""
            tail = f"; its output ends:\n{self.output_tail}" if self.output_tail else ""
            return f"torchrun exited with {self.returncode}{tail}"
        from runner.launch import _is_peer_loss

        e = min(self.errors, key=lambda e: (_is_peer_loss(e), e.get("time", 0.0), e["rank"]))
        tail = (
            f"\n(no rank reported a failure of its own; the output ends:)\n{self.output_tail}"
            if self.output_tail
            else ""
        )
        return f"rank {e['rank']} failed: {e['type']}: {e['message']}{tail}"


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun's session (torchrun and its ranks)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class _StepReader:
    """Reads the lines rank 0 appends to the progress file as they arrive."""

    def __init__(self, path: Path, on_step: Callable[[dict], None] | None) -> None:
        self.path, self.on_step = path, on_step
        self.records: list[dict] = []
        self._offset = 0
        self._partial = ""

    def poll(self) -> None:
        try:
            with open(self.path) as f:
                f.seek(self._offset)
                chunk = f.read()
                self._offset = f.tell()
        except OSError:
            return
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            self.records.append(record)
            if self.on_step is not None:
                self.on_step(record)


def _wait(proc: subprocess.Popen, timeout_s: float | None, poll: Callable[[], None], every_s: float = 0.5) -> int:
    """``proc.wait(timeout_s)`` that calls ``poll()`` every ``every_s`` meanwhile."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        step = every_s if deadline is None else max(0.0, min(every_s, deadline - time.monotonic()))
        try:
            return proc.wait(timeout=step)
        except subprocess.TimeoutExpired:
            poll()
            if deadline is not None and time.monotonic() >= deadline:
                raise


#: torchrun options autotune sets itself (the program it launches): not for the user to pass through
_OWN_TORCHRUN_OPTIONS = ("-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path", "-h", "--help")


def check_torchrun_args(torchrun_args: list[str]) -> None:
    """Every pass-through argument is one of torchrun's options, spelled out (torchrun's parser accepts a
    prefix: ``--nnode 2`` would mean ``--nnodes 2`` and wait for a second machine for ten minutes), with its
    value where it takes one; else one SpecError naming it, before anything is launched."""
    import difflib

    from torch.distributed.run import get_args_parser

    actions = {s: a for a in get_args_parser()._actions for s in a.option_strings if s not in _OWN_TORCHRUN_OPTIONS}
    args = list(torchrun_args)
    i = 0
    while i < len(args):
        name, eq, _ = args[i].partition("=")
        if name not in actions:
            close = difflib.get_close_matches(name, list(actions), n=1)
            hint = f" (did you mean {close[0]}?)" if close else f" (torchrun's options: {', '.join(sorted(actions))})"
            what = "is not a torchrun option" if name.startswith("-") else "is not an option of train or torchrun"
            raise SpecError("train", name, what + hint)
        if actions[name].nargs != 0 and not eq:
            if i + 1 >= len(args):
                raise SpecError("torchrun", name, "needs a value")
            i += 1
        i += 1


def _node_rank(torchrun_args: list[str] | None) -> int:
    """torchrun's ``--node-rank`` among ``torchrun_args`` (0 when not given: one machine, or node 0)."""
    args = list(torchrun_args or [])
    for i, a in enumerate(args):
        name, _, value = a.partition("=")
        if name in ("--node-rank", "--node_rank"):
            value = value if _ else (args[i + 1] if i + 1 < len(args) else "0")
            try:
                return int(value)
            except ValueError:
                raise SpecError("torchrun", name, f"must be an integer, got {value!r}") from None
    return 0


def torchrun_command(world_size: int, job_path: Path, torchrun_args: list[str], quiet: bool = False) -> list[str]:
    """``python -m torch.distributed.run`` for ``job_path``: ``--standalone`` unless multi-node flags are given;
    torchrun's own log folder inside the run directory (removed with it) unless ``--log-dir`` is given;
    ``quiet``: each rank's output into that folder (``--redirects 3``) unless the caller says otherwise."""
    args = list(torchrun_args)
    flags = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    cmd = [sys.executable, "-m", "runner.torchrun"]  # torch.distributed.run that dies with its parent
    if not flags & set(_MULTI_NODE_FLAGS) and "--standalone" not in flags:
        cmd.append("--standalone")
    if not flags & {"--nproc-per-node", "--nproc_per_node"}:
        if flags & set(_MULTI_NODE_FLAGS):
            raise SpecError(
                "torchrun",
                "--nproc-per-node",
                f"is required with multi-node flags (the config has "
                f"{world_size} devices in all; give each node's count)",
            )
        cmd += ["--nproc-per-node", str(world_size)]
    if not flags & {"--log-dir", "--log_dir"}:  # else torchrun leaves a /tmp/torchelastic_* folder per run
        cmd += ["--log-dir", str(job_path.parent / "torchrun")]
    if quiet and not flags & {"--redirects", "--tee", "-r", "-t"}:
        cmd += ["--redirects", "3"]
    return cmd + args + ["-m", "runner.worker", str(job_path)]


def train(
    cluster,
    model,
    config,
    *,
    steps: int,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    metrics_out: str | Path | None = None,
    data: str | Path | None = None,
    tracking_uri: str | None = None,
    seed: int = 0,
    torchrun_args: list[str] | None = None,
    global_batch_size: int | None = None,
    timeout_s: float | None = None,
    quiet: bool = False,
    on_step: Callable[[dict], None] | None = None,
    init_from: str | Path | None = None,
    save_hf: str | Path | None = None,
    settings=None,
    compile_blocks: bool = False,
) -> TrainOutcome:
    """Train ``model`` under ``config`` for ``steps`` optimizer steps on torchrun-launched ranks.

    Bad input raises SpecError before anything is launched. ``timeout_s`` (tests) kills the whole
    job after that many seconds. ``on_step(record)`` hears of each step rank 0 finishes
    (``{"step", "loss", "tokens_per_s"}``; rank 0 on this machine only), and rank 0 then leaves the
    per-step log lines to it. The outcome sums the run up (steps, mean tokens/s, final loss, wall time).
    ``init_from`` (a Hugging Face checkpoint directory; also the model when ``model`` is None),
    ``save_hf`` and ``settings`` (``runner.optim.TrainSettings``): ``runner.finetune``. ``compile_blocks``:
    ``torch.compile`` each transformer block (``runner.model.compile_blocks``; not RoundPipe or MoE plans).
    """
    from runner.data import TokenSource
    from runner.finetune import FineTuning
    from runner.jobs import preflight

    check_torchrun_args(torchrun_args or [])
    cluster = load_cluster(cluster)
    if model is None and init_from is None:
        raise SpecError("train", "", "give --model, or --init-from a Hugging Face checkpoint directory")
    model = load_model(model if model is not None else str(init_from), global_batch_size)
    config = load_config(config)
    layout = preflight(cluster, model, config)
    tuning = FineTuning.of(init_from, save_hf, settings)
    tuning.check(model, config, layout, data)
    _check_engine_options(model, config, checkpoint_dir, resume, compile_blocks)
    _check_options(steps, checkpoint_every, resume, checkpoint_dir, seed, metrics_out, tracking_uri)
    if data is not None:  # checks the file, the tokenizer and the vocabulary now, with a clear error
        TokenSource(model, seed, data, tuning.tokenizer)
    from runner import checkpoint
    from runner.launch import make_run_dir

    # one trainer per directory, holding no other run's checkpoints (checkpoint.hold); node 0 holds a shared one
    node0 = checkpoint_dir is not None and _node_rank(torchrun_args) == 0
    held = checkpoint.hold(checkpoint_dir, model, config, resume) if node0 else None
    try:
        resume_from = checkpoint.resume_point(checkpoint_dir) if resume else None
        if resume_from is not None and metrics_out is not None:
            _drop_rows_after(Path(metrics_out), checkpoint.step_of(resume_from))  # they are trained again
        run_dir = make_run_dir("autotune-train-")
        # --save-hf converts the last checkpoint: without --checkpoint-dir, one in the run directory
        ckpt_dir = checkpoint_dir if checkpoint_dir is not None or save_hf is None else run_dir / "checkpoints"
        try:
            job_path = _write_job(
                run_dir,
                cluster,
                model,
                config,
                steps=steps,
                seed=seed,
                checkpoint_dir=ckpt_dir,
                checkpoint_every=checkpoint_every,
                resume_from=resume_from,
                metrics_out=metrics_out,
                data=data,
                tracking_uri=tracking_uri,
                log_steps=on_step is None,
                tuning=tuning,
                compile_blocks=compile_blocks,
            )
            outcome = _launch(
                run_dir,
                job_path,
                config,
                layout,
                torchrun_args=torchrun_args,
                timeout_s=timeout_s,
                quiet=quiet,
                on_step=on_step,
            )
            finished = outcome.returncode == 0 or (outcome.stopped and not outcome.errors)  # a clean stop too
            if tuning.save_hf is not None and finished and _node_rank(torchrun_args) == 0:
                outcome.saved_hf = str(tuning.write_hf(Path(ckpt_dir), model, seed))
            return outcome
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        if held is not None:
            held.close()


def _check_engine_options(model, config, checkpoint_dir, resume: bool, compile_blocks: bool) -> None:
    """Refuse in one line what the plan's engine does not do: ``--compile`` outside dense pipeline plans,
    checkpoints of a RoundPipe plan."""
    if compile_blocks and (config.is_roundpipe or model.is_moe):
        what = "RoundPipe plans" if config.is_roundpipe else "MoE models"
        raise SpecError("--compile", "", f"compiles the blocks of dense models on the pipeline engine, not {what}")
    if config.is_roundpipe:
        from runner.roundpipe_run import refuse_checkpoints

        refuse_checkpoints(checkpoint_dir, resume)


def _drop_rows_after(path: Path, step: int) -> None:
    """Keep the ``--metrics-out`` rows of steps up to ``step`` (a resume trains the later ones again)."""
    if not path.is_file():
        return
    kept, dropped = [], 0
    for line in path.read_text(errors="replace").splitlines(keepends=True):
        try:
            row_step = json.loads(line).get("step")
        except (json.JSONDecodeError, AttributeError):
            row_step = None
        if isinstance(row_step, int) and row_step > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
        log.info("--metrics-out: dropped %d rows of steps after %d (resumed from step %d)", dropped, step, step)


def _ranks_of(pid: int) -> list[int]:
    """The child processes of ``pid`` (torchrun's ranks), from /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(entry.name))
    return children


def _launch(
    run_dir: Path,
    job_path: Path,
    config,
    layout,
    *,
    torchrun_args,
    timeout_s,
    quiet,
    on_step=None,
) -> TrainOutcome:
    """Run torchrun on ``job_path`` (written by ``_write_job``) and wait for it, forwarding Ctrl-C and
    SIGTERM to the ranks so that they checkpoint; rank 0's steps are read from ``run_dir``."""
    from runner.launch import worker_env

    cmd = torchrun_command(layout.world_size, job_path, torchrun_args or [], quiet)
    # a quiet run keeps torchrun's output (and, through --redirects, each rank's) in the run directory:
    # a failure with no rank error quotes their ends (``output_tail``)
    out = open(run_dir / "torchrun.log", "wb") if quiet else None
    # its own session: a terminal's Ctrl-C reaches only this process, which decides what the ranks get;
    # runner.torchrun dies with this process (and its ranks with it), even on SIGKILL
    # a roundpipe plan: one process whose CUDA devices are the pool (runner.roundpipe_run)
    extra = layout.env() if config.is_roundpipe else None
    proc = subprocess.Popen(cmd, env=worker_env(extra), stdout=out, stderr=out, start_new_session=True)
    interrupts = {"n": 0}

    def stop_ranks() -> None:
        """SIGTERM to the ranks themselves: they finish the step, checkpoint and exit 0, and torchrun ends
        as after any run (SIGTERM to torchrun would stop them too, but with its SignalException traceback)."""
        ranks = _ranks_of(proc.pid)
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        if not ranks:  # none started yet
            proc.send_signal(signal.SIGTERM)

    def forward(signum, frame):
        interrupts["signal"] = signum
        if signum == signal.SIGINT:
            interrupts["n"] += 1
            if interrupts["n"] > 1:  # a second Ctrl-C: stop now, without the checkpoint
                log.warning("second interrupt: killing the ranks")
                _kill_group(proc)
                return
            log.warning("interrupted: finishing the current step and writing a checkpoint (Ctrl-C again to kill)")
        stop_ranks()

    # handlers can only be installed from the main thread; elsewhere (a library caller's thread) the
    # caller's own signal handling stays in charge
    in_main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)} if in_main else {}
    progress = _StepReader(run_dir / "progress.jsonl", on_step)
    started = time.monotonic()
    try:
        try:
            code = _wait(proc, timeout_s, progress.poll)
        except subprocess.TimeoutExpired:
            stop_ranks()
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                code = proc.wait()
    except BaseException:  # this process is dying: take torchrun and the ranks with it
        _kill_group(proc)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if out is not None:
            out.close()
    progress.poll()
    return _outcome(run_dir, code, time.monotonic() - started, progress.records, interrupts.get("signal"))


def _check_options(steps, checkpoint_every, resume, checkpoint_dir, seed, metrics_out, tracking_uri) -> None:
    """``train``'s own options, each refused in one line before anything starts."""
    if steps < 1:
        raise SpecError("--steps", "", f"must be >= 1, got {steps}")
    if checkpoint_every < 0:
        raise SpecError("--checkpoint-every", "", f"must be >= 0, got {checkpoint_every}")
    if resume and checkpoint_dir is None:
        raise SpecError("--resume", "", "needs --checkpoint-dir")
    from autotune import prechecks

    prechecks.seed(seed)
    if metrics_out is not None:
        prechecks.writable_file(metrics_out, "--metrics-out")
    if checkpoint_dir is not None:
        prechecks.writable_dir(checkpoint_dir, "--checkpoint-dir")
    prechecks.tracking_uri(tracking_uri)


def _write_job(
    run_dir: Path,
    cluster,
    model,
    config,
    *,
    steps,
    seed,
    checkpoint_dir,
    checkpoint_every,
    resume_from,
    metrics_out,
    data,
    tracking_uri,
    log_steps: bool,
    tuning=None,
    compile_blocks: bool = False,
) -> Path:
    """The job file every rank reads (``runner.jobs.make_job``), written into the run directory."""
    from runner.jobs import make_job

    job = make_job(
        "train",
        cluster,
        model,
        config,
        steps=steps,
        seed=seed,
        out_dir=str(run_dir),
        checkpoint_dir=str(Path(checkpoint_dir).resolve()) if checkpoint_dir else None,
        checkpoint_every=checkpoint_every,
        resume_from=str(resume_from) if resume_from else None,
        metrics_out=str(Path(metrics_out).resolve()) if metrics_out else None,
        data=str(Path(data).resolve()) if data else None,
        tracking_uri=tracking_uri,
        pg_timeout_s=1800,
    )
    if tuning is not None:
        job["settings"] = tuning.settings.to_dict()
        job["init_from"] = str(tuning.init_from) if tuning.init_from else None
        job["tokenizer"] = str(tuning.tokenizer) if tuning.tokenizer and data else None
        job["full_weights"] = tuning.save_hf is not None  # a sharded plan's checkpoints carry them too
    job["progress_out"] = str(run_dir / "progress.jsonl")  # rank 0's steps, for on_step and the summary
    job["log_steps"] = log_steps  # rank 0 logs each step unless on_step hears of them
    job["compile_blocks"] = compile_blocks
    job_path = run_dir / "job.json"
    job_path.write_text(json.dumps(job))
    return job_path


def _outcome(run_dir: Path, code: int, wall_s: float, records: list[dict], stop_signal: int | None) -> TrainOutcome:
    """What the run did, from torchrun's exit code, rank 0's step records and the ranks' result files. A run
    the ranks stopped cleanly on a signal (step finished, checkpoint written) ends 128 + the signal, as a
    shell reports it: 130 for SIGINT (Ctrl-C), 143 for SIGTERM (the launcher's, or the ranks' own when
    something else sent it to them); 0 only when every requested step was done."""
    outcome = TrainOutcome(code, wall_time_s=wall_s)
    if records:
        outcome.steps_run = len(records)
        rates = [r["tokens_per_s"] for r in records[1:]] or [records[0]["tokens_per_s"]]
        outcome.mean_tokens_per_s = sum(rates) / len(rates)
        outcome.final_loss = records[-1]["loss"]
    result = run_dir / "result.json"
    outcome.rank0_here = result.exists() or bool(records)
    if result.exists():
        info = json.loads(result.read_text())
        outcome.steps_done, outcome.stopped = info["steps_done"], info["stopped"]
        if outcome.stopped:  # a clean stop: the step finished, the checkpoint written
            sig = signal.Signals(stop_signal) if stop_signal is not None else signal.SIGTERM
            outcome.returncode, outcome.stop_signal = 128 + int(sig), sig.name
    for path in sorted(run_dir.glob("error-rank*.json")):
        outcome.errors.append(json.loads(path.read_text()))
    from runner.launch import _is_peer_loss

    if code != 0 and not outcome.stopped and all(_is_peer_loss(e) for e in outcome.errors):
        from runner.launch import output_tail

        outcome.output_tail = output_tail(run_dir)  # nobody said why: what torchrun and the ranks printed
    return outcome
