"""autotune's planners against Sailor's plans on Sailor's own heterogeneous setting (issue 16).

OPT-350M (fp32, as Sailor runs and profiles it) on GCP nodes of 4 A100-40GB and 4 V100-16GB in one
zone, global batch 1024, 16 to 512 GPUs. Every plan is scored by autotune's simulator with Sailor's
measured per-layer times as the compute numbers (a calibration profile built from
``experiments/data/sailor_a100_v100.json``, Sailor's ``profiles_tmp.json`` transcribed) and Sailor's
measured bandwidths (intra-node all-reduce and node-to-node asymptotes of its provider files). The
search is restricted to the micro-batch sizes Sailor profiled (1, 2, 4, 8), so no plan leaves the
measured numbers.

Columns: ``dp`` (the structured planner, ``--method dp`` at ``--dp-budget`` evaluations), ``optuna``
(TPE at ``--budget`` evaluations starting from dp's plan, the default ``--start dp``), their best, the
best plan of the heterogeneity-blind ``uniform`` grid (whole grid), and Sailor's plan where the data
file has it (translated as the file says: its replicas, its tp, its micro-batch size, the batch split
evenly over the replicas as in Sailor's data parallelism). ``ratio`` = best of dp and optuna / Sailor.

    .venv/bin/python experiments/quality/sailor_planner_comparison.py [--budget 200] [--sizes 16 320]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

from autotune.loading import cluster_from_dict, model_from_dict
from autotune.planning.budget import BudgetedEvaluator
from autotune.planning.space import SearchSpace, apportion
from autotune.profile import CalibrationProfile, DeviceProfile, EdgeTiming, LayerTiming
from autotune.search.api import tune
from autotune.simulator import Simulator
from autotune.specs import ParallelConfig, PipelineConfig, StageConfig

ROOT = Path(__file__).resolve().parents[2]

DATA = ROOT / "experiments" / "data" / "sailor_a100_v100.json"
GPN = 4  # GPUs per node (Sailor's basic_cluster_config.json)
MBS = (1, 2, 4, 8)  # micro-batch sizes in Sailor's profile
MODEL = {
    "name": "OPT-350",
    "num_layers": 24,
    "hidden_size": 1024,
    "num_heads": 16,
    "num_kv_heads": 16,
    "ffn_hidden_size": 4096,
    "mlp": "gelu",
    "vocab_size": 50272,
    "seq_len": 2048,
    "global_batch_size": 1024,
    "precision": "fp32",
    "attention": "standard",
    "dropout": 0.0,
}
NAMES = {"A100-40GB": "a100", "V100-16GB": "v100"}


def cluster(data: dict, a100: int, v100: int):
    nodes = []
    for gpu, n in (("A100-40GB", a100), ("V100-16GB", v100)):
        g = data["gpus"][gpu]
        if n:
            nodes.append(
                {
                    "name": NAMES[gpu],
                    "gpu": g.get("inline", g.get("catalog")),
                    "count": GPN,
                    "repeat": n // GPN,
                    "intra_node": {"bandwidth_GBps": g["intra_node_GBps"], "latency_us": 2},
                    "network": {"bandwidth_GBps": g["network_GBps"], "latency_us": 20},
                }
            )
    return cluster_from_dict(
        {"nodes": nodes, "network": {"bandwidth_GBps": 6.0, "latency_us": 20}},
        source="sailor_a100_v100",
        default_name=f"sailor-{a100}a100-{v100}v100",
    )


def profile(data: dict, model) -> CalibrationProfile:
    """Sailor's per-layer times as one device profile per GPU type (the format of
    ``experiments/fidelity/sailor_validation.py``: layers, edges, optimizer time per parameter)."""
    by_gpu: dict[str, list[dict]] = {}
    for e in data["sailor_layer_profiles"]["entries"]:
        by_gpu.setdefault(e["gpu"], []).append(e)
    devices = []
    for gpu, entries in by_gpu.items():
        layers = tuple(
            LayerTiming(
                model.hidden_size,
                model.num_heads,
                model.num_kv_heads,
                model.ffn_hidden_size,
                model.mlp,
                model.seq_len,
                e["micro_batch_size"],
                e["tp"],
                e["layer_forward_s"],
                e["layer_backward_s"],
                precision=model.precision,
                attention=model.attention,
            )
            for e in entries
        )
        edges = tuple(
            EdgeTiming(
                model.hidden_size,
                model.vocab_size,
                model.seq_len,
                e["micro_batch_size"],
                e["tp"],
                e["embedding_forward_s"],
                e["embedding_backward_s"],
                e["head_forward_s"],
                e["head_backward_s"],
            )
            for e in entries
        )
        per_param = statistics.mean(e["optimizer_step_s"] / (model.params_per_layer / e["tp"]) for e in entries)
        devices.append(
            DeviceProfile(
                gpu,
                (),
                layers=layers,
                edges=edges,
                optimizer_s_per_param=per_param,
                source=data["sailor_layer_profiles"]["source"],
            )
        )
    return CalibrationProfile(
        tuple(devices),
        cluster="sailor-a100-v100",
        notes="Sailor's profiles_tmp.json per-layer times (experiments/quality/sailor_planner_comparison.py)",
    )


def sailor_plan(plan: dict, cl, model) -> ParallelConfig:
    """Sailor's replicas (one stage each, as its data file lists them), the batch split evenly."""
    groups = []
    for rep in plan["replicas"]:
        nodes = [n for n in cl.nodes if n.device.name == rep["gpu"]]
        ids = [d for n in nodes for d in n.device_ids()]
        tp = rep["tp"]
        groups += [tuple(ids[i * tp : (i + 1) * tp]) for i in range(rep["count"])]
    mbs = plan["micro_batch_size"]
    shares = apportion(model.global_batch_size // mbs, [1.0] * len(groups))
    pipes = tuple(PipelineConfig(m, (StageConfig(g, model.num_layers, False),)) for g, m in zip(groups, shares))
    return ParallelConfig(mbs, pipes, "1f1b")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=int, default=200, help="optuna's evaluations")
    ap.add_argument("--dp-budget", type=int, default=20, help="dp's evaluations of its candidates")
    ap.add_argument("--sizes", type=int, nargs="*", help="total GPUs (default: every size of the data file)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works (tests/integration/experiments/test_experiments.py runs it)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.budget, args.dp_budget, args.sizes = 6, 3, [16]
    logging.basicConfig(level=logging.WARNING)
    data = json.loads(DATA.read_text())
    model = model_from_dict(MODEL, "sailor_planner_comparison")
    prof = profile(data, model)
    rows = []
    print(
        f"{'GPUs':>5s} {'A100+V100':>10s} | {'dp':>9s} {'optuna':>9s} {'best':>9s} {'uniform':>9s} {'Sailor':>9s} "
        f"{'ratio':>6s} | best plan (tokens/s; {args.budget} optuna evaluations)"
    )
    for size in data["sizes"]:
        a, v = size["a100"], size["v100"]
        if args.sizes and a + v not in args.sizes:
            continue
        t0 = time.time()
        cl = cluster(data, a, v)
        sim = Simulator(cl, model, profile=prof)
        restrict = {"mbs": list(MBS)}
        space = SearchSpace(cl, model, restrict=restrict)
        dp = tune(cl, model, method="dp", budget=args.dp_budget, track=False, evaluator=sim, restrict=restrict)
        opt = tune(
            cl,
            model,
            method="optuna",
            budget=args.budget,
            track=False,
            storage="memory",
            evaluator=sim,
            restrict=restrict,
            seed=0,
        )
        best = max((dp, opt), key=lambda r: r.best_measurement.score())
        ub = BudgetedEvaluator(sim, space, 10**6)
        uniform = max((ub.evaluate(p).score() for p in space.uniform_plans()), default=0.0)
        sailor = None
        plan = data["sailor_plans"].get(str(a + v))
        if plan is not None:
            m = sim.evaluate(sailor_plan(plan, cl, model))
            sailor = m.score()
        row = {
            "gpus": a + v,
            "a100": a,
            "v100": v,
            "dp": dp.best_measurement.score(),
            "optuna": opt.best_measurement.score(),
            "best": best.best_measurement.score(),
            "uniform": uniform,
            "sailor": sailor,
            "best_plan": best.best_config.describe(),
            "seconds": round(time.time() - t0, 1),
        }
        rows.append(row)
        fmt = lambda x: "-" if x is None else f"{x / 1000:8.1f}k"  # noqa: E731
        ratio = f"{row['best'] / sailor:6.3f}" if sailor else "     -"
        print(
            f"{a + v:5d} {f'{a}+{v}':>10s} | {fmt(row['dp'])} {fmt(row['optuna'])} {fmt(row['best'])} "
            f"{fmt(uniform)} {fmt(sailor)} {ratio} | {row['best_plan'][:90]}  ({row['seconds']:.0f} s)",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
