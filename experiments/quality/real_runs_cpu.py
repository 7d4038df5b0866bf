"""Real runs on this machine's CPU ranks: which plans each method runs, and how soon it has the best one.

On ``cpu-hetero`` (2 CPU ranks + 2 emulated 2x slower, one machine) and the ``tiny`` model, each method
searches with ``--backend real`` (short profiled runs under torchrun, the closed loop of
``autotune.search.screen``), ``--budget`` plans, ``--repeats`` times (seeds 0, 1, ...):

- ``sim order``: ``--method dp`` (the planner's plans in the corrected simulator's order);
- ``optuna``: ``--method optuna`` (TPE on real runs, from dp's best 3 plans);
- ``agent``: ``--method rl`` (the learned chooser of real runs, ``autotune.search.agents.acquire``, with its
  stopping rule).

The truth on a real machine is unknown and runs are noisy (15-40% between runs of one plan on a loaded
machine); per repeat, the reference is the best plan any method measured in that repeat, and a method
"has" it once its best measured plan is within ``TARGET`` of it; "ran best plan" counts the repeats in which
it ran the reference's plan itself (its own runs of it may measure slower: run-to-run noise). Printed per
repeat and method: the plans
run, the runs including repeats of one plan, the run at which it reached the reference, and its best time;
then the summary over repeats and the load average.

    .venv/bin/python experiments/quality/real_runs_cpu.py [--budget 6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

TARGET = 0.95
METHODS = (("sim order", "dp"), ("optuna", "optuna"), ("agent", "rl"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=int, default=6, help="plans per search")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cluster", default="cpu-hetero")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--plans", action="store_true", help="print every plan each method ran, predicted and measured")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works (tests/integration/experiments/test_experiments.py runs it)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.budget, args.repeats = 2, 1
    logging.basicConfig(level=logging.ERROR)
    if args.plans:  # the chooser says why it stopped
        logging.getLogger("autotune.search.agents.acquire").setLevel(logging.INFO)
    import torch

    torch.set_num_threads(1)
    from autotune.search.api import tune

    t0 = time.time()
    reached: dict[str, list[int | None]] = {name: [] for name, _ in METHODS}
    plans: dict[str, list[int]] = {name: [] for name, _ in METHODS}
    runs: dict[str, list[int]] = {name: [] for name, _ in METHODS}
    has_plan: dict[str, list[bool]] = {name: [] for name, _ in METHODS}
    for seed in range(args.repeats):
        found, configs = {}, {}
        for name, method in METHODS:
            result = tune(
                args.cluster,
                args.model,
                method=method,
                budget=args.budget,
                backend="real",
                seed=seed,
                track=False,
                storage="memory",
                run_timeout_s=300,
            )
            times = [r.measured_s if r.status == "ok" and r.measured_s > 0 else float("inf") for r in result.real_runs]
            if args.plans:
                for r in result.real_runs:
                    pred = f"{r.predicted_s:.3f}" if r.predicted_s else "-"
                    print(
                        f"  {name:10s} plan {r.index}: predicted {pred} s, measured {r.measured_s:.3f} s "
                        f"{r.runs_s} {r.status}  {r.config.describe()}",
                        flush=True,
                    )
            found[name] = (times, sum(len(r.runs_s) for r in result.real_runs))
            configs[name] = [r.config for r in result.real_runs]
        best = min(min(t, default=float("inf")) for t, _ in found.values())
        # the plan behind the reference time: a method that ran it has it, whatever its own run's noise
        best_plan = next(configs[n][t.index(best)] for n, (t, _) in found.items() if best in t)
        for name, (times, n_runs) in found.items():
            has_plan[name].append(best_plan in configs[name])
            so_far = [min(times[: i + 1]) for i in range(len(times))]
            k = next((i + 1 for i, t in enumerate(so_far) if best / t >= TARGET), None)
            reached[name].append(k)
            plans[name].append(len(times))
            runs[name].append(n_runs)
            print(
                f"repeat {seed} {name:10s}: {len(times)} plans, {n_runs} runs, reference reached at plan "
                f"{k if k is not None else '-'}; best {min(times, default=float('inf')):.3f} s (reference {best:.3f} s)",
                flush=True,
            )
    print(
        f"\n{args.cluster} / {args.model}, budget {args.budget}, {args.repeats} repeats, {time.time() - t0:.0f} s, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(f"{'method':<10s} {'reached':>8s} {'median plan':>12s} {'plans':>6s} {'runs':>6s} {'ran best plan':>14s}")
    for name, _ in METHODS:
        ks = [k for k in reached[name] if k is not None]
        med = f"{statistics.median(ks):g}" if ks else "-"
        print(
            f"{name:<10s} {len(ks):>4d}/{len(reached[name]):<3d} {med:>12s} "
            f"{statistics.mean(plans[name]):>6.1f} {statistics.mean(runs[name]):>6.1f} "
            f"{sum(has_plan[name]):>10d}/{len(has_plan[name])}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
