"""Fidelity of the calibrated simulator against real profiled runs on this machine's CPU ranks.

    .venv/bin/python experiments/fidelity/fidelity.py [--repeats 2] [--steps 3] [--out experiments/out/fidelity_results.json]
    .venv/bin/python experiments/fidelity/fidelity.py --from-json experiments/out/fidelity_results.json   # re-analyse

1. ``autotune profile --cluster experiments/fidelity/fidelity_cluster.yaml --model M`` for M in tiny, small.
2. For each of 19 plans (1-4 ranks, 1-4 stages, uneven splits, 2 replicas, 2-way tensor parallel stages,
   recompute on/off, an emulated 2x slow node): the prediction of ``autotune simulate --profile P --json`` (the CLI, in a
   subprocess) and ``repeats`` real profiled runs (``runner.profiled_run``, what ``autotune measure``
   runs), each ``--steps`` timed steps after one warm-up step.
3. Errors: per plan ``|predicted - measured| / measured`` for the iteration time (measured = best of
   the repeats, the least-disturbed run: the host is shared, and the micro-benchmarks are likewise
   lower-quartile timings) and for peak memory (mean over the plan's ranks; measured = median of the
   repeats). Mean and max over plans; Kendall tau between predicted and measured iteration times,
   per model (the order a search sees) and over all 16.
4. Closing the loop: per model, plans split in two halves; an ``OnlineCalibrator`` fitted on one
   half's measurements predicts the other half; both ways round (2-fold). Error before vs after.

This script never imports torch: the runner measures CPU memory as peak-RSS growth, and a process
spawned by a big parent can inherit the parent's peak RSS (Linux ``ru_maxrss`` survives fork+exec),
so the launching process is kept small.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autotune.calibration.online import OnlineCalibrator
from autotune.loading import load_cluster, load_config, load_model
from autotune.profile import CalibrationProfile
from autotune.simulator import Simulator
from autotune.specs import Measurement

ROOT = Path(__file__).resolve().parents[2]

CLUSTER = Path(__file__).with_name("fidelity_cluster.yaml")
AUTOTUNE = [sys.executable, "-m", "autotune.cli"]


def plan(mbs: int, *pipelines: tuple[int, list[tuple[str | tuple[str, ...], int, bool]]]) -> dict:
    """A 1F1B config; a stage's devices are one name, or a tuple of names (tensor parallel)."""
    return {
        "micro_batch_size": mbs,
        "schedule": "1f1b",
        "pipelines": [
            {
                "num_microbatches": m,
                "stages": [
                    {"devices": [d] if isinstance(d, str) else list(d), "layers": n, "recompute": r}
                    for d, n, r in stages
                ],
            }
            for m, stages in pipelines
        ],
    }


# name -> (model, config). tiny: 4 layers, global batch 8; small: 8 layers, global batch 16.
PLANS: dict[str, tuple[str, dict]] = {
    "T1 1 rank": ("tiny", plan(2, (4, [("cpu:0", 4, False)]))),
    "T2 2 stages 2+2": ("tiny", plan(1, (8, [("cpu:0", 2, False), ("cpu:1", 2, False)]))),
    "T3 2 stages 3+1 R/-": ("tiny", plan(2, (4, [("cpu:0", 3, True), ("cpu:1", 1, False)]))),
    "T4 4 stages": (
        "tiny",
        plan(1, (8, [("cpu:0", 1, False), ("cpu:1", 1, False), ("cpu:2", 1, False), ("cpu:3", 1, False)])),
    ),
    "T5 2 replicas": ("tiny", plan(2, (2, [("cpu:0", 4, False)]), (2, [("cpu:1", 4, False)]))),
    "T6 fast+slow 3+1": ("tiny", plan(1, (8, [("cpu:0", 3, False), ("slow:0", 1, False)]))),
    "T7 tp2": ("tiny", plan(2, (4, [(("cpu:0", "cpu:1"), 4, False)]))),
    "S1 1 rank": ("small", plan(2, (8, [("cpu:0", 8, False)]))),
    "S2 1 rank R mbs4": ("small", plan(4, (4, [("cpu:0", 8, True)]))),
    "S3 2 stages 4+4": ("small", plan(2, (8, [("cpu:0", 4, False), ("cpu:1", 4, False)]))),
    "S4 2 stages 5+3 R": ("small", plan(2, (8, [("cpu:0", 5, True), ("cpu:1", 3, True)]))),
    "S5 3 stages 3+3+2": ("small", plan(2, (8, [("cpu:0", 3, False), ("cpu:1", 3, False), ("cpu:2", 2, False)]))),
    "S6 4 stages": (
        "small",
        plan(1, (16, [("cpu:0", 2, False), ("cpu:1", 2, False), ("cpu:2", 2, False), ("cpu:3", 2, False)])),
    ),
    "S7 2 replicas": ("small", plan(2, (4, [("cpu:0", 8, False)]), (4, [("cpu:1", 8, False)]))),
    "S8 2 replicas x 2 stages": (
        "small",
        plan(2, (4, [("cpu:0", 4, False), ("cpu:1", 4, False)]), (4, [("cpu:2", 4, False), ("cpu:3", 4, False)])),
    ),
    "S9 fast+slow 6+2": ("small", plan(2, (8, [("cpu:0", 6, False), ("slow:0", 2, False)]))),
    "S10 replicas fast m5 / slow m3": ("small", plan(2, (5, [("cpu:0", 8, False)]), (3, [("slow:0", 8, False)]))),
    "S11 tp2": ("small", plan(2, (8, [(("cpu:0", "cpu:1"), 8, False)]))),
    "S12 2 stages of tp2": ("small", plan(2, (8, [(("cpu:0", "cpu:1"), 4, False), (("cpu:2", "cpu:3"), 4, False)]))),
}


def profile_model(model: str, out_dir: Path, quick: bool = False) -> Path:
    path = out_dir / f"profile-{model}.json"
    t0 = time.time()
    subprocess.run(
        AUTOTUNE
        + ["profile", "--cluster", str(CLUSTER), "--model", model, "--output", str(path)]
        + (["--quick"] if quick else []),
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    print(f"profiled {model} in {time.time() - t0:.0f} s -> {path}", flush=True)
    return path


def simulate_cli(model: str, config: dict, profile: Path, work: Path) -> dict:
    cfg = work / "config.json"
    cfg.write_text(json.dumps(config))
    out = subprocess.run(
        AUTOTUNE
        + [
            "simulate",
            "--cluster",
            str(CLUSTER),
            "--model",
            model,
            "--config",
            str(cfg),
            "--profile",
            str(profile),
            "--json",
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def measure(model: str, config: dict, steps: int) -> dict:
    from runner import profiled_run

    m = profiled_run(str(CLUSTER), model, config, steps=steps, warmup=1, timeout_s=300)
    return m.to_dict()


def predict_fresh(model: str, config: dict, profile: Path) -> tuple[dict, list]:
    """Predict with the profile's contention curve replaced by one measured now (1..ranks processes)."""
    from dataclasses import replace

    from autotune.calibration.bench import bench_contention

    cluster = load_cluster(str(CLUSTER))
    cfg = load_config(config)
    n = max(2, int(sum(1.0 / cluster.node_of(d).slowdown for d in cfg.devices) + 0.999))
    curve = bench_contention(n, duration_s=0.3, rounds=2)
    prof = CalibrationProfile.load(profile)
    cpu = prof.device("cpu")
    prof = replace(
        prof,
        devices=tuple(
            replace(d, contention=tuple((float(a), float(b)) for a, b in curve)) if d is cpu else d
            for d in prof.devices
        ),
    )
    return Simulator(cluster, load_model(model), prof).evaluate(cfg).to_dict(), [list(x) for x in curve]


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


# --------------------------------------------------------------------------------------------------
# Analysis


def mem_error(pred: dict, meas: dict) -> float:
    errs = [abs(pred[d] - g) / g for d, g in meas.items() if d in pred and g > 0]
    return sum(errs) / len(errs) if errs else float("nan")


def measured_summary(runs: list[dict]) -> dict:
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        return {}
    best = min(ok, key=lambda r: r["iteration_time_s"])
    devices = best["peak_memory_GiB"].keys()
    mem = {d: statistics.median(r["peak_memory_GiB"][d] for r in ok) for d in devices}
    times = [r["iteration_time_s"] for r in ok]
    return {
        **best,
        "peak_memory_GiB": mem,
        "iteration_times_s": times,
        "spread": (max(times) - min(times)) / min(times),
    }


def errors(rows: list[dict]) -> dict:
    from scipy.stats import kendalltau

    t = [
        abs(r["pred"]["iteration_time_s"] - r["meas"]["iteration_time_s"]) / r["meas"]["iteration_time_s"] for r in rows
    ]
    m = [mem_error(r["pred"]["peak_memory_GiB"], r["meas"]["peak_memory_GiB"]) for r in rows]
    out = {
        "n": len(rows),
        "time_mean": statistics.mean(t),
        "time_max": max(t),
        "mem_mean": statistics.mean(m),
        "mem_max": max(m),
    }
    if len(rows) > 2:
        tau = kendalltau([r["pred"]["iteration_time_s"] for r in rows], [r["meas"]["iteration_time_s"] for r in rows])
        out["tau"] = float(tau.statistic)
    return out


def fmt(e: dict) -> str:
    tau = f", Kendall tau {e['tau']:.2f}" if "tau" in e else ""
    return (
        f"time error mean {100 * e['time_mean']:.1f}% max {100 * e['time_max']:.1f}%; "
        f"memory error mean {100 * e['mem_mean']:.1f}% max {100 * e['mem_max']:.1f}%{tau} (n={e['n']})"
    )


def online_experiment(rows: list[dict], profiles: dict[str, Path]) -> None:
    cluster = load_cluster(str(CLUSTER))
    print("\nClosing the loop: OnlineCalibrator fitted on one half of a model's plans, error on the other half")
    before_all, after_all = [], []
    for model in sorted({r["model"] for r in rows}):
        group = [r for r in rows if r["model"] == model]
        if len(group) < 2:
            print(f"  {model}: one plan measured, nothing to hold out")
            continue
        halves = [group[0::2], group[1::2]]
        spec = load_model(model)
        prof = CalibrationProfile.load(profiles[model])
        for k, (fit_half, test_half) in enumerate(((halves[0], halves[1]), (halves[1], halves[0]))):
            cal = OnlineCalibrator(Simulator(cluster, spec, prof))
            cal.fit([(load_config(r["config"]), Measurement.from_dict(r["meas"])) for r in fit_half])
            sim = cal.corrected_simulator()
            after = []
            for r in test_half:
                pred = sim.evaluate(load_config(r["config"])).to_dict()
                after.append({**r, "pred": pred})
            before_all += test_half
            after_all += after
            print(
                f"  {model} fold {k + 1}: fit on {[r['name'].split()[0] for r in fit_half]}, "
                f"corrections {json.dumps(cal.corrections.to_dict())}"
            )
            print(f"    before: {fmt(errors(test_half))}")
            print(f"    after:  {fmt(errors(after))}")
    if not before_all:
        return
    print(f"  all held-out predictions, before: {fmt(errors(before_all))}")
    print(f"  all held-out predictions, after:  {fmt(errors(after_all))}")

    # As a search with --backend real uses it: plans in the order they were measured, each predicted by
    # the simulator corrected with every earlier run of the same model (the first: the profile alone).
    print("\nSequential (as in a real-backend search): plan i predicted after the runs of plans 0..i-1")
    seq_before, seq_after = [], []
    for model in sorted({r["model"] for r in rows}):
        group = [r for r in rows if r["model"] == model]
        spec = load_model(model)
        cal = OnlineCalibrator(Simulator(cluster, spec, CalibrationProfile.load(profiles[model])))
        for r in group:
            pred = cal.corrected_simulator().evaluate(load_config(r["config"])).to_dict()
            if cal.observations:
                seq_before.append(r)
                seq_after.append({**r, "pred": pred})
            cal.update(load_config(r["config"]), Measurement.from_dict(r["meas"]))
    print(f"  profile only:        {fmt(errors(seq_before))}")
    print(f"  corrected by the runs before it: {fmt(errors(seq_after))}")


def report(rows: list[dict], profiles: dict[str, Path]) -> None:
    print(
        f"\n{'plan':34s} {'pred s':>8s} {'meas s':>8s} {'err':>6s} {'spread':>6s} {'pred GiB':>8s} "
        f"{'meas GiB':>8s} {'err':>6s}"
    )
    for r in rows:
        p, m = r["pred"], r["meas"]
        te = (p["iteration_time_s"] - m["iteration_time_s"]) / m["iteration_time_s"]
        pm = statistics.mean(p["peak_memory_GiB"].values())
        mm = statistics.mean(m["peak_memory_GiB"].values())
        print(
            f"{r['name']:34s} {p['iteration_time_s']:8.4f} {m['iteration_time_s']:8.4f} {100 * te:+5.1f}% "
            f"{100 * m['spread']:5.1f}% {pm:8.3f} {mm:8.3f} {100 * mem_error(p['peak_memory_GiB'], m['peak_memory_GiB']):5.1f}%"
        )
    print()
    for model in sorted({r["model"] for r in rows}):
        print(f"{model:6s}: {fmt(errors([r for r in rows if r['model'] == model]))}")
    print(f"all   : {fmt(errors(rows))}")
    fresh = [r for r in rows if "pred_fresh" in r]
    if fresh:
        print("with the contention curve re-measured just before each plan's runs (pred_fresh):")
        fr = [{**r, "pred": r["pred_fresh"]} for r in fresh]
        for model in sorted({r["model"] for r in fr}):
            print(f"{model:6s}: {fmt(errors([r for r in fr if r['model'] == model]))}")
        print(f"all   : {fmt(errors(fr))}")
    spreads = [r["meas"]["spread"] for r in rows]
    print(
        f"run-to-run spread of measured iteration time (max/min - 1 over repeats): mean {100 * statistics.mean(spreads):.1f}%"
        f", max {100 * max(spreads):.1f}%"
    )
    online_experiment(rows, profiles)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "out" / "fidelity_results.json")
    ap.add_argument("--from-json", type=Path, help="re-analyse a previous run's results")
    ap.add_argument("--only", default="", help="comma-separated plan-name prefixes (e.g. T1,S3)")
    ap.add_argument(
        "--repredict",
        action="store_true",
        help="with --from-json: predict again with the profiles in --profiles-dir (library simulator, "
        "the same numbers as the CLI), keeping the stored measurements",
    )
    ap.add_argument("--profiles-dir", type=Path, help="with --repredict: where profile-<model>.json are")
    ap.add_argument(
        "--refresh-contention",
        action="store_true",
        help="also re-measure the host-contention curve just before each plan's runs and predict "
        "with it (pred_fresh): the profile's load snapshot made current",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works (tests/integration/experiments/test_experiments.py runs it)",
    )
    args = ap.parse_args()
    if args.quick:
        args.only, args.repeats, args.steps = "T1", 1, 1  # one plan, one run: the script still works

    if args.from_json:
        data = json.loads(args.from_json.read_text())
        profiles = {k: Path(v) for k, v in data["profiles"].items()}
        if args.repredict:
            if args.profiles_dir:
                profiles = {k: args.profiles_dir / f"profile-{k}.json" for k in profiles}
            cluster = load_cluster(str(CLUSTER))
            for r in data["rows"]:
                sim = Simulator(cluster, load_model(r["model"]), CalibrationProfile.load(profiles[r["model"]]))
                r["pred"] = sim.evaluate(load_config(r["config"])).to_dict()
            print(f"re-predicted with {', '.join(str(p) for p in profiles.values())}")
        report(data["rows"], profiles)
        return

    work = Path(tempfile.mkdtemp(prefix="fidelity-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # its stores and files are scratch
    profile_dir = args.out.parent / args.out.stem.replace("fidelity_results", "fidelity_profiles")
    profile_dir.mkdir(parents=True, exist_ok=True)
    selected = {
        k: v for k, v in PLANS.items() if not args.only or any(k.startswith(p + " ") for p in args.only.split(","))
    }
    profiles = {m: profile_model(m, profile_dir, args.quick) for m in sorted({m for m, _ in selected.values()})}
    rows = []
    t_start = time.time()
    for name, (model, config) in selected.items():
        pred = simulate_cli(model, config, profiles[model], work)
        fresh = None
        if args.refresh_contention:
            fresh = predict_fresh(model, config, profiles[model])
        runs = []
        for _ in range(args.repeats):
            load = loadavg()
            runs.append({**measure(model, config, args.steps), "loadavg_before": load})
        meas = measured_summary(runs)
        if not meas:
            print(f"{name}: no successful run: {runs[-1]['status']} {runs[-1]['error']}", flush=True)
            continue
        rows.append(
            {
                "name": name,
                "model": model,
                "config": config,
                "pred": pred,
                "meas": meas,
                "runs": runs,
                **({"pred_fresh": fresh[0], "contention_fresh": fresh[1]} if fresh else {}),
            }
        )
        print(
            f"{name:34s} predicted {pred['iteration_time_s']:.4f} s, measured {meas['iteration_time_s']:.4f} s "
            f"(runs {', '.join(f'{t:.4f}' for t in meas['iteration_times_s'])}; load {runs[0]['loadavg_before']:.1f})",
            flush=True,
        )
    print(f"measured {len(rows)} plans in {time.time() - t_start:.0f} s")
    args.out.write_text(
        json.dumps(
            {
                "rows": rows,
                "profiles": {k: str(v) for k, v in profiles.items()},
                "repeats": args.repeats,
                "steps": args.steps,
            },
            indent=1,
        )
    )
    report(rows, profiles)


if __name__ == "__main__":
    main()
