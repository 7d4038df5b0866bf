"""Every maintained experiment still runs: its ``--quick`` mode (a tiny run of the same code path) exits 0
and prints its table. ``experiments/README.md`` lists each script; a script there that this test does not
run, or a script here that the README does not list, fails ``test_the_readme_lists_every_script``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from experiment_runs import HELPERS, QUICK, _run, left_behind
from paths import REPO


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(s for s in QUICK if s.startswith("experiments/fidelity/")))
def test_quick_mode_runs(script, tmp_path):
    out = _run(script, QUICK[script], tmp_path)
    assert out.returncode == 0, f"{script} --quick failed:\n{out.stderr[-3000:]}"
    assert out.stdout.strip(), f"{script} --quick printed nothing"
    assert not left_behind(tmp_path), f"{script} --quick left temporary files: {left_behind(tmp_path)}"


@pytest.mark.slow
def test_compare_policies_reads_two_heldout_runs(tmp_path):
    """compare_policies.py on two quick held-out runs (its input format is heldout_eval's --json)."""
    for name in ("a", "b"):
        out = _run("experiments/quality/heldout_eval.py", ["--json", f"{{tmp}}/{name}.json"], tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "consumer-tight-8" in json.loads((tmp_path / f"{name}.json").read_text())["results"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, str(REPO / "experiments/quality/compare_policies.py"), "--quick"]
    cmd += ["--old", str(tmp_path / "a.json"), "--new", str(tmp_path / "b.json"), "--methods", "dp,random"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "consumer-tight-8" in out.stdout


def test_the_readme_lists_every_script():
    """The index and the scripts agree, and every script has a quick run here (or is a named helper)."""
    scripts = {str(p.relative_to(REPO)) for p in (REPO / "experiments").rglob("*.py")}
    assert scripts == set(QUICK) | set(HELPERS) | {"experiments/quality/compare_policies.py"}
    readme = (REPO / "experiments" / "README.md").read_text()
    listed = {m for m in re.findall(r"`((?:experiments|scripts)/[\w/]+\.py)`", readme)}
    tools = {str(p.relative_to(REPO)) for p in (REPO / "scripts").glob("*.py")}
    assert scripts | tools <= listed, f"not in experiments/README.md: {sorted(scripts | tools - listed)}"
