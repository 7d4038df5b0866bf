"""``autotune train``: train the model under a plan on torchrun-launched ranks (``runner.train``)."""

from __future__ import annotations

from pathlib import Path


def run(cluster: str, model: str, config: Path, global_batch_size: int | None, steps: int,
        checkpoint_dir: Path | None, checkpoint_every: int, resume: bool, metrics_out: Path | None,
        data: Path | None, tracking_uri: str | None, seed: int, torchrun_args: list[str]) -> int:
    from rich.console import Console
    from rich.markup import escape

    from runner.train import train

    console = Console(stderr=True)
    outcome = train(cluster, model, config, steps=steps, checkpoint_dir=checkpoint_dir,
                    checkpoint_every=checkpoint_every, resume=resume, metrics_out=metrics_out, data=data,
                    tracking_uri=tracking_uri, seed=seed, torchrun_args=torchrun_args,
                    global_batch_size=global_batch_size)
    if outcome.returncode != 0:
        console.print(f"[red]training failed[/red]: {escape(outcome.error)}")  # gloo writes "[/path:line]"
        return 1
    how = "stopped by SIGTERM/Ctrl-C" if outcome.stopped else "done"
    where = f"; checkpoint in {checkpoint_dir}" if checkpoint_dir else ""
    console.print(escape(f"training {how} after step {outcome.steps_done}{where}"))
    return 0
