"""Child processes that die with their parent, even when the parent is killed with SIGKILL.

``die_with_parent()`` is called first thing in every process autotune starts (runner ranks, torchrun,
``--workers`` processes): Linux's ``prctl(PR_SET_PDEATHSIG)`` has the kernel send it SIGKILL when its
parent dies. The parent may already be gone when the child gets there, so the child also compares
its parent with ``AUTOTUNE_PARENT_PID`` (set by whoever launched it, ``child_env()``) and exits if
they differ. Where ``prctl`` is missing (not Linux) a thread polls the parent every second instead.

``python -m autotune.lifeline CMD ...`` supervises a program that starts processes of its own (the
MLflow UI server and its uvicorn worker): it runs CMD in a new process group and, when its own
parent dies or it gets SIGTERM / SIGINT / SIGHUP, sends the whole group SIGTERM, then SIGKILL
after ``GRACE_S``; it exits with CMD's exit code (128 + signal when it was stopped).

``stop_signals_end(kill)`` is how a process that waits on children takes Ctrl-C and SIGTERM: while
the children run, the signal calls ``kill`` (ending them) and is raised again only once they are
reaped, never inside ``subprocess.Popen``'s own waiting (see its docstring); ``communicate_all`` waits
on a list of children that way.

Standard library only: it runs before anything heavy is imported.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

PARENT_ENV = "AUTOTUNE_PARENT_PID"
PR_SET_PDEATHSIG = 1
GRACE_S = 5.0


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) plus ``AUTOTUNE_PARENT_PID`` = this process."""
    out = dict(os.environ if env is None else env)
    out[PARENT_ENV] = str(os.getpid())
    return out


def _prctl_pdeathsig(sig: int) -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Have this process get ``sig`` when its parent dies (see the module docstring). ``parent`` is the
    pid the parent had (default: ``AUTOTUNE_PARENT_PID``, else whatever the parent is now)."""
    expected = os.environ.get(PARENT_ENV) if parent is None else str(parent)
    armed = _prctl_pdeathsig(sig)
    parent = int(expected) if expected and expected.isdigit() else os.getppid()
    if os.getppid() != parent:  # the parent died before the kernel could be told to watch it
        os._exit(128 + int(sig))
    if not armed:

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os.kill(os.getpid(), sig)

        threading.Thread(target=watch, name="autotune-lifeline", daemon=True).start()


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_signals_end(kill: Callable[[], None], reraise: bool = True) -> Iterator[list[int]]:
    """While the block runs, SIGTERM and SIGINT (Ctrl-C) to this process call ``kill()`` (which ends the
    children the block waits on: it must not wait, lock or raise) and are recorded in the yielded list;
    the block's wait then ends because the children are gone. On the way out the handlers that were
    there are restored and, with ``reraise``, each recorded signal is raised again through them: with
    the default actions the process still dies of SIGTERM or raises ``KeyboardInterrupt``, a handler
    installed before is still called, and an ignored signal stays ignored (no handler is put there).

    Why not let ``KeyboardInterrupt`` fly: raised wherever the main thread happens to be, it can land
    inside ``Popen.poll()`` or a ``Popen.wait(timeout)`` just after it took the Popen's wait lock and
    before its ``try``; the lock is then never released and a later ``Popen.wait()`` on that child blocks
    for ever (an experiment of issue 14, in the git history as ``experiments/popen_interrupt_lock.py``: 513 to 579 of 3,000 interrupts raised in a
    ``poll()`` loop left the lock held).

    Outside the main thread Python cannot install handlers: nothing is changed there (the caller's own
    signal handling stays in charge)."""
    stopped: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield stopped
        return

    def handler(signum, frame):  # no lock, no wait, no exception: safe wherever it interrupts
        if signum not in stopped:
            stopped.append(signum)
        kill()

    restore = {}
    for sig in STOP_SIGNALS:
        previous = signal.getsignal(sig)
        if previous == signal.SIG_IGN or previous is None:  # None: set outside Python; leave it alone
            continue
        restore[sig] = previous
        signal.signal(sig, handler)
    try:
        yield stopped
    finally:
        for sig, previous in restore.items():
            signal.signal(sig, previous)
        if reraise:
            for sig in stopped:  # through the handlers restored above: dies, raises KeyboardInterrupt, or returns
                signal.raise_signal(sig)


def start_spawned(process) -> None:
    """``process.start()`` for a ``multiprocessing`` spawn-context process whose target is in this package,
    without re-running the caller's ``__main__`` in the child. Spawn re-imports the parent's main script
    in the child, so a library user's ``tune.py`` without an ``if __name__ == "__main__":`` guard would run
    its search again there and fail ("An attempt has been made to start a new process before the current
    process has finished its bootstrapping phase"); autotune's children need nothing from it. CPython's
    spawn reads the main module's ``__spec__`` and ``__file__`` when the process starts: both are hidden
    for that moment."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__dict__["__spec__"] = None
        process.start()
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


def kill_all(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every child in ``procs`` not reaped yet (signal-handler safe: no wait, no lock)."""
    for p in list(procs):
        if p.returncode is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def communicate_all(procs: list[subprocess.Popen], timeout_s: float) -> list[tuple]:
    """``communicate()`` with each child in turn; every child is killed and reaped on the way out,
    however the wait ends (a ``TimeoutExpired`` after ``timeout_s`` per child is re-raised). SIGINT /
    SIGTERM meanwhile kill the children and are raised again after they are reaped
    (``stop_signals_end``), so the interrupted wait cannot lose a Popen's lock and hang."""
    outs = []
    with stop_signals_end(lambda: kill_all(procs)):
        try:
            for p in procs:
                outs.append(p.communicate(timeout=timeout_s))
        finally:
            kill_all(procs)
            for p in procs:
                p.wait()
    return outs


def supervise(cmd: list[str]) -> int:
    """Run ``cmd`` in its own process group; stop the whole group when this process is told to stop or
    its parent dies. Returns ``cmd``'s exit code (128 + signal number when stopped)."""
    stop = {"signal": 0}

    def on_stop(signum, frame):
        stop["signal"] = signum

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_stop)
    die_with_parent(signal.SIGTERM)  # the parent's death arrives as SIGTERM: handled like a stop
    proc = subprocess.Popen(cmd, start_new_session=True)
    while proc.poll() is None and not stop["signal"]:
        try:
            proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None or stop["signal"]:
        _stop_group(proc)
        return 128 + stop["signal"] if stop["signal"] else proc.returncode
    _stop_group(proc)  # the program ended by itself: take any process it left behind
    return proc.returncode


def _stop_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        proc.poll()
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        if proc.returncode is not None and not _group_has_live_members(proc.pid):
            return
        time.sleep(0.05)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _group_has_live_members(pgid: int) -> bool:
    """Whether a process other than a zombie is in group ``pgid`` (read from /proc; True if unknown)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m autotune.lifeline CMD [ARGS...]", file=sys.stderr)
        return 2
    return supervise(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
