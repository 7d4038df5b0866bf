"""Memory-tight clusters: the best plan each method finds at a fixed budget (simulator backend).

Default: one server of 8 x RTX 4090 (24 GB, PCIe 4.0 only, 512 GiB host memory; ``examples/8x4090.yaml``)
with Llama-2-13B and a 32B model of Qwen2.5-32B's shape (64 layers, hidden 5120, 40 heads / 8 key-value
heads, SwiGLU 27648, vocabulary 152064; Qwen2.5 technical report / config.json), sequence 4096, global
batch 512. Without ZeRO or offload no plan of either fits there. ``--cluster`` / ``--model`` add other
scenarios (e.g. a T4 + L4 + A10G cloud mix with Llama-3-8B: ``--scenario cloud-mix``).

For each method: does its best plan fit, tokens/s, MFU, what it uses (tp, pp, dp, zero, offload,
micro-batch, recompute), and the evaluation (of the budget; plans the memory model screens out cost
none and are not counted) at which it first saw a plan that fits. Each Optuna run gets a fresh study.

    .venv/bin/python experiments/quality/bench_zero.py --budget 50 [--seed 0]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from autotune.loading import cluster_from_dict, load_cluster, load_model, model_from_dict
from autotune.planning.space import SearchSpace
from autotune.search.api import tune

METHODS = ("rl", "optuna", "random", "uniform", "exhaustive", "dp")
BOX = str(Path(__file__).resolve().parents[2] / "examples" / "8x4090.yaml")
QWEN_32B = dict(
    name="qwen-32b-like",
    num_layers=64,
    hidden_size=5120,
    num_heads=40,
    num_kv_heads=8,
    ffn_hidden_size=27648,
    mlp="swiglu",
    vocab_size=152064,
    seq_len=4096,
    global_batch_size=512,
)
CLOUD_MIX = dict(
    name="cloud-t4-l4-a10g",
    nodes=[
        dict(name="t4", gpu="T4", count=4, intra_node=dict(bandwidth_GBps=12, latency_us=10)),
        dict(name="l4", gpu="L4", count=4, intra_node=dict(bandwidth_GBps=25, latency_us=10)),
        dict(name="a10g", gpu="A10G", count=4, intra_node=dict(bandwidth_GBps=25, latency_us=10)),
    ],
    network=dict(bandwidth_GBps=3.1, latency_us=50),
)
SCENARIOS = {
    "8x4090-13b": (BOX, "llama2-13b"),
    "8x4090-32b": (BOX, "qwen-32b"),
    "cloud-mix": ("cloud-mix", "llama3-8b"),
}


def _cluster(name: str):
    return cluster_from_dict(CLOUD_MIX, "bench_zero:cloud-mix") if name == "cloud-mix" else load_cluster(name)


def _model(name: str):
    return model_from_dict(QWEN_32B, "bench_zero:qwen-32b") if name == "qwen-32b" else load_model(name)


def uses(space: SearchSpace, config) -> str:
    p = space.params_of(config)
    if "zero" not in p:  # a RoundPipe plan (issue 11): its own parameters
        return " ".join(f"{k}={v}" for k, v in p.items() if k not in ("devices_used", "devices_idle"))[:90]
    rc = "R" if p["recompute_stages"] else "-"
    return (
        f"tp{p['tp']} pp{p['pp']} dp{p['dp']} zero{p['zero']} off={p['offload']} mbs{p['mbs']} {p['schedule']} rc{rc}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scenario", action="append", choices=list(SCENARIOS), help="default: 8x4090-13b and 8x4090-32b")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works (tests/integration/experiments/test_experiments.py runs it)",
    )
    args = ap.parse_args()
    if args.quick:
        args.budget, args.scenario, args.methods = 4, ["8x4090-13b"], "dp,random"
    logging.basicConfig(level=logging.WARNING)
    for name in args.scenario or ["8x4090-13b", "8x4090-32b"]:
        cluster, model = _cluster(SCENARIOS[name][0]), _model(SCENARIOS[name][1])
        space = SearchSpace(cluster, model)
        print(
            f"\n{name}: {model.name} ({model.num_params / 1e9:.1f}B) on {cluster.name} "
            f"({cluster.num_devices} GPUs), budget {args.budget}, seed {args.seed}"
        )
        print(f"{'method':10s} {'fits':4s} {'tokens/s':>9s} {'MFU':>6s} {'first fit':>9s} {'wall s':>6s}  plan")
        for method in args.methods.split(","):
            t0 = time.monotonic()
            first_fit = {"at": None, "n": 0}

            def seen(ev, first_fit=first_fit):
                if ev.measurement.status == "pruned":  # screened out by the memory model: no budget spent
                    return
                first_fit["n"] += 1
                if first_fit["at"] is None and ev.measurement.ok:
                    first_fit["at"] = first_fit["n"]

            try:
                with tempfile.TemporaryDirectory() as tmp:  # a fresh Optuna study: never resume an old one
                    result = tune(
                        cluster,
                        model,
                        method=method,
                        budget=args.budget,
                        seed=args.seed,
                        track=False,
                        on_evaluation=seen,
                        storage=str(Path(tmp) / "optuna.journal"),
                    )
            except Exception as e:  # a method that refuses (e.g. exhaustive over a huge space) is reported
                print(
                    f"{method:10s} {'-':4s} {'-':>9s} {'-':>6s} {'-':>9s} {time.monotonic() - t0:6.1f}  "
                    f"{type(e).__name__}: {str(e)[:90]}"
                )
                continue
            m = result.best_measurement
            ok = m is not None and m.ok
            plan = uses(space, result.best_config) if ok else (m.error[:90] if m is not None else "nothing evaluated")
            print(
                f"{method:10s} {'yes' if ok else 'NO':4s} {m.tokens_per_s if ok else 0:9,.0f} "
                f"{m.mfu if ok else 0:6.1%} {str(first_fit['at'] or '-'):>9s} {time.monotonic() - t0:6.1f}  {plan}",
                flush=True,
            )


if __name__ == "__main__":
    main()
