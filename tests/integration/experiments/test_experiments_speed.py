"""The speed and training experiments' ``--quick`` runs (tests/integration/experiments/test_experiments.py says what they check)."""

from __future__ import annotations

import pytest
from experiment_runs import QUICK, _run, left_behind


@pytest.mark.slow
@pytest.mark.parametrize(
    "script", sorted(s for s in QUICK if s.startswith(("experiments/speed/", "experiments/training/")))
)
def test_quick_mode_runs(script, tmp_path):
    out = _run(script, QUICK[script], tmp_path)
    assert out.returncode == 0, f"{script} --quick failed:\n{out.stderr[-3000:]}"
    assert out.stdout.strip(), f"{script} --quick printed nothing"
    assert not left_behind(tmp_path), f"{script} --quick left temporary files: {left_behind(tmp_path)}"
