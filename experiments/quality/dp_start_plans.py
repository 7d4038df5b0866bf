"""How many of the structured planner's plans should ``--start dp`` evaluate? (issue 16)

On validation scenarios (``autotune.policy.scenarios.validation_rng``: the training generator's mixture
with its own seed stream, never the held-out set) this runs ``--method dp`` through ``autotune.tune``
(memory first, the simulator backend) at ``--budget`` evaluations and prints, for k = 1, 2, 3, 5, 8,
..., the best plan among dp's first k evaluations as a fraction of the best of all ``--budget``, and
how many scenarios reach 98% of it by k. dp's candidates come best composed time first, but the
composition is approximate (no schedule simulation, no contention), so the first candidate is not
always the best once simulated; this measures how far down the list the best one sits.

    .venv/bin/python experiments/quality/dp_start_plans.py --scenarios 24 --budget 20
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from autotune.policy.scenarios import SCENARIO_KINDS, draw_scenario, validation_rng

KS = (1, 2, 3, 4, 5, 6, 8, 10, 15, 20)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", type=int, default=24)
    ap.add_argument("--budget", type=int, default=20)
    ap.add_argument("--seed", type=int, default=7, help="validation seed stream (train_policy.py uses 0)")
    ap.add_argument("--skip", type=int, default=0, help="draw but do not run the first N scenarios")
    ap.add_argument(
        "--kinds",
        default="classic,tight,internet,moe",
        help=f"scenario kinds in turn (of {', '.join(SCENARIO_KINDS)}; large costs minutes each)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works (tests/integration/experiments/test_experiments.py runs it)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.scenarios, args.budget = 1, 4
    logging.basicConfig(level=logging.WARNING)

    from autotune import tune
    from autotune.simulator import Simulator

    kinds = args.kinds.split(",")
    rng = validation_rng(args.seed)
    ks = [k for k in KS if k <= args.budget]
    rows = []
    t0 = time.time()
    for i in range(args.scenarios):
        s = draw_scenario(rng, name=f"val{i}", kind=kinds[i % len(kinds)])
        if i < args.skip:
            continue
        t1 = time.time()
        try:
            result = tune(
                s.cluster,
                s.model,
                method="dp",
                budget=args.budget,
                track=False,
                storage="memory",
                evaluator=Simulator(s.cluster, s.model),
            )
            curve = list(result.best_curve)
        except Exception as e:  # no plan at all: nothing to rank
            print(f"{s.name} ({kinds[i % len(kinds)]}): no plan ({str(e)[:80]})")
            continue
        best = max(curve) if curve else 0.0
        if best <= 0:
            continue
        at = [curve[min(k, len(curve)) - 1] / best for k in ks]
        to98 = next((j + 1 for j, x in enumerate(curve) if x >= 0.98 * best), None)
        rows.append((s.name, kinds[i % len(kinds)], at, to98))
        print(
            f"{s.name:6s} {kinds[i % len(kinds)]:9s} " + " ".join(f"{x:5.3f}" for x in at) + f"   98% at {to98}"
            f"   ({s.cluster.num_devices} GPUs, {time.time() - t1:.0f} s)",
            flush=True,
        )
    print(f"\n{len(rows)} validation scenarios with a plan, dp at budget {args.budget}, {time.time() - t0:.0f} s")
    print("k (dp plans evaluated)       " + " ".join(f"{k:>5d}" for k in ks))
    print(
        "median best@k / best@budget  "
        + " ".join(f"{statistics.median(r[2][j] for r in rows):5.3f}" for j in range(len(ks)))
    )
    print(
        "mean                         "
        + " ".join(f"{statistics.mean(r[2][j] for r in rows):5.3f}" for j in range(len(ks)))
    )
    print(
        "scenarios at >= 98% by k     " + " ".join(f"{sum(r[2][j] >= 0.98 for r in rows):5d}" for j in range(len(ks)))
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
