"""The processes tests start take Ctrl-C (SIGINT) as from a terminal, however the suite was started
(``tests/conftest.py``): a ``make test &`` in a script runs the suite with SIGINT ignored."""

from __future__ import annotations

import os
import subprocess
import sys

from paths import REPO

REPO = REPO
CHILD = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
# what a shell does to a background command: SIGINT ignored, then exec
IGNORED = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"


def test_a_child_of_the_suite_takes_ctrl_c():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


def test_the_suite_started_with_ctrl_c_ignored_still_gives_its_children_ctrl_c():
    cmd = [
        sys.executable,
        "-c",
        IGNORED,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"{__file__}::test_a_child_of_the_suite_takes_ctrl_c",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout + r.stderr
    # the same child, started with SIGINT ignored and without the suite's set-up, ignores Ctrl-C
    bare = subprocess.run([sys.executable, "-c", IGNORED, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert bare.stdout.strip() == "False", bare.stderr
