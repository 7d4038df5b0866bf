"""FSDP as torchtitan runs it: simulated vs torchtitan's published throughput, memory and out-of-memory runs.

Nothing here was fitted. Sources (pytorch/torchtitan, docs/performance.md and
benchmarks/llama3_h100_202412_torchtitan.md):

- 64 A100-80GB, FSDP2 (ZeRO-3 over all 64 ranks), bf16, one micro-batch per step: Llama 3 8B (seq 8192,
  local batch 1) with selective layer (every-2) and selective op checkpointing, Llama 3 70B full; Llama 2
  13B (seq 4096, local batch 2) without, with selective layer and selective op checkpointing, Llama 2 70B
  local batch 1 selective op and local batch 2 full. "70B with local batch size 2 will cause an OOM error
  when selective activation checkpointing is used": that plan must come out out of memory, and the
  others must fit. The A100 cluster's network is not stated: 8 x 200 Gbit/s per node assumed.
- 8 and 128 H100 (96 GB HBM2e, 500 W power limit), FSDP2, Llama 3.1 8B, seq 8192, local batch 2,
  selective (op) checkpointing, eager: 5,762 / 5,605 tokens/s per GPU and 82.4 / 67.0 GiB, torchtitan's
  memory reading (``torch.cuda.max_memory_reserved``: the allocator's pool, without the CUDA context).
  Nodes of 8 with NVLink, 400 Gbit/s per GPU between nodes.

Time error = simulated / published iteration time - 1; memory error against the simulator's allocator
view times its pool (``peak - context``). The issue's test: no plan that runs in production with a
memory reading may be predicted out of memory on a device with 10% headroom over that reading.
"""

from __future__ import annotations

import argparse
import statistics

from autotune.catalog import GPU_CATALOG
from autotune.loading import cluster_from_dict, model_from_dict
from autotune.simulator import Simulator
from autotune.simulator.device_memory import device_memory
from autotune.specs import ParallelConfig

LLAMA3_8B = dict(
    num_layers=32,
    hidden_size=4096,
    num_heads=32,
    num_kv_heads=8,
    ffn_hidden_size=14336,
    vocab_size=128256,
    seq_len=8192,
)
LLAMA3_70B = dict(
    num_layers=80,
    hidden_size=8192,
    num_heads=64,
    num_kv_heads=8,
    ffn_hidden_size=28672,
    vocab_size=128256,
    seq_len=8192,
)
LLAMA2_13B = dict(
    num_layers=40,
    hidden_size=5120,
    num_heads=40,
    num_kv_heads=40,
    ffn_hidden_size=13824,
    vocab_size=32000,
    seq_len=4096,
)
LLAMA2_70B = dict(
    num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, ffn_hidden_size=28672, vocab_size=32000, seq_len=4096
)

# (name, model, GPUs, local batch, recompute, published tokens/s per GPU or None (OOM), published GiB or None)
A100_RUNS = [
    ("llama3-8b every-2", LLAMA3_8B, 64, 1, "every-2", 2904, None),
    ("llama3-8b selective-op", LLAMA3_8B, 64, 1, "selective-op", 2973, None),
    ("llama3-70b full", LLAMA3_70B, 64, 1, True, 331, None),
    ("llama2-13b none", LLAMA2_13B, 64, 2, False, 2162, None),
    ("llama2-13b every-2", LLAMA2_13B, 64, 2, "every-2", 1914, None),
    ("llama2-13b selective-op", LLAMA2_13B, 64, 2, "selective-op", 1904, None),
    ("llama2-70b b1 selective-op", LLAMA2_70B, 64, 1, "selective-op", 355, None),
    ("llama2-70b b2 full", LLAMA2_70B, 64, 2, True, 353, None),
    ("llama2-70b b2 selective-op", LLAMA2_70B, 64, 2, "selective-op", None, None),  # published: OOM
]
H100_RUNS = [
    ("llama3.1-8b 8 GPUs", LLAMA3_8B, 8, 2, "selective-op", 5762, 82.4),
    ("llama3.1-8b 128 GPUs", LLAMA3_8B, 128, 2, "selective-op", 5605, 67.0),
]
H100_96GB = {
    **{
        k: getattr(GPU_CATALOG["H100-80GB"], k)
        for k in ("peak_tflops", "peak_tflops_tf32", "peak_tflops_fp32", "pcie_gen")
    },
    "name": "H100-96GB",
    "memory_GiB": 96e9 / 2**30,
    "memory_bandwidth_GBps": 2400.0,
    "source": "torchtitan's H100 (96 GB HBM2e, 2.4 TB/s): the catalog H100's compute rates",
}


def cluster(gpu, gpus: int, nic_GBps_per_gpu: float, headroom_GiB: float | None = None):
    node_gpu = dict(gpu) if isinstance(gpu, dict) else gpu
    if headroom_GiB is not None:  # a device with exactly this much memory
        base = (
            dict(node_gpu)
            if isinstance(node_gpu, dict)
            else {
                **{
                    k: getattr(GPU_CATALOG[gpu], k)
                    for k in (
                        "peak_tflops",
                        "peak_tflops_tf32",
                        "peak_tflops_fp32",
                        "pcie_gen",
                        "memory_bandwidth_GBps",
                    )
                },
                "name": gpu,
                "source": "catalog",
            }
        )
        node_gpu = {**base, "memory_GiB": headroom_GiB}
    return cluster_from_dict(
        {
            "name": f"{gpus}-gpus",
            "nodes": [
                {
                    "name": "n",
                    "gpu": node_gpu,
                    "count": min(8, gpus),
                    "repeat": max(1, gpus // 8),
                    "intra_node": {"bandwidth_GBps": 300, "latency_us": 3},
                    "network": {"bandwidth_GBps": nic_GBps_per_gpu * min(8, gpus), "latency_us": 10},
                }
            ],
            "network": {"bandwidth_GBps": nic_GBps_per_gpu * min(8, gpus), "latency_us": 10},
        },
        "torchtitan",
    )


def fsdp(cl, layers: int, mbs: int, recompute) -> ParallelConfig:
    return ParallelConfig.from_dict(
        {
            "micro_batch_size": mbs,
            "zero": 3,
            "pipelines": [
                {"num_microbatches": 1, "stages": [{"devices": [d], "layers": layers, "recompute": recompute}]}
                for d in cl.device_ids()
            ],
        }
    )


def model(name: str, shape: dict, gpus: int, mbs: int):
    return model_from_dict(
        {"name": name, **shape, "mlp": "swiglu", "global_batch_size": gpus * mbs, "precision": "bf16"}, "torchtitan"
    )


def time_rows() -> list[tuple[str, float, float]]:
    """(run, time error, expected_error) of every published run that fits (``error_bars.py`` reads them)."""
    out = []
    for gpu, runs, nic in (("A100-80GB", A100_RUNS, 25.0), (H100_96GB, H100_RUNS, 50.0)):
        for name, shape, gpus, mbs, rc, pub_tps, _ in runs:
            cl = cluster(gpu, gpus, nic)
            r = Simulator(cl, model(name, shape, gpus, mbs), engine="torchtitan").evaluate(
                fsdp(cl, shape["num_layers"], mbs, rc)
            )
            if r.ok and pub_tps:
                out.append((name, pub_tps / (r.tokens_per_s / gpus) - 1, r.expected_error))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the same table (it takes about a second)")
    ap.parse_args()
    time_errors, oom_right = [], []
    print(
        f"{'run':34s} {'pub tok/s/GPU':>13s} {'sim':>8s} {'t err':>7s} {'bar':>5s} | {'pub GiB':>7s} {'sim GiB':>7s} {'m err':>7s} | fits?"
    )
    for gpu, runs, nic in (("A100-80GB", A100_RUNS, 25.0), (H100_96GB, H100_RUNS, 50.0)):
        for name, shape, gpus, mbs, rc, pub_tps, pub_gib in runs:
            cl = cluster(gpu, gpus, nic)
            m = model(name, shape, gpus, mbs)
            r = Simulator(cl, m, engine="torchtitan").evaluate(fsdp(cl, shape["num_layers"], mbs, rc))
            gpu_name = gpu if isinstance(gpu, str) else gpu["name"]
            context = device_memory(gpu_name).context_GiB
            sim_gib = max(r.peak_memory_GiB.values(), default=0.0) - context
            line = f"{gpu_name[:4]} {name:29s} {pub_tps or 'OOM':>13} "
            if r.ok:
                tps = r.tokens_per_s / gpus
                line += (
                    f"{tps:8,.0f} {(pub_tps / tps - 1) if pub_tps else float('nan'):+7.1%} {r.expected_error:5.0%} | "
                )
                if pub_tps:
                    time_errors.append(pub_tps / tps - 1)
            else:
                line += f"{'oom':>8s} {'':7s} {'':5s} | "
            mem_err = ""
            if pub_gib:
                mem_err = f"{sim_gib / pub_gib - 1:+7.1%}"
            line += f"{pub_gib or '-':>7} {sim_gib:7.1f} {mem_err:>7s} | "
            fits_published = pub_tps is not None
            right = r.ok == fits_published
            oom_right.append(right)
            line += ("fits" if r.ok else "OOM") + ("" if right else "  <- published the other way")
            if pub_gib:  # the check: 10% headroom over the published reading must fit
                headroom = Simulator(cluster(gpu, gpus, nic, 1.1 * pub_gib + context), m, engine="torchtitan").evaluate(
                    fsdp(cl, shape["num_layers"], mbs, rc)
                )
                line += f"; with 10% headroom over {pub_gib} GiB: {'fits' if headroom.ok else 'OOM'}"
            print(line)
    print(
        f"\ntime: mean |error| {statistics.mean(abs(e) for e in time_errors):.1%}, max {max(abs(e) for e in time_errors):.1%} "
        f"over {len(time_errors)} runs; fits / out of memory as published: {sum(oom_right)}/{len(oom_right)}"
    )


if __name__ == "__main__":
    main()
