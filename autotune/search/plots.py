"""Pictures of a search: the best plan's pipeline timeline (Gantt) and the search-progress curve."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from autotune.specs import Measurement, ParallelConfig


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _op_colour(op: str) -> str:
    if op.startswith("F"):
        return "#4C72B0"
    if op.startswith("B"):
        return "#DD8452"
    if op.startswith("R"):
        return "#8172B3"
    if "reduce" in op:
        return "#55A868"
    if "optim" in op:
        return "#937860"
    return "#C44E52"


def timeline_png(config: ParallelConfig, measurement: Measurement, path: Path, title: str = "") -> Path:
    """One row per device in plan order; boxes are the ops of ``measurement.timeline``.

    Forward blue, backward orange, recompute purple, all-reduce green, optimizer brown, other red.
    Without a timeline (e.g. a profiled run that recorded none) the picture says so.
    """
    plt = _pyplot()
    devices = list(config.devices)
    rows = {d: i for i, d in enumerate(devices)}
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(devices) + 1.5))
    events = [e for e in measurement.timeline if e.device in rows]
    if not events:
        ax.text(0.5, 0.5, "no timeline recorded for this plan", ha="center", va="center", transform=ax.transAxes)
    for e in events:
        ax.barh(rows[e.device], e.end_s - e.start_s, left=e.start_s, height=0.8, color=_op_colour(e.op),
                edgecolor="none")
    if events:
        from matplotlib.patches import Patch

        kinds = [("forward", "F"), ("backward", "B"), ("recompute", "R"), ("all-reduce", "allreduce"),
                 ("optimizer", "optimizer"), ("other", "send")]
        seen = {_op_colour(e.op) for e in events}
        handles = [Patch(color=_op_colour(op), label=label) for label, op in kinds if _op_colour(op) in seen]
        ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=len(handles))
    ax.set_yticks(range(len(devices)))
    ax.set_yticklabels(devices, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(title or f"{config.describe()[:120]}\n{measurement.tokens_per_s:,.0f} tokens/s, "
                          f"iteration {measurement.iteration_time_s:.3f} s", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def progress_png(best_curve: Sequence[float], path: Path, title: str = "", scores: Sequence[float] = ()) -> Path:
    """Best tokens/s found vs number of evaluated plans (and each plan's own score as dots)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = list(range(1, len(best_curve) + 1))
    if scores:
        ax.scatter(xs, scores, s=8, color="#999999", label="plan")
    ax.step(xs, best_curve, where="post", color="#4C72B0", label="best so far")
    ax.set_xlabel("evaluated plans")
    ax.set_ylabel("tokens/s")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
