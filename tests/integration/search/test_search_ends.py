"""Every method ends when its reachable space is exhausted, says so, and prints progress lines when its
output is not a terminal (issue 46, case 4)."""

from __future__ import annotations

import pytest
from cli_run import run_cli

from autotune import tune


def test_random_with_a_budget_beyond_the_space_evaluates_it_all_and_says_so(tmp_path, monkeypatch, capsys):
    """``--budget 10^12`` on ``cpu-2`` / ``tiny`` (9,216 combinations) sampled for ever (over 5 minutes with
    no output into a file); now it evaluates every valid plan once, in a seeded random order, and ends.
    (The progress lines it prints into a file: tests/unit/commands/test_progress_lines.py.)"""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(
        capsys, "search", "--cluster", "cpu-2", "--model", "tiny", "--method", "random", "--budget", "1000000000000"
    )
    assert code == 0, err
    text = " ".join((out + err).split())
    assert "random ended before its budget: the space is exhausted" in text


@pytest.mark.parametrize("method", ["dp", "uniform"])
def test_methods_with_fewer_plans_than_their_budget_say_why_they_ended(method):
    r = tune("cpu-2", "tiny", method=method, budget=100_000, track=False)
    assert r.evaluations < 100_000 and "was evaluated" in r.summary.ended
