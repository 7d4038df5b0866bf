"""Held-out evaluation of the pretrained RL policy against optuna, random and uniform.

On every held-out scenario (autotune.policy.scenarios.heldout_scenarios: GPU mixes never drawn in
training) and for budgets 5, 10, 20, 50, 100 evaluations (simulator backend, the shared
``BudgetedEvaluator``, no MLflow):

- best throughput found / best-known for the scenario, where best-known is the best plan any run
  below found, including a reference Optuna run of ``--reference-budget`` evaluations;
- evaluations needed to reach 98% of best-known (median over seeds, then over scenarios; ">N" when a
  run never reaches it within its budget);
- the best plan / the best uniform plan (whole uniform grid) on each scenario.

The agents are the search package's agent functions (``run_optuna``, ``run_random``, ``run_uniform``)
and ``run_pretrained``. rl, optuna and random do not look at the budget, so one run of the largest
budget gives every smaller budget as a prefix of its best-so-far curve (identical to separate runs);
``uniform`` visits its grid in a budget-dependent order and is run once per budget. ``walk`` is the
rl agent's best-first walk with the policy replaced by uniformly random move choices (ablation: what
the policy adds).

    .venv/bin/python experiments/heldout_eval.py [--seeds 3] [--policy autotune/data/policy.safetensors]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.search.agents.simple import run_random, run_uniform  # noqa: E402
from autotune.search.agents.tpe import open_study, run_optuna  # noqa: E402
from autotune.search.budget import BudgetedEvaluator  # noqa: E402
from autotune.policy.pretrained import default_policy_path, load_policy, run_pretrained  # noqa: E402
from autotune.policy.scenarios import draw_scenario, heldout_scenarios, validation_rng  # noqa: E402
from autotune.search.space import SearchSpace  # noqa: E402
from autotune.simulator import Simulator  # noqa: E402

BUDGETS = (5, 10, 20, 50, 100)
TARGET = 0.98


def in_memory_study(space: SearchSpace, seed: int):
    """The study ``autotune search --method optuna`` opens (same TPE sampler), in memory."""
    return open_study(space, f"heldout-{seed}", "memory", seed)


def curve_of(space: SearchSpace, sim: Simulator, budget: int, fn) -> list[float]:
    ev = BudgetedEvaluator(sim, space, budget)
    fn(ev)
    curve = ev.best_curve()
    return curve + [curve[-1] if curve else 0.0] * (budget - len(curve))  # a run that stopped early keeps its best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--policy", default=None, help="policy file (default: the shipped one)")
    ap.add_argument("--reference-budget", type=int, default=400)
    ap.add_argument("--only", default=None, help="comma-separated scenario names")
    ap.add_argument("--json", default=None, help="write all curves to this file")
    ap.add_argument("--validation", type=int, default=0,
                    help="use this many validation scenarios (training distribution, validation seeds) instead "
                         "of the held-out set: for developing the policy without touching the held-out set")
    ap.add_argument("--methods", default="rl,optuna,random,uniform,walk")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(1)
    policy = load_policy(args.policy)
    policy_path = Path(args.policy) if args.policy else default_policy_path()
    meta_path = policy_path.with_suffix(".json")
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
    t_all = time.time()
    for s in scenarios:
        t0 = time.time()
        space = SearchSpace(s.cluster, s.model)
        sim = Simulator(s.cluster, s.model)
        curves: dict[str, list[list[float]]] = {m: [] for m in methods}
        uniform_at: dict[int, list[float]] = {}
        timing: dict[str, float] = {m: 0.0 for m in methods}
        for seed in range(args.seeds):
            for m in methods:
                if m == "uniform":
                    continue
                t = time.time()
                if m == "rl":
                    fn = lambda ev, seed=seed: run_pretrained(space, ev, seed, policy=policy)  # noqa: E731
                elif m == "rl-sample":
                    fn = lambda ev, seed=seed: run_pretrained(space, ev, seed, policy=policy, sample=True)  # noqa: E731
                elif m == "rl-finetune":
                    fn = lambda ev, seed=seed: run_pretrained(space, ev, seed, policy_path=policy_path, fine_tune=True)  # noqa: E731
                elif m.startswith("rl-starts"):
                    k = int(m.removeprefix("rl-starts"))
                    fn = lambda ev, seed=seed, k=k: run_pretrained(space, ev, seed, policy=policy, starts=k)  # noqa: E731
                elif m.startswith("rl-stall"):
                    k = int(m.removeprefix("rl-stall"))
                    fn = lambda ev, seed=seed, k=k: run_pretrained(space, ev, seed, policy=policy, stall_restart=k)  # noqa: E731
                elif m == "optuna":
                    fn = lambda ev, seed=seed: run_optuna(space, ev, seed, study=in_memory_study(space, seed))  # noqa: E731
                elif m == "random":
                    fn = lambda ev, seed=seed: run_random(space, ev, seed)  # noqa: E731
                else:
                    fn = lambda ev, seed=seed: run_pretrained(space, ev, seed, order="random")  # noqa: E731
                curves[m].append(curve_of(space, sim, B, fn))
                timing[m] += time.time() - t
            for b in BUDGETS if "uniform" in methods else ():
                t = time.time()
                uniform_at.setdefault(b, []).append(curve_of(space, sim, b, lambda ev, seed=seed: run_uniform(space, ev, seed))[-1])
                timing["uniform"] += time.time() - t
        ref = curve_of(space, sim, args.reference_budget,
                       lambda ev: run_optuna(space, ev, 1000, study=in_memory_study(space, 1000)))[-1]
        grid = space.uniform_plans()
        best_uniform = max((sim.evaluate(p).score() for p in grid), default=0.0)
        best_known = max([ref, best_uniform] + [c[-1] for cs in curves.values() for c in cs])
        results[s.name] = dict(curves=curves, uniform_at=uniform_at, reference=ref, best_uniform=best_uniform,
                               best_known=best_known, mixed=s.mixed, describe=s.describe(), timing=timing)
        print(f"{s.describe()}\n  best-known {best_known:,.0f} tokens/s (reference optuna {ref / best_known:.3f}), "
              f"best uniform {best_uniform / best_known:.3f} of it, {time.time() - t0:.0f} s", flush=True)

    # -- tables --------------------------------------------------------------------------------------
    def rel(name: str, m: str, b: int) -> float:
        r = results[name]
        if m == "uniform":
            vals = r["uniform_at"][b]
        else:
            vals = [c[b - 1] for c in r["curves"][m]]
        return float(np.mean(vals)) / r["best_known"]

    def evals_to_target(name: str, m: str) -> float:
        r = results[name]
        if m == "uniform":
            per_budget = [b for b in BUDGETS if np.median(r["uniform_at"][b]) >= TARGET * r["best_known"]]
            return float(per_budget[0]) if per_budget else math.inf
        needs = []
        for c in r["curves"][m]:
            hit = next((i + 1 for i, v in enumerate(c) if v >= TARGET * r["best_known"]), math.inf)
            needs.append(hit)
        return float(np.median(needs))

    names = list(results)
    print("\nBest found / best-known (mean over seeds), median over held-out scenarios:")
    header = f"{'method':14s}" + "".join(f"{'B=' + str(b):>8s}" for b in BUDGETS) + f"{'evals to 98%':>14s}"
    print(header)
    summary = {}
    for m in methods:
        row = [float(np.median([rel(n, m, b) for n in names])) for b in BUDGETS]
        need = float(np.median([evals_to_target(n, m) for n in names]))
        summary[m] = dict(rel=row, evals_to_98=need)
        need_s = f">{B}" if math.isinf(need) else f"{need:g}"
        print(f"{m:14s}" + "".join(f"{v:8.3f}" for v in row) + f"{need_s:>14s}")
    print(f"\nPer scenario at budget 10 / 50 ({', '.join(methods)}) and evals to 98% (rl, optuna):")
    for n in names:
        r = results[n]
        cells = " ".join(f"{rel(n, m, 10):.3f}/{rel(n, m, 50):.3f}" for m in methods)
        e_rl, e_opt = evals_to_target(n, "rl"), evals_to_target(n, "optuna")
        fmt = lambda x: f">{B}" if math.isinf(x) else f"{x:.0f}"  # noqa: E731
        print(f"  {n:20s} {cells}   rl {fmt(e_rl):>4s}  optuna {fmt(e_opt):>4s}  best/uniform {r['best_known'] / r['best_uniform']:.2f}x")
    mixed = [n for n in names if results[n]["mixed"]]
    speedups = [results[n]["best_known"] / results[n]["best_uniform"] for n in mixed]
    print(f"\nbest plan / best uniform plan, median over the {len(mixed)} mixed-GPU scenarios: "
          f"{float(np.median(speedups)):.2f}x (min {min(speedups):.2f}x, max {max(speedups):.2f}x)")
    rl50 = [rel(n, "rl", 50) for n in names]
    opt50 = [rel(n, "optuna", 50) for n in names]
    print(f"budget 50: rl median {np.median(rl50):.3f} vs optuna median {np.median(opt50):.3f}; rl >= optuna on "
          f"{sum(a >= b - 1e-9 for a, b in zip(rl50, opt50))} of {len(names)} scenarios")
    secs = {m: sum(results[n]['timing'][m] for n in names) / max(len(names) * args.seeds, 1) for m in methods}
    print("wall time per search of 100 evaluations (s, mean): " + ", ".join(f"{m} {v:.1f}" for m, v in secs.items()))
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        secs = meta.get("total_train_time_s", meta.get("train_time_s", 0))
        steps = meta.get("total_timesteps", meta.get("timesteps", "?"))
        print(f"pretraining cost: {secs / 60:.1f} min on {meta.get('cpu', '?')}, {steps} env steps "
              f"(= simulator evaluations) on random training scenarios, over {1 + len(meta.get('previous_runs', []))} "
              f"run(s) (policy file {policy_path.stat().st_size / 1024:.0f} KiB)")
    print(f"total {time.time() - t_all:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "results": results}, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
