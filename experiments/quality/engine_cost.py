"""What training with torchtitan, Megatron-LM or DeepSpeed costs on a mixed cluster: the best plan each
engine can run against the best plan of the whole space (issue 28).

On every held-out scenario (``autotune.policy.scenarios.heldout_scenarios``) the same search (``--method``,
``--budget`` simulator evaluations, seed 0, not recorded) runs over the whole space and under each
``--engine``; the whole space's best is the better of that search and ``dp``'s best at the same budget.
Printed per scenario: the whole space's best tokens/s, each engine's best as a fraction of it, and why
Megatron-LM cannot run the whole space's best plan (the grid's reasons are the same for all three); then the median fraction per engine. Every engine
plan is checked to export (``autotune.engines.export``).

    nice -n 15 .venv/bin/python experiments/quality/engine_cost.py --budget 100
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import statistics
import time

from autotune import engines
from autotune.policy.scenarios import heldout_scenarios
from autotune.search.api import tune


def best(scenario, method: str, budget: int, engine: str | None, storage: str):
    result = tune(
        scenario.cluster,
        scenario.model,
        method=method,
        budget=budget,
        track=False,
        storage=storage if method == "optuna" else None,
        engine=engine,
        study_name=f"{scenario.name}-{method}-{engine}-{budget}-{time.time_ns()}",
    )
    return result if result.best_measurement.ok else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="optuna")
    ap.add_argument("--budget", type=int, default=100)
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    ap.add_argument("--quick", action="store_true", help="two scenarios, budget 10 (the tests' smoke run)")
    args = ap.parse_args()
    import tempfile

    import torch

    torch.set_num_threads(1)
    scenarios = heldout_scenarios()
    budget = args.budget
    if args.quick:
        scenarios, budget = scenarios[2:4], 10
    if args.only:
        keep = set(args.only.split(","))
        scenarios = [s for s in scenarios if s.name in keep]
    names = list(engines.ENGINES)
    fractions: dict[str, list[float]] = {e: [] for e in names}
    scratch = tempfile.mkdtemp(prefix="engine-cost-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    storage = f"{scratch}/optuna.journal"
    print(f"{args.method} at budget {budget} per search; whole space = max({args.method}, dp) at that budget")
    print(
        f"{'scenario':<20} {'whole space':>12} "
        + " ".join(f"{e:>11}" for e in names)
        + "  why Megatron-LM cannot run the whole space's best"
    )
    for s in scenarios:
        t0 = time.time()
        found = [r for r in (best(s, args.method, budget, None, storage), best(s, "dp", budget, None, storage)) if r]
        if not found:
            print(f"{s.name:<20} {'no plan fits':>12}")
            continue
        top = max(found, key=lambda r: r.best_measurement.tokens_per_s)
        whole = top.best_measurement.tokens_per_s
        cells, whys = [], []
        for e in names:
            r = best(s, args.method, budget, e, storage)
            if r is None:
                cells.append(f"{'none fits':>11}")
                fractions[e].append(0.0)
                continue
            engines.export(e, r.best_config, s.model)  # every engine plan exports
            frac = r.best_measurement.tokens_per_s / whole
            fractions[e].append(frac)
            cells.append(f"{frac:>11.2f}")
            why = engines.check(e, top.best_config)
            if why is not None and e == names[1]:
                whys.append(why.split(":")[0][:70])
        print(
            f"{s.name:<20} {whole:>12,.0f} "
            + " ".join(cells)
            + f"  {'; '.join(whys) or '-'}  ({time.time() - t0:.0f} s)"
        )
    print(
        f"{'median':<20} {'':>12} "
        + " ".join(f"{statistics.median(fractions[e]) if fractions[e] else 0:>11.2f}" for e in names)
    )


if __name__ == "__main__":
    main()
