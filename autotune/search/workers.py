"""Who is working on a shared search, and whether they still are.

Several ``autotune search`` processes, on one machine or many, may work on one Optuna study (an RDB
or journal storage). Each search (one ``tune`` call) has a worker id ``<machine>:<pid>:<token>``
written beside everything it claims: an Optuna trial it is evaluating, an MLflow child run it is
writing. Another process decides from it whether that work is abandoned:

- same machine, same process: abandoned unless that ``tune`` call is still running (``live``);
- same machine, other process: abandoned when the process is gone (or a zombie);
- another machine (or a live pid that may have been reused): abandoned when its heartbeat is older
  than ``GRACE_S``. A worker refreshes the heartbeat of the trial it evaluates every ``HEARTBEAT_S``.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

GRACE_S = 60.0
HEARTBEAT_S = 15.0

_live: dict[str, int] = {}
_lock = threading.Lock()


@lru_cache(maxsize=1)
def machine() -> str:
    """Host name plus the first 8 characters of /etc/machine-id (two hosts may share a name)."""
    name = socket.gethostname() or "host"
    try:
        with open("/etc/machine-id") as f:
            name += "-" + f.read().strip()[:8]
    except OSError:
        pass
    return name.replace(":", "_")


def new_worker_id() -> str:
    return f"{machine()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@contextmanager
def live(worker: str) -> Iterator[str]:
    """Mark ``worker`` (an id of this process) as running for the duration of the block."""
    with _lock:
        _live[worker] = _live.get(worker, 0) + 1
    try:
        yield worker
    finally:
        with _lock:
            _live[worker] -= 1
            if not _live[worker]:
                del _live[worker]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child its parent has not reaped yet is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def abandoned(worker: str | None, heartbeat: float | None, now: float, grace_s: float = GRACE_S) -> bool:
    """True when the work of ``worker`` (last heartbeat at ``heartbeat``, epoch seconds) is abandoned."""
    if not worker:
        return heartbeat is None or now - heartbeat > grace_s
    parts = worker.rsplit(":", 2)
    if len(parts) == 3 and parts[0] == machine() and parts[1].isdigit():
        pid = int(parts[1])
        if pid == os.getpid():
            with _lock:
                return worker not in _live
        if not _pid_alive(pid):
            return True
    return heartbeat is None or now - heartbeat > grace_s
