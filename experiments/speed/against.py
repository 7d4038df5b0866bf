"""Side-by-side timing against an earlier commit, the only honest comparison on a shared machine.

``checkout(commit)`` puts that commit's tree in a temporary ``git worktree`` (removed afterwards); a benchmark
then runs its own measurement in child processes whose ``PYTHONPATH`` points at one tree or the other,
alternating rounds (``alternate``), so both see the same load. The best round of each is reported (noise on a
shared machine only ever slows a run down), with the load average.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the release the speed issue compares against (issue 48: before the error bars)
PREVIOUS_RELEASE = "61c44b6"


@contextlib.contextmanager
def checkout(commit: str) -> Iterator[Path]:
    """A temporary worktree of ``commit`` of this repository."""
    with tempfile.TemporaryDirectory(prefix="bench-against-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(tree), commit],
            check=True,
            capture_output=True,
        )
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)


def run_in(tree: Path, args: list[str]) -> str:
    """``python args...`` with ``tree`` first on the import path; its stdout."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, cwd=tree)
    if out.returncode:
        raise SystemExit(f"{' '.join(args)} under {tree} failed:\n{out.stderr[-2000:]}")
    return out.stdout


def alternate(
    commit: str, rounds: int, measure: Callable[[Path], float], label: str, higher_is_better: bool = True
) -> None:
    """Print ``measure(tree)`` for ``commit`` and for this tree, alternating ``rounds`` times, then the best
    of each and their ratio (this tree over ``commit``)."""
    with checkout(commit) as old:
        mine: list[float] = []
        theirs: list[float] = []
        for i in range(rounds):
            theirs.append(measure(old))
            mine.append(measure(ROOT))
            print(
                f"  round {i + 1}: {commit} {theirs[-1]:10,.2f}   this tree {mine[-1]:10,.2f}   "
                f"(load {os.getloadavg()[0]:.2f})",
                flush=True,
            )
    pick = max if higher_is_better else min
    a, b = pick(theirs), pick(mine)
    ratio = b / a if higher_is_better else a / b
    print(f"{label}: best of {rounds}: {commit} {a:,.2f}, this tree {b:,.2f}  ({ratio:.2f}x as fast)")
