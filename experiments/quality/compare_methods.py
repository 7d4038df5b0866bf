"""Every search method on several mixed clusters and models at equal budgets (simulator backend).

For each scenario and method: the best tokens/s found within ``--budget`` evaluated plans, relative to
the best plan any method found on that scenario, and relative to the best heterogeneity-blind
``uniform`` plan (the whole uniform grid evaluated, outside the budget, so the baseline is its best).
Stochastic methods run with ``--seeds`` seeds; the table shows the median over seeds. ``exhaustive``
is not held to the budget: where the space is small enough it evaluates every distinct plan of the
encoding (a reference optimum, with its number of evaluations); elsewhere it refuses.

    python experiments/quality/compare_methods.py --budget 100 --seeds 3
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from autotune.loading import cluster_from_dict, load_cluster, load_model
from autotune.planning.space import EXHAUSTIVE_LIMIT, SearchSpace
from autotune.search.api import tune
from autotune.simulator import Simulator


def _node(name, gpu, count, bw, repeat=1):
    return dict(name=name, gpu=gpu, count=count, repeat=repeat, intra_node=dict(bandwidth_GBps=bw, latency_us=2))


# Scenarios: 8 to 64 GPUs, 2 to 4 GPU types, fast (50 GB/s) to slow (0.125 GB/s = 1 Gbit/s) networks.
CUSTOM_CLUSTERS = {
    "zoo-3types-24": dict(
        nodes=[_node("a100", "A100-80GB", 8, 300), _node("v100", "V100-32GB", 8, 16), _node("t4", "T4", 8, 16)],
        network=dict(bandwidth_GBps=12.5, latency_us=10),
    ),
    "wan-2types-16": dict(
        nodes=[_node("a100", "A100-80GB", 8, 300), _node("rtx", "RTX-3090", 4, 16, repeat=2)],
        network=dict(bandwidth_GBps=0.125, latency_us=2000),
    ),
    "four-types-64": dict(
        nodes=[
            _node("h100", "H100-80GB", 8, 450, repeat=2),
            _node("a100", "A100-40GB", 8, 300, repeat=2),
            _node("l4", "L4", 8, 32, repeat=2),
            _node("a10g", "A10G", 8, 32, repeat=2),
        ],
        network=dict(bandwidth_GBps=50, latency_us=5),
    ),
}
SCENARIOS = [
    ("mixed-a100-v100", "gpt2-xl"),  # 8 GPUs, 2 types, 100 Gbit/s
    ("mixed-consumer-16", "llama2-7b"),  # 16 GPUs, 2 types, 10 Gbit/s
    ("wan-2types-16", "gpt2-xl"),  # 16 GPUs, 2 types, 1 Gbit/s
    ("zoo-3types-24", "llama2-7b"),  # 24 GPUs, 3 types, 100 Gbit/s
    ("mixed-h100-a100-32", "llama2-13b"),  # 32 GPUs, 2 types, 200 Gbit/s
    ("four-types-64", "llama3-8b"),  # 64 GPUs, 4 types, 400 Gbit/s
]
METHODS = ("dp", "rl", "optuna", "random", "uniform", "exhaustive")


def cluster_of(name: str):
    if name in CUSTOM_CLUSTERS:
        return cluster_from_dict(CUSTOM_CLUSTERS[name], source=f"compare_methods:{name}", default_name=name)
    return load_cluster(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--scenarios", type=int, default=len(SCENARIOS), help="run the first N scenarios")
    ap.add_argument("--tracking-uri", default=None, help="also log every search to this MLflow store")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works (tests/integration/experiments/test_experiments.py runs it)",
    )
    args = ap.parse_args()
    if args.quick:
        args.budget, args.seeds, args.scenarios, args.methods = 4, 1, 1, "dp,random"
    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(1)
    methods = args.methods.split(",")
    rows = []
    t_all = time.time()
    for cname, mname in SCENARIOS[: args.scenarios]:
        cluster, model = cluster_of(cname), load_model(mname)
        space = SearchSpace(cluster, model)
        sim = Simulator(cluster, model)
        uniform_grid = space.uniform_plans()
        uniform_best = max((sim.evaluate(c).score() for c in uniform_grid), default=0.0)
        found: dict[str, list[float]] = {}
        secs: dict[str, float] = {}
        notes: dict[str, str] = {}
        notes_budget: dict[str, int] = {}
        for method in methods:
            seeds = range(args.seeds) if method in ("rl", "optuna", "random") else range(1)
            budget = args.budget
            if method == "exhaustive" and space.size <= EXHAUSTIVE_LIMIT:
                budget = len(space.enumerate())  # the reference optimum of the encoding, not an equal budget
                notes_budget[method] = budget
            for seed in seeds:
                t0 = time.time()
                try:
                    r = tune(
                        cluster,
                        model,
                        method=method,
                        budget=budget,
                        seed=seed,
                        evaluator=Simulator(cluster, model),
                        storage="memory",
                        track=args.tracking_uri is not None,
                        tracking_uri=args.tracking_uri,
                        study_name=f"{cname}-{mname}-{seed}",
                    )
                    found.setdefault(method, []).append(r.best_measurement.score())
                except Exception as e:  # exhaustive refuses large spaces: say so in the table
                    notes[method] = (
                        f"refused: {space.size:,} combinations > {EXHAUSTIVE_LIMIT:,}"
                        if "exceed the limit" in str(e)
                        else f"error: {e}"[:80]
                    )
                    break
                secs[method] = secs.get(method, 0.0) + time.time() - t0
        best_any = max([uniform_best] + [max(v) for v in found.values()])
        print(
            f"\n{cname} ({cluster.num_devices} GPUs, {len({n.device.name for n in cluster.nodes})} types) / {mname}: "
            f"space {space.size:,} combinations, uniform grid {len(uniform_grid)} plans, best uniform "
            f"{uniform_best:,.0f} tokens/s, best found {best_any:,.0f} tokens/s"
        )
        for method in methods:
            if method in notes:
                print(f"  {method:<10} {notes[method]}")
                rows.append((cname, mname, method, None, None, notes[method]))
                continue
            med = statistics.median(found[method])
            rel_best = med / best_any if best_any else 0.0
            rel_uniform = med / uniform_best if uniform_best else float("inf")
            extra = f", all {notes_budget[method]} plans of the space" if method in notes_budget else ""
            print(
                f"  {method:<10} median {med:>12,.0f} tokens/s  vs best {rel_best:6.3f}  vs uniform "
                f"{rel_uniform:6.2f}x  (seeds {len(found[method])}, {secs[method]:.1f} s{extra})"
            )
            rows.append(
                (
                    cname,
                    mname,
                    method,
                    rel_best,
                    rel_uniform,
                    f" ({notes_budget[method]} evals)" if method in notes_budget else "",
                )
            )
    print(
        f"\nmarkdown (budget {args.budget}, median over {args.seeds} seeds for rl/optuna/random; total "
        f"{time.time() - t_all:.0f} s)\n"
    )
    print("| scenario | " + " | ".join(methods) + " |")
    print("|---|" + "---|" * len(methods))
    for cname, mname in SCENARIOS[: args.scenarios]:
        cells = []
        for method in methods:
            row = next(r for r in rows if r[0] == cname and r[1] == mname and r[2] == method)
            cells.append(row[5] if row[3] is None else f"{row[3]:.3f} / {row[4]:.2f}x{row[5]}")
        print(f"| {cname} / {mname} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
