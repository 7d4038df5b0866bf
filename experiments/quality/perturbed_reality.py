"""Real runs spent to reach the true best plan when the simulator is wrong: today's methods (issue 27, point 3).

"Reality" is autotune's simulator on a perturbed copy of the cluster (``autotune.simulator.perturbation``: per GPU
class compute time and usable memory, per node network and intra-node bandwidth, each off by a factor drawn from
the error bars of ``autotune.simulator.error_bar``, the fidelity validation table), never shown to the searches.
The chooser of real runs was trained on realities drawn the same way (on training scenarios, never these):
this benchmark checks it on clusters it never saw, not on errors of another kind.

Per held-out scenario (``autotune.policy.scenarios.heldout_scenarios``) and draw, each method spends up to
``--budget`` real runs (evaluations of reality; a plan that runs out of memory is a run too), through
``autotune.tune`` as a user runs it, the searches seeing the cluster as given:

- ``sim order``: dp's plans in the nominal simulator's order (``--method dp``);
- ``optuna``: TPE on the real runs (``--method optuna``, its default start: dp's best 3 plans);
- ``loop dp`` / ``loop optuna``: today's closed loop (``--backend real``): every run refits the simulator's
  correction, and the corrected simulator screens the plans the method asks for next;
- ``greedy gain``: dp's candidates, each next run the one of largest expected gain under the posterior the
  runs so far refitted (``autotune.planning.posterior``; ``--method rl --backend real --policy greedy-gain``):
  the fixed rule the learned chooser must beat to earn its place;
- ``agent``: the learned chooser (``--method rl --backend real``, ``autotune.search.agents.acquire``), with
  its stopping rule (it may stop before the budget: a draw it stops short of 98% counts as not reached).

Every method keeps to the runner's limits (``runner.jobs.plan_limits``: reality refuses what ``autotune
train`` would), on both backends. The true best of a draw is the best plan under reality within those limits
among dp's 64 candidates and every plan any method ran. Printed: per method, the real runs to reach 98% of it
(median and 90th percentile over draws; ">B" when not within the budget), the share of draws that reach it
within 1, 3 and 10 runs, the mean real runs spent, and the share within every budget 1..B. Per draw, each
method's runs to 98% and the runs it spent (``3/10``); ``--out`` writes them as JSON.

    .venv/bin/python experiments/quality/perturbed_reality.py [--draws 5] [--budget 10] [--out FILE.json]

``--lies structured`` draws realities of another kind (issue 45), what users get wrong in a cluster file
(``autotune.simulator.perturbation.structured_lie``, of the developers' own design): draw ``d`` is lie kind
``LIE_KINDS[d % 6]`` (network x 0.3-0.6, one GPU class 1.25-1.6x slower, one class 10-20% less usable memory,
one node type on PCIe, network latency x 5-20, two at once); ``--changed-only`` keeps the draws where the lie
changes the ranking (the nominal planner's first plan is below 98% of the true best). It then also prints,
per lie kind and method, the share within 2% after 1 / 2 / 3 / 5 / 10 runs, the median runs, the returned
plan's true throughput over the true best (mean / min) and the real runs that ran out of memory.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time

import numpy as np

from autotune.evaluator import Evaluator
from autotune.planning.planner import plan_candidates
from autotune.planning.space import SearchSpace
from autotune.policy.acquisition_training import runs_to_target
from autotune.policy.scenarios import heldout_scenarios
from autotune.search.api import tune
from autotune.simulator import Simulator
from autotune.simulator.perturbation import LIE_KINDS, draw_errors, perturb, structured_lie
from autotune.specs import ClusterSpec, Measurement, ParallelConfig
from runner.jobs import plan_limits

METHODS = (  # (name, --method, --backend, --policy)
    ("sim order", "dp", "sim", None),
    ("optuna", "optuna", "sim", None),
    ("loop dp", "dp", "real", None),
    ("loop optuna", "optuna", "real", None),
    ("greedy gain", "rl", "real", "greedy-gain"),
    ("agent", "rl", "real", None),
)


class Reality(Evaluator):
    """Real runs: the simulator of the perturbed cluster ``real``. Not a ``Simulator`` (nor wrapping one under
    the names the searches look for), so no search ranks plans by it; its ``cluster`` is the one the user
    describes (``nominal``), as a real runner's is, and its memory model the nominal one."""

    def __init__(self, nominal: ClusterSpec, real: ClusterSpec, model) -> None:
        self.cluster, self.model = nominal, model
        self._truth = Simulator(real, model)
        self._nominal = Simulator(nominal, model)
        self._limits = plan_limits(nominal, model)

    def memory_check(self, config: ParallelConfig) -> Measurement | None:
        """The search's own memory model (the nominal simulator's, as on the simulator backend): a plan it says
        does not fit is not run, on both backends (the closed loop's screen has the corrected one)."""
        return self._nominal.memory_check(config)

    def check(self, config: ParallelConfig) -> str | None:
        """What the real runner refuses (``runner.jobs.plan_limits``): the same limits the simulator backend's
        searches keep to, so that every method and the true best stay within them."""
        return self._limits(config) if self._limits is not None else None

    def evaluate(self, config: ParallelConfig) -> Measurement:
        return self._truth.evaluate(config)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draws", type=int, default=5, help="perturbed realities per scenario")
    ap.add_argument("--budget", type=int, default=10, help="real runs per method")
    ap.add_argument("--only", default=None, help="comma-separated scenario names")
    ap.add_argument("--out", default=None, help="write every draw's runs to 98%% and runs spent here (JSON)")
    ap.add_argument("--methods", default=None, help="comma-separated methods of the table (default: all)")
    ap.add_argument(
        "--truth",
        default=None,
        help="an earlier --out of all methods: each draw's true best is at least what that run found (a run of "
        "a few methods then measures against the same truth as the full table)",
    )
    ap.add_argument("--stop-gain", type=float, default=None, help="the chooser's stopping threshold (default: its own)")
    ap.add_argument("--lies", choices=("bars", "structured"), default="bars", help="how reality differs (docstring)")
    ap.add_argument(
        "--changed-only", action="store_true", help="skip draws whose lie leaves the nominal best plan best"
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works (tests/integration/experiments/test_experiments.py runs it)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.draws, args.budget, args.only = 1, 3, args.only or "consumer-tight-8"
    logging.basicConfig(level=logging.ERROR)
    import torch

    torch.set_num_threads(1)
    methods = [m for m in METHODS if args.methods is None or m[0] in args.methods.split(",")]
    unknown = set(args.methods.split(",")) - {m[0] for m in METHODS} if args.methods else set()
    if unknown:
        ap.error(f"--methods: unknown {', '.join(sorted(unknown))} (one of: {', '.join(m[0] for m in METHODS)})")
    earlier = {}
    if args.truth:
        with open(args.truth) as f:
            earlier = {(d["scenario"], d["draw"]): d["true_best_tokens_per_s"] for d in json.load(f)["draws"]}
    if args.stop_gain is not None:
        from autotune.search.agents import acquire

        acquire.STOP_GAIN = args.stop_gain
    t0 = time.time()
    results: dict[str, list[int | None]] = {name: [] for name, *_ in methods}
    spent: dict[str, list[int]] = {name: [] for name, *_ in methods}
    draws: list[dict] = []
    for s in heldout_scenarios():
        if args.only and s.name not in args.only.split(","):
            continue
        for draw in range(args.draws):
            rng = np.random.default_rng([draw, sum(map(ord, s.name))])
            kind = LIE_KINDS[draw % len(LIE_KINDS)] if args.lies == "structured" else "bars"
            errors = (
                structured_lie(s.cluster, kind, rng)
                if args.lies == "structured"
                else draw_errors(s.cluster, s.model.precision, rng)
            )
            real_cluster = perturb(s.cluster, errors)
            truth = Simulator(real_cluster, s.model)
            candidates = [c.config for c in plan_candidates(SearchSpace(s.cluster, s.model), None, limit=64)]
            if args.changed_only:
                probe = Reality(s.cluster, real_cluster, s.model)
                fine = [truth.evaluate(c).score() for c in candidates if probe.check(c) is None]
                if fine and truth.evaluate(candidates[0]).score() >= 0.98 * max(fine):
                    print(f"{s.name:18s} draw {draw} ({kind}): the lie leaves the nominal best plan best; skipped")
                    continue
            curves = {}
            returned: dict[str, float] = {}
            ooms: dict[str, int] = {}
            ran: set[ParallelConfig] = set()
            for name, method, backend, policy in methods:
                reality = Reality(s.cluster, real_cluster, s.model)
                oom_runs: list[int] = []

                def seen(ev, oom_runs=oom_runs) -> None:
                    ran.add(ev.config)
                    oom_runs.append(int(ev.measurement.oom))

                result = tune(
                    s.cluster,
                    s.model,
                    method=method,
                    budget=args.budget,
                    backend=backend,
                    policy=policy,
                    seed=draw,
                    track=False,
                    storage="memory",
                    evaluator=reality,
                    on_evaluation=seen,
                )
                curves[name] = list(result.best_curve)
                spent[name].append(len(result.best_curve))
                m = result.best_measurement
                returned[name] = truth.evaluate(result.best_config).score() if m.ok else 0.0
                ooms[name] = sum(oom_runs)
            ran |= set(candidates)
            best = max(truth.evaluate(c).score() for c in ran if reality.check(c) is None)
            best = max(best, earlier.get((s.name, draw), 0.0))
            line = []
            draws.append({"scenario": s.name, "draw": draw, "lie": kind, "true_best_tokens_per_s": best, "methods": {}})
            for name, *_ in methods:
                k = runs_to_target(curves[name], best)
                results[name].append(k)
                draws[-1]["methods"][name] = {
                    "runs_to_98": k,
                    "spent": len(curves[name]),
                    "returned_over_true_best": returned[name] / best if best > 0 else 0.0,
                    "oom_runs": ooms[name],
                }
                line.append(f"{name} {k if k is not None else '>' + str(args.budget)}/{len(curves[name])}")
            print(
                f"{s.name:18s} draw {draw}: true best {best:,.0f} tokens/s; runs to 98% / spent: " + ", ".join(line),
                flush=True,
            )
    n = len(next(iter(results.values())))
    print(f"\n{n} draws, budget {args.budget} real runs, {time.time() - t0:.0f} s")
    print(f"{'method':<12s} {'median':>7s} {'p90':>6s} {'<=1':>6s} {'<=3':>6s} {'<=10':>6s} {'spent':>6s}")
    for name, ks in results.items():
        vals = sorted(k if k is not None else math.inf for k in ks)

        def pct(q: float) -> str:
            v = vals[min(len(vals) - 1, int(math.ceil(q * len(vals))) - 1)]
            return f">{args.budget}" if math.isinf(v) else str(int(v))

        share = [sum(v <= r for v in vals) / len(vals) for r in (1, 3, 10)]
        print(
            f"{name:<12s} {pct(0.5):>7s} {pct(0.9):>6s} "
            + " ".join(f"{x:>6.0%}" for x in share)
            + f" {np.mean(spent[name]):>6.1f}"
        )
    print("\nshare of draws within r real runs")
    print(f"{'method':<12s} " + " ".join(f"{r:>5d}" for r in range(1, args.budget + 1)))
    for name, ks in results.items():
        print(
            f"{name:<12s} "
            + " ".join(
                f"{sum(k is not None and k <= r for k in ks) / len(ks):>5.0%}" for r in range(1, args.budget + 1)
            )
        )
    if args.lies == "structured":
        by_kind(draws, [name for name, *_ in methods])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"budget": args.budget, "draws": draws}, f, indent=1)
    return 0


def by_kind(draws: list[dict], names: list[str]) -> None:
    """Per lie kind (and all together) and method: share within 2% after 1/2/3/5/10 runs, median runs, the
    returned plan's true throughput over the true best (mean / min), real runs out of memory."""
    kinds = sorted({d["lie"] for d in draws}, key=lambda k: LIE_KINDS.index(k)) + ["all"]
    print("\nper lie kind: within 2% after 1/2/3/5/10 runs | median runs | returned / true best mean, min | OOM runs")
    for kind in kinds:
        mine = [d for d in draws if kind in ("all", d["lie"])]
        print(f"{kind} ({len(mine)} draws)")
        for name in names:
            ks = [d["methods"][name]["runs_to_98"] for d in mine]
            within = " / ".join(f"{sum(k is not None and k <= r for k in ks) / len(ks):.0%}" for r in (1, 2, 3, 5, 10))
            vals = sorted(k if k is not None else math.inf for k in ks)
            med = vals[(len(vals) - 1) // 2]
            ratio = [d["methods"][name]["returned_over_true_best"] for d in mine]
            oom = sum(d["methods"][name]["oom_runs"] for d in mine)
            print(
                f"  {name:<12s} {within:<26s} | {'>10' if math.isinf(med) else int(med):>4} | "
                f"{np.mean(ratio):.3f}, {min(ratio):.3f} | {oom}"
            )


if __name__ == "__main__":
    raise SystemExit(main())
