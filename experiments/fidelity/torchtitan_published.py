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


def results() -> list[dict]:
    """One dict per published run: ``run``, ``gpu``, ``ok`` (fits in the simulator), ``published_ok`` (ran),
    ``time_error`` (simulated / published iteration time - 1, or None), ``bar``, ``tokens_per_s_per_gpu``,
    ``sim_GiB`` (the simulator's device view minus its context: torchtitan's reading), ``pub_GiB``, ``memory_error``
    and ``fits_with_headroom`` (a device of 10% over the published reading; None without a reading)."""
    out = []
    for gpu, runs, nic in (("A100-80GB", A100_RUNS, 25.0), (H100_96GB, H100_RUNS, 50.0)):
        for name, shape, gpus, mbs, rc, pub_tps, pub_gib in runs:
            cl = cluster(gpu, gpus, nic)
            m = model(name, shape, gpus, mbs)
            r = Simulator(cl, m, engine="torchtitan").evaluate(fsdp(cl, shape["num_layers"], mbs, rc))
            gpu_name = gpu if isinstance(gpu, str) else gpu["name"]
            context = device_memory(gpu_name).context_GiB
            sim_gib = max(r.peak_memory_GiB.values(), default=0.0) - context
            tps = r.tokens_per_s / gpus if r.ok else None
            row = dict(
                run=name,
                gpu=gpu_name,
                ok=r.ok,
                published_ok=pub_tps is not None,
                pub_tokens_per_s_per_gpu=pub_tps,
                tokens_per_s_per_gpu=tps,
                time_error=pub_tps / tps - 1 if tps and pub_tps else None,
                bar=r.expected_error,
                sim_GiB=sim_gib,
                pub_GiB=pub_gib,
                memory_error=sim_gib / pub_gib - 1 if pub_gib else None,
                fits_with_headroom=None,
            )
            if pub_gib:  # the check: 10% headroom over the published reading must fit
                headroom = Simulator(cluster(gpu, gpus, nic, 1.1 * pub_gib + context), m, engine="torchtitan").evaluate(
                    fsdp(cl, shape["num_layers"], mbs, rc)
                )
                row["fits_with_headroom"] = headroom.ok
            out.append(row)
    return out


def time_rows() -> list[tuple[str, float, float]]:
    """(run, time error, expected_error) of every published run that fits (``error_bars.py`` reads them)."""
    return [(r["run"], r["time_error"], r["bar"]) for r in results() if r["time_error"] is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the same table (it takes about a second)")
    ap.parse_args()
    rows = results()
    print(
        f"{'run':34s} {'pub tok/s/GPU':>13s} {'sim':>8s} {'t err':>7s} {'bar':>5s} | {'pub GiB':>7s} {'sim GiB':>7s} {'m err':>7s} | fits?"
    )
    for r in rows:
        line = f"{r['gpu'][:4]} {r['run']:29s} {r['pub_tokens_per_s_per_gpu'] or 'OOM':>13} "
        if r["ok"]:
            t_err = r["time_error"] if r["time_error"] is not None else float("nan")
            line += f"{r['tokens_per_s_per_gpu']:8,.0f} {t_err:+7.1%} {r['bar']:5.0%} | "
        else:
            line += f"{'oom':>8s} {'':7s} {'':5s} | "
        mem_err = f"{r['memory_error']:+7.1%}" if r["memory_error"] is not None else ""
        line += f"{r['pub_GiB'] or '-':>7} {r['sim_GiB']:7.1f} {mem_err:>7s} | "
        line += ("fits" if r["ok"] else "OOM") + (
            "" if r["ok"] == r["published_ok"] else "  <- published the other way"
        )
        if r["fits_with_headroom"] is not None:
            line += f"; with 10% headroom over {r['pub_GiB']} GiB: {'fits' if r['fits_with_headroom'] else 'OOM'}"
        print(line)
    time_errors = [r["time_error"] for r in rows if r["time_error"] is not None]
    right = sum(r["ok"] == r["published_ok"] for r in rows)
    print(
        f"\ntime: mean |error| {statistics.mean(abs(e) for e in time_errors):.1%}, max {max(abs(e) for e in time_errors):.1%} "
        f"over {len(time_errors)} runs; fits / out of memory as published: {right}/{len(rows)}"
    )


if __name__ == "__main__":
    main()
