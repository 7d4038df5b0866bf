"""Pictures of a search: the best plan's pipeline timeline (Gantt) and the search-progress curve."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from autotune.specs import Measurement, ParallelConfig
from autotune.specs.recompute import flag as recompute_flag

_KINDS = (
    ("forward", "#4C72B0"),
    ("backward", "#DD8452"),
    ("recompute", "#8172B3"),
    ("all-reduce", "#55A868"),
    ("optimizer", "#937860"),
    ("weight upload", "#BBBBBB"),
    ("other", "#C44E52"),
)
_COLOUR = dict(_KINDS)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _kind(op: str) -> str:
    if op.startswith("upload"):  # a roundpipe stage's weights coming over the host link
        return "weight upload"
    if op.startswith("F"):
        return "forward"
    if op.startswith("B"):
        return "backward"
    if op.startswith("R"):
        return "recompute"
    if "reduce" in op:
        return "all-reduce"
    if "optim" in op:
        return "optimizer"
    return "other"


def _op_colour(op: str) -> str:
    return _COLOUR[_kind(op)]


def _device_range(devices: Sequence[str]) -> str:
    """``a100:0-3`` for consecutive devices of one node, else the list."""
    nodes = {d.rsplit(":", 1)[0] for d in devices}
    if len(devices) > 1 and len(nodes) == 1:
        idx = [d.rsplit(":", 1)[1] for d in devices]
        if all(i.isdigit() for i in idx) and [int(i) for i in idx] == list(range(int(idx[0]), int(idx[0]) + len(idx))):
            return f"{next(iter(nodes))}:{idx[0]}-{idx[-1]}"
    return ",".join(devices) if len(devices) <= 3 else f"{devices[0]} +{len(devices) - 1}"


def timeline_png(config: ParallelConfig, measurement: Measurement, path: Path, title: str = "") -> Path:
    """One row per pipeline stage (its tensor-parallel devices run the same operations), grouped by
    data-parallel replica; boxes are the ops of ``measurement.timeline`` on the stage's first device.

    Forward blue, backward orange, recompute purple, all-reduce green, optimizer brown, other red.
    Rows are labelled ``r<replica> s<stage>`` with the devices and layers; replicas alternate in
    shading. Without a timeline (e.g. a profiled run that recorded none) the picture says so.
    """
    plt = _pyplot()
    from matplotlib.patches import Patch

    rows: list[tuple[int, int, str, str]] = []  # (replica, stage, first device, label)
    for r, pipe in enumerate(config.pipelines):
        if pipe.roundpipe is not None:  # stages are not bound to GPUs: one row per GPU of the pool
            rows += [(r, g, d, f"r{r} {d}  (roundpipe pool)") for g, d in enumerate(pipe.roundpipe.devices)]
            continue
        for s, stage in enumerate(pipe.stages):
            tp = len(stage.devices)
            label = (
                f"r{r} s{s}  {_device_range(stage.devices)}"
                + (f" (tp {tp})" if tp > 1 else "")
                + f"  {stage.layers} layers"
                + recompute_flag(stage.recompute)
            )
            rows.append((r, s, stage.devices[0], label))
    row_of = {dev: i for i, (_, _, dev, _) in enumerate(rows)}
    boxes: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for e in measurement.timeline:
        if e.device in row_of:
            boxes[(row_of[e.device], _kind(e.op))].append((e.start_s, e.end_s - e.start_s))
    height = min(0.32 * len(rows) + 1.9, 30.0)
    fig, ax = plt.subplots(figsize=(12, height))
    for (row, kind), spans in boxes.items():  # one collection per row and kind: fast at thousands of ops
        ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=_COLOUR[kind], edgecolor="none")
    for r in range(len(config.pipelines)):  # replicas alternate in shading
        members = [i for i, row in enumerate(rows) if row[0] == r]
        if r % 2 == 1 and members:
            ax.axhspan(members[0] - 0.5, members[-1] + 0.5, color="#000000", alpha=0.05, lw=0)
        if r and members:
            ax.axhline(members[0] - 0.5, color="#555555", lw=0.6)
    if not boxes:
        ax.text(0.5, 0.5, "no timeline recorded for this plan", ha="center", va="center", transform=ax.transAxes)
    else:
        seen = {kind for _, kind in boxes}
        handles = [Patch(color=c, label=k) for k, c in _KINDS if k in seen]
        ax.legend(
            handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=7, ncol=len(handles), frameon=False
        )
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for *_, label in rows], fontsize=7 if len(rows) <= 40 else 5)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("time in one iteration (s)")
    n_dev = len(config.devices)
    stages = max((p.roundpipe.num_stages if p.roundpipe is not None else len(p.stages)) for p in config.pipelines)
    head = title or (
        f"best plan: {measurement.tokens_per_s:,.0f} tokens/s, iteration {measurement.iteration_time_s:.3f} s, "
        f"{len(config.pipelines)} replicas x {stages} stages "
        f"on {n_dev} devices, micro-batch {config.micro_batch_size}, {config.schedule}"
    )
    fig.suptitle(head, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97 if height > 4 else 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def progress_png(
    best_curve: Sequence[float],
    path: Path,
    title: str = "",
    scores: Sequence[float] = (),
    statuses: Sequence[str] | None = None,
) -> Path:
    """Best tokens/s found vs number of evaluated plans, each plan's own throughput as a dot.

    Plans that do not run (out of memory, failed) have no throughput: they are drawn as red marks
    in a strip below the axis, not as points at 0 among the valid plans."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = list(range(1, len(best_curve) + 1))
    statuses = list(statuses) if statuses is not None else ["ok" if s > 0 else "oom" for s in scores]
    ok = [(x, s) for x, s, st in zip(xs, scores, statuses) if st == "ok"]
    bad = [(x, st) for x, st in zip(xs, statuses) if st != "ok"]
    if ok:
        ax.scatter(
            [x for x, _ in ok], [s for _, s in ok], s=10, color="#7f7f7f", label=f"plan that runs ({len(ok)})", zorder=2
        )
    ax.step(xs, best_curve, where="post", color="#4C72B0", lw=2, label="best so far", zorder=3)
    top = max(best_curve, default=0.0) or 1.0
    if bad:  # a strip below the axis for the plans that have no throughput
        ax.set_ylim(-0.12 * top, 1.08 * top)
        ax.axhspan(-0.12 * top, -0.02 * top, color="#fbe3e3", lw=0, zorder=0)
    else:
        ax.set_ylim(0, 1.08 * top)
    for label, marker, colour in (("oom", "x", "#C44E52"), ("failed", "v", "#8c564b"), ("timeout", "v", "#8c564b")):
        pts = [x for x, st in bad if st == label]
        if pts:
            name = {"oom": "out of memory", "failed": "failed", "timeout": "timed out"}[label]
            ax.scatter(
                pts,
                [-0.07 * top] * len(pts),
                marker=marker,
                s=14,
                color=colour,
                lw=0.8,
                label=f"{name} ({len(pts)}): no throughput",
                zorder=2,
            )
    ax.set_xlabel("evaluated plans")
    ax.set_ylabel("tokens/s")
    ax.set_xlim(0, max(len(xs), 1) + 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
