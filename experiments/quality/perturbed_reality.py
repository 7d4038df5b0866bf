"""Real runs spent to reach the true best plan when the simulator is wrong: today's methods (issue 27, point 3).

"Reality" is autotune's simulator on a perturbed copy of the cluster, with errors drawn from the error bars of
``autotune.simulator.error_bar`` (the fidelity validation table), never shown to the searches:

- per GPU class, its compute time x exp(N(0, s)), s = ``compute_error`` of that class and precision (4.4% for
  A100 16-bit ... 72% for RTX-4090; 36% for classes with no measured run): the class's peak rates and memory
  bandwidth divided by that factor;
- per node, its network and intra-node bandwidth x exp(N(0, s)), s = ``network_error`` at that bandwidth
  (10% at 10 GB/s and above, growing to 110% at 1 Gbit/s), latency divided by the same factor;
- per GPU class, its usable memory x exp(N(0, 0.1)) (the memory model's 6-12% mean error, RESULTS.md).

Per held-out scenario (``autotune.policy.scenarios.heldout_scenarios``) and draw, each method spends up to
``--budget`` real runs (evaluations of reality; a plan that runs out of memory is a run too), through
``autotune.tune`` as a user runs it, the searches seeing the cluster as given:

- ``sim order``: dp's plans in the nominal simulator's order (``--method dp``);
- ``optuna``: TPE on the real runs (``--method optuna``, its default start: dp's best 3 plans);
- ``loop dp`` / ``loop optuna``: today's closed loop (``--backend real``): every run refits the simulator's
  correction, and the corrected simulator screens the plans the method asks for next.

Every method keeps to the runner's limits (``runner.jobs.plan_limits``: reality refuses what ``autotune
train`` would), on both backends. The true best of a draw is the best plan under reality within those limits
among dp's 64 candidates and every plan any method ran. Printed: per method, the real runs to reach 98% of it (median and 90th percentile over draws; ">B" when
not within the budget) and the share of draws that reach it within 1, 3 and 10 runs. The learned agent of
issue 27 is not built yet; these are the numbers it has to beat.

    .venv/bin/python experiments/quality/perturbed_reality.py [--draws 5] [--budget 10]
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from dataclasses import replace

import numpy as np

from autotune.evaluator import Evaluator
from autotune.planning.planner import plan_candidates
from autotune.planning.space import SearchSpace
from autotune.policy.scenarios import heldout_scenarios
from autotune.search.api import tune
from autotune.simulator import Simulator
from autotune.simulator.error_bar import compute_error, network_error
from autotune.specs import ClusterSpec, LinkSpec, Measurement, ParallelConfig
from runner.jobs import plan_limits

TARGET = 0.98
MEMORY_ERROR = 0.10
METHODS = (
    ("sim order", "dp", "sim"),
    ("optuna", "optuna", "sim"),
    ("loop dp", "dp", "real"),
    ("loop optuna", "optuna", "real"),
)


def perturbed(cluster: ClusterSpec, precision: str, rng: np.random.Generator) -> ClusterSpec:
    """The cluster as reality has it (module docstring)."""
    compute, memory = {}, {}
    for n in cluster.nodes:
        if n.device.name not in compute:
            s = compute_error(n.device.name, precision, calibrated=False)[0]
            compute[n.device.name] = math.exp(rng.normal(0.0, s))
            memory[n.device.name] = math.exp(rng.normal(0.0, MEMORY_ERROR))

    def link(spec: LinkSpec) -> LinkSpec:
        f = math.exp(rng.normal(0.0, network_error(spec.bandwidth_GBps)[0]))
        return LinkSpec(spec.bandwidth_GBps * f, spec.latency_us / f)

    nodes = []
    for n in cluster.nodes:
        d, f = n.device, compute[n.device.name]
        device = replace(
            d,
            peak_tflops=d.peak_tflops / f,
            peak_tflops_tf32=(d.peak_tflops_tf32 or 0.0) / f,
            peak_tflops_fp32=(d.peak_tflops_fp32 or 0.0) / f,
            memory_bandwidth_GBps=d.memory_bandwidth_GBps / f,
            memory_GiB=d.memory_GiB * memory[d.name],
        )
        nodes.append(replace(n, device=device, intra_node=link(n.intra_node), network=link(n.network)))
    return replace(cluster, nodes=tuple(nodes))


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


def runs_to_target(curve: list[float], best: float) -> int | None:
    """The first run (1-based) whose best-so-far reaches ``TARGET`` of ``best``; None when none does."""
    return next((i + 1 for i, v in enumerate(curve) if v >= TARGET * best), None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draws", type=int, default=5, help="perturbed realities per scenario")
    ap.add_argument("--budget", type=int, default=10, help="real runs per method")
    ap.add_argument("--only", default=None, help="comma-separated scenario names")
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
    t0 = time.time()
    results: dict[str, list[int | None]] = {name: [] for name, *_ in METHODS}
    for s in heldout_scenarios():
        if args.only and s.name not in args.only.split(","):
            continue
        for draw in range(args.draws):
            rng = np.random.default_rng([draw, sum(map(ord, s.name))])
            real_cluster = perturbed(s.cluster, s.model.precision, rng)
            curves = {}
            ran: set[ParallelConfig] = set()
            for name, method, backend in METHODS:
                reality = Reality(s.cluster, real_cluster, s.model)
                result = tune(
                    s.cluster,
                    s.model,
                    method=method,
                    budget=args.budget,
                    backend=backend,
                    seed=draw,
                    track=False,
                    storage="memory",
                    evaluator=reality,
                    on_evaluation=lambda ev: ran.add(ev.config),
                )
                curves[name] = list(result.best_curve)
            truth = Simulator(real_cluster, s.model)
            space = SearchSpace(s.cluster, s.model)
            ran |= {c.config for c in plan_candidates(space, None, limit=64)}
            best = max(truth.evaluate(c).score() for c in ran if reality.check(c) is None)
            line = []
            for name, *_ in METHODS:
                k = runs_to_target(curves[name], best)
                results[name].append(k)
                line.append(f"{name} {k if k is not None else '>' + str(args.budget)}")
            print(
                f"{s.name:18s} draw {draw}: true best {best:,.0f} tokens/s; runs to 98%: " + ", ".join(line), flush=True
            )
    n = len(next(iter(results.values())))
    print(f"\n{n} draws, budget {args.budget} real runs, {time.time() - t0:.0f} s")
    print(f"{'method':<12s} {'median':>7s} {'p90':>6s} {'<=1':>6s} {'<=3':>6s} {'<=10':>6s}")
    for name, ks in results.items():
        vals = sorted(k if k is not None else math.inf for k in ks)

        def pct(q: float) -> str:
            v = vals[min(len(vals) - 1, int(math.ceil(q * len(vals))) - 1)]
            return f">{args.budget}" if math.isinf(v) else str(int(v))

        share = [sum(v <= r for v in vals) / len(vals) for r in (1, 3, 10)]
        print(f"{name:<12s} {pct(0.5):>7s} {pct(0.9):>6s} " + " ".join(f"{x:>6.0%}" for x in share))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
