"""Simulator speed: configs per second on one core for a 32-GPU mixed cluster, 8 stages, 64 micro-batches.

Plans: llama2-7b (global batch 256 sequences) on the ``mixed-h100-a100-32`` preset (16 H100 + 16 A100-40GB),
8 pipeline stages per replica, 64 micro-batches per replica, tensor parallelism 1, 2 or 4 (so 4, 2 or 1
replicas, micro-batch 1, 2 or 4), random layer splits, random placement of tensor-parallel groups
(kept inside a node), recomputation on every stage (without it most llama2-7b plans at 4096 tokens do not fit),
1F1B, GPipe or interleaved 1F1B with 2 chunks per stage. Every plan is distinct.

    .venv/bin/python experiments/speed/bench_simulator.py [--configs 3000] [--seed 0] [--against 61c44b6]

Prints configs/s for: the search's usage (one Simulator, its caches on); with the whole-pipeline cache
off (every pipeline simulated operation by operation); and per schedule. ``--against COMMIT`` instead times
the search's usage of this tree and of that commit side by side in alternating rounds (``against.py``;
default rounds 5, best of each), the previous release being 61c44b6; by default per second of each child's CPU
time (``--clock cpu``: on a shared machine its other programs stretch wall time, far less CPU time).
``--against COMMIT --instructions N`` counts instructions per plan instead (valgrind's callgrind), which
the machine's load does not move at all.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

from against import PREVIOUS_RELEASE, alternate, run_in

from autotune import load_cluster, load_model
from autotune.simulator import Simulator
from autotune.simulator import simulator as simulator_module
from autotune.specs import ParallelConfig, PipelineConfig, StageConfig

STAGES, MICROBATCHES, GLOBAL_BATCH = 8, 64, 256
SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")


def random_config(rng: random.Random, cluster, num_layers: int, schedule: str) -> ParallelConfig:
    v = 2 if schedule == "interleaved-1f1b" else 1  # interleaved: 2 chunks per stage, so even layer counts
    tp = rng.choice([1, 2, 4])
    dp = cluster.num_devices // (STAGES * tp)
    groups = []
    for node in cluster.nodes:
        ids = list(node.device_ids())
        groups += [tuple(ids[i : i + tp]) for i in range(0, len(ids), tp)]
    rng.shuffle(groups)
    pipelines = []
    for r in range(dp):
        cuts = sorted(rng.sample(range(1, num_layers // v), STAGES - 1))
        layers = [v * (b - a) for a, b in zip([0] + cuts, cuts + [num_layers // v])]
        stages = tuple(StageConfig(groups[r * STAGES + s], layers[s], True) for s in range(STAGES))
        pipelines.append(PipelineConfig(MICROBATCHES, stages))
    return ParallelConfig(GLOBAL_BATCH // (dp * MICROBATCHES), tuple(pipelines), schedule=schedule, virtual_stages=v)


def bench(sim: Simulator, configs: list[ParallelConfig], clock=time.perf_counter) -> tuple[float, int]:
    t0 = clock()
    ok = sum(sim.evaluate(c).ok for c in configs)
    return len(configs) / (clock() - t0), ok


WARM = 300  # --instructions: plans evaluated first by every child (imports, compiled programs, caches warm)


def instructions(commit: str, n: int, seed: int) -> None:
    """Instructions per plan (callgrind) of that commit's simulator and this tree's, over ``n`` plans after the
    warm-up: each tree's count with ``n`` plans less its count with none, all four runs at once."""
    import re
    import shutil
    import subprocess
    import sys
    import tempfile

    from against import ROOT, checkout

    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (apt install valgrind)")
    me = [str(Path(__file__).resolve()), "--configs", str(n + WARM), "--seed", str(seed)]
    with checkout(commit) as old, tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for name, tree in ((commit, old), ("this tree", ROOT)):
            for k in (0, n):
                out = Path(tmp) / f"{len(runs)}.out"
                cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, *me]
                env = dict(os.environ, PYTHONPATH=str(tree))
                proc = subprocess.Popen([*cmd, "--instructions-child", str(k)], env=env, cwd=tree, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
                runs[(name, k)] = (proc, out)
        counts: dict[str, dict[int, tuple[int, str]]] = {}
        for (name, k), (proc, out) in runs.items():
            stdout, _ = proc.communicate()
            if proc.returncode:
                raise SystemExit(f"callgrind of {name} with {k} plans exited {proc.returncode}")
            total = int(re.search(r"^summary: (\d+)", out.read_text(), re.M).group(1))
            counts.setdefault(name, {})[k] = (total, stdout.strip())
    print(f"instructions per plan (callgrind), {n} plans after {WARM} warm-up plans")
    per_plan = {}
    for name, c in counts.items():
        per_plan[name] = (c[n][0] - c[0][0]) / n
        print(f"  {name:10s} {per_plan[name] / 1e6:8.3f} M  ({c[n][1]} of {n})")
    print(
        f"simulator: {commit} executes {per_plan[commit] / per_plan['this tree']:.2f}x this tree's instructions per plan"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works (tests/integration/experiments/test_experiments.py runs it)",
    )
    ap.add_argument("--against", metavar="COMMIT", help=f"side by side with that commit (e.g. {PREVIOUS_RELEASE})")
    ap.add_argument("--rounds", type=int, default=5, help="--against: alternating rounds")
    ap.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="--against: configs per second of the process's CPU time (default: what a loaded machine's other "
        "programs do not move much; on a quiet machine the two agree) or of wall time",
    )
    ap.add_argument(
        "--instructions",
        type=int,
        metavar="N",
        help="--against: instead of timing, count the instructions each tree executes per plan over N plans "
        "(valgrind's callgrind: what a shared machine's load does not move; ~20 min for N = 600)",
    )
    ap.add_argument("--search-usage-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--instructions-child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.configs = 100
    if args.against and args.instructions:
        instructions(args.against, args.instructions, args.seed)
        return
    if args.against:
        print(f"configs/s, search usage, {args.configs} plans, load average {os.getloadavg()[0]:.2f} (2 cores)")
        me = [str(Path(__file__).resolve()), "--configs", str(args.configs), "--seed", str(args.seed)]
        me += ["--clock", args.clock]
        print(f"clock: {args.clock} time")

        def measure(tree: Path) -> float:
            line = run_in(tree, [*me, "--search-usage-only"]).strip().splitlines()[-1]
            return float(line.split("configs/s")[0].split(":")[-1])

        alternate(args.against, args.rounds, measure, "simulator")
        return
    cluster = load_cluster("mixed-h100-a100-32")
    model = load_model("llama2-7b", global_batch_size=GLOBAL_BATCH)
    rng = random.Random(args.seed)
    configs = list(
        {random_config(rng, cluster, model.num_layers, rng.choice(SCHEDULES)): None for _ in range(args.configs)}
    )
    print(
        f"{len(configs)} distinct plans: {cluster.name} ({cluster.num_devices} GPUs), {model.name}, "
        f"{STAGES} stages, {MICROBATCHES} micro-batches per replica"
    )

    if args.instructions_child is not None:  # --instructions' child: warm (programs compiled), then the plans
        sim = Simulator(cluster, model)
        for c in configs[:WARM]:
            sim.evaluate(c)
        if args.instructions_child:
            sim = Simulator(cluster, model)
            print("fit", sum(sim.evaluate(c).ok for c in configs[WARM : WARM + args.instructions_child]))
        return
    clock = time.process_time if args.search_usage_only and args.clock == "cpu" else time.perf_counter
    rate, ok = bench(Simulator(cluster, model), configs, clock)
    if args.search_usage_only:  # --against's child: the best of three passes, each on a fresh Simulator
        rate = max(rate, *(bench(Simulator(cluster, model), configs, clock)[0] for _ in range(2)))
    print(
        f"search usage (one Simulator, caches on):      {rate:8.0f} configs/s  ({ok} fit, "
        f"{len(configs) - ok} out of memory)"
    )
    if args.search_usage_only:
        return

    size = simulator_module._PIPELINE_CACHE_SIZE
    simulator_module._PIPELINE_CACHE_SIZE = -1  # clear on every insert: each pipeline simulated op by op
    try:
        rate, _ = bench(Simulator(cluster, model), configs)
        print(f"whole-pipeline cache off:                     {rate:8.0f} configs/s")
        fits = [c for c in configs if Simulator(cluster, model).evaluate(c).ok]
        for schedule in SCHEDULES:
            subset = [c for c in fits if c.schedule == schedule]
            rate, _ = bench(Simulator(cluster, model), subset)
            print(f"  {schedule:16s} plans that fit ({len(subset):5d}), cache off: {rate:8.0f} configs/s")
    finally:
        simulator_module._PIPELINE_CACHE_SIZE = size


if __name__ == "__main__":
    main()
