"""CLI usage errors through the installed console script: one line on stderr, exit 2, no traceback
(typer 0.29 raises the exceptions of the click it bundles; ``cli.main`` catches both flavours)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

AUTOTUNE = Path(sys.executable).with_name("autotune")


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    assert AUTOTUNE.exists(), "the console script is installed by `make install` (pip install -e .)"
    return subprocess.run([str(AUTOTUNE), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


USAGE = [
    (["search", "--model", "tiny"], "autotune search: Missing option '--cluster'"),
    (["search", "--cluster", "cpu-2", "--model", "tiny", "--bogus"], "No such option: --bogus"),
    (["serach"], "No such command 'serach'"),
    (["search", "--cluster", "cpu-2", "--model", "tiny", "--budget", "abc"], "Invalid value for '--budget'"),
    (
        ["measure", "--cluster", "cpu-2", "--model", "tiny", "--config", "c.json", "--timeout", "soon"],
        "Invalid value for '--timeout'",
    ),
    (["simulate", "--cluster"], "Option '--cluster' requires an argument"),
]


@pytest.mark.parametrize(
    "args,message", USAGE, ids=["missing", "unknown-option", "unknown-command", "not-int", "not-float", "no-value"]
)
def test_usage_errors_are_one_line(tmp_path, args, message):
    r = run(*args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_version(tmp_path):
    from importlib.metadata import version

    r = run("--version", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout == f"autotune {version('autotune')}\n" and r.stderr == ""


def test_bare_autotune_prints_the_help(tmp_path):
    r = run(cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Usage: autotune" in r.stdout and "search" in r.stdout and "Traceback" not in r.stdout + r.stderr


def test_an_unexpected_exception_is_one_line(capsys, monkeypatch):
    """A bug that escapes a command is one line (exit 1), with the way to see its traceback."""
    import autotune.commands.best as best
    from autotune import cli

    monkeypatch.setattr(best, "run", lambda **kw: (_ for _ in ()).throw(RuntimeError("x" * 5000)))
    monkeypatch.setattr(sys, "argv", ["autotune", "best"])
    with pytest.raises(SystemExit) as info:
        cli.main()
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RuntimeError: xxx" in err and "AUTOTUNE_DEBUG=1" in err
    assert len(err) < cli.MAX_ERROR_CHARS + 200
