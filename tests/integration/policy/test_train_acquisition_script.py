"""``scripts/train_acquisition.py`` end to end on a few scenarios: a policy file the search reads, and its record."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from paths import REPO

from autotune.policy import policy_file
from autotune.search.agents.acquire import uses_acquisition


@pytest.mark.slow
def test_the_training_script_writes_a_policy_rl_uses_on_real_runs(tmp_path) -> None:
    out = tmp_path / "acq.safetensors"
    cmd = [
        sys.executable,
        str(REPO / "scripts/train_acquisition.py"),
        "--scenarios",
        "2",
        "--validation-scenarios",
        "1",
    ]
    cmd += ["--draws", "2", "--steps", "256", "--validate-every", "128", "--n-steps", "128", "--warm-epochs", "2"]
    cmd += ["--episodes", str(tmp_path / "episodes"), "--output", str(out)]
    done = subprocess.run(
        cmd, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "simulator order" in done.stdout and "greedy gain" in done.stdout and "best validation regret" in done.stdout
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["steps"] == 256 and [v["steps"] for v in record["validation"]] == [0, 128, 256]
    assert record["warm_start"]["epochs"] == 2 and set(record["baselines"]) == {
        "simulator order",
        "greedy gain",
        "gain and teaching",
    }
    assert policy_file.read(out)[1]["trained_steps"] in (0, 128, 256)
    assert uses_acquisition(out)  # a file of the chooser's layout: rl runs the chooser with it
    assert (tmp_path / "episodes").is_dir()  # the episodes are cached for the next run
