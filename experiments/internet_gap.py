"""Why rl misses Optuna's plan on the held-out internet-4node scenario (issue 16).

internet-4node: 2 nodes of 4 A100-80GB (300 GB/s inside) + 2 nodes of 4 RTX-4090 (16 GB/s inside),
joined by a 1 Gbit/s (0.125 GB/s), 30 ms network; GPT-2 XL, global batch 256. Prints dp's plan, the
reference Optuna run's best plan (budget as heldout_eval's reference, seed 1000, start dp) and rl's best
plan at budget 50 for the given policies, each with its simulated tokens/s, the time split (compute,
bubble, data-parallel sync, pipeline transfers) the simulator reports, and, for rl, how many moves from
its best plan lead to Optuna's plan's structure (pp, tp per class, use per class, mbs, schedule).

    .venv/bin/python experiments/internet_gap.py [--reference-budget 400] [--policy FILE ...]
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.policy.scenarios import heldout_scenarios  # noqa: E402
from autotune.search.api import tune  # noqa: E402
from autotune.simulator import Simulator  # noqa: E402


def show(label: str, config, sim: Simulator) -> None:
    m = sim.evaluate_detailed(config)
    print(
        f"{label}: {m.tokens_per_s:,.0f} tokens/s, iteration {m.iteration_time_s:.2f} s, bubble "
        f"{m.bubble_fraction:.2f}, status {m.status}"
    )
    print(f"    {config.describe()}")
    # the busiest device's time by kind of op (forward, backward, gradient all-reduce, sends, optimizer)
    if m.timeline:
        by_dev: dict[str, dict[str, float]] = {}
        for e in m.timeline:
            kind = re.match(r"[A-Za-z_]*", e.op).group() or e.op  # F3 / B3.1 / FB.0 -> F / B / FB
            d = by_dev.setdefault(e.device, {})
            d[kind] = d.get(kind, 0.0) + e.end_s - e.start_s
        dev, kinds = max(by_dev.items(), key=lambda kv: sum(kv[1].values()))
        print(f"    busiest device {dev}: " + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(kinds.items())))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference-budget", type=int, default=400)
    ap.add_argument("--budget", type=int, default=50)
    ap.add_argument("--policy", action="append", default=[])
    ap.add_argument("--scenario", default="internet-4node")
    ap.add_argument(
        "--pipeline-only-budget",
        type=int,
        default=0,
        help="also search the space without RoundPipe plans (dp, and optuna at this budget)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    import torch

    torch.set_num_threads(1)
    s = next(x for x in heldout_scenarios() if x.name == args.scenario)
    sim = Simulator(s.cluster, s.model)
    print(s.describe())
    dp = tune(s.cluster, s.model, method="dp", budget=args.budget, seed=0, track=False, storage="memory", evaluator=sim)
    show(f"dp (budget {args.budget})", dp.best_config, sim)
    ref = tune(
        s.cluster,
        s.model,
        method="optuna",
        budget=args.reference_budget,
        seed=1000,
        track=False,
        storage="memory",
        evaluator=sim,
        start="dp",
    )
    found_at = next(i + 1 for i, v in enumerate(ref.best_curve) if v >= ref.best_curve[-1])
    show(
        f"optuna reference (budget {args.reference_budget}, best found at evaluation {found_at})", ref.best_config, sim
    )
    if args.pipeline_only_budget:
        off = {"roundpipe": [False]}
        dp2 = tune(
            s.cluster,
            s.model,
            method="dp",
            budget=args.budget,
            seed=0,
            track=False,
            storage="memory",
            evaluator=sim,
            restrict=off,
        )
        show(f"pipeline plans only: dp (budget {args.budget})", dp2.best_config, sim)
        op2 = tune(
            s.cluster,
            s.model,
            method="optuna",
            budget=args.pipeline_only_budget,
            seed=1000,
            track=False,
            storage="memory",
            evaluator=sim,
            start="dp",
            restrict=off,
        )
        show(f"pipeline plans only: optuna (budget {args.pipeline_only_budget})", op2.best_config, sim)
    for policy in args.policy or [None]:
        r = tune(
            s.cluster,
            s.model,
            method="rl",
            budget=args.budget,
            seed=0,
            track=False,
            storage="memory",
            evaluator=sim,
            start="dp",
            policy=policy,
        )
        show(f"rl {policy or 'shipped'} (budget {args.budget})", r.best_config, sim)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
