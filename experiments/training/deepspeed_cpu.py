"""DeepSpeed trains the file ``autotune export --to deepspeed`` writes, on this machine's CPUs (issue 47).

For each plan (two data-parallel replicas, ZeRO 0 / 1 / 2, two micro-batches each per step), the exported
JSON is handed unchanged to ``deepspeed.initialize`` on 2 CPU ranks (gloo, ``DS_ACCELERATOR=cpu``) with a
stand-in model (a stack of linear layers: DeepSpeed's config does not describe the model) and the plan's
batch: each step, rank r's k-th micro-batch is samples ``(k * dp + r) * mbs ...`` of the step's global
batch. The same steps run in one process on the whole global batch (AdamW, the mean loss); the largest
parameter difference after the steps says whether DeepSpeed read the file's batch, accumulation and ZeRO
settings as the plan means them. DeepSpeed's shared-memory all-reduce for CPU ranks (a C++ op it compiles on
first use, 2-3 minutes on a fresh machine) is left out: gloo carries the collectives.

    DS_ACCELERATOR=cpu .venv/bin/python experiments/training/deepspeed_cpu.py [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WIDTH, BLOCKS, SEED, LR = 32, 3, 0, 1e-2

RANK = r"""
import json, sys, torch, deepspeed
import deepspeed.comm.torch
# not DeepSpeed's shared-memory all-reduce for CPU ranks, a C++ op it compiles on first use (2-3 minutes on a
# fresh machine): gloo carries the collectives, as torch.distributed does for the runner
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
sys.path.insert(0, sys.argv[3])
from deepspeed_cpu import batch, model_of
config = json.load(open(sys.argv[1]))
torch.manual_seed(0)
model = model_of()
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                  optimizer=torch.optim.AdamW(model.parameters(), lr=float(sys.argv[4])))
rank, dp = engine.global_rank, engine.dp_world_size
mbs, acc = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
for step in range(int(sys.argv[2])):
    x, y = batch(step, config["train_batch_size"])
    for k in range(acc):
        lo = (k * dp + rank) * mbs
        loss = torch.nn.functional.mse_loss(engine(x[lo:lo + mbs]), y[lo:lo + mbs])
        engine.backward(loss)
        engine.step()
if rank == 0:
    params = [p.detach().float().flatten() for p in engine.module.parameters()]
    out = {"params": torch.cat(params).tolist(), "zero": engine.zero_optimization_stage(), "acc": acc}
    print("RESULT " + json.dumps(out), flush=True)
"""


def model_of():
    import torch

    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS)])


def batch(step: int, size: int):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, WIDTH, generator=g), torch.randn(size, WIDTH, generator=g)


def reference(steps: int, global_batch: int) -> list[float]:
    import torch

    torch.manual_seed(0)
    model = model_of()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = batch(step, global_batch)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def plan(zero: int) -> dict:
    pipelines = [{"num_microbatches": 2, "stages": [{"devices": [f"cpu:{i}"], "layers": 4}]} for i in (0, 1)]
    return {"micro_batch_size": 2, "zero": zero, "pipelines": pipelines}


MODEL = {"name": "fp32-stand-in", "num_layers": 4, "hidden_size": 64, "num_heads": 4, "ffn_hidden_size": 256}
MODEL.update(vocab_size=256, seq_len=16, global_batch_size=8, precision="fp32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="ZeRO 2 alone, 2 steps (the test suite's run)")
    args = parser.parse_args()
    if args.quick:
        args.steps = 2
    try:
        import deepspeed
    except ImportError:
        print("DeepSpeed is not installed (DS_BUILD_OPS=0 pip install -e '.[engines]'): nothing to run")
        return
    from autotune import engines
    from autotune.loading import model_from_dict
    from autotune.specs import ParallelConfig

    model = model_from_dict(MODEL, "the stand-in model")
    print(f"DeepSpeed {deepspeed.__version__}, 2 CPU ranks (gloo), {args.steps} steps")
    print("| plan | exported file | DeepSpeed read | largest parameter difference vs one process |")
    print("|---|---|---|---|")
    env = dict(os.environ, DS_ACCELERATOR="cpu", DS_BUILD_OPS="0", OMP_NUM_THREADS="1")
    wrong = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "rank.py"
        script.write_text(RANK)
        for zero in (2,) if args.quick else (0, 1, 2):
            config = ParallelConfig.from_dict(plan(zero))
            path = Path(tmp) / f"zero{zero}.json"
            path.write_text(engines.export("deepspeed", config, model))
            doc = json.loads(path.read_text())
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
            cmd += ["--log-dir", str(Path(tmp) / f"torchrun-zero{zero}")]  # else a /tmp/torchelastic_* per run
            cmd += [str(script), str(path), str(args.steps), str(Path(__file__).parent), str(LR)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
                print(f"| zero {zero} | train_batch_size {doc['train_batch_size']} | failed: {' / '.join(tail)} | |")
                wrong.append(zero)
                continue
            got = json.loads(line[len("RESULT ") :])
            ref = reference(args.steps, doc["train_batch_size"])
            diff = max(abs(a - b) for a, b in zip(got["params"], ref, strict=True))
            described = f"train_batch_size {doc['train_batch_size']}, accumulation {doc['gradient_accumulation_steps']}"
            print(f"| zero {zero}, dp 2 x 2 micro-batches of 2 | {described} | stage {got['zero']} | {diff:.2e} |")
            if diff > 1e-5 or got["zero"] != zero:
                wrong.append(zero)
    if wrong:
        raise SystemExit(f"DeepSpeed did not train the exported file as the plan means at zero {wrong}")


if __name__ == "__main__":
    main()
