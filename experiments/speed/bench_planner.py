"""Planning time of ``--method dp`` (the structured planner) on large clusters of four GPU types.

For 128, 512 and 1,024 GPUs (equal numbers of H100-80GB, A100-40GB, L4 and A10G, 8 per node, 400 Gbit/s
between nodes), the wall time of ``Planner.plan`` on one core (the composition of every candidate plan
from per-stage costs for every offload mode, and the simulations of the best structures' memory-state
variants, ``autotune.planning.state_variants``; CPU time of this process, which load on the machine does
not inflate, and wall time), the number of plans composed, the best plan's estimate (its composed
iteration time, or its simulated time for a state variant), and the full simulator's time for that plan.

    python experiments/speed/bench_planner.py            # --sizes 128 512 1024 --model llama2-70b
    python experiments/speed/bench_planner.py --against COMMIT --sizes 1024 --rounds 3

``--against COMMIT`` times this tree's planner and that commit's side by side (``against.py``: alternating
child processes, the best CPU time of each).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from against import alternate, run_in

from autotune.loading import cluster_from_dict, load_model
from autotune.planning.planner import Planner
from autotune.planning.space import SearchSpace
from autotune.simulator import Simulator

TYPES = (("h100", "H100-80GB", 450), ("a100", "A100-40GB", 300), ("l4", "L4", 32), ("a10g", "A10G", 32))


def cluster(n_gpus: int):
    per_type_nodes = n_gpus // (8 * len(TYPES))
    nodes = [
        dict(name=name, gpu=gpu, count=8, repeat=per_type_nodes, intra_node=dict(bandwidth_GBps=bw, latency_us=2))
        for name, gpu, bw in TYPES
    ]
    return cluster_from_dict(
        dict(nodes=nodes, network=dict(bandwidth_GBps=50, latency_us=5)),
        source="bench_planner",
        default_name=f"four-types-{n_gpus}",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[128, 512, 1024])
    ap.add_argument("--model", default="llama2-70b")
    ap.add_argument("--global-batch-size", type=int, default=2048)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works (tests/integration/experiments/test_experiments.py runs it)",
    )
    ap.add_argument("--against", metavar="COMMIT", help="side by side with that commit's planner (CPU time)")
    ap.add_argument("--rounds", type=int, default=3, help="--against: alternating runs of each tree")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.rounds = [128], 1
    if args.against:
        for n in args.sizes:
            me = [str(Path(__file__).resolve()), "--sizes", str(n), "--model", args.model]
            me += ["--global-batch-size", str(args.global_batch_size)]

            def measure(tree: Path) -> float:  # the child's table row: | GPUs | model | CPU s | ...
                return float(run_in(tree, me).strip().splitlines()[-1].split("|")[3])

            print(f"planning CPU time (s), {n} GPUs, {args.model}:")
            alternate(args.against, args.rounds, measure, f"planner at {n} GPUs", higher_is_better=False)
        return
    import torch

    torch.set_num_threads(1)
    print(
        "| GPUs | model | planning CPU time (s) | wall (s) | plans composed | best estimate (s) | "
        "simulated (s) | plan |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in args.sizes:
        c = cluster(n)
        m = load_model(args.model, args.global_batch_size)
        space = SearchSpace(c, m)
        sim = Simulator(c, m)
        t0, c0 = time.perf_counter(), time.process_time()
        planner = Planner(space, sim)
        cands = planner.plan(limit=10)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        best = cands[0]
        meas = sim.evaluate(best.config)
        used = len(best.config.devices)
        print(
            f"| {n} | {m.name} (gbs {m.global_batch_size}) | {cpu:.2f} | {dt:.2f} | {planner.composed:,} | "
            f"{best.estimate_s:.3f} | {meas.iteration_time_s:.3f} ({meas.status}) | {best.family}, "
            f"{len(best.config.pipelines)} replicas, {used} GPUs used, mbs {best.config.micro_batch_size} |"
        )


if __name__ == "__main__":
    main()
