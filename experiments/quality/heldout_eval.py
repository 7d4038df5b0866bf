"""Held-out evaluation of every search method, as ``autotune search`` runs them (issue 16).

On every held-out scenario (``autotune.policy.scenarios.heldout_scenarios``: GPU mixes never drawn in
training, memory-tight consumer and cloud clusters and an MoE model among them) and for budgets 5, 10,
20, 50, 100 evaluations, each method runs through ``autotune.tune`` on the simulator backend (no
MLflow, Optuna in memory), so memory first, the shared budget rule and the structured planner's start
plan are exactly the product's:

- ``dp``: the structured planner (``--method dp``); its B=1 value is its first evaluation (RoundPipe's own plan
  where RoundPipe applies, which every method evaluates first, else dp's best plan);
- ``rl``: the learned chooser alone (its first evaluation is the planner's first plan, then the candidates
  its policy picks; ``--start`` does not apply);
- ``optuna``: the default ``--start dp`` (dp's best plans evaluated first,
  ``autotune.search.methods.DP_START_PLANS`` evaluations); ``optuna-heuristic``: ``--start heuristic``;
- ``random`` and ``uniform`` (the heterogeneity-blind grid in a seeded order).

Printed: best throughput found / best-known (mean over seeds, then the median over scenarios), where
best-known is the best plan any run below found, a reference Optuna run of ``--reference-budget``
evaluations (``--start dp``) and dp included; evaluations to reach 98% of best-known (median over seeds,
then scenarios; ">N" when never within N); per scenario the budget-20 and budget-50 values; and whether
every method's budget-20 result fits (a plan that runs) wherever the uniform grid or dp finds one.

optuna does not look at the budget (the budget only stops it), so one run of the largest budget
gives each smaller budget as a prefix of its best-so-far curve. That is exact unless a smaller run would
have stopped at its cap of 20 x budget plans screened out by the memory model first; the script counts
the screened plans before each budget's last evaluation and flags a prefix that passed the smaller cap.
``random`` (its memory-frugal fallback comes at the budget's last evaluation), ``uniform`` and ``dp``
(their plan lists depend on the budget) run once per budget. ``rl`` (the chooser of which plan to evaluate
next) reads the share of its budget spent, so it runs once per budget too, and its run at the largest budget
gives its evaluations to 98%.

    .venv/bin/python experiments/quality/heldout_eval.py [--seeds 3] [--policy autotune/data/acquisition.safetensors]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import numpy as np

from autotune.planning.budget import PRUNED, SCREENED_PER_BUDGET
from autotune.planning.space import SearchSpace
from autotune.policy.scenarios import draw_scenario, heldout_scenarios, validation_rng
from autotune.search.agents.acquire import default_acquisition_path
from autotune.search.api import tune
from autotune.simulator import Simulator

BUDGETS = (5, 10, 20, 50, 100)
TARGET = 0.98
PREFIX_METHODS = ("rl", "optuna", "optuna-heuristic")
PER_BUDGET_METHODS = ("dp", "random", "uniform", "rl")  # rl: both (module docstring)
DEFAULT_METHODS = "dp,rl,optuna,optuna-heuristic,random,uniform"


def read_results(files: str) -> dict[str, dict]:
    """Per scenario, the results of comma-separated ``--json`` files of earlier runs (a later file's
    scenario replaces an earlier one's), with the per-budget tables keyed by int budget."""
    out: dict[str, dict] = {}
    for f in files.split(","):
        for name, r in json.loads(Path(f).read_text())["results"].items():
            r["at"] = {m: {int(b): v for b, v in per.items()} for m, per in r["at"].items()}
            out[name] = r
    return out


def run(s, sim, method: str, budget: int, seed: int, policy) -> tuple[list[float], list[int]]:
    """(best-so-far after each evaluation, padded to ``budget``; plans screened out before each
    evaluation) of one ``autotune.tune`` run."""
    base, _, start = method.partition("-")
    events: list[bool] = []  # True: an evaluation that spent budget; False: screened out
    result = None
    try:
        result = tune(
            s.cluster,
            s.model,
            method=base,
            budget=budget,
            seed=seed,
            track=False,
            storage="memory",
            evaluator=sim,
            start=start or "dp",
            policy=policy if base == "rl" else None,
            on_evaluation=lambda ev: events.append(ev.measurement.status != PRUNED),
        )
        curve = list(result.best_curve)
    except Exception as e:  # a method that finds no plan at all (the api raises): a zero curve
        logging.warning("%s on %s (budget %d, seed %d): %s", method, s.name, budget, seed, e)
        curve = []
    screened_before, screened = [], 0
    for spent in events:
        if spent:
            screened_before.append(screened)
        else:
            screened += 1
    curve = curve + [curve[-1] if curve else 0.0] * (budget - len(curve))  # a run that stopped early keeps its best
    return curve[:budget], screened_before


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--policy", default=None, help="policy file (default: the shipped one)")
    ap.add_argument("--reference-budget", type=int, default=400)
    ap.add_argument("--only", default=None, help="comma-separated scenario names")
    ap.add_argument("--json", default=None, help="write all curves to this file")
    ap.add_argument(
        "--validation",
        type=int,
        default=0,
        help="use this many validation scenarios (training distribution, validation seeds) instead "
        "of the held-out set: for developing the policy without touching the held-out set",
    )
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument(
        "--reference-from",
        default=None,
        help="comma-separated --json files of earlier runs (same --reference-budget): take each scenario's reference "
        "Optuna result from it instead of re-running it (e.g. to compare two policies)",
    )
    ap.add_argument(
        "--load",
        default=None,
        help="comma-separated --json files of earlier runs (for example shards run with --only and the "
        "same --seeds): print their tables together instead of running",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works (tests/integration/experiments/test_experiments.py runs it)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.reference_budget, args.methods = 1, 20, "dp,random"
        args.only = args.only or "consumer-tight-8"
    logging.basicConfig(level=logging.ERROR)
    import torch

    torch.set_num_threads(1)
    policy_path = Path(args.policy) if args.policy else default_acquisition_path()
    if args.validation:
        rng = validation_rng(1)
        scenarios = [draw_scenario(rng, name=f"val{i}") for i in range(args.validation)]
    else:
        scenarios = heldout_scenarios()
    if args.only:
        keep = set(args.only.split(","))
        scenarios = [s for s in scenarios if s.name in keep]
    B = max(BUDGETS)
    methods = tuple(args.methods.split(","))
    results: dict[str, dict] = {}
    earlier_refs = (
        {n: float(r["reference"]) for n, r in read_results(args.reference_from).items()} if args.reference_from else {}
    )
    t_all = time.time()
    if args.load:  # the tables of earlier runs, in the scenarios' order
        loaded = read_results(args.load)
        results = {s.name: loaded[s.name] for s in scenarios if s.name in loaded}
        scenarios = []
    for s in scenarios:
        t0 = time.time()
        sim = Simulator(s.cluster, s.model)
        space = SearchSpace(s.cluster, s.model)
        curves: dict[str, list[list[float]]] = {m: [] for m in methods if m in PREFIX_METHODS}
        screened: dict[str, list[list[int]]] = {m: [] for m in curves}
        at: dict[str, dict[int, list[float]]] = {m: {} for m in methods if m in PER_BUDGET_METHODS}
        timing: dict[str, float] = {m: 0.0 for m in methods}
        for seed in range(args.seeds):
            for m in methods:
                t = time.time()
                if m in PREFIX_METHODS:
                    c, sc = run(s, sim, m, B, seed, policy_path)
                    curves[m].append(c)
                    screened[m].append(sc)
                if m in PER_BUDGET_METHODS and (m != "dp" or seed == 0):  # dp is deterministic
                    for b in BUDGETS:
                        v = curves[m][-1][-1] if m in curves and b == B else run(s, sim, m, b, seed, policy_path)[0][-1]
                        at[m].setdefault(b, []).append(v)
                timing[m] += time.time() - t
        if "dp" in at:
            at["dp"][1] = [run(s, sim, "dp", 1, 0, policy_path)[0][-1]]
        if s.name in earlier_refs:
            ref = earlier_refs[s.name]
        else:
            ref = run(s, sim, "optuna", args.reference_budget, 1000, policy_path)[0][-1]
        grid = space.uniform_plans()
        best_uniform = max((sim.evaluate(p).score() for p in grid), default=0.0)
        best_known = max(
            [ref, best_uniform]
            + [c[-1] for cs in curves.values() for c in cs]
            + [v for per in at.values() for vals in per.values() for v in vals]
        )
        results[s.name] = dict(
            curves=curves,
            screened=screened,
            at=at,
            reference=ref,
            best_uniform=best_uniform,
            best_known=best_known,
            mixed=s.mixed,
            describe=s.describe(),
            timing=timing,
        )
        print(
            f"{s.describe()}\n  best-known {best_known:,.0f} tokens/s (reference optuna {ref / best_known:.3f}), "
            f"best uniform {best_uniform / best_known:.3f} of it, {time.time() - t0:.0f} s",
            flush=True,
        )
        if args.json:  # after every scenario, so a run stopped early keeps what it finished (--load reads it)
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"summary": {}, "results": results}, default=float))

    # -- tables --------------------------------------------------------------------------------------
    def values(name: str, m: str, b: int) -> list[float]:
        r = results[name]
        if m in r["at"]:
            return r["at"][m].get(b, r["at"][m][max(k for k in r["at"][m] if k <= b)] if b > 1 else [])
        return [c[b - 1] for c in r["curves"][m]]

    def rel(name: str, m: str, b: int) -> float:
        return float(np.mean(values(name, m, b))) / results[name]["best_known"]

    def fits(name: str, m: str, b: int) -> bool:
        return all(v > 0 for v in values(name, m, b))

    def evals_to_target(name: str, m: str) -> float:
        r = results[name]
        goal = TARGET * r["best_known"]
        if m in r["at"] and not r["curves"].get(m):
            hit = [b for b in sorted(r["at"][m]) if np.median(r["at"][m][b]) >= goal]
            return float(hit[0]) if hit else math.inf
        needs = [next((i + 1 for i, v in enumerate(c) if v >= goal), math.inf) for c in r["curves"][m]]
        return float(np.median(needs))

    names = list(results)
    fmt = lambda x: f">{B}" if math.isinf(x) else f"{x:g}"  # noqa: E731
    print("\nBest found / best-known (mean over seeds), median over held-out scenarios:")
    print(f"{'method':18s}" + "".join(f"{'B=' + str(b):>8s}" for b in BUDGETS) + f"{'evals to 98%':>14s}")
    summary = {}
    for m in methods:
        row = [float(np.median([rel(n, m, b) for n in names])) for b in BUDGETS]
        need = float(np.median([evals_to_target(n, m) for n in names]))
        summary[m] = dict(rel=row, evals_to_98=need)
        print(f"{m:18s}" + "".join(f"{v:8.3f}" for v in row) + f"{fmt(need):>14s}")
    if "dp" in methods:
        dp1 = float(np.median([rel(n, "dp", 1) for n in names]))
        print(f"{'dp plan (B=1)':18s}{dp1:8.3f}")
    print("\nWhich method at which budget (the highest median; within 0.005 of it listed too):")
    for k, b in enumerate(BUDGETS):
        top = max(summary[m]["rel"][k] for m in methods)
        print(f"  B={b}: {', '.join(m for m in methods if summary[m]['rel'][k] >= top - 0.005)} ({top:.3f})")
    print(f"\nPer scenario, budget 20 / budget 50 ({', '.join(methods)}), evals to 98% (rl):")
    for n in names:
        r = results[n]
        cells = " ".join(f"{rel(n, m, 20):.3f}/{rel(n, m, 50):.3f}" for m in methods)
        e = fmt(evals_to_target(n, "rl")) if "rl" in methods else "-"
        print(f"  {n:20s} {cells}   rl {e:>4s}  best/uniform {r['best_known'] / max(r['best_uniform'], 1e-9):.2f}x")
    print("\nBudget 20: does every method return a plan that fits where the uniform grid or dp finds one?")
    ok_all = True
    for n in names:
        r = results[n]
        reachable = r["best_uniform"] > 0 or ("dp" in r["at"] and r["at"]["dp"][20][0] > 0)
        fails = [m for m in methods if not fits(n, m, 20)]
        flagged = [
            m
            for m in r["screened"]
            if any(len(sc) >= 20 and sc[19] > SCREENED_PER_BUDGET * 20 for sc in r["screened"][m])
        ]
        ok = not reachable or not fails
        ok_all &= ok
        print(
            f"  {n:20s} fit reachable: {'yes' if reachable else 'no '}  no plan at B=20: "
            f"{', '.join(fails) or 'none'}{'  (prefix past the B=20 cap: ' + ', '.join(flagged) + ')' if flagged else ''}"
        )
    print(f"  -> {'every method fits wherever a fit is reachable' if ok_all else 'MISSED (see above)'}")
    mixed = [n for n in names if results[n]["mixed"] and results[n]["best_uniform"] > 0]
    if mixed:
        speedups = [results[n]["best_known"] / results[n]["best_uniform"] for n in mixed]
        print(
            f"\nbest plan / best uniform plan, median over {len(mixed)} mixed-GPU scenarios where uniform fits: "
            f"{float(np.median(speedups)):.2f}x (min {min(speedups):.2f}x, max {max(speedups):.2f}x)"
        )
    if "rl" in methods:
        rl10 = [rel(n, "rl", 10) for n in names]
        rl20 = [rel(n, "rl", 20) for n in names]
        rl50 = [rel(n, "rl", 50) for n in names]
        need = float(np.median([evals_to_target(n, "rl") for n in names]))
        print(
            f"targets: rl median at B=10 {np.median(rl10):.3f} (>= 0.98: "
            f"{'met' if np.median(rl10) >= 0.98 else 'MISSED'}); rl median at B=20 {np.median(rl20):.3f} (>= 0.97: {'met' if np.median(rl20) >= 0.97 else 'MISSED'}); "
            f"rl min over scenarios at B=50 {min(rl50):.3f} (>= 0.90: {'met' if min(rl50) >= 0.90 else 'MISSED'}, "
            f"{sum(v >= 0.90 for v in rl50)} of {len(rl50)}); rl evals to 98% median {fmt(need)} "
            f"(<= 13: {'met' if need <= 13 else 'MISSED'})"
        )
    secs = {m: sum(results[n]["timing"][m] for n in names) / max(len(names) * args.seeds, 1) for m in methods}
    print(
        "wall time per scenario and seed (s, mean; per-budget methods: all budgets): "
        + ", ".join(f"{m} {v:.1f}" for m, v in secs.items())
    )
    meta_path = policy_path.with_suffix(".json")
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        print(
            f"policy: {policy_path.name}, training cost {meta.get('train_time_s', 0) / 60:.1f} min on "
            f"{meta.get('cpu', '?')}, {meta.get('timesteps', '?')} env steps"
        )
    print(f"total {time.time() - t_all:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "results": results}, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
