"""The MLflow record written by a process of its own (``BackgroundTracker``), beside the search.

An MLflow child run costs tens of milliseconds of CPU in MLflow's SQLAlchemy store; a simulator
evaluation costs a few. Written in the search's process, the record would be most of a search's
time; written by a second process it runs on the other core while the search goes on.

``BackgroundTracker`` has the ``SearchTracker`` interface the search uses. Calls whose answer the
search needs (``start``, ``recorded``, ``run_exists``, ``finish`` ...) wait for the writer; the
per-plan ``log_evaluation`` and ``log_parent_metrics`` are queued and return at once, in order.
``finish`` waits until everything queued is written. An error in a queued call is raised by the next
call that waits. The writer ignores Ctrl-C (the search's process handles it and then finishes the
record) and dies with the search's process (``autotune.lifeline``); what was still queued when the
search was killed is missing from MLflow but not from the Optuna study, and a resumed search logs
it (``api.tune``; the other methods evaluate those plans again).
"""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_ASYNC = frozenset({"log_evaluation", "log_parent_metrics"})


class WriterError(RuntimeError):
    """An MLflow call failed in the writer process."""


def _serve(tracking_uri: str | None, experiment: str, description: str, calls, replies, parent_pid: int) -> None:
    import signal

    from autotune.lifeline import die_with_parent

    die_with_parent(parent=parent_pid)  # a killed search takes its writer along (what it queued is in the study)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the search's to handle; it then calls finish
    from autotune.search.tracking import quiet_libraries

    quiet_libraries()
    from autotune.search.tracking import SearchTracker

    try:
        tracker = SearchTracker(tracking_uri, experiment, description=description)
        replies.put((0, True, (tracker.tracking_uri, tracker.experiment_id)))
    except BaseException as e:  # noqa: BLE001 - reported to the search, which raises it
        replies.put((0, False, f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            msg = calls.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent_pid:  # the search's process is gone, and so is anything it queued
                return
            continue
        if msg is None:
            return
        seq, name, args, kwargs = msg
        try:
            value = getattr(tracker, name)(*args, **kwargs)
            replies.put((seq, True, value if name not in _ASYNC else None))
        except BaseException as e:  # noqa: BLE001
            replies.put((seq, False, f"{type(e).__name__}: {e}"))


class BackgroundTracker:
    """A ``SearchTracker`` in a writer process (see the module docstring)."""

    def __init__(self, tracking_uri: str | None, experiment: str, description: str = "") -> None:
        import multiprocessing

        from autotune.search.tracking import DEFAULT_TRACKING_URI, workers

        ctx = multiprocessing.get_context("spawn")
        self._calls = ctx.Queue()
        self._replies = ctx.Queue()
        self._proc = ctx.Process(
            target=_serve,
            name="autotune-mlflow-writer",
            daemon=True,
            args=(tracking_uri, experiment, description, self._calls, self._replies, os.getpid()),
        )
        from autotune.lifeline import start_spawned

        start_spawned(self._proc)  # a library user's script without a __main__ guard is not run again there
        self.tracking_uri = tracking_uri or DEFAULT_TRACKING_URI
        self.experiment = experiment
        self.experiment_id: str | None = None
        self.parent_id: str | None = None
        self.worker = workers.new_worker_id()
        self._seq = 0
        self._answers: dict[int, tuple[bool, Any]] = {}
        self._pending: set[int] = set()
        self._ready = False
        self.on_wait: Callable[[int], None] | None = None  # told how many queued writes are left

    # -- plumbing ----------------------------------------------------------------------------------
    def _drain(self, block_for: int | None = None, timeout: float = 1.0) -> None:
        """Collect replies; with ``block_for`` wait until that call's reply arrives."""
        while True:
            try:
                seq, ok, value = (
                    self._replies.get(timeout=timeout) if block_for is not None else self._replies.get_nowait()
                )
            except queue.Empty:
                if block_for is None:
                    return
                if not self._proc.is_alive():
                    raise WriterError(f"the MLflow writer process exited (code {self._proc.exitcode})") from None
                if self.on_wait is not None and self._pending:
                    self.on_wait(len(self._pending))
                continue
            self._pending.discard(seq)
            if not ok:
                if seq == 0:
                    self._proc.join(5)
                raise WriterError(f"MLflow: {value}")
            if seq == 0:
                self.tracking_uri, self.experiment_id = value
                self._ready = True
            if block_for is not None and seq == block_for:
                self._answers[seq] = (ok, value)
                return

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self._seq += 1
        seq = self._seq
        self._calls.put((seq, name, args, kwargs))
        self._pending.add(seq)
        if name in _ASYNC:
            self._drain()  # surface an earlier failure without waiting
            return None
        self._drain(block_for=seq, timeout=0.5)
        return self._answers.pop(seq)[1]

    # -- the SearchTracker interface ---------------------------------------------------------------
    def run_exists(self, run_id: str) -> bool:
        return self._call("run_exists", run_id)

    def start(self, run_name: str, params, tags=None, resume_run_id: str | None = None) -> str:
        self.parent_id = self._call("start", run_name, dict(params), dict(tags or {}), resume_run_id=resume_run_id)
        return self.parent_id

    def find_parent(self, key: str) -> str | None:
        return self._call("find_parent", key)

    def adopt(self, run_id: str, candidate: str) -> None:
        self._call("adopt", run_id, candidate)
        self.parent_id = run_id

    def recorded(self):
        return self._call("recorded")

    def log_evaluation(self, ev, shape) -> None:
        self._call("log_evaluation", ev, dict(shape))

    def log_parent_metrics(self, metrics, step: int = 0) -> None:
        self._call("log_parent_metrics", dict(metrics), step)

    def log_parent_artifact(self, path) -> None:
        self._call("log_parent_artifact", str(path))  # waits: the file may be a temporary one

    def finish(
        self, best, best_curve, scores, title: str, status: str = "FINISHED", summary=None, statuses=None
    ) -> None:
        """Draw the pictures here while the writer is still busy with the children, then wait for it."""
        import shutil
        import tempfile

        from autotune.search.tracking import write_artifacts

        tmp = tempfile.mkdtemp(prefix="autotune-artifacts-")
        try:
            write_artifacts(tmp, best, best_curve, scores, title, statuses)
            self._call(
                "finish",
                best,
                best_curve,
                scores,
                title,
                status=status,
                summary=summary,
                statuses=statuses,
                artifacts_dir=tmp,
            )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            self.close()

    def close(self, timeout_s: float = 30.0) -> None:
        if self._proc.is_alive():
            self._calls.put(None)
            self._proc.join(timeout_s)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)


def wait_with(tracker, say: Callable[[str], None]) -> None:
    """Tell ``say`` how many queued MLflow writes are left while ``tracker`` waits (if it queues)."""
    if isinstance(tracker, BackgroundTracker):
        last = {"t": 0.0}

        def on_wait(n: int) -> None:
            if time.time() - last["t"] > 0.5:
                last["t"] = time.time()
                say(f"writing the MLflow record: {n} writes left")

        tracker.on_wait = on_wait
