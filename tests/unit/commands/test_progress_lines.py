"""Progress as plain lines where no bar is drawn (issue 46, case 4: a search into a file printed nothing for
11 minutes)."""

from __future__ import annotations

import io

from rich.console import Console

from autotune.commands.progress_bar import ProgressLines


def test_lines_appear_where_the_output_is_not_a_terminal_at_most_one_per_period():
    out = io.StringIO()
    lines = ProgressLines(Console(file=out, force_terminal=False, width=200), "optuna", every_s=10.0)
    clock = iter([10.5, 11.0, 12.0, 25.0]).__next__
    lines.t0 = lines.last = 0.0
    lines._clock = clock
    lines("1/1,000 evaluations")  # at 10.5 s: printed
    lines("2/1,000 evaluations")  # 11 s: within the period, not printed
    lines("3/1,000 evaluations")  # 12 s: not printed
    lines("4/1,000 evaluations")  # 25 s: printed
    assert out.getvalue().splitlines() == ["optuna [10 s] 1/1,000 evaluations", "optuna [25 s] 4/1,000 evaluations"]


def test_nothing_is_printed_on_a_terminal_where_the_bar_draws():
    out = io.StringIO()
    lines = ProgressLines(Console(file=out, force_terminal=True), "optuna", every_s=0.0)
    lines("1/10 evaluations", force=True)
    assert out.getvalue() == ""
