"""Simulated vs measured: Megatron-LM's weak-scaling iteration times on DGX-2 (V100) and DGX-A100 (2020).

Source: NVIDIA/Megatron-LM's README of late 2020 (the v2.x line), its three tables as images
(``images/cases.png``, ``images/scaling-mp.png``, ``images/scaling-dp.png``; read here from the copy kept in
the fork Xianchao-Wu/Megatron-LM): four GPT-2 cases, "All models use a vocabulary size of 51,200 and a sequence
length of 1024", each run with tensor ("model") parallelism over 1, 2, 4, 8 GPUs:

- model parallelism on one DGX-2 (16 x V100-32GB on NVSwitch) at batch 8 and one DGX-A100 (8 x A100 on
  NVSwitch) at batch 16: measured iteration time and TFLOP/s per GPU;
- the same cases with 128-way data parallelism on DGX-A100 nodes (Selene) at batch 2048: iteration time.

Nothing is fitted to these runs; they are a source no constant of the simulator came from. Assumed (the
README does not say): one micro-batch per GPU and step (the per-GPU batch: Megatron of 2020 had no
gradient accumulation by default), full activation recomputation (the README's TFLOP/s equal
Narayanan et al.'s count with recomputation, ``96 B s l h^2 (1 + s/6h + V/16lh)``, over the iteration time:
the transcription check below), standard attention with dropout 0.1, mixed precision fp16, the catalog's
V100-32GB and A100-40GB (DGX-A100 shipped with 40 GB in 2020), NVSwitch at 150 GB/s (V100) and 300 GB/s
(A100) per GPU, Selene's 8 x 200 Gbit/s per node between nodes. Simulator defaults, no profile.

    .venv/bin/python experiments/fidelity/megatron_readme.py [--attention flash]
"""

from __future__ import annotations

import argparse
import statistics

import megatron_comparison as mc  # this folder: the script's own directory is on the path

from autotune.loading import cluster_from_dict
from autotune.simulator import Simulator
from autotune.simulator.flops import megatron_flops_per_iteration
from autotune.specs import ParallelConfig, PipelineConfig, StageConfig

SEQ = 1024  # the vocabulary is the papers' 51,200 (megatron_comparison.VOCAB)
#: case -> (hidden, heads, layers, billions of parameters, model-parallel GPUs) (``images/cases.png``)
CASES = {
    "1B": (1920, 15, 24, 1.16, 1),
    "2B": (2304, 18, 30, 2.03, 2),
    "4B": (3072, 24, 36, 4.24, 4),
    "8B": (4096, 32, 42, 8.67, 8),
}
#: case -> (iteration ms, TFLOP/s per GPU) on one DGX-2 at batch 8 and one DGX-A100 at batch 16
#: (``images/scaling-mp.png``)
DGX2_V100 = {"1B": (1121, 71.9), "2B": (1093, 64.2), "4B": (1238, 58.5), "8B": (1407, 52.2)}
DGX_A100 = {"1B": (1076, 149.8), "2B": (1026, 136.8), "4B": (1162, 124.7), "8B": (1343, 109.3)}
#: case -> iteration ms with 128-way data parallelism, batch 2048 (``images/scaling-dp.png``)
DGX_A100_DP128 = {"1B": 1153, "2B": 1101, "4B": 1242, "8B": 1380}

#: (section, GPU, GPUs per node, NVSwitch GB/s per GPU, batch per model-parallel group, data-parallel replicas)
SECTIONS = (
    ("DGX-2 (V100), batch 8", "V100-32GB", 16, 150, 8, 1),
    ("DGX-A100, batch 16", "A100-40GB", 8, 300, 16, 1),
    ("DGX-A100, 128-way data parallel, batch 2048", "A100-40GB", 8, 300, 16, 128),
)


def model(case: str, batch: int, attention: str = "standard"):
    hidden, heads, layers, params, _ = CASES[case]
    # transcription check: the case's shape gives the README's parameter count
    assert abs(mc.counted_params_B(layers, hidden, SEQ) - params) / params < 0.01, case
    return mc.gpt(
        params, heads, hidden, layers, batch, "fp16", "megatron-readme", SEQ, attention, f"megatron-readme-{case}"
    )


def cluster(gpu: str, per_node: int, nvswitch_GBps: float, gpus: int):
    return cluster_from_dict(
        {
            "name": f"megatron-readme-{gpu}-{gpus}",
            "nodes": [
                {
                    "name": "dgx",
                    "gpu": gpu,
                    "count": min(per_node, gpus),
                    "repeat": max(1, gpus // per_node),
                    "intra_node": {"bandwidth_GBps": nvswitch_GBps, "latency_us": 3},
                }
            ],
            "network": {"bandwidth_GBps": 200, "latency_us": 5},
        },
        "megatron-readme",
    )


def plan(c, layers: int, tp: int, replicas: int, per_replica_batch: int) -> ParallelConfig:
    devices = [d for node in c.nodes for d in node.device_ids()]  # node-major: a tensor-parallel group in a node
    pipelines = tuple(
        PipelineConfig(1, (StageConfig(tuple(devices[r * tp : (r + 1) * tp]), layers, True),)) for r in range(replicas)
    )
    return ParallelConfig(per_replica_batch, pipelines)


def rows(quick: bool = False, attention: str = "standard") -> list[tuple[str, str, float, float, float]]:
    """(section, case, measured s, simulated s, expected_error) of every run (the first case of each
    section with ``quick``), the model's attention ``attention`` (Megatron-LM of 2020: ``standard``)."""
    out = []
    for section, gpu, per_node, nvswitch, batch, replicas in SECTIONS:
        for case in list(CASES)[:1] if quick else CASES:
            hidden, _, layers, _, tp = CASES[case]
            if replicas == 1:
                ms, tflops = (DGX2_V100 if gpu.startswith("V100") else DGX_A100)[case]
                flops = megatron_flops_per_iteration(model(case, batch), recompute=True)
                # transcription check: the README's TFLOP/s per GPU is its count over the iteration time
                assert abs(flops / (ms / 1e3) / tp / 1e12 - tflops) / tflops < 0.01, (section, case)
            else:
                ms = DGX_A100_DP128[case]
            c = cluster(gpu, per_node, nvswitch, tp * replicas)
            m = Simulator(c, model(case, batch * replicas, attention), engine=mc.ENGINE).evaluate(
                plan(c, layers, tp, replicas, batch)
            )
            if not m.ok:
                raise SystemExit(f"{section} {case}: the simulator refuses the run: {m.error}")
            out.append((section, case, ms / 1e3, m.iteration_time_s, m.expected_error))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the first case of each table")
    ap.add_argument(
        "--attention",
        default="standard",
        choices=("standard", "flash"),
        help="the model's attention: standard (scores stored, as Megatron-LM ran in 2020) or flash (what-if)",
    )
    args = ap.parse_args()
    table = rows(args.quick, args.attention)
    print(f"{'section':44s} {'case':4s} {'GPUs':>5s} | {'meas ms':>7s} {'sim ms':>7s} {'error':>7s} | {'bar':>5s}")
    for section, case, meas, sim, bar in table:
        gpus = CASES[case][4] * (128 if "128-way" in section else 1)
        print(
            f"{section:44s} {case:4s} {gpus:5d} | {1e3 * meas:7.0f} {1e3 * sim:7.0f} {sim / meas - 1:+7.1%} | {bar:5.1%}"
        )
    print()
    for section, *_ in SECTIONS:
        errs = [sim / meas - 1 for s, _, meas, sim, _ in table if s == section]
        print(
            f"{section:44s} mean |time error| {statistics.mean(abs(e) for e in errs):5.1%} "
            f"(signed {statistics.mean(errs):+.1%}, max {max(abs(e) for e in errs):.1%}) over {len(errs)} runs"
        )
    errs = [sim / meas - 1 for _, _, meas, sim, _ in table]
    print(
        f"{'all':44s} mean |time error| {statistics.mean(abs(e) for e in errs):5.1%} over {len(errs)} runs "
        "(a source nothing was fitted to; issue 24's target <= 15%)"
    )


if __name__ == "__main__":
    main()
