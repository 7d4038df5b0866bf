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
from paths import REPO

#: script -> extra arguments of its quick run (``--quick`` is always given)
QUICK = {
    "experiments/fidelity/closed_loop.py": [],
    "experiments/fidelity/error_bars.py": [],
    "experiments/fidelity/fidelity.py": ["--out", "{tmp}/fidelity_results.json"],
    "experiments/fidelity/loss_peak.py": [],
    "experiments/fidelity/megatron_comparison.py": [],
    "experiments/fidelity/megatron_readme.py": [],
    "experiments/fidelity/roundpipe_published.py": [],
    "experiments/fidelity/sailor_mit.py": [],
    "experiments/fidelity/sailor_validation.py": [],
    "experiments/fidelity/sources.py": [],
    "experiments/fidelity/torchtitan_published.py": [],
    "experiments/fidelity/zero_offload.py": [],
    "experiments/quality/bench_zero.py": [],
    "experiments/quality/compare_methods.py": [],
    "experiments/quality/dp_start_plans.py": [],
    "experiments/quality/engine_cost.py": [],
    "experiments/quality/layerwise.py": [],
    "experiments/quality/heldout_eval.py": ["--json", "{tmp}/heldout.json"],
    "experiments/quality/memory_first.py": [],
    "experiments/quality/mixed_stages.py": [],
    "experiments/quality/perturbed_reality.py": [],
    "experiments/quality/real_runs_cpu.py": [],
    "experiments/quality/roundpipe_bench.py": [],
    "experiments/quality/runnable.py": [],
    "experiments/quality/sailor_planner_comparison.py": [],
    "experiments/quality/zorse_comparison.py": [],
    "experiments/quality/spes_benchmark.py": [],
    "experiments/quality/stop_rule.py": [],
    "experiments/speed/bench_host_adam.py": [],
    "experiments/speed/bench_planner.py": [],
    "experiments/speed/bench_runner.py": [],
    "experiments/speed/bench_search.py": [],
    "experiments/speed/bench_simulator.py": [],
    "experiments/training/runner_equivalence.py": [],
    "experiments/training/zero_runner.py": [],
}
#: run by another script, or reading another script's output (tested below), not on their own
HELPERS = {
    "experiments/speed/minimal_pipeline.py": "bench_runner.py runs it",
    "experiments/speed/against.py": "bench_simulator.py and bench_search.py time a tree against a commit with it",
}


def _run(script: str, args: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, str(REPO / script), "--quick", *(a.format(tmp=tmp_path) for a in args)]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(QUICK))
def test_quick_mode_runs(script, tmp_path):
    out = _run(script, QUICK[script], tmp_path)
    assert out.returncode == 0, f"{script} --quick failed:\n{out.stderr[-3000:]}"
    assert out.stdout.strip(), f"{script} --quick printed nothing"


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
