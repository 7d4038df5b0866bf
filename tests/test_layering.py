"""The layers import in one direction: what every method shares (specs, evaluator, space, budget) and
the env know nothing of the agents, the library call or the RL policy's training code."""

from __future__ import annotations

import subprocess
import sys

import pytest

UPPER = ("autotune.search.api", "autotune.search.agents", "autotune.policy", "autotune.search.tracking")


@pytest.mark.parametrize("module", ["envs.parallel_config", "autotune.search.space", "autotune.search.budget",
                                    "autotune.evaluator", "autotune.simulator", "autotune.search.planner"])
def test_shared_layers_import_no_agent_api_or_policy_code(module):
    code = (f"import sys, {module}\n"
            f"bad = sorted(m for m in sys.modules if m.startswith({UPPER!r}))\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{module} pulls in {out.stdout.strip()}"


def test_the_env_builds_its_own_evaluator_without_the_library_call():
    code = ("import sys\nfrom envs.parallel_config import ParallelConfigEnv\n"
            "env = ParallelConfigEnv(cluster='cpu-2', model='tiny')\nenv.reset(seed=0)\n"
            f"print(','.join(sorted(m for m in sys.modules if m.startswith({UPPER!r}))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
