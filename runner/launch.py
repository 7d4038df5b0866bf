"""Launch a job's ranks as subprocesses that can always be ended: ``profiled_run`` and ``RealEvaluator``.

Each rank is ``python -m runner.worker JOB.json`` with RANK / WORLD_SIZE in its environment and a
``file://`` rendezvous in a fresh temporary directory (no ports to race for). All ranks share one
new process group, so ``os.killpg`` ends every one of them: on the wall-clock timeout, or as soon
as one rank exits with an error (the others would otherwise wait in a collective until the
process-group timeout). The caller never hangs and always learns why a run ended.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from autotune.errors import SpecError
from autotune.lifeline import stop_signals_end
from autotune.loading import load_cluster, load_config, load_model
from autotune.specs import ClusterSpec, Measurement, ModelSpec, ParallelConfig
from runner.jobs import make_job, preflight

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parent.parent
_GRACE_S = 1.0  # after a rank fails, time the others get to write their own error before the kill


@dataclass
class RunOutcome:
    status: str  # ok | failed | oom | timeout
    error: str = ""
    result: dict | None = None
    errors: list[dict] = field(default_factory=list)
    wall_s: float = 0.0


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    from autotune.lifeline import child_env

    env = child_env()  # the child checks that this process is still its parent when it starts
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - exists but not ours
        return True


def _kill_group(pgid: int, procs: list[subprocess.Popen]) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in procs:
        p.wait()
    deadline = time.monotonic() + 5.0
    while _group_alive(pgid) and time.monotonic() < deadline:  # grandchildren, if any
        time.sleep(0.05)


def _kill_group_now(pgid: int) -> None:
    """SIGKILL the rank group ``pgid`` (0: not started yet); no wait, no lock: safe in a signal handler."""
    if pgid:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


_OWNER = "owner"
_RUN_DIR_PREFIXES = ("autotune-run-", "autotune-train-", "autotune-probe-")


def _process_token(pid: int) -> str | None:
    """``pid:start-time`` of a live process (the start time tells a reused pid apart), else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else f"{pid}:{fields[19]}"


def sweep_stale_run_dirs(root: str | Path | None = None) -> int:
    """Remove run directories whose owner process is gone (a launcher killed with SIGKILL cannot remove
    its own); called before each new run. Only directories with an ``owner`` file are touched."""
    root = Path(root or tempfile.gettempdir())
    removed = 0
    for d in root.iterdir() if root.is_dir() else ():
        if not d.name.startswith(_RUN_DIR_PREFIXES) or not d.is_dir():
            continue
        try:
            token = (d / _OWNER).read_text().strip()
        except OSError:
            continue
        pid = token.split(":", 1)[0]
        if pid.isdigit() and _process_token(int(pid)) != token:
            shutil.rmtree(d, ignore_errors=True)
            removed += 1
    if removed:
        log.info("removed %d run directories left by killed runs in %s", removed, root)
    return removed


def make_run_dir(prefix: str) -> Path:
    """A fresh temporary run directory owned by this process (after sweeping up stale ones)."""
    sweep_stale_run_dirs()
    run_dir = Path(tempfile.mkdtemp(prefix=prefix))
    (run_dir / _OWNER).write_text((_process_token(os.getpid()) or str(os.getpid())) + "\n")
    return run_dir


@contextlib.contextmanager
def run_dir(prefix: str):
    """``make_run_dir(prefix)``, removed on the way out (and swept by a later run if this one is killed)."""
    path = make_run_dir(prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_ranks(
    job: dict, world_size: int, timeout_s: float, keep_dir: bool = False, extra_env: dict[str, str] | None = None
) -> RunOutcome:
    """Run ``world_size`` ranks of ``job``; end them all by ``timeout_s``; collect rank 0's result.
    ``extra_env``: more environment for every rank (a roundpipe plan's ``CUDA_VISIBLE_DEVICES``)."""
    run_dir = make_run_dir("autotune-run-")
    keep = keep_dir or bool(os.environ.get("AUTOTUNE_KEEP_RUN_DIR"))
    job = {
        **job,
        "out_dir": str(run_dir),
        "init_method": f"file://{run_dir}/rendezvous",
        "pg_timeout_s": max(30.0, timeout_s),
    }
    job_path = run_dir / "job.json"
    job_path.write_text(json.dumps(job))
    procs: list[subprocess.Popen] = []
    logs = []
    t0 = time.monotonic()
    pgid = 0
    running = {"pgid": 0}
    finished = False
    status = "failed"
    # SIGTERM / Ctrl-C while the ranks run: the rank group is killed at once and the signal raised again
    # once they are reaped (autotune.lifeline.stop_signals_end: an interrupted Popen.poll() can lose its
    # wait lock, and the wait below then hung for ever: test_stopping_the_launcher_kills_the_ranks)
    with stop_signals_end(lambda: _kill_group_now(running["pgid"])) as stopped:
        try:
            for rank in range(world_size):
                env = worker_env(
                    {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), **(extra_env or {})}
                )
                out = open(run_dir / f"rank{rank}.log", "wb")
                logs.append(out)
                group = {"process_group": 0 if rank == 0 else pgid}  # one new group for all ranks
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "runner.worker", str(job_path)],
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        cwd=str(REPO_ROOT),
                        **group,
                    )
                )
                if rank == 0:
                    pgid = running["pgid"] = procs[0].pid
                if stopped:
                    break
            deadline = t0 + timeout_s
            while not stopped:
                if time.monotonic() >= deadline:
                    status = "timeout"
                    break
                codes = [p.poll() for p in procs]
                if any(c not in (None, 0) for c in codes):
                    status = "failed"
                    time.sleep(_GRACE_S)
                    break
                if all(c == 0 for c in codes):
                    status = "ok"
                    break
                time.sleep(0.05)
            finished = not stopped
        finally:  # also on any error: no rank outlives this call
            if pgid:
                _kill_group(pgid, procs)
            for f in logs:
                f.close()
            if not finished and not keep:
                shutil.rmtree(run_dir, ignore_errors=True)
    wall = time.monotonic() - t0
    outcome = _collect(run_dir, status, world_size, timeout_s, wall, procs)
    if stopped:
        outcome = RunOutcome(
            "failed",
            f"stopped by {signal.Signals(stopped[0]).name}; killed the ranks",
            errors=outcome.errors,
            wall_s=wall,
        )
    if keep:
        (run_dir / _OWNER).unlink(missing_ok=True)  # kept on purpose: not for the sweep
        log.info("run directory kept: %s", run_dir)
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    return outcome


def _collect(
    run_dir: Path, status: str, world: int, timeout_s: float, wall: float, procs: list[subprocess.Popen]
) -> RunOutcome:
    errors = []
    for r in range(world):
        path = run_dir / f"error-rank{r}.json"
        if path.exists():
            try:
                errors.append(json.loads(path.read_text()))
            except json.JSONDecodeError:
                errors.append({"rank": r, "type": "?", "message": "unreadable error report", "oom": False})
    result_path = run_dir / "result.json"
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    if status == "ok" and result is None:
        status = "failed"
    if status == "ok":
        return RunOutcome("ok", result=result, wall_s=wall)
    if status == "timeout":
        stuck = [str(r) for r, p in enumerate(procs) if p.returncode not in (0,)]
        msg = (
            f"no result after {timeout_s:g} s wall clock; killed {len(stuck)} rank process(es) "
            f"(ranks {', '.join(stuck)})"
        )
        if errors:
            msg += f"; rank {errors[0]['rank']} had failed: {errors[0]['type']}: {errors[0]['message']}"
        return RunOutcome("timeout", msg, errors=errors, wall_s=wall)
    if errors:
        # the cause is the earliest error that is not a peer losing its connection to the failed rank
        first = min(errors, key=lambda e: (_is_peer_loss(e), e.get("time", 0.0), e["rank"]))
        oom = any(e.get("oom") for e in errors)
        msg = f"rank {first['rank']} failed: {first['type']}: {first['message']}"
        return RunOutcome("oom" if oom else "failed", msg, errors=errors, wall_s=wall)
    codes = {r: p.returncode for r, p in enumerate(procs) if p.returncode}
    tail = ""
    for r in codes:
        log_path = run_dir / f"rank{r}.log"
        if log_path.exists():
            lines = log_path.read_text(errors="replace").strip().splitlines()
            tail = lines[-1] if lines else ""
            break
    return RunOutcome("failed", f"rank process(es) exited with {codes}; {tail}".strip("; "), wall_s=wall)


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def killed_ranks(torchrun_log: str) -> list[str]:
    """The ranks torchrun's failure summary lists with a negative exit code, i.e. killed by a signal (a crash in
    native code, such as glibc's abort on a corrupted heap, or the kernel's out-of-memory killer): they report
    no Python error, and their peers only lose them. As ``rank 1 (SIGABRT)``, in rank order."""
    import re

    found = {}
    for m in re.finditer(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*-(\d+)", torchrun_log):
        try:
            name = signal.Signals(int(m[2])).name
        except ValueError:
            name = f"signal {m[2]}"
        found[int(m[1])] = f"rank {m[1]} ({name})"
    return [found[r] for r in sorted(found)]


def output_tail(run_dir: Path, lines: int = 15) -> str:
    """The last ``lines`` non-empty lines of torchrun's output (``torchrun.log``) and of each rank's stdout and
    stderr that torchrun redirected under ``run_dir/torchrun``, each headed by its file's name; a rank's Python
    stack from a crash in native code (``faulthandler``'s "Fatal Python error") from its first line instead.
    First, the ranks that a signal killed (``killed_ranks``: torchrun's lines for them may be above the tail)."""
    torchrun_log = run_dir / "torchrun.log"
    killed, parts = [], []
    for path in [torchrun_log] + sorted((run_dir / "torchrun").glob("**/*.log")):
        try:
            raw = path.read_text(errors="replace")
        except OSError:
            continue
        if path == torchrun_log:
            killed = killed_ranks(raw)
        text = [line for line in raw.splitlines() if line.strip()]
        if not text:
            continue
        fatal = [i for i, line in enumerate(text) if line.startswith("Fatal Python error")]
        if fatal:  # the stack from its first line: its end is a list of extension modules
            quoted, where = text[fatal[-1] : fatal[-1] + 2 * lines], f"from line {fatal[-1] + 1}"
        else:
            quoted, where = text[-lines:], f"last {min(lines, len(text))}"
        parts.append(f"--- {path.relative_to(run_dir)} ({where} of {len(text)} lines)\n" + "\n".join(quoted))
    if killed:
        parts.insert(0, f"killed by a signal, without a Python error: {', '.join(killed)}")
    return "\n".join(parts)


def _is_peer_loss(error: dict) -> bool:
    text = error.get("message", "").lower()
    return error.get("type") == "DistBackendError" or any(
        k in text for k in ("connection closed by peer", "connection reset", "remote worker crashing", "broken pipe")
    )


def profiled_run(
    cluster: str | ClusterSpec,
    model: str | ModelSpec,
    config: str | Path | ParallelConfig | dict,
    *,
    steps: int = 3,
    warmup: int = 1,
    timeout_s: float = 300.0,
    seed: int = 0,
    global_batch_size: int | None = None,
) -> Measurement:
    """Train ``steps`` timed steps (after ``warmup``) of ``config`` on real ranks; return what was measured.

    Never raises for a bad plan: an invalid or unsupported plan gives status ``invalid`` / ``failed``,
    a crashed rank ``failed`` (or ``oom``), a hung one ``timeout``; ``error`` says why.
    """
    try:
        cluster = load_cluster(cluster)
        model = load_model(model, global_batch_size)
        config = load_config(config)
    except SpecError as e:
        return Measurement.failure("invalid", str(e))
    try:
        layout = preflight(cluster, model, config)
    except SpecError as e:
        return Measurement.failure("failed" if e.source == "runner" else "invalid", str(e))
    if config.is_roundpipe:  # one process drives the pool (runner.roundpipe_run); preflight checked its GPUs
        job = make_job("profile", cluster, model, config, steps=steps, warmup=warmup, seed=seed)
        outcome = run_ranks(job, 1, timeout_s, extra_env=layout.env())
        if outcome.status != "ok":
            return Measurement.failure(outcome.status, outcome.error, oom=outcome.status == "oom")
        return Measurement.from_dict(outcome.result["measurement"])
    gpus = _cuda_device_count() if any(cluster.device(d).name != "cpu" for d in config.devices) else 0
    if gpus and gpus < layout.world_size:
        return Measurement.failure(
            "failed",
            f"runner: the plan needs {layout.world_size} GPUs on this machine (one rank per device), it has {gpus}",
        )
    job = make_job("profile", cluster, model, config, steps=steps, warmup=warmup, seed=seed)
    outcome = run_ranks(job, layout.world_size, timeout_s)
    if outcome.status != "ok":
        return Measurement.failure(outcome.status, outcome.error, oom=outcome.status == "oom")
    return Measurement.from_dict(outcome.result["measurement"])


class RealEvaluator:
    """The evaluator interface (``autotune.evaluator.Evaluator``) backed by short profiled runs."""

    def __init__(
        self,
        cluster: str | ClusterSpec,
        model: str | ModelSpec,
        *,
        steps: int = 2,
        warmup: int = 1,
        timeout_s: float = 300.0,
        seed: int = 0,
    ) -> None:
        self.cluster = load_cluster(cluster)
        self.model = load_model(model)
        self.steps, self.warmup, self.timeout_s, self.seed = steps, warmup, timeout_s, seed

    def check(self, config: ParallelConfig) -> str | None:
        """Why the runner cannot run ``config`` here (``None`` when it can), without launching anything:
        the search treats such a plan as invalid for this backend instead of spending a real run on it."""
        try:
            preflight(self.cluster, self.model, config)
        except SpecError as e:
            return str(e)
        return None

    def evaluate(self, config: ParallelConfig) -> Measurement:
        try:
            return profiled_run(
                self.cluster,
                self.model,
                config,
                steps=self.steps,
                warmup=self.warmup,
                timeout_s=self.timeout_s,
                seed=self.seed,
            )
        except Exception as e:  # the interface never raises for a plan
            log.exception("profiled run crashed")
            return Measurement.failure("failed", f"{type(e).__name__}: {e}")
