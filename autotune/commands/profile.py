"""``autotune profile``: micro-benchmark each device type and link kind of a cluster, write a profile."""

from __future__ import annotations

from pathlib import Path


def run(cluster: str, model: str | None, output: Path, quick: bool = False) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from autotune import prechecks
    from autotune.calibration import profiler
    from autotune.loading import load_cluster, load_model

    console = Console(stderr=True)
    prechecks.writable_file(output, "--output")  # before the profiling, not after it
    cluster_spec = load_cluster(cluster)
    model_spec = load_model(model) if model is not None else None
    plan = profiler.plan_profile(cluster_spec, model_spec, max_micro_batch_size=2 if quick else 8)
    for dev in plan.devices:
        if not dev.runnable:
            console.print(f"[yellow]{escape(dev.name)}[/]: {escape(dev.skip_reason)}")
    if plan.links_skip_reason:
        console.print(f"[yellow]links[/]: {escape(plan.links_skip_reason)}")
    if not any(d.runnable for d in plan.devices):
        console.print(
            escape(
                f"error: no device type of cluster {cluster_spec.name!r} can be profiled here "
                f"({', '.join(d.name for d in plan.devices)}); no profile written"
            ),
            style="red",
        )
        return 1

    results: dict = {}
    links: dict = {}
    steps = profiler.profile_steps(cluster_spec, model_spec, plan, results, links, quick=quick)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task("profiling", total=len(steps))
        for step in steps:
            progress.update(task, description=step.label)
            step.run()
            progress.advance(task)
        progress.update(task, description="done")

    prof = profiler.to_profile(cluster_spec, model_spec, plan, results, links)
    output = Path(output)
    prof.save(output)
    console.print(escape(f"wrote {output}"))

    table = Table(title=escape(f"calibration profile -> {output}"))
    table.add_column("device / link")
    table.add_column("measured")
    for name, res in results.items():
        if res.skipped:
            table.add_row(escape(name), f"[yellow]{escape(res.skipped)}[/]")
            continue
        best = max((p.tflops for p in res.matmul), default=0.0)
        row = f"matmul up to {best * 1e3:.1f} GFLOP/s, memory {res.memory_bandwidth_GBps:.1f} GB/s"
        if res.layers:
            row += f", {len(res.layers)} layer timings"
        table.add_row(escape(name), row)
    for kind, lb in links.items():
        table.add_row(
            escape(f"link {kind}"),
            f"p2p {lb.p2p.bandwidth_GBps:.2f} GB/s + {lb.p2p.latency_us:.0f} us; "
            f"all-reduce {lb.allreduce.bandwidth_GBps:.2f} GB/s + "
            f"{lb.allreduce.latency_us:.0f} us",
        )
    Console().print(table)
    return 0
