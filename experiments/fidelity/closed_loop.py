"""Closing the loop: a ``--backend real`` search whose real runs correct the simulator, which screens
the next plans. Prints, per real run, the error of the *starting* simulator and of the *corrected*
simulator predicted before that run (what the search used), how many plans were screened out, and
(optionally) real runs of a few screened-out plans, to check that none of them beat the best plan.

    .venv/bin/python experiments/fidelity/closed_loop.py --model small --budget 10 --seed 0
    .venv/bin/python experiments/fidelity/closed_loop.py --model small --budget 10 --profile experiments/out/fidelity_profiles/profile-small.json  # made by fidelity.py

Cluster: ``experiments/fidelity/fidelity_cluster.yaml`` (4 CPU ranks + 2 emulated 2x slower, this machine).
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

CLUSTER = Path(__file__).with_name("fidelity_cluster.yaml")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--method", default="random")
    ap.add_argument("--budget", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=None, help="starting profile (default: the datasheet model)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--check-pruned", type=int, default=3, help="real runs of this many screened-out plans")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works (tests/integration/experiments/test_experiments.py runs it)",
    )
    args = ap.parse_args()
    if args.quick:
        args.model, args.budget, args.steps, args.check_pruned = "tiny", 2, 1, 0

    import torch

    torch.set_num_threads(1)
    from mlflow.tracking import MlflowClient

    from autotune.loading import load_cluster, load_model
    from autotune.profile import CalibrationProfile
    from autotune.search.api import tune
    from autotune.simulator import Simulator
    from autotune.specs import Measurement, ParallelConfig
    from runner import RealEvaluator

    cluster, model = load_cluster(str(CLUSTER)), load_model(args.model)
    start_profile = CalibrationProfile.load(args.profile) if args.profile else None
    real = RealEvaluator(cluster, model, steps=args.steps, warmup=1, timeout_s=120)
    tmp = Path(tempfile.mkdtemp(prefix="closed-loop-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # its stores and files are scratch
    uri = f"sqlite:///{tmp}/mlflow.db"
    t0 = time.monotonic()
    result = tune(
        cluster,
        model,
        method=args.method,
        budget=args.budget,
        backend="real",
        seed=args.seed,
        evaluator=real,
        profile=start_profile,
        tracking_uri=uri,
        storage=f"sqlite:///{tmp}/optuna.db",
    )
    wall = time.monotonic() - t0

    client = MlflowClient(uri)
    parent = client.get_run(result.run_id)
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{result.run_id}'", max_results=10000
    )
    before = {m.step: m.value for m in client.get_metric_history(result.run_id, "calibration_time_error")}
    mem_before = {m.step: m.value for m in client.get_metric_history(result.run_id, "calibration_memory_error")}
    start_sim = Simulator(cluster, model, start_profile)
    final = CalibrationProfile.load(client.download_artifacts(result.run_id, "calibrated_profile.json", str(tmp)))
    final_sim = Simulator(cluster, model, final)
    corrections = json.loads(
        Path(client.download_artifacts(result.run_id, "calibration_corrections.json", str(tmp))).read_text()
    )

    print(
        f"cluster {cluster.name}, model {model.name}, method {args.method}, budget {args.budget}, seed {args.seed}, "
        f"start profile {args.profile or 'datasheet'}; {wall:.0f} s"
    )
    print(f"{'#':>3} {'status':8} {'meas s':>8} {'start err':>9} {'corr err':>9} {'final err':>9}  plan")
    rows = []
    real_children = sorted(
        (c for c in children if c.data.tags.get("status") != "pruned"), key=lambda c: int(c.data.params["eval_index"])
    )
    for c in real_children:
        i = int(c.data.params["eval_index"])
        config = ParallelConfig.from_json(c.data.tags["autotune.config"])
        m = Measurement.from_dict(json.loads(c.data.tags["autotune.measurement"]))
        line = f"{i:>3} {c.data.tags['status']:8}"
        if m.ok:
            s, f = start_sim.evaluate(config), final_sim.evaluate(config)
            se = abs(s.iteration_time_s - m.iteration_time_s) / m.iteration_time_s if s.ok else float("nan")
            fe = abs(f.iteration_time_s - m.iteration_time_s) / m.iteration_time_s if f.ok else float("nan")
            ce = before.get(i, float("nan"))
            rows.append((i, se, ce, fe, mem_before.get(i)))
            line += f" {m.iteration_time_s:8.3f} {se:9.1%} {ce:9.1%} {fe:9.1%}"
        else:
            line += f" {'':8} {'':9} {'':9} {'':9}"
        print(line + "  " + config.describe()[:70])
    pruned = [c for c in children if c.data.tags.get("status") == "pruned"]
    print(
        f"real runs {result.evaluations}, screened out {result.screened} "
        f"(pruned_plans metric {parent.data.metrics.get('pruned_plans')}), fitted from "
        f"{corrections['fitted_from_runs']} ok runs; corrections {corrections['corrections']}"
    )
    if rows:
        n_ok = len(rows)
        later = rows[2:]  # after the first two ok runs the screen is on and the fit has data
        print(
            f"time error, all {n_ok} ok runs: start simulator mean {statistics.mean(r[1] for r in rows):.1%}, "
            f"corrected-before-run mean {statistics.mean(r[2] for r in rows):.1%}, "
            f"final profile (in-sample) mean {statistics.mean(r[3] for r in rows):.1%}"
        )
        if later:
            print(
                f"time error, ok runs 3..{n_ok}: start simulator mean {statistics.mean(r[1] for r in later):.1%}, "
                f"corrected-before-run mean {statistics.mean(r[2] for r in later):.1%}"
            )
        mems = [r[4] for r in later if r[4] is not None]
        if mems:
            print(f"memory error, ok runs 3..{n_ok}, corrected-before-run mean {statistics.mean(mems):.1%}")
    print(f"best measured {result.best_measurement.tokens_per_s:,.0f} tokens/s: {result.best_config.describe()[:80]}")
    for c in pruned[: args.check_pruned]:
        config = ParallelConfig.from_json(c.data.tags["autotune.config"])
        m = real.evaluate(config)
        ratio = m.tokens_per_s / result.best_measurement.tokens_per_s if m.ok else 0.0
        print(
            f"pruned plan run for real: {m.status if not m.oom else 'oom':7} {ratio:5.2f} x best  "
            f"({c.data.tags.get('error', '')[:60]}) {config.describe()[:60]}"
        )


if __name__ == "__main__":
    main()
