"""The simulator against RoundPipe's published 8 x RTX-4090 numbers (PyPI ``roundpipe`` 0.1.1 README).

Published (tokens/s, "4090 · RoundPipe"): training throughput on 8 GPUs and the multi-GPU scaling table
(1, 2, 4, 8 GPUs) for Qwen3-1.7B, Llama3.1-8B and Qwen3-32B. The README does not give the sequence length
or batch of these runs, so we simulate each at several sequence lengths (``--seq-lens``, tokens per
sequence) with ``--global-batch`` sequences, and say which fits. MFU columns: model FLOPs per token
(``runner.model.flops_per_token``: 6 N plus attention, recomputation not counted) times tokens/s over the
GPUs' datasheet 16-bit tensor peak with fp32 accumulation (RTX-4090: 165.2 TFLOPS). The published runs trained in fp16
with fp16 accumulation (RoundPipe's ``benchmark/train.py`` sets ``torch.backends.cuda.matmul.allow_fp16_accumulation =
True``), whose tensor rate on GeForce Ada is twice that (330.4 TFLOPS dense, Ada whitepaper), so the card is
simulated at that rate, as the source ran it; ``--fp32-accumulate`` simulates the catalog card instead (the rate
of bf16 or fp16 training with fp32 accumulation, what the 72% error of earlier tables came from). Simulated plan: the one RoundPipe itself
picks (``SearchSpace.roundpipe_start``: its automatic partition, 60% memory limit, stage grain, the
largest micro-batch that leaves GPUs + 1 micro-batches, or the largest that fits) on a node of k
RTX-4090s shaped like ``examples/8x4090.yaml`` but with 1 TiB of host memory (``HOST_GiB``). Model shapes: ``experiments/quality/roundpipe_bench.py``. Nothing fitted, no profile.

    .venv/bin/python experiments/fidelity/roundpipe_published.py [--seq-lens 2048,4096,8192] [--global-batch 64]
        [--fp32-accumulate]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from autotune.loading import cluster_from_dict, load_model
from autotune.planning.space import SearchSpace
from autotune.simulator import Simulator

#: PyPI roundpipe 0.1.1 README, "Multi-GPU Scaling (8× RTX 4090)", tokens/s by GPU count
SCALING = {
    "qwen3-1.7b": {1: 8_881, 2: 17_026, 4: 33_178, 8: 65_417},
    "llama3-8b": {1: 3_142, 2: 6_259, 4: 12_278, 8: 24_275},
    "qwen3-32b": {1: 740, 2: 1_476, 4: 2_897, 8: 5_516},
}


#: host memory of the simulated server: RoundPipe keeps ~20 bytes per parameter in DRAM (16-bit weights and
#: gradients, fp32 master copy, gradient and Adam moments), 610 GB for our 30.5B Qwen3-32B, so the published
#: 32B runs had more than examples/8x4090.yaml's 512 GiB; the README does not say how much
HOST_GiB = 1024


def gpu(fp16_accumulate: bool):
    """The catalog RTX-4090, or the same card at its fp16-accumulate tensor rate (2 x the fp32-accumulate
    165.2 TFLOPS, Ada whitepaper): RoundPipe's benchmark script trains in fp16 with
    ``torch.backends.cuda.matmul.allow_fp16_accumulation = True`` (ITcarrot/RoundPipe benchmark/train.py)."""
    if not fp16_accumulate:
        return "RTX-4090"
    from autotune.catalog import GPU_CATALOG

    d = GPU_CATALOG["RTX-4090"]
    return {
        "name": "RTX-4090-fp16acc",
        "peak_tflops": 2 * d.peak_tflops,
        "memory_GiB": d.memory_GiB,
        "memory_bandwidth_GBps": d.memory_bandwidth_GBps,
        "peak_tflops_tf32": d.peak_tflops_tf32,
        "peak_tflops_fp32": d.peak_tflops_fp32,
        "pcie_gen": d.pcie_gen,
        "pcie_lanes": d.pcie_lanes,
        "source": "RTX-4090 catalog entry at 2x its tensor peak (fp16 accumulation)",
    }


#: the published runs' setting (module docstring)
FP16_ACC = True


def node(count: int):
    return cluster_from_dict(
        {
            "name": f"{count}x4090",
            "nodes": [
                {
                    "name": "box",
                    "gpu": gpu(FP16_ACC),
                    "count": count,
                    "intra_node": {"bandwidth_GBps": 25, "latency_us": 10},
                    "host": {"memory_GiB": HOST_GiB, "link": {"bandwidth_GBps": 25, "latency_us": 10}},
                }
            ],
            "network": {"bandwidth_GBps": 12.5, "latency_us": 10},
        },
        f"{count}x4090",
    )


def roundpipe_default(cluster, model):
    """RoundPipe's own plan (``start_params``), at the largest micro-batch size that fits when RoundPipe's
    default (GPUs + 1 micro-batches) does not: the published runs fit, so their batch must have."""
    space = SearchSpace(cluster, model)
    params = space.roundpipe_start()
    if params is None:
        return None, None
    sim = Simulator(cluster, model)
    config = m = None
    for mbs in sorted((x for x in space._dims["mbs"].choices if x <= params["mbs"]), reverse=True):
        decoded = space.decode({**params, "mbs": mbs}).config
        if decoded is None:
            continue
        config, m = decoded, sim.evaluate(decoded)
        if m.ok:
            break
    return config, m


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="2048,4096,8192")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument(
        "--fp32-accumulate",
        action="store_true",
        help="simulate the catalog RTX-4090 (fp32 accumulation) instead of the published runs' fp16 accumulation",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works (tests/integration/experiments/test_experiments.py runs it)",
    )
    args = parser.parse_args()
    if args.quick:
        args.seq_lens = "2048"
    global FP16_ACC
    FP16_ACC = not args.fp32_accumulate
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    from autotune.catalog import GPU_CATALOG
    from runner.model import flops_per_token

    peak = GPU_CATALOG["RTX-4090"].matmul_peak_tflops("bf16") * 1e12  # MFU at the datasheet rate
    print(
        "| model | seq | GPUs | published tokens/s | published MFU | simulated | simulated MFU | sim / published | plan |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    errors: dict[int, list[float]] = {s: [] for s in seq_lens}
    time_errors: list[float] = []  # simulated / measured iteration time - 1, as error_bars.py counts it
    for name, published in SCALING.items():
        for seq in seq_lens:
            model = replace(load_model(name), seq_len=seq, global_batch_size=args.global_batch)
            sims = {}
            for k, pub in published.items():
                config, m = roundpipe_default(node(k), model)
                tps = m.tokens_per_s if m is not None and m.ok else 0.0
                sims[k] = tps
                if tps > 0:
                    errors[seq].append(abs(tps / pub - 1))
                    time_errors.append(abs(pub / tps - 1))
                plan = "none fits" if config is None else (config.describe() if m.ok else f"{m.status}: {m.error}")
                mfu = lambda t: f"{t * flops_per_token(model) / (k * peak):.0%}"  # 6N + attention, no recompute
                print(
                    f"| {name} | {seq} | {k} | {pub:,} | {mfu(pub)} | {tps:,.0f} | {mfu(tps)} | {tps / pub:.2f} "
                    f"| {plan[:90]} |"
                )
            if sims.get(1):
                print(
                    f"| {name} | {seq} | 8 vs 1 | {published[8] / published[1]:.2f}x | | {sims[8] / sims[1]:.2f}x | | "
                    f"| |"
                )
    for seq, errs in errors.items():
        if errs:
            print(f"seq {seq}: mean |sim / published - 1| = {sum(errs) / len(errs):.1%} over {len(errs)} points")
    if time_errors:
        rate = "fp16 accumulation (the published runs')" if FP16_ACC else "fp32 accumulation (the catalog's)"
        print(
            f"all: mean |time error| = {sum(time_errors) / len(time_errors):.1%} over {len(time_errors)} points "
            f"at the tensor rate of {rate}"
        )


if __name__ == "__main__":
    main()
