"""``autotune compare``: one row per search of an MLflow experiment (a table, or CSV with ``--csv``)."""

from __future__ import annotations


def run(experiment: str | None, tracking_uri: str | None, csv: bool) -> int:
    from autotune.commands.status import loading
    from autotune.search.tracking import quiet_libraries

    quiet_libraries()
    with loading(f"loading MLflow to read {tracking_uri or 'sqlite:///mlflow.db'}"):
        from autotune.search.history import SearchRow, list_searches

        name, rows = list_searches(experiment, tracking_uri)
    if csv:
        import csv as csv_module
        import sys

        writer = csv_module.writer(sys.stdout, lineterminator="\n")
        writer.writerow(SearchRow.FIELDS)
        for r in rows:
            writer.writerow(["" if getattr(r, f) is None else getattr(r, f) for f in SearchRow.FIELDS])
        return 0
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(
        title=escape(f"searches in experiment {name}"), title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False
    )
    for col, just in (
        ("method", "left"),
        ("plans", "right"),
        ("seed", "right"),
        ("backend", "left"),
        ("variant", "left"),
        ("best tokens/s", "right"),
        ("found at", "right"),
        ("wall", "right"),
        ("vs uniform", "right"),
        ("oom", "right"),
        ("status", "left"),
        ("run", "left"),
    ):
        table.add_column(col, justify=just, no_wrap=True)
    for r in rows:
        table.add_row(
            escape(r.method),
            f"{r.evaluations}/{r.budget}",
            str(r.seed),
            escape(r.backend),
            escape(r.variant or "-"),
            f"{r.best_tokens_per_s:,.0f}",
            str(r.found_at or "-"),
            f"{r.wall_time_s:.1f} s" if r.wall_time_s else "-",
            f"{r.speedup_vs_uniform:.2f}x" if r.speedup_vs_uniform else "-",
            str(r.oom_plans),
            r.status.lower(),
            r.run_id[:8],
        )
    console = Console()
    if not console.is_terminal:  # a pipe or a file: no terminal width to fit, print whole rows
        console = Console(width=160)
    console.print(table)
    if not rows:
        print("no searches in this experiment yet")
    return 0
