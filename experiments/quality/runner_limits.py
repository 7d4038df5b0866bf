"""What the runner's limits leave out of the default search (issue 44): on four seed-family cases the search
of dp, optuna and rl at ``--budget`` (simulator, seed 0, not recorded) counts every proposal ``autotune
train``'s pre-flight refuses (``runner.jobs.plan_limits``, an invalid proposal); printed per case and method:
how many were left out, why (the refusals' rules with their numbers as N, counted), and whether the best plan passes the pre-flight.

    nice -n 15 .venv/bin/python experiments/quality/runner_limits.py --budget 60

Cases: a Mixtral-8x7B-shaped model on 2 x 8 A100-40GB + 8 RTX-4090 over 25 Gbit/s; Mixtral on
``mixed-h100-a100-32``; Llama-2-13B restricted to ZeRO-3 on ``mixed-consumer-16``; SPES's 2B model with
``--max-sync-every 50`` on the first fleet.
"""

from __future__ import annotations

import argparse
import atexit
import re
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

FLEET = """name: a100x16-4090x8
nodes:
  - {name: a100, gpu: A100-40GB, count: 8, repeat: 2, intra_node: {bandwidth_GBps: 300, latency_us: 2}}
  - {name: rtx, gpu: RTX-4090, count: 8, intra_node: {bandwidth_GBps: 25, latency_us: 5}}
network: {bandwidth_GBps: 3.125, latency_us: 20}
"""


def cases(directory: Path) -> list[tuple[str, str, str, dict, int]]:
    fleet = directory / "fleet.yaml"
    fleet.write_text(FLEET)
    return [
        ("mixtral on A100-40GB + 4090", str(fleet), "mixtral-8x7b", {}, 1),
        ("mixtral on mixed-h100-a100-32", "mixed-h100-a100-32", "mixtral-8x7b", {}, 1),
        ("llama2-13b zero=3 on mixed-consumer-16", "mixed-consumer-16", "llama2-13b", {"zero": [3]}, 1),
        ("spes-2b sync<=50 on A100-40GB + 4090", str(fleet), "spes-2b", {}, 50),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=60)
    ap.add_argument("--methods", default="dp,optuna,rl")
    ap.add_argument("--quick", action="store_true", help="the first case, dp only, budget 10 (the tests' smoke run)")
    args = ap.parse_args()
    import torch

    import runner.jobs as jobs
    from autotune import SpecError, load_cluster, load_model
    from autotune.search.api import tune

    torch.set_num_threads(1)
    reasons: Counter = Counter()
    preflight = jobs.preflight_refusal

    def counted(cluster, model, config):  # what plan_limits asks, with the refusals counted
        refused = preflight(cluster, model, config)
        if refused is not None:
            reasons[re.sub(r"\d+", "N", refused.rule)] += 1  # one family whatever its numbers
        return refused

    jobs.preflight_refusal = counted
    directory = Path(tempfile.mkdtemp(prefix="runner-limits-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    todo = cases(directory)
    methods = args.methods.split(",")
    budget = args.budget
    if args.quick:
        todo, methods, budget = todo[:1], ["dp"], 10
    storage = f"{directory}/optuna.journal"
    print(f"proposals left out for the runner's limits, budget {budget}")
    for name, cluster, model, restrict, sync in todo:
        for m in methods:
            reasons.clear()
            t0 = time.perf_counter()
            try:
                r = tune(
                    cluster,
                    model,
                    method=m,
                    budget=budget,
                    track=False,
                    storage=storage if m == "optuna" else None,
                    restrict=restrict,
                    max_sync_every=sync,
                )
            except SpecError as e:  # no plan: the search says why in one line
                print(f"{name:<40} {m:<7} {str(e)[:150]}")
                for rule, n in reasons.most_common():
                    print(f"{'':48}{n:5d} x {rule}")
                continue
            if r.best_measurement.ok:
                refused = preflight(load_cluster(cluster), load_model(model), r.best_config)
                best = f"best {r.best_measurement.tokens_per_s:,.0f} tokens/s, pre-flight " + (
                    "ok" if refused is None else f"refuses: {refused.rule[:60]}"
                )
            else:
                best = "no plan fits"
            print(
                f"{name:<40} {m:<7} left out {r.summary.runner_limited:4d} | {best} ({time.perf_counter() - t0:.0f} s)"
            )
            for rule, n in reasons.most_common():  # every refusal the search asked for (a plan may be asked twice)
                print(f"{'':48}{n:5d} x {rule}")


if __name__ == "__main__":
    main()
