"""Zorse's layer-wise execution (``execution: "layerwise"``): where it pays, and that the runner trains with it.

Part 1 (simulated): on each cluster the same search (``--method``, ``--budget``, simulator backend) over the
space without layer-wise execution (``execution: [microbatch]``) and over the whole space; the best tokens/s
of each and how the best plan executes. Then the micro-batch search's best sharded or offloaded plan
(ZeRO-2/3 or offload, where layer-wise execution can differ) simulated again with every pipeline
layer-wise: its time and peak device memory against the same plan run micro-batch by micro-batch.

Part 2 (``--runner``, measured on this machine's CPU ranks): ``examples/layerwise-plan.json`` (a mixed
stage 5/3 then one rank, ZeRO-2, optimizer state and activations in host memory) and the same plan run
micro-batch by micro-batch, each trained 6 steps by the runner (gloo): the largest relative difference of
the loss from single-process training, and the mean tokens/s after the first step.

    nice -n 5 .venv/bin/python experiments/quality/layerwise.py --budget 50 [--runner] [--quick]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from mixed_stages import CLUSTERS as MIXED_CLUSTERS

from autotune.loading import cluster_from_dict, load_cluster, load_model

QUIET = True
REPO = Path(__file__).resolve().parents[2]
CLUSTERS = {
    # Zorse's setting (its paper's section 6): three 4-GPU machines over 1 GB/s; A100-40GB-like, V100 and T4
    "3x4-over-1GBps": {
        "nodes": [
            {"name": "a100", "gpu": "A100-40GB", "count": 4, "intra_node": {"bandwidth_GBps": 300, "latency_us": 2}},
            {"name": "v100", "gpu": "V100-32GB", "count": 4, "intra_node": {"bandwidth_GBps": 16, "latency_us": 5}},
            {"name": "t4", "gpu": "T4", "count": 4, "intra_node": {"bandwidth_GBps": 16, "latency_us": 5}},
        ],
        "network": {"bandwidth_GBps": 1.0, "latency_us": 50},
    },
    "a100x2+t4x4": MIXED_CLUSTERS["a100x2+t4x4"],  # mixed_stages.py's: 2 A100-80GB + 4 T4, 100 Gbit/s
    "mixed-a100-v100": None,  # preset: 4 A100-80GB + 4 V100-32GB
    "mixed-consumer-16": None,  # preset: 8 A100-80GB + 2 x 4 RTX-4090, 10 Gbit/s
}
#: (cluster, model, global batch in sequences: the preset's 512 or a fine-tuning size of 32)
CASES = [
    ("3x4-over-1GBps", "llama2-7b", 512),
    ("3x4-over-1GBps", "llama2-7b", 32),
    ("3x4-over-1GBps", "gpt2-xl", 32),
    ("a100x2+t4x4", "llama2-7b", 32),
    ("mixed-a100-v100", "llama2-13b", 512),
    ("mixed-consumer-16", "llama2-7b", 32),
]
QUICK_CASES = [("a100x2+t4x4", "gpt2-xl", 32)]


def cluster_of(name: str):
    raw = CLUSTERS[name]
    return load_cluster(name) if raw is None else cluster_from_dict({"name": name, **raw}, name)


def layerwise_of(config):
    from dataclasses import replace

    return replace(config, pipelines=tuple(replace(p, execution="layerwise") for p in config.pipelines))


def offloaded(config):
    """``config`` with every stage's optimizer state (and, layer-wise, its activations) in host memory."""
    from dataclasses import replace

    return replace(
        config,
        pipelines=tuple(
            replace(p, stages=tuple(replace(st, offload="optimizer") for st in p.stages)) for p in config.pipelines
        ),
    )


def shardable(config) -> bool:
    """ZeRO-2/3 among peers or offload: where layer-wise execution can differ from micro-batch execution."""
    peers = len(config.pipelines) > 1 or config.has_mixed_stages
    return (config.zero >= 2 and peers) or config.offloads


class Recorder:
    """The simulator, keeping every plan it evaluates with its measurement."""

    def __init__(self, sim) -> None:
        self.sim, self.plans = sim, []

    def __getattr__(self, name):  # everything else (check, memory_estimate, ...) is the simulator's
        return getattr(self.sim, name)

    def evaluate(self, config):
        m = self.sim.evaluate(config)
        self.plans.append((config, m))
        return m


def search_part(cases, method: str, budget: int, seed: int) -> list[dict]:
    from autotune.search.api import tune
    from autotune.simulator import Simulator

    rows = []
    for cluster_name, model_name, batch in cases:
        cluster, model = cluster_of(cluster_name), load_model(model_name, global_batch_size=batch)
        sim = Simulator(cluster, model)
        t0 = time.perf_counter()
        best = {}
        plans = {}
        for label, restrict in (("microbatch", {"execution": ["microbatch"]}), ("all", None)):
            recorder = Recorder(Simulator(cluster, model))
            with tempfile.TemporaryDirectory() as tmp:  # a fresh Optuna study (./optuna.journal would resume)
                best[label] = tune(
                    cluster,
                    model,
                    method=method,
                    budget=budget,
                    seed=seed,
                    track=False,
                    restrict=restrict,
                    evaluator=recorder,
                    storage=str(Path(tmp) / "optuna.journal"),
                )
            plans[label] = recorder.plans
        # the micro-batch search's best plan where layer-wise execution can differ, run layer-wise
        candidates = sorted(
            ((m.tokens_per_s, c) for c, m in plans["microbatch"] if m.ok and shardable(c)), key=lambda t: t[0]
        )
        flipped = None
        if candidates:
            tps, config = candidates[-1]
            micro, layer = sim.evaluate(config), sim.evaluate(layerwise_of(config))
            # Zorse keeps the activations in host memory: the plan layer-wise with its optimizer state offloaded
            host = layerwise_of(offloaded(config)) if not config.offloads else None
            hosted = sim.evaluate(host) if host is not None else None
            flipped = {
                "plan": config.describe(),
                "microbatch_tokens_per_s": micro.tokens_per_s,
                "layerwise_tokens_per_s": layer.tokens_per_s if layer.ok else 0.0,
                "layerwise_status": layer.status,
                "microbatch_peak_GiB": max(micro.peak_memory_GiB.values()),
                "layerwise_peak_GiB": max(layer.peak_memory_GiB.values()) if layer.peak_memory_GiB else 0.0,
                "offloaded_layerwise_tokens_per_s": hosted.tokens_per_s if hosted is not None and hosted.ok else None,
                "offloaded_layerwise_peak_GiB": max(hosted.peak_memory_GiB.values())
                if hosted is not None and hosted.peak_memory_GiB
                else None,
            }
        whole = best["all"].best_config
        rows.append(
            {
                "cluster": cluster_name,
                "model": model_name,
                "global_batch_size": batch,
                "without_layerwise": best["microbatch"].best_measurement.tokens_per_s,
                "with_layerwise": best["all"].best_measurement.tokens_per_s,
                "best_is_layerwise": any(p.execution == "layerwise" for p in whole.pipelines),
                "layerwise_evaluated": sum(
                    any(p.execution == "layerwise" for p in c.pipelines) for c, m in plans["all"]
                ),
                "same_plan": flipped,
                "seconds": time.perf_counter() - t0,
            }
        )
        r = rows[-1]
        print(
            f"{cluster_name:18s} {model_name:10s} gbs {batch:3d}: without {r['without_layerwise']:>9,.0f}  with "
            f"{r['with_layerwise']:>9,.0f} tokens/s ({r['with_layerwise'] / r['without_layerwise'] - 1:+.1%}); "
            f"best layer-wise: {'yes' if r['best_is_layerwise'] else 'no'}; "
            f"{r['layerwise_evaluated']} layer-wise plans evaluated ({r['seconds']:.0f} s)",
            flush=True,
        )
        if flipped:
            ratio = flipped["layerwise_tokens_per_s"] / flipped["microbatch_tokens_per_s"]
            print(
                f"    same plan layer-wise: {flipped['microbatch_tokens_per_s']:,.0f} -> "
                f"{flipped['layerwise_tokens_per_s']:,.0f} tokens/s ({ratio:.2f}x, {flipped['layerwise_status']}); "
                f"peak {flipped['microbatch_peak_GiB']:.1f} -> {flipped['layerwise_peak_GiB']:.1f} GiB; "
                f"{flipped['plan']}",
                flush=True,
            )
            if flipped["offloaded_layerwise_peak_GiB"] is not None:
                t = flipped["offloaded_layerwise_tokens_per_s"]
                print(
                    f"    with optimizer and activations in host memory: "
                    f"{t / flipped['microbatch_tokens_per_s'] if t else 0:.2f}x"
                    f"{'' if t else ' (oom)'}, peak {flipped['offloaded_layerwise_peak_GiB']:.1f} GiB",
                    flush=True,
                )
    return rows


def runner_part(steps: int = 6) -> list[dict]:
    from runner.reference import reference_losses
    from runner.train import train

    cluster = str(REPO / "examples" / "cpu-fast-slow.yaml")
    plan = json.loads((REPO / "examples" / "layerwise-plan.json").read_text())
    micro = json.loads(json.dumps(plan))
    for pipe in micro["pipelines"]:
        pipe["execution"] = "microbatch"
    reference = reference_losses("tiny", steps)
    rows = []
    for label, config in (("layerwise", plan), ("microbatch", micro)):
        with tempfile.TemporaryDirectory() as tmp:
            metrics = Path(tmp) / "m.jsonl"
            out = train(cluster, "tiny", config, steps=steps, metrics_out=metrics, quiet=QUIET, timeout_s=600)
            if out.returncode != 0:
                raise SystemExit(f"{label}: the runner failed: {out.error}")
            records = [json.loads(line) for line in metrics.read_text().splitlines()]
        losses = [r["loss"] for r in records]
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        tps = sum(r["tokens_per_s"] for r in records[1:]) / max(1, len(records) - 1)
        rows.append({"execution": label, "max_rel_loss_diff": diff, "tokens_per_s": tps})
        print(f"runner {label:10s}: loss vs single process max rel. diff {diff:.1e}; {tps:,.0f} tokens/s", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="optuna")
    ap.add_argument("--budget", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runner", action="store_true", help="also part 2: the runner on this machine's CPU ranks")
    ap.add_argument("--quick", action="store_true", help="one small case at budget 6 (the tests' smoke run)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    cases, budget = (QUICK_CASES, 6) if args.quick else (CASES, args.budget)
    out = {"search": search_part(cases, args.method, budget, args.seed)}
    if args.runner:
        out["runner"] = runner_part()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
