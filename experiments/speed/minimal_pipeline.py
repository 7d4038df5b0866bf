"""A minimal hand-written torch.distributed.pipelining training script: the baseline for bench_runner.py.

Two ranks, one stage each, Schedule1F1B, AdamW; the same decoder blocks as the runner
(runner.model.StageChunk) so both do identical compute. No gradient sync (one pipeline), no loss
all-reduce, no timing hooks: just what a user would write by hand. Run with torchrun:

    torchrun --standalone --nproc-per-node 2 experiments/speed/minimal_pipeline.py --model small --steps 5 --warmup 2

Rank 0 prints one JSON line: {"step_times_s": [seconds of each timed step]}; each step ends in a
barrier so the time is the slower rank's.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from autotune.loading import load_model
from runner.model import StageChunk, lm_loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spec = load_model(args.model)
    half = spec.num_layers // 2
    layers = range(0, half) if rank == 0 else range(half, spec.num_layers)
    chunk = StageChunk(spec, layers, first=rank == 0, last=rank == 1, seed=0)
    stage = PipelineStage(chunk, rank, 2, torch.device("cpu"))
    n_micro = spec.global_batch_size // args.micro_batch_size
    schedule = Schedule1F1B(stage, n_micro, loss_fn=lm_loss)
    opt = torch.optim.AdamW(chunk.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (spec.global_batch_size, spec.seq_len + 1), generator=gen)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    times = []
    dist.barrier()
    for _i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps({"step_times_s": times[args.warmup :]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
