"""Issue 10 benchmark: the best plan with Zorse's mixed stages vs the best plan without them.

Part 1 (simulated): on each cluster, the same search (``--method``, ``--budget`` plans, simulator backend,
every seed) over the full space and over the space restricted to one rank per stage
(``stage_ranks: [1]``: the plans autotune could write before issue 10); the best
tokens/s of each, and the winning plan with a breakdown per GPU type. ``--only-mixed`` adds a third search
over the plans with mixed stages only (``ONLY_MIXED``): the best mixed-stage plan at the same budget.

Part 2 (``--runner``, measured): a CPU cluster with emulated slowdown (2 fast ranks, 2 ranks 3x slower):
the best plan of each space found by the simulator search (tiny model, CPU profile built in; both spaces
cut to what the runner runs with mixed stages: zero 0-2, no offload) and a hand-written mixed-stage plan
(with zero 0 and 2), each measured by the runner (``measure``: real gloo ranks).

    nice -n 15 .venv/bin/python experiments/quality/mixed_stages.py --budget 100 --seeds 0,1 [--only-mixed] [--cases a100x2]
    nice -n 15 .venv/bin/python experiments/quality/mixed_stages.py --grid [--cases /32]
    nice -n 15 .venv/bin/python experiments/quality/mixed_stages.py --runner
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from autotune.loading import cluster_from_dict, load_cluster, load_model
from autotune.planning.space import SearchSpace

NO_MIXED = {"stage_ranks": [1]}
#: the search among plans with mixed stages only (stages of 2, 4, 8 ranks or the bandwidth cut; no RoundPipe)
ONLY_MIXED = {"stage_ranks": [2, 4, 8, "bandwidth"], "roundpipe": [False]}

# A P40-like card: Pascal, no 16-bit tensor cores (12 TFLOP/s FP32 used for everything), 24 GB GDDR5, 346 GB/s
P40 = {
    "name": "P40-like",
    "peak_tflops": 12.0,
    "memory_GiB": 22.35,
    "memory_bandwidth_GBps": 346.0,
    "pcie_gen": 3,
    "peak_tflops_tf32": 12.0,
    "peak_tflops_fp32": 12.0,
}

CLUSTERS = {
    # 2 A100-80GB (NVLink) + 4 T4 (16 GB, PCIe), 100 Gbit/s between the nodes
    "a100x2+t4x4": {
        "nodes": [
            {"name": "a100", "gpu": "A100-80GB", "count": 2, "intra_node": {"bandwidth_GBps": 300, "latency_us": 2}},
            {"name": "t4", "gpu": "T4", "count": 4, "intra_node": {"bandwidth_GBps": 16, "latency_us": 5}},
        ],
        "network": {"bandwidth_GBps": 12.5, "latency_us": 10},
    },
    # 4 V100-32GB + 4 P40-like cards, 100 Gbit/s
    "v100x4+p40x4": {
        "nodes": [
            {"name": "v100", "gpu": "V100-32GB", "count": 4, "intra_node": {"bandwidth_GBps": 16, "latency_us": 5}},
            {"name": "p40", "gpu": P40, "count": 4, "intra_node": {"bandwidth_GBps": 12, "latency_us": 5}},
        ],
        "network": {"bandwidth_GBps": 12.5, "latency_us": 10},
    },
    # Zorse's natural case: few big GPUs, many small ones (2 A100-80GB + 2 nodes of 4 T4)
    "a100x2+t4x8": {
        "nodes": [
            {"name": "a100", "gpu": "A100-80GB", "count": 2, "intra_node": {"bandwidth_GBps": 300, "latency_us": 2}},
            {"name": "t4a", "gpu": "T4", "count": 4, "intra_node": {"bandwidth_GBps": 16, "latency_us": 5}},
            {"name": "t4b", "gpu": "T4", "count": 4, "intra_node": {"bandwidth_GBps": 16, "latency_us": 5}},
        ],
        "network": {"bandwidth_GBps": 12.5, "latency_us": 10},
    },
    # 4 V100-32GB + 2 nodes of 4 P40-like cards: llama2-13b's 208 GB of training state fits neither type alone
    "v100x4+p40x8": {
        "nodes": [
            {"name": "v100", "gpu": "V100-32GB", "count": 4, "intra_node": {"bandwidth_GBps": 16, "latency_us": 5}},
            {"name": "p40a", "gpu": P40, "count": 4, "intra_node": {"bandwidth_GBps": 12, "latency_us": 5}},
            {"name": "p40b", "gpu": P40, "count": 4, "intra_node": {"bandwidth_GBps": 12, "latency_us": 5}},
        ],
        "network": {"bandwidth_GBps": 12.5, "latency_us": 10},
    },
    "mixed-a100-v100": None,  # preset: 4 A100-80GB + 4 V100-32GB
    "mixed-consumer-16": None,  # preset: 8 A100-80GB + 2 x 4 RTX-4090, 10 Gbit/s
}
#: (cluster, model[, global batch size]) cases of part 1
CASES = [
    ("a100x2+t4x4", "llama2-7b"),
    ("a100x2+t4x4", "gpt2-xl"),
    ("v100x4+p40x4", "llama2-7b"),
    ("v100x4+p40x4", "gpt2-xl"),
    ("mixed-a100-v100", "gpt2-xl"),
    ("mixed-consumer-16", "llama2-7b"),
    ("a100x2+t4x8", "llama2-7b"),
    ("v100x4+p40x8", "llama2-13b"),
    # small global batches (32 sequences of 4,096 tokens: fine-tuning sizes): few micro-batches per replica
    ("v100x4+p40x4", "llama2-7b", 32),
    ("a100x2+t4x8", "llama2-7b", 32),
    ("v100x4+p40x8", "llama2-13b", 32),
]


def cluster_of(name: str):
    raw = CLUSTERS[name]
    return load_cluster(name) if raw is None else cluster_from_dict({"name": name, **raw}, name)


class MixedCounter:
    """The simulator, counting the plans with a stage of several ranks it evaluates and the best of them."""

    def __init__(self, sim) -> None:
        self.sim, self.mixed, self.best_mixed, self.best_mixed_config = sim, 0, 0.0, None
        self.mixed_fit = 0

    def __getattr__(self, name):  # everything else (check, memory_estimate, ...) is the simulator's
        return getattr(self.sim, name)

    def evaluate(self, config):
        m = self.sim.evaluate(config)
        if config.has_mixed_stages:
            self.mixed += 1
            self.mixed_fit += m.ok
            if m.ok and m.tokens_per_s > self.best_mixed:
                self.best_mixed, self.best_mixed_config = m.tokens_per_s, config
        return m


def breakdown(sim, config) -> str:
    """Where a plan's step goes, per GPU type (mean over its devices): forward / backward busy, the step's
    data-parallel phases (all-reduce, all-gather), optimizer, idle; its peak memory against usable."""
    m = sim.evaluate_detailed(config)
    if not m.ok:
        return f"    {m.status}: {m.error}"
    cluster = sim.costs.effective_cluster
    per: dict[str, dict[str, float]] = {}
    count: dict[str, set] = {}
    for e in m.timeline:
        gpu = cluster.node_of(e.device).device.name
        kind = "fwd" if e.op.startswith("F") else "bwd" if e.op.startswith("B") else e.op
        per.setdefault(gpu, {}).setdefault(kind, 0.0)
        per[gpu][kind] += e.end_s - e.start_s
        count.setdefault(gpu, set()).add(e.device)
    lines = [f"    step {m.iteration_time_s:.3f} s, bubble {m.bubble_fraction:.3f}, zero {config.zero}"]
    for gpu, kinds in per.items():
        n = len(count[gpu])
        busy = {k: v / n for k, v in kinds.items()}
        idle = m.iteration_time_s - sum(busy.values())
        peak = max(m.peak_memory_GiB.get(d, 0.0) for d in count[gpu])
        usable = sim.costs.stage_estimate((sorted(count[gpu])[0],), 1, False, False, False, 1, 1).usable_GiB
        lines.append(
            f"    {gpu:10s} x{n}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in sorted(busy.items()))
            + f", idle {idle:.3f} s; peak {peak:.1f} of {usable:.1f} GiB"
        )
    return "\n".join(lines)


def simulated(args) -> list[dict]:
    from autotune.search.api import tune
    from autotune.simulator import Simulator

    rows = []
    for name, model_name, *gbs in (c for c in CASES if args.cases in "/".join(map(str, c))):
        cluster, model = cluster_of(name), load_model(model_name, global_batch_size=gbs[0] if gbs else None)
        for seed in args.seeds:
            row = {"cluster": name, "model": model.name, "global_batch_size": model.global_batch_size, "seed": seed}
            searches = (("without", NO_MIXED), ("with", None)) + ((("only", ONLY_MIXED),) if args.only_mixed else ())
            for label, restrict in searches:
                t0 = time.process_time()
                counter = MixedCounter(Simulator(cluster, model))
                if label == "only":
                    space_dims = {d.name for d in SearchSpace(cluster, model).dimensions}
                    restrict = {k: v for k, v in restrict.items() if k in space_dims}
                with tempfile.TemporaryDirectory() as tmp:  # a fresh Optuna study (./optuna.journal would resume)
                    res = tune(
                        cluster,
                        model,
                        method=args.method,
                        budget=args.budget,
                        seed=seed,
                        track=False,
                        restrict=restrict,
                        evaluator=counter,
                        storage=str(Path(tmp) / "optuna.journal"),
                    )
                if label == "only":
                    row["only"] = counter.best_mixed
                    row["only_plan"] = counter.best_mixed_config.describe() if counter.best_mixed_config else ""
                    row["only_breakdown"] = (
                        breakdown(counter.sim, counter.best_mixed_config) if counter.best_mixed_config else ""
                    )
                    row["only_cpu_s"] = round(time.process_time() - t0, 1)
                    continue
                if label == "with":
                    row["mixed_evaluated"] = counter.mixed
                    row["mixed_fit"] = counter.mixed_fit
                    row["best_mixed"] = counter.best_mixed
                    row["best_mixed_plan"] = counter.best_mixed_config.describe() if counter.best_mixed_config else ""
                    row["best_mixed_breakdown"] = (
                        breakdown(counter.sim, counter.best_mixed_config) if counter.best_mixed_config else ""
                    )
                else:
                    row["without_breakdown"] = (
                        breakdown(counter.sim, res.best_config) if res.best_measurement.ok else ""
                    )
                row[label] = res.best_measurement.tokens_per_s if res.best_measurement.ok else 0.0
                row[f"{label}_plan"] = res.best_config.describe()
                row[f"{label}_cpu_s"] = round(time.process_time() - t0, 1)
            row["gain"] = row["with"] / row["without"] - 1 if row["without"] > 0 else float("inf")
            rows.append(row)
            print(
                f"{name:18s} {model.name:10s} gbs {model.global_batch_size} seed {seed}: without {row['without']:>10,.0f}  with "
                f"{row['with']:>10,.0f} tokens/s ({row['gain']:+.1%}); {row['mixed_evaluated']} mixed-stage plans "
                f"evaluated ({row['mixed_fit']} fit), best {row['best_mixed']:,.0f}",
                flush=True,
            )
            print(
                f"    without: {row['without_plan']}\n{row['without_breakdown']}\n    with:    {row['with_plan']}\n"
                f"    best mixed: {row['best_mixed_plan']}\n{row['best_mixed_breakdown']}",
                flush=True,
            )
            if "only" in row:
                print(
                    f"  mixed-only search: best mixed-stage plan {row['only']:,.0f} tokens/s "
                    f"({row['only'] / row['without'] - 1 if row['without'] else 0:+.1%} vs without)\n"
                    f"    {row['only_plan']}\n{row['only_breakdown']}",
                    flush=True,
                )
    return rows


def grid(args) -> list[dict]:
    """Part 1b (``--grid``): the best plan with and without mixed stages over a fixed grid of decoded plans
    (every ``stage_ranks``, pp up to 8, zero 0-3, recompute none / all, mbs 1 / 2 / 4, both ``assign``, every
    TP degree per class, layer_split 0.5 / 1; other dimensions at the first start plan's), simulated."""
    import itertools

    from autotune.simulator import Simulator

    rows = []
    for name, model_name, *gbs in (c for c in CASES if args.cases in "/".join(map(str, c))):
        cluster, model = cluster_of(name), load_model(model_name, global_batch_size=gbs[0] if gbs else None)
        space, sim = SearchSpace(cluster, model), Simulator(cluster, model)
        base = space.heuristic_params()[0]
        tps = {c.name: space._dims[f"tp.{c.name}"].choices for c in space.node_classes}
        best: dict[str, tuple[float, object]] = {}
        t0, n = time.process_time(), 0
        for sr, pp, zero, rc, mbs, assign, tpc, ls in itertools.product(
            space._dims["stage_ranks"].choices,
            space._dims["pp"].choices[:8],
            (0, 1, 2, 3),
            ("none", "all"),
            (1, 2, 4),
            ("grouped", "mixed"),
            itertools.product(*tps.values()),
            (0.5, 1.0),
        ):
            d = space.decode(
                dict(
                    base,
                    stage_ranks=sr,
                    pp=pp,
                    zero=zero,
                    recompute=rc,
                    mbs=mbs,
                    assign=assign,
                    offload="none",
                    layer_split=ls,
                    **{f"tp.{k}": v for k, v in zip(tps, tpc)},
                )
            )
            if not d.ok:
                continue
            n += 1
            m = sim.evaluate(d.config)
            key = "mixed" if d.config.has_mixed_stages else "plain"
            if m.ok and m.tokens_per_s > best.get(key, (0.0, None))[0]:
                best[key] = (m.tokens_per_s, d.config)
        row = {
            "cluster": name,
            "model": model.name,
            "global_batch_size": model.global_batch_size,
            "plans": n,
            "cpu_s": round(time.process_time() - t0, 1),
        }
        for key in ("plain", "mixed"):
            tps_, cfg = best.get(key, (0.0, None))
            row[key], row[f"{key}_plan"] = tps_, cfg.describe() if cfg else ""
        rows.append(row)
        print(
            f"{name:18s} {model.name:10s} gbs {model.global_batch_size}: grid of {n} plans: plain "
            f"{row['plain']:,.0f}, mixed {row['mixed']:,.0f} tokens/s\n    plain: {row['plain_plan']}\n"
            f"    mixed: {row['mixed_plan']}",
            flush=True,
        )
        if best.get("mixed"):
            print(breakdown(sim, best["mixed"][1]), flush=True)
    return rows


CPU_CLUSTER = {
    "nodes": [{"name": "fast", "gpu": "cpu", "count": 2}, {"name": "slow", "gpu": "cpu", "count": 2, "slowdown": 3}],
    "network": {"bandwidth_GBps": 5, "latency_us": 20},
}


def measured(args) -> list[dict]:
    from autotune.search.api import tune
    from autotune.specs import ParallelConfig
    from runner.launch import profiled_run

    cluster, model = cluster_from_dict({"name": "cpu-fast2-slow2", **CPU_CLUSTER}, "cpu"), load_model(args.cpu_model)
    plans = {}
    # both searches over what the runner runs with mixed stages (runner.mixed.check_plan: zero <= 2, no offload)
    runnable = {"zero": [0, 1, 2], "offload": ["none"]}
    for label, restrict in (("without", {**NO_MIXED, **runnable}), ("with", runnable)):
        with tempfile.TemporaryDirectory() as tmp:  # a fresh Optuna study
            res = tune(
                cluster,
                model,
                method=args.method,
                budget=args.budget,
                seed=0,
                track=False,
                restrict=restrict,
                storage=str(Path(tmp) / "optuna.journal"),
            )
        plans[f"best {label} (sim {res.best_measurement.tokens_per_s:,.0f})"] = res.best_config
    gbs = model.global_batch_size
    # hand-written: 2 stages, each one fast + one slow rank with shares 3:1 (speed ratio 3)
    mixed = {
        "micro_batch_size": 1,
        "schedule": "1f1b",
        "pipelines": [
            {
                "num_microbatches": gbs,
                "stages": [
                    {
                        "layers": model.num_layers // 2,
                        "ranks": [
                            {"devices": ["fast:0"], "num_microbatches": gbs * 3 // 4},
                            {"devices": ["slow:0"], "num_microbatches": gbs // 4},
                        ],
                    },
                    {
                        "layers": model.num_layers // 2,
                        "ranks": [
                            {"devices": ["fast:1"], "num_microbatches": gbs * 3 // 4},
                            {"devices": ["slow:1"], "num_microbatches": gbs // 4},
                        ],
                    },
                ],
            }
        ],
    }
    plans["hand: 2 mixed stages, shares 3:1"] = ParallelConfig.from_dict(mixed)
    plans["hand: the same with zero 2"] = ParallelConfig.from_dict({**mixed, "zero": 2})
    rows = []
    for label, config in plans.items():
        m = profiled_run(cluster, model, config, steps=args.steps, warmup=1, timeout_s=600)
        rows.append(
            {
                "plan": label,
                "config": config.describe(),
                "tokens_per_s": m.tokens_per_s,
                "status": m.status,
                "error": m.error,
            }
        )
        print(
            f"{label:40s} measured {m.tokens_per_s:>8,.0f} tokens/s {m.status} {m.error}\n    {config.describe()}",
            flush=True,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=100)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--method", default="optuna")
    ap.add_argument("--runner", action="store_true", help="part 2: CPU cluster with slowdown, measured by the runner")
    ap.add_argument("--cpu-model", default="tiny")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--grid", action="store_true", help="part 1b: a fixed grid of plans instead of the searches")
    ap.add_argument(
        "--only-mixed",
        action="store_true",
        help="part 1: also search the plans with mixed stages only (stage_ranks > 1, no RoundPipe)",
    )
    ap.add_argument("--cases", default="", help="run only the cases whose 'cluster/model' contains this")
    ap.add_argument("--json")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works (tests/integration/experiments/test_experiments.py runs it)",
    )
    args = ap.parse_args()
    if args.quick:
        args.budget, args.cases = 8, args.cases or "a100x2+t4x4/llama2-7b"
    args.seeds = [int(s) for s in args.seeds.split(",")]
    rows = measured(args) if args.runner else grid(args) if args.grid else simulated(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
