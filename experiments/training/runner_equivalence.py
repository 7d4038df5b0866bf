"""Runner equivalence: each plan's loss curve vs single-process training on the same data and seed.

For every plan below, trains ``--steps`` steps through ``runner.train.train`` (torchrun, gloo on the
``cpu-4`` preset; or any cluster with ``--cluster``) and prints the largest relative difference of
its per-step loss from the single-process reference (fp32; reduction order is the only difference).

    .venv/bin/python experiments/training/runner_equivalence.py [--steps 6] [--only moe]

``--only`` keeps the plans whose name contains it (``moe``: the mixture-of-experts plans of issue 12:
expert parallelism by all-to-all over gloo, and SPES with every expert trained and ``sync_every_steps`` 1;
``mixed``: Zorse's mixed data-parallel stages of issue 10, with ZeRO-1 / 2 across their ranks).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from autotune.loading import load_model
from runner.reference import reference_losses, trained_difference

LLAMA = str(Path(__file__).resolve().parents[2] / "tests" / "data" / "tiny-llama.yaml")
LLAMA_STANDARD = replace(load_model(LLAMA), attention="standard")  # scores written out and stored


def st(devices, layers, recompute=False):
    return {"devices": devices if isinstance(devices, list) else [devices], "layers": layers, "recompute": recompute}


PLANS = [  # (name, model, config)
    (
        "2 stages 1+3, 1f1b",
        "tiny",
        {"micro_batch_size": 2, "pipelines": [{"num_microbatches": 4, "stages": [st("cpu:0", 1), st("cpu:1", 3)]}]},
    ),
    (
        "2 stages x 2 replicas, 3+1 / 1+3, 5+3 micro-batches, recompute",
        "tiny",
        {
            "micro_batch_size": 1,
            "pipelines": [
                {"num_microbatches": 5, "stages": [st("cpu:0", 3), st("cpu:1", 1, True)]},
                {"num_microbatches": 3, "stages": [st("cpu:2", 1), st("cpu:3", 3)]},
            ],
        },
    ),
    (
        "4 stages, gpipe",
        "tiny",
        {
            "micro_batch_size": 2,
            "schedule": "gpipe",
            "pipelines": [{"num_microbatches": 4, "stages": [st(f"cpu:{i}", 1) for i in range(4)]}],
        },
    ),
    (
        "interleaved-1f1b v=2, 2 stages",
        "tiny",
        {
            "micro_batch_size": 1,
            "schedule": "interleaved-1f1b",
            "virtual_stages": 2,
            "pipelines": [{"num_microbatches": 8, "stages": [st("cpu:0", 2), st("cpu:1", 2)]}],
        },
    ),
    (
        "interleaved v=2: 2-stage replica (6 mb) + 1-stage replica (2 mb)",
        "tiny",
        {
            "micro_batch_size": 1,
            "schedule": "interleaved-1f1b",
            "virtual_stages": 2,
            "pipelines": [
                {"num_microbatches": 6, "stages": [st("cpu:0", 2), st("cpu:1", 2)]},
                {"num_microbatches": 2, "stages": [st("cpu:2", 4)]},
            ],
        },
    ),
    (
        "TP 2 x 2 replicas, 5+3 micro-batches, recompute",
        "tiny",
        {
            "micro_batch_size": 1,
            "pipelines": [
                {"num_microbatches": 5, "stages": [st(["cpu:0", "cpu:1"], 4, True)]},
                {"num_microbatches": 3, "stages": [st(["cpu:2", "cpu:3"], 4)]},
            ],
        },
    ),
    (
        "PP 2 x TP 2, SwiGLU + GQA (tests/data/tiny-llama.yaml)",
        LLAMA,
        {
            "micro_batch_size": 1,
            "pipelines": [
                {"num_microbatches": 4, "stages": [st(["cpu:0", "cpu:1"], 1), st(["cpu:2", "cpu:3"], 1, True)]}
            ],
        },
    ),
    (
        "PP 2 x TP 2 sequence parallel, selective / full recompute",
        "tiny",
        {
            "micro_batch_size": 1,
            "pipelines": [
                {
                    "num_microbatches": 8,
                    "stages": [
                        {**st(["cpu:0", "cpu:1"], 2, "selective"), "sequence_parallel": True},
                        {**st(["cpu:2", "cpu:3"], 2, True), "sequence_parallel": True},
                    ],
                }
            ],
        },
    ),
    (
        "TP 2 sequence parallel, standard attention, SwiGLU + GQA",
        LLAMA_STANDARD,
        {
            "micro_batch_size": 1,
            "pipelines": [
                {
                    "num_microbatches": 4,
                    "stages": [{**st(["cpu:0", "cpu:1"], 2, "selective"), "sequence_parallel": True}],
                }
            ],
        },
    ),
    *(
        (
            f"mixed: stage of 2 ranks (5 + 3 micro-batches) + 1 rank, zero {z}",
            "tiny",
            {
                "micro_batch_size": 1,
                "zero": z,
                "pipelines": [
                    {
                        "num_microbatches": 8,
                        "stages": [
                            {
                                "layers": 3,
                                "ranks": [
                                    {"devices": ["cpu:0"], "num_microbatches": 5},
                                    {"devices": ["cpu:1"], "num_microbatches": 3},
                                ],
                            },
                            st("cpu:2", 1),
                        ],
                    }
                ],
            },
        )
        for z in (0, 1, 2)
    ),
    (
        "mixed: 1 rank -> stage of 2 ranks (3 + 2), recompute, gpipe, + a 1-stage replica, zero 2",
        "tiny",
        {
            "micro_batch_size": 1,
            "schedule": "gpipe",
            "zero": 2,
            "pipelines": [
                {
                    "num_microbatches": 5,
                    "stages": [
                        st("cpu:0", 1),
                        {
                            "layers": 3,
                            "recompute": True,
                            "ranks": [
                                {"devices": ["cpu:1"], "num_microbatches": 3},
                                {"devices": ["cpu:2"], "num_microbatches": 2},
                            ],
                        },
                    ],
                },
                {"num_microbatches": 3, "stages": [st("cpu:3", 4)]},
            ],
        },
    ),
    (
        "moe: 4 replicas (tiny-moe, 4 experts top-2)",
        "tiny-moe",
        {
            "micro_batch_size": 1,
            "pipelines": [{"num_microbatches": 2, "stages": [st(f"cpu:{p}", 4)]} for p in range(4)],
        },
    ),
    (
        "moe: expert parallel 2, 2 groups x 2 stages 1+3, recompute",
        "tiny-moe",
        {
            "micro_batch_size": 1,
            "expert_parallel": 2,
            "pipelines": [
                {"num_microbatches": 4, "stages": [st(f"cpu:{2 * p}", 1), st(f"cpu:{2 * p + 1}", 3, True)]}
                for p in range(2)
            ],
        },
    ),
    (
        "moe: expert parallel 4, one expert per replica",
        "tiny-moe",
        {
            "micro_batch_size": 1,
            "expert_parallel": 4,
            "pipelines": [{"num_microbatches": 2, "stages": [st(f"cpu:{p}", 4)]} for p in range(4)],
        },
    ),
    (
        "moe: SPES lists, every expert trained, sync_every_steps 1",
        "tiny-moe",
        {
            "micro_batch_size": 1,
            "sync_every_steps": 1,
            "pipelines": [
                {"num_microbatches": 2, "trains_experts": [0, 1, 2, 3], "stages": [st(f"cpu:{p}", 4)]} for p in range(4)
            ],
        },
    ),
    (
        "moe: tp 2 inside the experts x expert parallel 2, sequence parallel",
        "tiny-moe",
        {
            "micro_batch_size": 1,
            "expert_parallel": 2,
            "pipelines": [
                {
                    "num_microbatches": 4,
                    "stages": [dict(st([f"cpu:{2 * p}", f"cpu:{2 * p + 1}"], 4), sequence_parallel=True)],
                }
                for p in range(2)
            ],
        },
    ),
    (
        "moe: zero 2, expert parallel 2 over 4 replicas",
        "tiny-moe",
        {
            "micro_batch_size": 1,
            "zero": 2,
            "expert_parallel": 2,
            "pipelines": [{"num_microbatches": 2, "stages": [st(f"cpu:{p}", 4)]} for p in range(4)],
        },
    ),
    (
        "moe: zero 3, tp 2 inside the experts x expert parallel 2",
        "tiny-moe",
        {
            "micro_batch_size": 1,
            "zero": 3,
            "expert_parallel": 2,
            "pipelines": [
                {"num_microbatches": 4, "stages": [st([f"cpu:{2 * p}", f"cpu:{2 * p + 1}"], 4)]} for p in range(2)
            ],
        },
    ),
    (
        "zero 3 + offload all, TP 2 sequence parallel x 2 replicas (vocab-parallel head)",
        LLAMA,
        {
            "micro_batch_size": 1,
            "zero": 3,
            "pipelines": [
                {
                    "num_microbatches": 2,
                    "stages": [
                        dict(st([f"cpu:{2 * p}", f"cpu:{2 * p + 1}"], 2), sequence_parallel=True, offload="all")
                    ],
                }
                for p in range(2)
            ],
        },
    ),
    (
        "zero 3 on FSDP2, 2 stages 2+2 x 2 replicas, 4+4 micro-batches, recompute",
        "tiny",
        {
            "micro_batch_size": 1,
            "zero": 3,
            "pipelines": [
                {"num_microbatches": 4, "stages": [st(f"cpu:{2 * p}", 2), st(f"cpu:{2 * p + 1}", 2, True)]}
                for p in range(2)
            ],
        },
    ),
    (
        "zero 2 on FSDP2, TP 2 sequence parallel x 2 replicas (vocab-parallel head)",
        LLAMA,
        {
            "micro_batch_size": 1,
            "zero": 2,
            "pipelines": [
                {
                    "num_microbatches": 2,
                    "stages": [dict(st([f"cpu:{2 * p}", f"cpu:{2 * p + 1}"], 2), sequence_parallel=True)],
                }
                for p in range(2)
            ],
        },
    ),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--cluster", default="cpu-4")
    parser.add_argument("--only", default="", help="run only the plans whose name contains this")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works (tests/integration/experiments/test_experiments.py runs it)",
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.only = 2, args.only or "1f1b"
    torch.set_num_threads(1)
    print(f"{'plan':70s} {'max rel diff':>12s} {'wall s':>7s}")
    worst = 0.0
    for name, model, config in (p for p in PLANS if args.only in p[0]):
        ref = reference_losses(model, args.steps)
        diff, wall, error = trained_difference(args.cluster, model, config, args.steps, ref)
        if diff is None:
            print(f"{name:70s} FAILED: {error}")
            continue
        worst = max(worst, diff)
        print(f"{name:70s} {diff:12.2e} {wall:7.1f}", flush=True)
    print(f"worst relative difference over {args.steps} steps: {worst:.2e} (tests assert rtol 1e-5)")


if __name__ == "__main__":
    main()
