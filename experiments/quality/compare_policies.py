"""Two policies on the held-out set, from experiments/quality/heldout_eval.py --json files, on one best-known.

Each side is a comma-separated list of --json files (shards of one run). For every scenario both sides
ran, best-known is the larger of the two runs' best-known (the reference Optuna run, the uniform grid,
dp and every curve of either), so the ratios of both policies share one denominator; only seeds both
sides ran are used. Prints, per method both ran (rl, optuna, ...), the median over scenarios of
best-found / best-known at each budget and of the evaluations to reach 98% of best-known, then per
scenario budget 20 / budget 50 and evaluations to 98%, and the issue-16 targets for rl.

    .venv/bin/python experiments/quality/compare_policies.py --old a.json,b.json --new c.json,d.json
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from heldout_eval import BUDGETS, TARGET  # experiments/quality/heldout_eval.py writes the files
from heldout_eval import read_results as load


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--methods", default="rl")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works (tests/integration/experiments/test_experiments.py runs it)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        pass  # it only reads the files it is given
    old, new = load(args.old), load(args.new)
    names = [n for n in old if n in new]
    methods = [
        m for m in args.methods.split(",") if all(m in old[n]["curves"] and m in new[n]["curves"] for n in names)
    ]
    best = {n: max(old[n]["best_known"], new[n]["best_known"]) for n in names}

    def curves(side: dict, n: str, m: str) -> list[list[float]]:
        k = min(len(old[n]["curves"][m]), len(new[n]["curves"][m]))  # the seeds both ran
        return side[n]["curves"][m][:k]

    def rel(side, n, m, b):
        return float(np.mean([c[b - 1] for c in curves(side, n, m)])) / best[n]

    def need(side, n, m):
        goal = TARGET * best[n]
        return float(
            np.median([next((i + 1 for i, v in enumerate(c) if v >= goal), math.inf) for c in curves(side, n, m)])
        )

    fmt = lambda x: ">100" if math.isinf(x) else f"{x:g}"  # noqa: E731
    seeds = {m: min(len(curves(old, n, m)) for n in names) for m in methods}
    print(f"{len(names)} held-out scenarios; seeds per method: {seeds}; best-known = max of both runs")
    print(f"{'policy / method':26s}" + "".join(f"{'B=' + str(b):>8s}" for b in BUDGETS) + f"{'evals to 98%':>14s}")
    for m in methods:
        for label, side in (("old", old), ("new", new)):
            row = [float(np.median([rel(side, n, m, b) for n in names])) for b in BUDGETS]
            e = float(np.median([need(side, n, m) for n in names]))
            print(f"{label + ' ' + m:26s}" + "".join(f"{v:8.3f}" for v in row) + f"{fmt(e):>14s}")
    if "dp" in old[names[0]]["at"]:
        dp = float(np.median([old[n]["at"]["dp"][20][0] / best[n] for n in names]))
        print(f"{'dp (B=20)':26s}{'':16s}{dp:8.3f}")
    print("\nper scenario, B=20 / B=50 (evals to 98%):")
    print(f"  {'scenario':20s}" + "".join(f"{'old ' + m:>26s}{'new ' + m:>26s}" for m in methods))
    for n in names:
        cells = ""
        for m in methods:
            for side in (old, new):
                cells += f"{rel(side, n, m, 20):>12.3f} /{rel(side, n, m, 50):.3f} ({fmt(need(side, n, m)):>4s})"
        print(f"  {n:20s}{cells}")
    for label, side in (("old", old), ("new", new)):
        if "rl" not in methods:
            break
        r20 = float(np.median([rel(side, n, "rl", 20) for n in names]))
        r50 = [rel(side, n, "rl", 50) for n in names]
        e = float(np.median([need(side, n, "rl") for n in names]))
        print(
            f"targets, {label} policy: rl median at B=20 {r20:.3f} (>= 0.97), rl min at B=50 {min(r50):.3f} "
            f"(>= 0.90: {sum(v >= 0.90 for v in r50)} of {len(r50)}), rl evals to 98% median {fmt(e)} (<= 13)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
