"""The experiments' quick runs, shared by tests/integration/experiments (split in files by what they measure,
so that ``make test`` spreads them over its workers)."""

from __future__ import annotations

import os
import subprocess
import sys

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
    "experiments/quality/runner_limits.py": [],
    "experiments/quality/sailor_planner_comparison.py": [],
    "experiments/quality/zorse_comparison.py": [],
    "experiments/quality/spes_benchmark.py": [],
    "experiments/quality/stop_rule.py": [],
    "experiments/quality/policy_vs_rule.py": [],
    "experiments/speed/bench_host_adam.py": [],
    "experiments/speed/bench_planner.py": [],
    "experiments/speed/bench_runner.py": [],
    "experiments/speed/bench_search.py": [],
    "experiments/speed/bench_simulator.py": [],
    "experiments/training/deepspeed_cpu.py": [],
    "experiments/training/runner_equivalence.py": [],
    "experiments/training/zero_runner.py": [],
}
#: run by another script, or reading another script's output (tested below), not on their own
HELPERS = {
    "experiments/speed/minimal_pipeline.py": "bench_runner.py runs it",
    "experiments/speed/against.py": "bench_simulator.py and bench_search.py time a tree against a commit with it",
}


#: what torch leaves in the temporary directory on its own (TorchInductor's cache; torchrun's per-launch
#: directories are not: a script starting torchrun gives it ``--log-dir`` in its scratch directory)
TORCH_LEFTOVERS = ("torchinductor_",)


def _run(script: str, args: list[str], tmp_path) -> subprocess.CompletedProcess:
    """The script's quick run, its temporary files in ``tmp_path / "tmp"`` (``left_behind`` reads them)."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), TMPDIR=str(tmp_path / "tmp"))
    cmd = [sys.executable, str(REPO / script), "--quick", *(a.format(tmp=tmp_path) for a in args)]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def left_behind(tmp_path) -> list[str]:
    """What a finished ``_run`` left in its temporary directory (a script removes its scratch files)."""
    return sorted(p.name for p in (tmp_path / "tmp").iterdir() if not p.name.startswith(TORCH_LEFTOVERS))
