"""Four CPU ranks started once (``torch.multiprocessing.spawn``, gloo, ``file://`` rendezvous) that build the
runner's engine for MoE plans in-process, shared by the MoE runner tests (``test_moe_runner``,
``test_moe_zero``): each rank runs a test's ``work(rank, directory)`` and its result comes back per rank."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

MODEL = "tiny-moe"
WORLD = 4


def build_engine(plan: dict, rank: int, model: str = MODEL, **options):
    """The engine ``autotune train`` builds on ``rank`` for ``plan`` (``model``, ``tiny-moe`` unless named, on
    ``cpu-4``, seed 0); ``options`` go to ``runner.engine.Engine`` (e.g. ``fsdp=False``)."""
    from autotune import load_cluster, load_config, load_model
    from runner.data import TokenSource
    from runner.engine import Engine
    from runner.layout import build_layout

    spec = load_model(model)
    config = load_config(plan)
    layout = build_layout(load_cluster("cpu-4"), spec, config)
    return Engine(
        layout,
        spec,
        rank,
        torch.device("cpu"),
        schedule=config.schedule,
        seed=0,
        tokens=TokenSource(spec, 0),
        **options,
    )


def _rank(rank: int, work: Callable[[int, Path], dict], out: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    init = f"file://{Path(out) / 'rendezvous'}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    results = work(rank, Path(out))
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def run_ranks(work: Callable[[int, Path], dict], directory: Path) -> list[dict]:
    """``work(rank, directory)`` on each of ``WORLD`` ranks (a module-level function: the ranks import it);
    the results, by rank."""
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(work, str(directory)), nprocs=WORLD, join=True)
    return [torch.load(directory / f"rank{r}.pt") for r in range(WORLD)]
