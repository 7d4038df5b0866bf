"""Finding processes a test started, by a tag in their environment (shared by the runner fault tests)."""

from __future__ import annotations

import os
from pathlib import Path


def processes_with(tag: str) -> list[int]:
    """Live processes whose environment holds ``tag`` (zombies and vanished ones do not count)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if "State:\tZ" in (entry / "status").read_text():
                continue
            if tag.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def kill_test_processes(proc, tag: str) -> None:
    """Never leave a test's processes behind, whatever happened: kill ``proc`` (a ``subprocess.Popen``)
    if it still runs, and every process carrying ``tag`` (only that test's)."""
    import signal

    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in processes_with(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
