"""``autotune measure``: a short profiled real run of one plan through the runner (``runner.profiled_run``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def run(
    cluster: str,
    model: str,
    config: Path,
    global_batch_size: int | None,
    steps: int,
    warmup: int,
    timeout: float,
    json_out: bool,
) -> int:
    from rich.console import Console
    from rich.table import Table

    from autotune.commands.status import loading
    from autotune.errors import SpecError
    from autotune.loading import load_cluster, load_config, load_model

    if steps < 1:
        raise SpecError("--steps", "", f"must be >= 1, got {steps}")
    if warmup < 0:
        raise SpecError("--warmup", "", f"must be >= 0, got {warmup}")
    from autotune import prechecks

    prechecks.finite_positive(timeout, "--timeout")
    cluster_spec = load_cluster(cluster)
    model_spec = load_model(model, global_batch_size)
    plan = load_config(config)
    try:
        with loading("loading torch") as say:
            from runner.jobs import preflight
            from runner.launch import profiled_run

            preflight(cluster_spec, model_spec, plan)  # bad or unsupported plans: one SpecError line, exit 2
            who = (
                f"one RoundPipe process on a pool of {len(plan.devices)} GPUs"
                if plan.is_roundpipe
                else f"{len(plan.devices)} ranks"
            )
            say(f"running {who}: {warmup} warm-up + {steps} timed steps (timeout {timeout:.0f} s)")
            m = profiled_run(cluster_spec, model_spec, plan, steps=steps, warmup=warmup, timeout_s=timeout)
    except KeyboardInterrupt:  # Ctrl-C: the launcher has killed the ranks before it re-raised it
        print(
            "interrupted: the run was stopped and its ranks killed before it finished; nothing was measured",
            file=sys.stderr,
        )
        return 130
    if json_out:
        print(json.dumps(m.to_dict()))
    else:
        out = Console()
        from rich.markup import escape

        table = Table(
            title=escape(f"measured: {model_spec.name} on {cluster_spec.name} ({steps} steps after {warmup} warm-up)"),
            show_header=False,
        )
        table.add_row("status", escape(m.status + (f": {m.error}" if m.error else "")))  # rank errors hold "[...]"
        if m.status in ("ok", "oom") and m.iteration_time_s > 0:
            table.add_row("tokens/s", f"{m.tokens_per_s:,.0f}")
            table.add_row("iteration time", f"{m.iteration_time_s:.4f} s")
            table.add_row("MFU", f"{m.mfu:.1%}")
            table.add_row("idle (not forward/backward)", f"{m.bubble_fraction:.1%}")
            table.add_row("stage busy (slowest pipeline)", ", ".join(f"{b:.4f} s" for b in m.stage_busy_s))
            for device, gib in m.peak_memory_GiB.items():
                table.add_row(escape(f"peak memory {device}"), f"{gib:.3f} GiB")
        out.print(table)
    return 0 if m.status == "ok" else 1
