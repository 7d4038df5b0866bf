"""RoundPipe on 8 x RTX-4090 (examples/8x4090.yaml), simulated: best roundpipe plan vs best other plan, 1.7B-32B.

For each model and each search method, two searches at ``--budget`` evaluations (simulator backend, no
tracking): one restricted to roundpipe plans (``restrict={"roundpipe": [True]}``), one to every other plan
(``[False]``: data / pipeline / tensor parallel, recomputation, and ZeRO / offload where the space has
them). Beside them, hand-made 1F1B + CPU-offload plans of the ZeRO / offload issue (8 stages of equal
layers, one GPU each, every micro-batch size, ``offload`` optimizer and all, recompute on), the best of
which is the "1F1B+offload" column, and RoundPipe's published 8 x RTX-4090 throughput where it names the
model (PyPI ``roundpipe`` 0.1.1 README, "Training Throughput (tokens/s)": Qwen3-1.7B 65,417, Llama3.1-8B
24,275, Qwen3-32B 5,516; sequence length and batch of that table are not published there).

Models: Qwen3-1.7B and Qwen3-32B from their released config.json (hidden, layers, heads, kv heads, FFN,
vocabulary; our decoder's head_dim is hidden / heads, so Qwen3-32B's 8192-wide query projection becomes
5120: 30.5B parameters instead of 32.8B), Llama-3.1-8B (the llama3-8b preset's shape) and Llama-2-13B (the
preset). All at sequence length ``--seq-len`` (4096) and global batch ``--global-batch`` (64 sequences),
bf16.

    .venv/bin/python experiments/quality/roundpipe_bench.py [--budget 50] [--methods optuna,random,rl] [--models ...]
        [--host-gib 1024]
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import replace
from pathlib import Path

from autotune.loading import load_cluster, load_model
from autotune.search.api import tune
from autotune.simulator import Simulator
from autotune.specs import ParallelConfig

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "examples" / "8x4090.yaml"

#: the models of RoundPipe's published runs (presets; Llama-3.1-8B has the llama3-8b preset's shape)
MODELS = ("qwen3-1.7b", "llama3-8b", "llama2-13b", "qwen3-32b")
#: PyPI roundpipe 0.1.1 README, "Training Throughput (tokens/s)", row "4090 · RoundPipe" (8 GPUs)
PUBLISHED = {"qwen3-1.7b": 65_417, "llama3-8b": 24_275, "qwen3-32b": 5_516}  # llama3-8b: Llama3.1-8B


def model_spec(name: str, seq_len: int, gbs: int):
    """The preset ``name`` at ``seq_len`` tokens and a global batch of ``gbs`` sequences."""
    return replace(load_model(name), seq_len=seq_len, global_batch_size=gbs)


def offload_baselines(cluster, model) -> tuple[float, str]:
    """Best hand-made 1F1B + offload plan: 8 stages of equal layers (the first ones one more), one GPU each."""
    sim = Simulator(cluster, model)
    n, L = 8, model.num_layers
    layers = [L // n + (1 if s < L % n else 0) for s in range(n)]
    best, text = 0.0, "none fits"
    for mbs in (1, 2, 4, 8):
        if model.global_batch_size % mbs:
            continue
        for offload in ("optimizer", "all"):
            cfg = ParallelConfig.from_dict(
                {
                    "micro_batch_size": mbs,
                    "schedule": "1f1b",
                    "pipelines": [
                        {
                            "num_microbatches": model.global_batch_size // mbs,
                            "stages": [
                                {"devices": [f"box:{s}"], "layers": layers[s], "recompute": True, "offload": offload}
                                for s in range(n)
                            ],
                        }
                    ],
                }
            )
            m = sim.evaluate(cfg)
            if m.ok and m.tokens_per_s > best:
                best, text = m.tokens_per_s, f"mbs={mbs} offload={offload}"
    return best, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=50)
    parser.add_argument("--methods", default="optuna,random,rl")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--host-gib", type=float, default=0.0, help="host memory of the node instead of examples/8x4090.yaml's 512 GiB"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works (tests/integration/experiments/test_experiments.py runs it)",
    )
    args = parser.parse_args()
    if args.quick:
        args.budget, args.methods, args.models = 4, "random", "qwen3-1.7b"
    logging.basicConfig(level=logging.WARNING)
    cluster = load_cluster(CLUSTER)
    if args.host_gib > 0:
        import dataclasses

        node = cluster.nodes[0]
        cluster = dataclasses.replace(
            cluster, nodes=(dataclasses.replace(node, host=dataclasses.replace(node.host, memory_GiB=args.host_gib)),)
        )
    methods = [m for m in args.methods.split(",") if m]
    rows = []
    for name in args.models.split(","):
        model = model_spec(name, args.seq_len, args.global_batch)
        t0 = time.perf_counter()
        found: dict[tuple[str, bool], tuple[float, str]] = {}
        for method in methods:
            for rp in (True, False):
                try:
                    res = tune(
                        cluster,
                        model,
                        method,
                        budget=args.budget,
                        seed=args.seed,
                        track=False,
                        storage="memory",
                        restrict={"roundpipe": [rp]},
                    )
                    m = res.best_measurement
                    found[(method, rp)] = (m.tokens_per_s if m.ok else 0.0, res.best_config.describe())
                except Exception as e:  # a method that finds nothing valid still leaves the others' rows
                    found[(method, rp)] = (0.0, f"{type(e).__name__}: {e}")
        hand, hand_text = offload_baselines(cluster, model)
        wall = time.perf_counter() - t0
        best_rp = max((found[(me, True)][0], me) for me in methods)
        best_other = max((found[(me, False)][0], me) for me in methods)
        rows.append((name, model, found, best_rp, best_other, hand, hand_text, wall))
        print(
            f"\n== {name}: {model.num_params / 1e9:.2f}B parameters, {args.global_batch} x {args.seq_len} tokens "
            f"({wall:.0f} s)"
        )
        for method in methods:
            for rp in (True, False):
                tps, text = found[(method, rp)]
                print(f"  {method:8s} {'roundpipe' if rp else 'other    '} {tps:10,.0f} tokens/s  {text}")
        print(f"  1F1B+offload (hand) {hand:10,.0f} tokens/s  {hand_text}")
    print(
        "\n| model | params | best roundpipe (method) | best other (method) | 1F1B+offload | roundpipe / other "
        "| roundpipe / 1F1B+offload | published RoundPipe | sim / published |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, model, _found, (rp, rp_m), (other, other_m), hand, _, _ in rows:
        pub = PUBLISHED.get(name)
        ratio = lambda a, b: f"{a / b:.2f}x" if b > 0 else "-"
        print(
            f"| {name} | {model.num_params / 1e9:.1f}B | {rp:,.0f} ({rp_m}) | {other:,.0f} ({other_m}) | {hand:,.0f} "
            f"| {ratio(rp, other)} | {ratio(rp, hand)} | {f'{pub:,}' if pub else '-'} "
            f"| {f'{rp / pub:.2f}' if pub else '-'} |"
        )


if __name__ == "__main__":
    main()
