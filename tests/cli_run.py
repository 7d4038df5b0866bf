"""Run the ``autotune`` command line in this process, as ``autotune ARGS...`` would: the exit code and what it
printed (for the tests of messages and exit codes; those that need a separate process start one)."""

from __future__ import annotations

import sys

from autotune import cli


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``autotune *args``."""
    argv = sys.argv
    sys.argv = ["autotune", *args]
    try:
        cli.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
    out = capsys.readouterr()
    return code, out.out, out.err
