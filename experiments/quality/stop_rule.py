"""The chooser's stopping rule on validation realities: runs spent against runs to the true best, per threshold.

``--method rl --backend real`` stops once no candidate is expected to beat the best measured plan by
``STOP_GAIN`` (``autotune.search.agents.acquire``). A high threshold saves runs and misses the best plan when
it stops short of it; a low one spends the budget. This replays the chooser (the shipped policy and the greedy
expected-gain rule; the first run is the planner's first plan, as in a search) on perturbed realities of the
validation scenarios (``autotune.policy.scenarios.validation_rng``, the stream ``scripts/train_acquisition.py``
validates on: never the held-out set), stopping at each threshold, and prints per threshold: the share of
draws that reach 98% of the true best within the budget, the median and 90th percentile of runs to it (">B":
not reached, counting a stop short of it), and the mean runs spent.

    .venv/bin/python experiments/quality/stop_rule.py [--scenarios 20] [--draws 12] [--budget 10]
"""

from __future__ import annotations

import argparse
import logging
import math
import time

import numpy as np

THRESHOLDS = (0.02, 0.01, 0.005, 0.002, 0.001, 0.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", type=int, default=20, help="validation scenarios")
    ap.add_argument("--draws", type=int, default=12, help="perturbed realities per scenario")
    ap.add_argument("--budget", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="2 scenarios x 2 draws (the same code path)")
    args = ap.parse_args(argv)
    if args.quick:
        args.scenarios, args.draws = 2, 2
    logging.basicConfig(level=logging.ERROR)
    import torch

    torch.set_num_threads(1)
    from autotune.policy.acquisition_training import (
        greedy_gain,
        policy_chooser,
        run_episode,
        runs_to_target,
        scenario_episodes,
    )
    from autotune.policy.policy_file import load_policy_network
    from autotune.policy.scenarios import draw_scenario, validation_rng
    from autotune.search.agents.acquire import STOP_GAIN, default_acquisition_path

    t0 = time.time()
    episodes = []
    for i in range(args.scenarios):  # as scripts/train_acquisition.py builds its validation episodes
        s = draw_scenario(validation_rng(i), name=f"val{i}")
        episodes += scenario_episodes(s, args.draws, np.random.default_rng([i, args.draws, len("val")]))
    choosers = {
        "agent": policy_chooser(load_policy_network(default_acquisition_path())),
        "greedy gain": greedy_gain,
    }
    print(
        f"{len(episodes)} validation episodes ({args.scenarios} scenarios x {args.draws} draws), budget {args.budget}"
    )
    print(f"{'chooser':12s} {'stop':>6s} {'reached':>8s} {'median':>7s} {'p90':>5s} {'spent':>6s}")
    for name, choose in choosers.items():
        for stop in THRESHOLDS:
            ks, spent = [], []
            for ep in episodes:
                curve = run_episode(ep, choose, args.budget, stop if stop > 0 else None, planner_first=True)
                k = runs_to_target(curve)
                ks.append(k if k is not None else math.inf)
                spent.append(len(curve))
            ks.sort()

            def pct(q: float) -> str:
                v = ks[min(len(ks) - 1, math.ceil(q * len(ks)) - 1)]
                return f">{args.budget}" if math.isinf(v) else str(int(v))

            mark = "  <- STOP_GAIN" if stop == STOP_GAIN else ""
            print(
                f"{name:12s} {stop:6.1%} {np.mean([k <= args.budget for k in ks]):8.0%} {pct(0.5):>7s} "
                f"{pct(0.9):>5s} {np.mean(spent):6.1f}{mark}",
                flush=True,
            )
    print(f"{time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
