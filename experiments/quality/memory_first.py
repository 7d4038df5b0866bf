"""Memory first on the issue-16 cluster: every method returns a plan that fits.

4 T4 + 4 L4 + 8 A10G (one node each of T4 and L4, two of A10G, PCIe inside nodes, 25 Gbit/s between)
training Llama-3-8B at global batch 128: before memory first, ``--method optuna``, ``rl`` and ``random``
at budget 60 all ended with "no evaluated plan runs (oom ...)". For every method (``--start heuristic``,
each method's own starts, and the default ``--start dp`` for optuna and rl) at budgets 10 and 60 this
prints the best plan's status and tokens/s, the evaluations spent and the plans the memory model screened
out without spending budget (simulator backend, no MLflow, seed 0).

    .venv/bin/python experiments/quality/memory_first.py [--budgets 10 60]
"""

from __future__ import annotations

import argparse
import logging
import time

from autotune.loading import cluster_from_dict, load_model
from autotune.search.api import tune

CLOUD = dict(
    nodes=[
        dict(name="t4", gpu="T4", count=4, intra_node=dict(bandwidth_GBps=12, latency_us=5)),
        dict(name="l4", gpu="L4", count=4, intra_node=dict(bandwidth_GBps=16, latency_us=5)),
        dict(name="a10g", gpu="A10G", count=4, repeat=2, intra_node=dict(bandwidth_GBps=16, latency_us=5)),
    ],
    network=dict(bandwidth_GBps=3.125, latency_us=20),
)
RUNS = (
    ("optuna", "heuristic"),
    ("rl", "heuristic"),
    ("random", "heuristic"),
    ("optuna", "dp"),
    ("rl", "dp"),
    ("uniform", "heuristic"),
    ("dp", "dp"),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[10, 60])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works (tests/integration/experiments/test_experiments.py runs it)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.budgets = [4]
    logging.basicConfig(level=logging.ERROR)
    import torch

    torch.set_num_threads(1)
    cluster = cluster_from_dict(CLOUD, source="memory_first", default_name="cloud-t4-l4-a10g")
    model = load_model("llama3-8b", 128)
    print("| method | start | budget | best plan | tokens/s | evaluations | screened out | CPU (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for method, start in RUNS:
        for budget in args.budgets:
            t = time.process_time()
            try:
                r = tune(
                    cluster, model, method=method, budget=budget, track=False, storage="memory", start=start, seed=0
                )
                m = r.best_measurement
                row = f"{m.status} | {m.tokens_per_s:,.0f} | {r.evaluations} | {r.memory_screened}"
            except Exception as e:  # no plan at all: the line says why
                row = f"none ({str(e)[:60]}) | - | - | -"
            start_s = start if method in ("optuna", "rl") else "-"
            print(f"| {method} | {start_s} | {budget} | {row} | {time.process_time() - t:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
