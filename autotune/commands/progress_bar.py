"""The progress bar of the long commands (``search``, ``train``): a label, the bar, done/total, what is
happening now (the task's ``what`` field) and the time so far."""

from __future__ import annotations


def step_bar(console, label: str):
    """A ``rich`` progress bar drawn on a terminal only and erased at the end, so that an error stays one
    line and the command's summary line says how it went. ``label`` is a column template (rich markup)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[what]}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
