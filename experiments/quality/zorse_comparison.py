"""autotune's planners against Zorse's plan on Zorse's own example (issue 25).

Zorse's README example: Llama 1B (22 layers, hidden 2048, sequence 512, fp16 autocast, global batch 128) on
one PCIe machine of 2 x L4, an RTX A6000 and a Tesla P40 (11.08 GB/s between them, as Zorse measured).
Everything is transcribed in ``experiments/data/zorse_example.json``: the cluster, the model, the plan
Zorse's planner wrote (one stage of four data-parallel ranks with micro-batch shares 18 / 1 / 28 / 17,
ZeRO-2, parameters in host memory, layer-wise execution) and the per-layer forward and backward times
Zorse measured on each GPU type at micro-batch sizes 1-4, which become autotune's calibration profile.

Every plan is scored by autotune's simulator with that profile; the search is restricted to the micro-batch
sizes Zorse measured, so no plan leaves the measured numbers. Columns: ``dp`` (``--method dp`` at
``--dp-budget`` evaluations), ``optuna`` (``--budget`` evaluations, the default ``--start dp``), Zorse's plan,
and ratio = best of dp and optuna / Zorse's plan. Zorse's own cost model's iteration time for its plan (the
``latency`` of its output) is printed beside autotune's prediction of it; Zorse's cost model is not run on
autotune's plans here.

    .venv/bin/python experiments/quality/zorse_comparison.py [--budget 200] [--dp-budget 20]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from autotune.loading import cluster_from_dict, model_from_dict
from autotune.profile import CalibrationProfile, DeviceProfile, LayerTiming
from autotune.search.api import tune
from autotune.simulator import Simulator
from autotune.specs import ParallelConfig, PipelineConfig, StageConfig
from autotune.specs.mixed_stage import RankConfig

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "experiments" / "data" / "zorse_example.json"


def cluster(data: dict):
    nodes = []
    for name, g in data["gpus"].items():
        for i in range(g["count"]):  # one node per GPU: one machine of mixed GPUs, joined by its PCIe link
            nodes.append({"name": f"{name}-{i}", "gpu": g.get("inline", g.get("catalog")), "count": 1})
    return cluster_from_dict(
        {"nodes": nodes, "network": data["link"]}, source="zorse_example", default_name="zorse-example"
    )


def model(data: dict):
    raw = {k: v for k, v in data["model"].items() if k != "note"}
    return model_from_dict(raw, "zorse_example")


def profile(data: dict, m, cl) -> CalibrationProfile:
    """Zorse's measured per-layer times as one device profile per GPU type (layers only: the embedding,
    the head and the optimizer keep the datasheet model)."""
    devices = []
    for name, times in data["layer_times_ms_by_micro_batch_size"].items():
        device = cl.node_of(f"{name}-0:0").device.name
        layers = tuple(
            LayerTiming(
                m.hidden_size,
                m.num_heads,
                m.num_kv_heads,
                m.ffn_hidden_size,
                m.mlp,
                m.seq_len,
                mbs,
                1,
                fwd / 1e3,
                bwd / 1e3,
                precision=m.precision,
            )
            for mbs, (fwd, bwd) in enumerate(zip(times["forward_ms"], times["backward_ms"]), start=1)
        )
        devices.append(DeviceProfile(device, (), layers=layers, source=data["source"]["layer_times"]))
    return CalibrationProfile(tuple(devices), cluster="zorse-example", notes="Zorse's model_latencies.json")


def zorse_plan(data: dict, m) -> ParallelConfig:
    plan = data["zorse_plan"]
    ranks = tuple(RankConfig((f"{gpu}-{i}:0",), share) for gpu, i, share in plan["ranks"])
    stage = StageConfig((), plan["layers"], False, plan["offload"], ranks=ranks)
    total = sum(share for *_, share in plan["ranks"])
    pipe = PipelineConfig(total, (stage,), execution=plan["execution"])
    return ParallelConfig(plan["micro_batch_size"], (pipe,), "1f1b", zero=plan["zero"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=int, default=200, help="optuna's evaluations")
    ap.add_argument("--dp-budget", type=int, default=20, help="dp's evaluations of its candidates")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works (tests/integration/experiments/test_experiments.py runs it)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.budget, args.dp_budget = 6, 3
    logging.basicConfig(level=logging.WARNING)
    data = json.loads(DATA.read_text())
    m = model(data)
    cl = cluster(data)
    sim = Simulator(cl, m, profile=profile(data, m, cl))
    restrict = {"mbs": [1, 2, 3, 4]}
    t0 = time.time()
    zorse = zorse_plan(data, m)
    zm = sim.evaluate(zorse)
    if not zm.ok:
        raise SystemExit(f"Zorse's plan does not run in autotune's simulator: {zm.status} {zm.error}")
    results = {}
    for method, budget in (("dp", args.dp_budget), ("optuna", args.budget)):
        r = tune(cl, m, method=method, budget=budget, track=False, storage="memory", evaluator=sim, restrict=restrict)
        results[method] = r
    best = max(results.values(), key=lambda r: r.best_measurement.score())
    zorse_tps = m.global_batch_size * m.seq_len / (data["zorse_plan"]["zorse_predicted_iteration_ms"] / 1e3)
    print(f"cluster: {cl.name} ({cl.num_devices} GPUs), model {m.name}, global batch {m.global_batch_size}")
    print(f"{'plan':<22s} {'tokens/s':>10s}  plan")
    for method, r in results.items():
        print(f"{method:<22s} {r.best_measurement.tokens_per_s:>10,.0f}  {r.best_config.describe()}")
    print(f"{'Zorse':<22s} {zm.tokens_per_s:>10,.0f}  {zorse.describe()}")
    print(
        f"Zorse's own cost model for its plan: {zorse_tps:,.0f} tokens/s "
        f"({data['zorse_plan']['zorse_predicted_iteration_ms']:.0f} ms); autotune's: {zm.iteration_time_s * 1e3:.0f} ms"
    )
    ratio = best.best_measurement.tokens_per_s / zm.tokens_per_s
    print(f"best / Zorse's plan in autotune's simulator: {ratio:.3f}  ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
