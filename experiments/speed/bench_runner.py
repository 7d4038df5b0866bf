"""Runner overhead: step time of the runner vs a minimal hand-written pipelining script, same 2-stage plan.

Plan: ``cpu-2``, model ``small`` by default (8 layers split 4 + 4), micro-batch 2, 1F1B, AdamW, the
same decoder modules (``runner.model``) on both sides. The runner side is ``runner.train.train``
(the engine that profiled runs and ``autotune train`` use; per-step times from its metrics file);
the baseline is ``experiments/speed/minimal_pipeline.py`` under torchrun. Rounds alternate so background
load hits both alike. This machine's 2 cores are shared, so single steps are noisy: we report the
median and the minimum (least-disturbed) step time of each side over all rounds, and the ratio of
each. Target: runner within 5% of the minimal script.

    .venv/bin/python experiments/speed/bench_runner.py [--model small] [--rounds 3] [--steps 6] [--warmup 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from autotune.loading import load_model
from autotune.specs import ParallelConfig
from runner.launch import REPO_ROOT, worker_env
from runner.train import train


def plan(model: str, mbs: int) -> ParallelConfig:
    spec = load_model(model)
    half = spec.num_layers // 2
    return ParallelConfig.from_dict(
        {
            "micro_batch_size": mbs,
            "schedule": "1f1b",
            "pipelines": [
                {
                    "num_microbatches": spec.global_batch_size // mbs,
                    "stages": [
                        {"devices": ["cpu:0"], "layers": half},
                        {"devices": ["cpu:1"], "layers": spec.num_layers - half},
                    ],
                }
            ],
        }
    )


def runner_times(model: str, mbs: int, steps: int, warmup: int) -> list[float]:
    spec = load_model(model)
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        outcome = train("cpu-2", model, plan(model, mbs), steps=warmup + steps, metrics_out=metrics, quiet=True)
        if outcome.returncode != 0:
            raise SystemExit(f"runner failed: {outcome.error}")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    tokens = spec.global_batch_size * spec.seq_len
    return [tokens / r["tokens_per_s"] for r in records[warmup:]]


def minimal_times(model: str, mbs: int, steps: int, warmup: int) -> list[float]:
    with tempfile.TemporaryDirectory() as log_dir:  # torchrun's log folder (else a /tmp/torchelastic_* per run)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--log-dir",
            log_dir,
            "--nproc-per-node",
            "2",
            str(Path(__file__).with_name("minimal_pipeline.py")),
            "--model",
            model,
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
            "--micro-batch-size",
            str(mbs),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, env=worker_env(), cwd=REPO_ROOT, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"minimal script failed:\n{res.stderr[-2000:]}")
    line = [s for s in res.stdout.splitlines() if s.startswith("{")][-1]
    return json.loads(line)["step_times_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks the script still works (tests/integration/experiments/test_experiments.py runs it)",
    )
    args = parser.parse_args()
    if args.quick:
        args.model, args.rounds, args.steps, args.warmup = "tiny", 1, 2, 1
    runner, minimal = [], []
    for r in range(args.rounds):
        rt = runner_times(args.model, args.micro_batch_size, args.steps, args.warmup)
        mt = minimal_times(args.model, args.micro_batch_size, args.steps, args.warmup)
        runner += rt
        minimal += mt
        print(
            f"round {r + 1}: median step runner {statistics.median(rt):.4f} s, minimal {statistics.median(mt):.4f} s",
            flush=True,
        )
    print(
        f"model {args.model}, 2 stages on cpu-2, micro-batch {args.micro_batch_size}, 1f1b; "
        f"{args.rounds} rounds x {args.steps} timed steps after {args.warmup} warm-up"
    )
    for name, f in (("median", statistics.median), ("min", min)):
        a, b = f(runner), f(minimal)
        print(
            f"{name:6s} step time: runner {a:.4f} s, minimal {b:.4f} s, ratio runner/minimal = {a / b:.3f} "
            f"({'within' if a / b <= 1.05 else 'OUTSIDE'} the 5% target)"
        )


if __name__ == "__main__":
    main()
