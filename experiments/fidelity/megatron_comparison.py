"""Simulated vs published: Megatron-LM weak scaling on DGX A100 clusters (Narayanan et al. 2021, Table 1).

Source: D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC'21 (arXiv:2104.04473), Table 1: GPT models of 1.7B to 1T parameters, vocabulary 51,200,
sequence 2048, on Selene (DGX A100 nodes: 8 x A100-80GB on NVLink/NVSwitch, 600 GB/s bidirectional per
GPU; 8 x 200 Gbit/s HDR InfiniBand per node), mixed precision, activation recomputation. "Achieved
teraFLOP/s per GPU" counts FLOPs with the paper's formula 96 B s l h^2 (1 + s/6h + V/16lh) (recomputation
included) over the measured iteration time. The rows below are copied from that table (parameter
count, heads, hidden size, layers, tensor- and pipeline-parallel size, GPUs, batch size, achieved
TFLOP/s per GPU, aggregate PFLOP/s); the script checks the transcription: per-GPU x GPUs gives the
aggregate column and the paper's parameter formula (its eq. 2) gives the first column.

Not in the table, so assumed here (the same for every row, chosen before comparing): micro-batch size 1
(what the paper's Table 2 uses for its PTD-P runs), full recomputation on every stage, the 1F1B
schedule (the interleaved schedule with 2 chunks per stage is printed beside it for the rows with
pipelining), simulator defaults (no calibration profile).

    .venv/bin/python experiments/fidelity/megatron_comparison.py

Prints, per row, the simulated and published TFLOP/s per GPU and the error, then the mean and max
absolute error.
"""

from __future__ import annotations

import argparse
import time

from autotune.loading import cluster_from_dict, model_from_dict
from autotune.simulator import Simulator
from autotune.simulator.flops import megatron_flops_per_iteration
from autotune.specs import ParallelConfig, PipelineConfig, StageConfig

# params (B), heads, hidden, layers, TP, PP, GPUs, batch, achieved TFLOP/s per GPU, aggregate PFLOP/s
# (Narayanan et al. 2021, Table 1)
TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 4.4),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 8.8),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 18.2),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 34.6),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 70.8),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 143.8),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 227.1),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 297.4),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 410.2),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 502.0),
]
VOCAB, SEQ = 51200, 2048
MICRO_BATCH = 1


def selene(num_gpus: int):
    """DGX A100 nodes: NVLink3 300 GB/s per direction per GPU; 8 x 200 Gbit/s HDR = 200 GB/s per node."""
    return cluster_from_dict(
        {
            "name": f"selene-{num_gpus}",
            "nodes": [
                {
                    "name": "dgx",
                    "gpu": "A100-80GB",
                    "count": 8,
                    "repeat": num_gpus // 8,
                    "intra_node": {"bandwidth_GBps": 300, "latency_us": 3},
                }
            ],
            "network": {"bandwidth_GBps": 200, "latency_us": 5},
        },
        "selene",
    )


#: Megatron-LM before Megatron-Core, as these runs ran it (its scatter/gather of pipeline hand-offs:
#: ``autotune.simulator.engine_terms``); megatron_readme.py, sailor_mit.py and error_bars.py use it too
ENGINE = "megatron-legacy"


def gpt(
    params,
    heads: int,
    hidden: int,
    layers: int,
    batch: int,
    precision: str,
    source: str,
    seq_len: int = SEQ,
    attention: str = "standard",
    name: str | None = None,
):
    """A GPT of Megatron-LM's papers: GeLU MLP 4h wide, vocabulary 51,200, sequence 2048 (``seq_len``),
    dropout 0.1, and attention "standard" (2021 Megatron-LM stored the attention scores)."""
    return model_from_dict(
        dict(
            name=name or f"gpt-{params}B",
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            ffn_hidden_size=4 * hidden,
            mlp="gelu",
            vocab_size=VOCAB,
            seq_len=seq_len,
            global_batch_size=batch,
            precision=precision,
            attention=attention,
            dropout=0.1,
        ),
        source,
    )


def counted_params_B(layers: int, hidden: int, seq_len: int = SEQ) -> float:
    """Billions of parameters by Narayanan et al.'s eq. 2 (blocks, position and tied word embeddings): what
    the papers' and the README's parameter columns print."""
    return 12 * layers * hidden**2 * (1 + 13 / (12 * hidden) + (VOCAB + seq_len) / (12 * layers * hidden)) / 1e9


def plan(
    cluster,
    layers: int,
    tp: int,
    pp: int,
    batch: int,
    schedule: str,
    v: int,
    mbs: int = MICRO_BATCH,
    recompute: bool | str = True,
    sequence_parallel: bool = False,
) -> ParallelConfig:
    devices = [d for node in cluster.nodes for d in node.device_ids()]  # node-major: a TP group stays in a node
    dp = len(devices) // (tp * pp)
    pipelines = []
    for r in range(dp):
        stages = tuple(
            StageConfig(
                tuple(devices[(r * pp + s) * tp : (r * pp + s + 1) * tp]),
                layers // pp,
                recompute,
                sequence_parallel=sequence_parallel,
            )
            for s in range(pp)
        )
        pipelines.append(PipelineConfig(batch // (dp * mbs), stages))
    return ParallelConfig(mbs, tuple(pipelines), schedule=schedule, virtual_stages=v)


# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (MLSys 2023,
# arXiv:2205.05198): GPT models on Selene with tensor parallelism 8, data parallelism 1, sequence 2048,
# vocabulary 51,200, sequence parallelism + selective recomputation ("present work"). Model FLOPs
# utilization (MFU) and hardware FLOPs utilization (HFU, counting the recomputed FLOPs) as published in
# their Table 4 and in Megatron-LM's README ("measured using a data parallel size of one"); the model
# configurations (heads, hidden, layers, TP, PP, GPUs, global batch, micro-batch) as transcribed from
# their Table 3 (this transcription could not be checked against the paper's text in this session; the
# MFU/HFU values could, against Megatron-LM's README).
# params (B), heads, hidden, layers, TP, PP, GPUs, global batch, micro-batch, published MFU %, published HFU %
KORTHIKANTI = [
    (22, 64, 6144, 48, 8, 1, 8, 4, 4, 41.5, 43.7),
    (175, 96, 12288, 96, 8, 8, 64, 64, 1, 51.4, 52.8),
    (530, 128, 20480, 105, 8, 35, 280, 280, 1, 56.0, 57.0),
    (1000, 160, 25600, 128, 8, 64, 512, 512, 1, 56.3, 57.0),
]


def korthikanti(engine: str = ENGINE) -> list[float]:
    """Simulated vs published MFU with selective recomputation and sequence parallelism on every stage;
    MFU = 72 B s l h^2 (1 + s/6h + V/12lh) / (iteration time x GPUs x 312 TFLOP/s), their definition.
    ``engine``: the engine simulated (Megatron-LM's own by default; ``autotune``: the runner, as
    ``autotune simulate`` predicts it by default)."""
    print(f"\nKorthikanti et al. 2022: selective recomputation + sequence parallelism, tp 8, 1F1B (engine {engine})")
    print(
        f"{'params':>8} {'PP':>3} {'GPUs':>5} {'batch':>5} {'mbs':>3} | {'MFU pub':>7} {'MFU sim':>7} {'error':>7} | "
        f"{'sim s':>6} {'GiB/dev':>7}"
    )
    errors = []
    for params, heads, hidden, layers, tp, pp, gpus, batch, mbs, mfu_pub, _hfu_pub in KORTHIKANTI:
        model = gpt(params, heads, hidden, layers, batch, "bf16", "korthikanti")
        cluster = selene(gpus)
        m = Simulator(cluster, model, engine=engine).evaluate(
            plan(cluster, layers, tp, pp, batch, "1f1b", 1, mbs, "selective", True)
        )
        if not m.ok:
            print(f"{params:8d} {pp:3d} {gpus:5d} {batch:5d} {mbs:3d} | {mfu_pub:7.1f}   {m.status}: {m.error}")
            continue
        flops = megatron_flops_per_iteration(model, recompute=False)
        mfu = 100 * flops / (m.iteration_time_s * gpus * 312e12)
        err = (mfu - mfu_pub) / mfu_pub
        errors.append(abs(err))
        print(
            f"{params:8d} {pp:3d} {gpus:5d} {batch:5d} {mbs:3d} | {mfu_pub:7.1f} {mfu:7.1f} {100 * err:+6.1f}% | "
            f"{m.iteration_time_s:6.2f} {max(m.peak_memory_GiB.values()):7.1f}"
        )
    print(
        f"selective + sequence parallel: mean |error| {100 * sum(errors) / len(errors):.1f}%, "
        f"max {100 * max(errors):.1f}% over {len(errors)} rows"
    )
    return errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the same tables (the whole run takes about a second)")
    ap.add_argument(
        "--engine",
        default=None,
        help="also simulate Korthikanti et al.'s table with this engine (autotune: the runner, the default engine)",
    )
    args = ap.parse_args()
    print(
        f"{'params':>8} {'TP':>3} {'PP':>3} {'GPUs':>5} {'batch':>5} | {'published':>9} {'1F1B':>7} {'error':>7}"
        f" | {'interleaved':>11} {'error':>7} | {'bubble':>6} {'sim s':>6}"
    )
    errors = []
    t0 = time.perf_counter()
    for params, heads, hidden, layers, tp, pp, gpus, batch, published, aggregate in TABLE_1:
        # transcription check: per-GPU x GPUs matches the aggregate column (both rounded in the paper)
        assert abs(published * gpus / 1000 - aggregate) / aggregate < 0.01, params
        model = gpt(params, heads, hidden, layers, batch, "fp16", "table-1")
        cluster = selene(gpus)
        sim = Simulator(cluster, model, engine=ENGINE)
        flops = megatron_flops_per_iteration(model, recompute=True)
        # and the model shape gives the parameter count of the first column (12 l h^2 + embeddings)
        assert abs(counted_params_B(layers, hidden) - params) / params < 0.04, params
        m = sim.evaluate(plan(cluster, layers, tp, pp, batch, "1f1b", 1))
        if not m.ok:
            print(f"{params:8.1f} {tp:3d} {pp:3d} {gpus:5d} {batch:5d} | {published:9d}   {m.status}: {m.error}")
            continue
        tflops = flops / m.iteration_time_s / gpus / 1e12
        err = (tflops - published) / published
        errors.append(abs(err))
        inter = ""
        if pp > 1 and (layers // pp) % 2 == 0:
            mi = sim.evaluate(plan(cluster, layers, tp, pp, batch, "interleaved-1f1b", 2))
            if mi.ok:
                ti = flops / mi.iteration_time_s / gpus / 1e12
                inter = f"{ti:11.1f} {100 * (ti - published) / published:+6.1f}%"
            else:
                inter = f"{mi.status:>11} {'':7}"
        print(
            f"{params:8.1f} {tp:3d} {pp:3d} {gpus:5d} {batch:5d} | {published:9d} {tflops:7.1f} {100 * err:+6.1f}%"
            f" | {inter or '-':>19} | {m.bubble_fraction:6.1%} {m.iteration_time_s:6.2f}"
        )
    print(
        f"1F1B: mean |error| {100 * sum(errors) / len(errors):.1f}%, max |error| {100 * max(errors):.1f}% "
        f"over {len(errors)} rows ({time.perf_counter() - t0:.1f} s)"
    )
    k = korthikanti()
    if args.engine:
        korthikanti(args.engine)
    both = errors + k
    print(
        f"\nboth tables: mean |error| {100 * sum(both) / len(both):.1f}% over {len(both)} rows "
        f"(target <= 5% on Narayanan et al.'s table: {'met' if sum(errors) / len(errors) <= 0.05 else 'missed'})"
    )


if __name__ == "__main__":
    main()
