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


class ProgressLines:
    """Where the bar is not drawn (output to a file or a pipe), the same progress as plain lines: at most one
    every ``every_s`` seconds, the first ``every_s`` after the start (a command that ends sooner, or fails
    on bad input, prints only what it prints anyway), each headed by ``label`` and the time so far."""

    def __init__(self, console, label: str, every_s: float = 10.0) -> None:
        import time

        self.console, self.label, self.every_s = console, label, every_s
        self._clock = time.monotonic
        self.t0 = self.last = self._clock()
        self.on = not console.is_terminal

    def __call__(self, text: str, force: bool = False) -> None:
        now = self._clock()
        if self.on and (force or now - self.last >= self.every_s):
            self.last = now
            self.console.print(f"{self.label} [{now - self.t0:.0f} s] {text}", markup=False, highlight=False)
