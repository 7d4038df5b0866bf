"""``autotune simulate``: predict one plan's iteration with the simulator; a table or one JSON object."""

from __future__ import annotations

import json
from pathlib import Path

from autotune import engines
from autotune.errors import SpecError
from autotune.loading import load_cluster, load_config, load_model
from autotune.profile import CalibrationProfile
from autotune.simulator import Simulator
from autotune.simulator.error_bar import describe as describe_error
from autotune.simulator.memory import usable_memory_GiB
from autotune.specs.recompute import label as recompute_label


def run(
    cluster: str,
    model: str,
    config: Path,
    global_batch_size: int | None = None,
    profile: Path | None = None,
    json_out: bool = False,
    engine: str | None = None,
) -> int:
    cluster_spec = load_cluster(cluster)
    model_spec = load_model(model, global_batch_size)
    cfg = load_config(config)
    prof = CalibrationProfile.load(profile) if profile is not None else None
    cfg.validate(cluster_spec, model_spec, source=str(config))
    if engine is not None and (why := engines.check(engine, cfg)) is not None:
        raise SpecError(str(config), "--engine", f"{engine} does not run this plan: {why}")
    sim = Simulator(cluster_spec, model_spec, prof, engine=engine)
    result = sim.evaluate(cfg) if json_out else sim.evaluate_detailed(cfg)
    if json_out:
        print(json.dumps(result.to_dict()))
        return 0
    _print_table(cluster_spec, model_spec, cfg, result, profile)
    return 0


def _print_table(cluster, model, cfg, result, profile: Path | None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    title = escape(f"{model.name} on {cluster.name}: {cfg.describe()}")
    summary = Table(title=title, show_header=False, title_justify="left")
    summary.add_column("quantity")
    summary.add_column("value", justify="right")
    status = "[red]out of memory[/red]" if result.oom else result.status
    summary.add_row("status", status)
    if result.ok:
        summary.add_row("tokens/s", f"{result.tokens_per_s:,.0f}")
        summary.add_row("iteration time", f"{result.iteration_time_s:.3f} s")
        summary.add_row("expected error", escape(describe_error(result.expected_error, result.error_terms)))
        summary.add_row("MFU", f"{result.mfu:.1%}")
        summary.add_row("pipeline bubble", f"{result.bubble_fraction:.1%}")
    else:
        summary.add_row("why", result.error)
    if cfg.zero:
        summary.add_row("zero", f"{cfg.zero} across {len(cfg.pipelines)} replica(s)")
    if cfg.expert_parallel > 1:
        summary.add_row("expert parallel", f"groups of {cfg.expert_parallel} replicas")
    if cfg.sync_every_steps > 1:  # SPES: the iteration time above includes the sync amortised
        summary.add_row("sync (SPES)", f"{result.sync_time_s:.2f} s every {cfg.sync_every_steps} steps")
    for node, gib in result.host_memory_GiB.items():  # offloaded state per node (plans that offload)
        cap = next(n.host.memory_GiB for n in cluster.nodes if n.name == node)
        used = f"{gib:.1f} / {cap:g} GiB"
        summary.add_row(escape(f"host memory {node}"), f"[red]{used}[/red]" if gib > cap else used)
    summary.add_row("global batch", f"{cfg.global_batch_size} x {model.seq_len} tokens")
    if profile:
        summary.add_row("calibration", str(profile))
    elif any(n.device.name == "cpu" for n in cluster.nodes):  # the catalog's nominal core, not this machine's
        summary.add_row(
            "calibration",
            "defaults (no --profile): a cpu device is the catalog's nominal core, often several times off this "
            "machine's; `autotune profile` measures it (README, What the numbers mean)",
        )
    else:
        summary.add_row("calibration", "defaults (no --profile)")
    console.print(summary)
    if cfg.is_roundpipe:
        _print_roundpipe(console, cluster, model, cfg, result)
        return

    stages = Table(title="stages", title_justify="left")
    for col, just in (
        ("pipeline", "right"),
        ("stage", "right"),
        ("devices", "left"),
        ("layers", "right"),
        ("recompute", "left"),
        ("offload", "left"),
        ("busy s", "right"),
        ("peak GiB / usable", "right"),
    ):
        stages.add_column(col, justify=just)
    busy_s: dict[str, float] = {}  # forward + backward time per device, from the timeline
    for e in result.timeline:
        if e.op[0] in "FB":
            busy_s[e.device] = busy_s.get(e.device, 0.0) + e.end_s - e.start_s
    for r, pipe in enumerate(cfg.pipelines):
        for s, st in enumerate(pipe.stages):
            for k, rank in enumerate(pipe.stage_ranks(s)):  # a mixed stage (ranks): one row per rank
                d = rank.devices[0]
                cap = usable_memory_GiB(cluster.device(d).memory_GiB)
                gib = result.peak_memory_GiB.get(d, 0.0)
                mem = f"{gib:.1f} / {cap:.1f}"
                if gib > cap:
                    mem = f"[red]{mem}[/red]"
                busy = f"{busy_s[d]:.3f}" if d in busy_s else "-"
                devices = escape(" ".join(rank.devices)) + (
                    f" ({rank.num_microbatches} micro-batches)" if st.mixed else ""
                )
                stages.add_row(
                    str(r),
                    f"{s}.{k}" if st.mixed else str(s),
                    devices,
                    str(st.layers),
                    recompute_label(st.recompute) or "no",
                    st.offload,
                    busy,
                    mem,
                )
    console.print(stages)


def _print_roundpipe(console, cluster, model, cfg, result) -> None:
    """A roundpipe plan: its stages in hand-out order (compute per iteration) and its GPUs."""
    from rich.markup import escape
    from rich.table import Table

    for r, pipe in enumerate(cfg.pipelines):
        rp = pipe.roundpipe
        stages = Table(
            title=escape(
                f"pipeline {r}: stages handed out round-robin to {len(rp.devices)} GPUs, "
                f"{pipe.num_microbatches // rp.accumulation_steps} micro-batches x "
                f"{rp.accumulation_steps} pass(es)"
            ),
            title_justify="left",
        )
        for col, just in (("order", "right"), ("stage", "left"), ("runs", "left"), ("compute s / iteration", "right")):
            stages.add_column(col, justify=just)
        busy = result.stage_busy_s if len(cfg.pipelines) == 1 else ()
        for k, (label, text) in enumerate(rp.stage_rows(model.num_layers)):
            stages.add_row(str(k), label, text, f"{busy[k]:.3f}" if k < len(busy) else "-")
        console.print(stages)
    gpus = Table(title="GPUs (stateless: every stage's weights come over the host link)", title_justify="left")
    for col, just in (("device", "left"), ("busy s", "right"), ("peak GiB / usable", "right")):
        gpus.add_column(col, justify=just)
    busy_s: dict[str, float] = {}
    for e in result.timeline:
        if not e.op.startswith("upload"):
            busy_s[e.device] = busy_s.get(e.device, 0.0) + e.end_s - e.start_s
    for d in cfg.devices:
        cap = usable_memory_GiB(cluster.device(d).memory_GiB)
        gib = result.peak_memory_GiB.get(d, 0.0)
        mem = f"{gib:.1f} / {cap:.1f}"
        gpus.add_row(escape(d), f"{busy_s[d]:.3f}" if d in busy_s else "-", f"[red]{mem}[/red]" if gib > cap else mem)
    console.print(gpus)
