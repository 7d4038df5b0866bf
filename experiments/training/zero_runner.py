"""The runner's ZeRO sharding and CPU offload on CPU ranks: loss vs single process, peak memory per rank
measured vs predicted.

1. Equivalence (``--steps`` optimizer steps, ``tiny``): each plan's per-step loss against single-process
   training (``runner.reference``), largest relative difference.
2. Resume (``--skip-resume`` to leave out): each plan of ``RESUME`` trains ``--steps`` at once, and again
   as half the steps, a sharded checkpoint (each rank writes its own shards) and ``--resume`` to the
   end; the per-step losses must be equal bit for bit.
3. Memory: short profiled runs (``runner.RealEvaluator``: 1 warm-up + 2 timed steps) of two
   single-stage replicas of a model whose training state dominates (``STATE_MODEL``: 25.2M parameters,
   short sequences), each plan's peak RSS growth per rank (host-held state counted apart) against the
   model-state bytes ``autotune.simulator.zero`` predicts for it. The CPU runner trains in fp32;
   ``runner.zero`` (optimizer-only offload here) keeps the optimizer's master weights apart from the
   parameters, so its bytes per parameter are weights 4, gradients 4, optimizer 12 (master 4 + two AdamW
   moments 8); the unsharded engine (zero 0) and FSDP2 (zero 1-3 and zero 3 + offload all here:
   ``runner.fsdp``, AdamW on the sharded weights) have no separate master: 4 + 4 + 8. The working set (one
   block's whole gradient under zero 2, two gathered blocks and one gradient under zero 3) is added as
   the simulator counts it; activations, the model's construction copy and allocator slack are the
   same in every plan, so the comparison is of each plan's peak minus the zero-0 plan's.

4. Speed (``--speed-rounds 0`` to leave out): zero 2 and 3 over two even replicas of ``STATE_MODEL`` and zero 1
   over two replicas of 3 and 1 micro-batches, step
   time on torch's FSDP2 (what runs them) against ``runner.zero`` (what ran them before), alternating.

    .venv/bin/python experiments/training/zero_runner.py [--steps 6] [--skip-equivalence] [--skip-resume] [--skip-memory] [--speed-rounds 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from autotune.loading import load_cluster, load_config, model_from_dict
from autotune.simulator.zero import StateBytes, offload_state_bytes, stage_units, working_bytes
from autotune.specs import ParallelConfig
from runner.data import TokenSource
from runner.engine import Engine
from runner.layout import build_layout
from runner.reference import reference_losses, trained_difference
from runner.train import train

GiB = 2**30
STATE_MODEL = dict(
    name="state-heavy",
    num_layers=8,
    hidden_size=512,
    num_heads=8,
    ffn_hidden_size=2048,
    mlp="gelu",
    vocab_size=256,
    seq_len=32,
    global_batch_size=4,
)
SHARDED = StateBytes(4.0, 4.0, 12.0)  # the CPU runner's sharded / offloaded engine (fp32, separate master)
PLAIN = StateBytes(4.0, 4.0, 8.0)  # the unsharded engine


def st(device, layers, recompute=False, offload="none"):
    return {
        "devices": [device] if isinstance(device, str) else device,
        "layers": layers,
        "recompute": recompute,
        "offload": offload,
    }


EQUIVALENCE = [  # (name, cluster, config) on tiny
    (
        "zero 1, 2 x 2 stages, layers 3+1 / 1+3, 5+3 mb, one replica offload optimizer",
        "cpu-4",
        {
            "micro_batch_size": 1,
            "zero": 1,
            "pipelines": [
                {
                    "num_microbatches": 5,
                    "stages": [st("cpu:0", 3, offload="optimizer"), st("cpu:1", 1, True, "optimizer")],
                },
                {"num_microbatches": 3, "stages": [st("cpu:2", 1), st("cpu:3", 3)]},
            ],
        },
    ),
    (
        "zero 2, 2 single-stage replicas, 5+3 mb",
        "cpu-2",
        {
            "micro_batch_size": 1,
            "zero": 2,
            "pipelines": [
                {"num_microbatches": 5, "stages": [st("cpu:0", 4)]},
                {"num_microbatches": 3, "stages": [st("cpu:1", 4, True)]},
            ],
        },
    ),
    (
        "zero 3, 2 single-stage replicas, 5+3 mb",
        "cpu-2",
        {
            "micro_batch_size": 1,
            "zero": 3,
            "pipelines": [
                {"num_microbatches": 5, "stages": [st("cpu:0", 4)]},
                {"num_microbatches": 3, "stages": [st("cpu:1", 4, True)]},
            ],
        },
    ),
    (
        "zero 3 + offload all / recompute, 5+3 mb",
        "cpu-2",
        {
            "micro_batch_size": 1,
            "zero": 3,
            "pipelines": [
                {"num_microbatches": 5, "stages": [st("cpu:0", 4, offload="all")]},
                {"num_microbatches": 3, "stages": [st("cpu:1", 4, True)]},
            ],
        },
    ),
    (
        "zero 2 + offload optimizer, 2 x 2 stages 1+3, 4+4 mb",
        "cpu-4",
        {
            "micro_batch_size": 1,
            "zero": 2,
            "pipelines": [
                {
                    "num_microbatches": 4,
                    "stages": [st("cpu:0", 1, offload="optimizer"), st("cpu:1", 3, True, "optimizer")],
                },
                {
                    "num_microbatches": 4,
                    "stages": [st("cpu:2", 1, offload="optimizer"), st("cpu:3", 3, offload="optimizer")],
                },
            ],
        },
    ),
    (
        "zero 3 + offload all, 2 x 2 stages 1+3, 4+4 mb",
        "cpu-4",
        {
            "micro_batch_size": 1,
            "zero": 3,
            "pipelines": [
                {"num_microbatches": 4, "stages": [st("cpu:0", 1, offload="all"), st("cpu:1", 3, True, "all")]},
                {"num_microbatches": 4, "stages": [st("cpu:2", 1, offload="all"), st("cpu:3", 3, offload="all")]},
            ],
        },
    ),
    (
        "zero 2, 2 x 2 stages, layers 3+1 / 1+3, 5+3 mb, one stage recompute + offload optimizer",
        "cpu-4",
        {
            "micro_batch_size": 1,
            "zero": 2,
            "pipelines": [
                {"num_microbatches": 5, "stages": [st("cpu:0", 3), st("cpu:1", 1, True, "optimizer")]},
                {"num_microbatches": 3, "stages": [st("cpu:2", 1), st("cpu:3", 3)]},
            ],
        },
    ),
    (
        "offload optimizer, one process (no peers)",
        "cpu-2",
        {
            "micro_batch_size": 2,
            "pipelines": [{"num_microbatches": 4, "stages": [st("cpu:0", 4, offload="optimizer")]}],
        },
    ),
    (
        "zero 1 + offload all, 2 single-stage replicas, 6+2 mb",
        "cpu-2",
        {
            "micro_batch_size": 1,
            "zero": 1,
            "pipelines": [
                {"num_microbatches": 6, "stages": [st("cpu:0", 4, offload="all")]},
                {"num_microbatches": 2, "stages": [st("cpu:1", 4, offload="all")]},
            ],
        },
    ),
    (  # even replicas: torch's FSDP2 (runner.fsdp)
        "zero 3 on FSDP2, 2 x 2 stages 2+2, 4+4 mb, second stage recompute",
        "cpu-4",
        {
            "micro_batch_size": 1,
            "zero": 3,
            "pipelines": [
                {"num_microbatches": 4, "stages": [st(f"cpu:{2 * p}", 2), st(f"cpu:{2 * p + 1}", 2, True)]}
                for p in range(2)
            ],
        },
    ),
]

# zero 1 uneven, zero 3 + all uneven, zero 3 + all pipelines, zero 2 over uneven splits and counts, FSDP2
RESUME = [EQUIVALENCE[0], EQUIVALENCE[3], EQUIVALENCE[5], EQUIVALENCE[6], EQUIVALENCE[-1]]

MEMORY = [
    ("zero 0", 0, "none"),
    ("zero 1", 1, "none"),
    ("zero 2", 2, "none"),
    ("zero 3", 3, "none"),
    ("zero 2 + offload optimizer", 2, "optimizer"),
    ("zero 3 + offload all", 3, "all"),
]


def equivalence(steps: int, rows: list = EQUIVALENCE) -> None:
    print(f"{'plan':78s} {'max rel diff':>12s} {'wall s':>7s}")
    worst = 0.0
    ref = reference_losses("tiny", steps)
    for name, cluster, config in rows:
        diff, wall, error = trained_difference(cluster, "tiny", config, steps, ref, timeout_s=600)
        if diff is None:
            print(f"{name:78s} FAILED: {error}")
            continue
        worst = max(worst, diff)
        print(f"{name:78s} {diff:12.2e} {wall:7.1f}", flush=True)
    print(f"worst relative difference over {steps} steps: {worst:.2e} (tests assert rtol 1e-5)\n")


def resume(steps: int) -> None:
    half = steps // 2
    print(f"{'plan':78s} {'resumed == at once':>18s}")
    for name, cluster, config in RESUME:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            runs = [
                train(cluster, "tiny", config, steps=steps, metrics_out=tmp / "whole.jsonl", quiet=True, timeout_s=600),
                train(
                    cluster,
                    "tiny",
                    config,
                    steps=half,
                    checkpoint_dir=tmp / "ckpt",
                    metrics_out=tmp / "parts.jsonl",
                    quiet=True,
                    timeout_s=600,
                ),
                train(
                    cluster,
                    "tiny",
                    config,
                    steps=steps,
                    checkpoint_dir=tmp / "ckpt",
                    resume=True,
                    metrics_out=tmp / "parts.jsonl",
                    quiet=True,
                    timeout_s=600,
                ),
            ]
            failed = [r.error for r in runs if r.returncode != 0]
            if failed:
                print(f"{name:78s} FAILED: {failed[0]}")
                continue
            whole, parts = (
                [json.loads(line)["loss"] for line in (tmp / f).read_text().splitlines()]
                for f in ("whole.jsonl", "parts.jsonl")
            )
            shards = sum(1 for _ in (tmp / "ckpt" / f"step-{half:08d}").glob("*.distcp"))
        same = "bit for bit" if parts == whole else f"NO (max diff {max(abs(a - b) for a, b in zip(parts, whole)):.2e})"
        print(f"{name:78s} {same:>18s}  ({len(parts)} steps, resumed at {half}, {shards} shard files)", flush=True)
    print()


def predicted_states_GiB(model, zero: int, offload: str) -> tuple[float, float]:
    """(device, host) model-state GiB of one rank holding the whole model with one peer."""
    units = stage_units(model, model.num_layers, 1, True, True)
    split = SHARDED if offload == "optimizer" else PLAIN  # runner.zero runs optimizer-only offload, FSDP2 the rest
    device, host = offload_state_bytes(sum(units), 2, zero, offload, split)
    return (device + working_bytes(units, zero, offload, 2, split)) / GiB, host / GiB


def memory() -> None:
    from runner import RealEvaluator

    model = model_from_dict(STATE_MODEL, "zero_runner")
    cluster = load_cluster("cpu-2")
    ev = RealEvaluator(cluster, model, steps=2, warmup=1, timeout_s=600)
    print(f"{model.name}: {model.num_params / 1e6:.1f}M parameters, 2 single-stage replicas on cpu-2")
    print(
        f"{'plan':28s} {'measured GiB':>12s} {'- zero 0':>9s} {'predicted - zero 0':>19s} {'host measured':>13s} "
        f"{'host predicted':>14s}"
    )
    base_measured = base_predicted = None
    for name, zero, offload in MEMORY:
        config = ParallelConfig.from_dict(_even(model, zero, offload))
        m = ev.evaluate(config)
        if m.status != "ok":
            print(f"{name:28s} {m.status}: {m.error}")
            continue
        measured = max(m.peak_memory_GiB.values())
        device, host = predicted_states_GiB(model, zero, offload)
        if base_measured is None:
            base_measured, base_predicted = measured, device
        host_measured = sum(m.host_memory_GiB.values()) / 2 if m.host_memory_GiB else 0.0
        print(
            f"{name:28s} {measured:12.3f} {measured - base_measured:+9.3f} {device - base_predicted:+19.3f} "
            f"{host_measured:13.3f} {host:14.3f}",
            flush=True,
        )


def _timed_rank(rank: int, plan: str, fsdp: bool, steps: int, out: str) -> None:
    """One of two ranks: ``steps`` + 1 training steps of ``SPEED[plan]``, rank 0's step times saved."""
    torch.set_num_threads(1)
    init = f"file://{Path(out) / 'rendezvous'}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=600))
    model = model_from_dict(STATE_MODEL, "zero_runner")
    config = load_config(SPEED[plan](model))
    layout = build_layout(load_cluster("cpu-2"), model, config)
    engine = Engine(
        layout, model, rank, torch.device("cpu"), schedule="1f1b", seed=0, tokens=TokenSource(model, 0), fsdp=fsdp
    )
    assert engine.fsdp == fsdp
    times = [engine.step(i).time_s for i in range(steps + 1)][1:]
    if rank == 0:
        (Path(out) / "times.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def _even(model, zero: int, offload: str = "none", counts: tuple[int, int] = (2, 2)) -> dict:
    """Two single-stage replicas of the whole ``model``, 2 micro-batches each unless ``counts`` says otherwise
    (the memory and speed plans)."""
    pipes = [
        {"num_microbatches": counts[p], "stages": [st(f"cpu:{p}", model.num_layers, offload=offload)]} for p in range(2)
    ]
    return {"micro_batch_size": 1, "zero": zero, "pipelines": pipes}


#: the speed plans: what FSDP2 runs since it took them over from runner.zero
SPEED = {
    "zero 2": lambda model: _even(model, 2),
    "zero 3": lambda model: _even(model, 3),
    "zero 1, 3 + 1 micro-batches": lambda model: _even(model, 1, counts=(3, 1)),
}


def speed(rounds: int, steps: int) -> None:
    """Step time of the ``SPEED`` plans (single-stage replicas of ``STATE_MODEL`` on ``cpu-2``), run by torch's
    FSDP2 (``runner.fsdp``, what ``autotune train`` runs for these plans) and by ``runner.zero`` (what ran them
    before; the engine's ``fsdp=False``), in-process engines, rounds alternating so that load hits both alike."""
    import statistics

    import torch.multiprocessing as mp

    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for plan in SPEED:
            for name, fsdp in (("FSDP2", True), ("runner.zero", False)):
                with tempfile.TemporaryDirectory() as d:
                    mp.spawn(_timed_rank, args=(plan, fsdp, steps, d), nprocs=2, join=True)
                    times.setdefault((plan, name), []).extend(json.loads((Path(d) / "times.json").read_text()))
    print(f"{'plan':42s} {'median s/step':>13s} {'min s/step':>10s}  (FSDP2 / runner.zero)")
    for plan in SPEED:
        f, z = times[(plan, "FSDP2")], times[(plan, "runner.zero")]
        for name, t in (("FSDP2", f), ("runner.zero", z)):
            print(f"{f'{plan}, {name}':42s} {statistics.median(t):13.3f} {min(t):10.3f}")
        print(f"{f'{plan}, ratio':42s} {statistics.median(f) / statistics.median(z):13.2f} {min(f) / min(z):10.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--skip-equivalence", action="store_true")
    ap.add_argument("--skip-resume", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--speed-rounds", type=int, default=2, help="FSDP2 against runner.zero, rounds (0: skip)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works: two equivalence rows, 2 steps "
        "(tests/integration/experiments/test_experiments_speed.py runs it)",
    )
    args = ap.parse_args()
    if args.quick:
        args.steps, args.skip_resume, args.skip_memory, args.speed_rounds = 2, True, True, 0
    torch.set_num_threads(1)
    if not args.skip_equivalence:  # --quick: the first row (runner.zero) and the last (FSDP2); the tests run them all
        equivalence(args.steps, [EQUIVALENCE[0], EQUIVALENCE[-1]] if args.quick else EQUIVALENCE)
    if not args.skip_resume:
        resume(args.steps)
    if not args.skip_memory:
        memory()
    if args.speed_rounds:
        speed(args.speed_rounds, args.steps)


if __name__ == "__main__":
    main()
