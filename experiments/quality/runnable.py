"""How often the search's best plan is one the runner runs (issue 26): on each held-out scenario
(``autotune.policy.scenarios.heldout_scenarios``) the best plan of dp, optuna and rl at ``--budget``
(simulator, seed 0, not recorded) goes through ``autotune train``'s pre-flight (``runner.jobs.preflight``,
CUDA assumed present: these are GPU clusters); printed per scenario and method: ``ok`` or the reason it is
refused (RoundPipe plans go through the RoundPipe pre-flight with CUDA, the GPUs and the library assumed),
then the counts.

    nice -n 15 .venv/bin/python experiments/quality/runnable.py --budget 20
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import tempfile
from collections import Counter

from autotune.policy.scenarios import heldout_scenarios
from autotune.search.api import tune

METHODS = ("dp", "optuna", "rl")


def verdict(scenario, config) -> str:
    from runner.jobs import preflight_refusal  # the pre-flight the search's runner limits ask

    refused = preflight_refusal(scenario.cluster, scenario.model, config)
    if refused is not None:
        return refused.rule
    return "ok (roundpipe: on a CUDA machine with the roundpipe library)" if config.is_roundpipe else "ok"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="two scenarios, budget 5 (the tests' smoke run)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    scenarios, budget = heldout_scenarios(), args.budget
    if args.quick:
        scenarios, budget = scenarios[2:4], 5
    scratch = tempfile.mkdtemp(prefix="runnable-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    storage = f"{scratch}/optuna.journal"
    counts: Counter = Counter()
    print(f"best plan of each method at budget {budget}: runnable by the runner?")
    for s in scenarios:
        for m in METHODS:
            r = tune(
                s.cluster, s.model, method=m, budget=budget, track=False, storage=storage if m == "optuna" else None
            )
            why = verdict(s, r.best_config) if r.best_measurement.ok else "no plan fits"
            counts[(m, why.startswith("ok"))] += 1
            print(f"{s.name:<20} {m:<7} {why[:110]}")
    for m in METHODS:
        total = counts[(m, True)] + counts[(m, False)]
        print(f"{m}: {counts[(m, True)]} of {total} runnable")


if __name__ == "__main__":
    main()
