"""``autotune train``: train the model under a plan on torchrun-launched ranks (``runner.train``).

On a terminal a progress bar follows rank 0's steps (loss, tokens/s); elsewhere rank 0 logs a line
per step. Either way the command ends with a summary: steps, mean tokens/s, final loss, wall time.
"""

from __future__ import annotations

from pathlib import Path

from autotune.commands.progress_bar import step_bar


def run(
    cluster: str,
    model: str,
    config: Path,
    global_batch_size: int | None,
    steps: int,
    checkpoint_dir: Path | None,
    checkpoint_every: int,
    resume: bool,
    metrics_out: Path | None,
    data: Path | None,
    tracking_uri: str | None,
    seed: int,
    torchrun_args: list[str],
    init_from: Path | None = None,
    save_hf: Path | None = None,
    settings: dict | None = None,
    compile_blocks: bool = False,
) -> int:
    from rich.console import Console
    from rich.markup import escape

    from runner.optim import TrainSettings

    train_settings = TrainSettings(**(settings or {}))  # a bad option: one line, before torch loads

    console = Console(stderr=True)
    progress = step_bar(console, "[bold]train")
    with progress:
        task = progress.add_task("train", total=steps, what="loading torch")
        from runner.train import train

        progress.update(task, what="starting torchrun and the ranks")

        def on_step(record: dict) -> None:
            progress.update(
                task,
                completed=record["step"],
                what=f"steps  loss {record['loss']:.4f}  {record['tokens_per_s']:,.0f} tokens/s",
            )

        outcome = train(
            cluster,
            model,
            config,
            steps=steps,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            resume=resume,
            metrics_out=metrics_out,
            data=data,
            tracking_uri=tracking_uri,
            seed=seed,
            torchrun_args=torchrun_args,
            global_batch_size=global_batch_size,
            on_step=on_step if console.is_terminal else None,
            init_from=init_from,
            save_hf=save_hf,
            settings=train_settings,
            compile_blocks=compile_blocks,
        )
    if outcome.returncode != 0 and not outcome.stopped:
        console.print(f"[red]training failed[/red]: {escape(outcome.error)}")  # gloo writes "[/path:line]"
        return 1
    if not outcome.rank0_here:  # a machine of a multi-node run without rank 0: its ranks ended cleanly
        console.print(
            f"training done on this machine's ranks in {outcome.wall_time_s:.1f} s; the machine with "
            "--node-rank 0 (rank 0) reports the steps, the loss and the checkpoint",
            highlight=False,
            soft_wrap=True,
        )
        return outcome.returncode
    how = f"stopped by {outcome.stop_signal}" if outcome.stopped else "done"
    where = f"; checkpoint in {escape(str(checkpoint_dir))}" if checkpoint_dir else ""
    console.print(f"training {how} after step {outcome.steps_done}{where}", highlight=False)
    if outcome.stopped and checkpoint_dir:
        console.print("  the same command with --resume continues from it", highlight=False)
    if outcome.saved_hf:
        console.print(
            f"  Hugging Face checkpoint written to {escape(outcome.saved_hf)}", highlight=False, soft_wrap=True
        )
    if outcome.steps_run:
        console.print(
            f"  {outcome.steps_run} steps in {outcome.wall_time_s:.1f} s (torchrun start-up included), "
            f"mean {outcome.mean_tokens_per_s:,.0f} tokens/s"
            + (" after the first step" if outcome.steps_run > 1 else "")
            + (f", final loss {outcome.final_loss:.4f}" if outcome.final_loss is not None else ""),
            highlight=False,
            soft_wrap=True,
        )
    return outcome.returncode  # 0 when every step is done; 130 / 143 when stopped by SIGINT / SIGTERM
