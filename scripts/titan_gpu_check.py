"""autotune's runner beside torchtitan on one GPU: one plan, tokens/s and peak memory side by side.

    python scripts/titan_gpu_check.py [--layers 4] [--seq-len 2048] [--batch 1] [--steps 5] [--warmup 2]
                                      [--out FILE] [--device cuda|cpu]

The plan is the homogeneous one both engines run: the whole model on one device, one micro-batch of
``--batch`` sequences per step, no activation checkpointing, AdamW. The model has Llama-3-8B's shapes (hidden
4096, 32 heads, 8 key-value heads, FFN 14,336, vocabulary 128,256) cut to ``--layers`` blocks, in bf16 on a
GPU with bf16 (fp32 master weights on both sides).

- autotune: ``autotune measure --json`` of that plan (the runner, ``--warmup`` + ``--steps`` timed steps);
  its iteration time and ``allocated_memory_GiB`` (``torch.cuda.max_memory_allocated``).
- torchtitan (PyPI 0.3: from the import path, else ``.engines/titan`` (``make titan-site``: 42 MB, what a
  lent GPU machine without a package index needs carried) or ``.engines/site`` (``make engines``)): its own Llama 3
  (``torchtitan.models.llama3.model_registry("8B")``, its blocks cut to ``--layers``), set up as its trainer
  sets it up (built on the meta device, ``parallelize_llama``: FSDP2 over the one rank with its bf16
  ``MixedPrecisionPolicy``, then ``init_weights``), its default flex attention with the block-causal masks
  of one document per row, fused AdamW, cross entropy on random tokens, the same steps. Not its
  ``Trainer`` itself: that reads a tokenizer and a dataset from disk, which the lent machines do not have;
  the model, its attention and its FSDP2 wrapping are torchtitan's, the loop is the trainer's
  forward / backward / clip / step. The trainer's default chunked loss (which never materialises fp32 logits)
  is not used: both sides compute the whole logits.

One table: engine, parameters, iteration seconds, tokens/s, peak allocated GiB, and their ratios. Each
engine runs in its own process with a time limit; a failing side prints its error and the other still runs.
``--device cpu`` is the smoke run a CPU machine can do (``tests/integration/engines/test_titan_gpu_check.py``:
torchtitan's debug model's shapes, fp32, gloo, SDPA attention, as flex attention has no backward on CPU);
without CUDA and without ``--device cpu`` it says so and exits 0. ``scripts/gpu_checks.sh`` runs it (step 4).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: torchtitan's sites: ``make titan-site``'s (no triton: for a GPU machine) and ``make engines``' own
SITES = [p for p in (ROOT / ".engines" / "titan", ROOT / ".engines" / "site") if p.is_dir()]
AUTOTUNE = [sys.executable, "-m", "autotune.cli"]

#: torchtitan flavor -> the same shapes as an autotune model file (torchtitan's ``_8b`` / ``_debugmodel``:
#: FFN ``compute_ffn_hidden_dim(4096, 1024, 1.3)`` = 14,336 and ``(256, 256)`` = 768)
SHAPES = {
    "8B": dict(hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336, vocab_size=128256),
    "debugmodel": dict(hidden_size=256, num_heads=16, num_kv_heads=16, ffn_hidden_size=768, vocab_size=2048),
}


def model_file(flavor: str, layers: int, seq_len: int, batch: int, precision: str) -> dict:
    return {
        "name": f"llama3-{flavor.lower()}-{layers}l",
        "num_layers": layers,
        **SHAPES[flavor],
        "mlp": "swiglu",
        "seq_len": seq_len,
        "global_batch_size": batch,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500_000.0,
        "precision": precision,
    }


def autotune_side(args, flavor: str, precision: str, work: Path) -> dict:
    """``autotune measure`` of the one-device plan: iteration seconds, peak allocated GiB, parameters."""
    if args.device == "cuda":
        import torch
        from gpu_check import one_gpu_cluster  # scripts/, this script's directory

        props = torch.cuda.get_device_properties(0)
        cluster = work / "cluster.json"
        cluster.write_text(json.dumps(one_gpu_cluster("titan-check", props.name, props.total_memory / 2**30)))
        cluster_arg, device = str(cluster), "gpu:0"
    else:
        cluster_arg, device = "cpu-2", "cpu:0"
    spec = model_file(flavor, args.layers, args.seq_len, args.batch, precision)
    model = work / "model.json"
    model.write_text(json.dumps(spec))
    plan = work / "plan.json"
    stage = {"devices": [device], "layers": args.layers, "recompute": False}
    plan.write_text(
        json.dumps({"micro_batch_size": args.batch, "pipelines": [{"num_microbatches": 1, "stages": [stage]}]})
    )
    cmd = AUTOTUNE + ["measure", "--cluster", cluster_arg, "--model", str(model), "--config", str(plan)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--timeout", str(args.timeout_s), "--json"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout_s + 60)
    if out.returncode or not out.stdout.strip().startswith("{"):
        raise RuntimeError(f"autotune measure exited {out.returncode}: {(out.stderr or out.stdout).strip()[-600:]}")
    m = json.loads(out.stdout)
    if m.get("status") != "ok":
        raise RuntimeError(f"autotune measure: {m.get('status')}: {m.get('error', '')[:600]}")
    from autotune.loading import model_from_dict

    alloc = m.get("allocated_memory_GiB") or {}
    return {
        "iteration_s": m["iteration_time_s"],
        "peak_allocated_GiB": max(alloc.values()) if alloc else float("nan"),
        "parameters": model_from_dict(spec, "the check's model").num_params,
    }


def titan_worker(args) -> None:
    """One rank of torchtitan's model, set up as its trainer does; prints ``RESULT {json}``."""
    import torch
    import torch.distributed as dist

    cuda = args.device == "cuda"
    sys.path += [str(p) for p in SITES]  # after site-packages: a machine's own CUDA torch and triton come first
    torch.manual_seed(0)
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo")
    from torchtitan.tools import utils as titan_utils

    if not cuda:  # torchtitan assumes an accelerator ("cuda" when none is found): the CPU smoke run only
        titan_utils.device_type, titan_utils.device_module = "cpu", torch.cpu
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    flavor = args.flavor
    cfg = model_registry(flavor).model
    cfg.layers = cfg.layers[: args.layers]
    if not cuda:
        for layer in cfg.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    dtype = "bfloat16" if args.precision == "bf16" else "float32"
    training = TrainingConfig(
        local_batch_size=args.batch, seq_len=args.seq_len, steps=args.steps, mixed_precision_param=dtype
    )
    parallelism = ParallelismConfig()
    cfg.update_from_config(config=argparse.Namespace(training=training, parallelism=parallelism))
    with torch.device("meta"):
        model = cfg.build()
    dims = ParallelDims.from_config(parallelism, 1)
    model = model_registry(flavor).parallelize_fn(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder=tempfile.mkdtemp(prefix="titan-"),
    )
    device = torch.device("cuda" if cuda else "cpu")
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda, foreach=None if cuda else True)
    tokens = torch.randint(0, SHAPES[flavor]["vocab_size"], (args.batch, args.seq_len + 1), device=device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(args.seq_len, device=device).unsqueeze(0).expand(args.batch, -1)
    extra = {"positions": positions}
    if cuda:  # flex attention: one document per row, block-causal (what the trainer builds from positions)
        extra["attention_masks"] = model.get_attention_masks(positions=positions)

    def step() -> float:
        logits = model(inputs, **extra)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses = [step() for _ in range(args.steps)]
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / args.steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    print("RESULT " + json.dumps({"iteration_s": seconds, "peak_allocated_GiB": peak, "parameters": params,
                                  "losses": losses}), flush=True)  # fmt: skip
    dist.destroy_process_group()


def titan_side(args, flavor: str, precision: str) -> dict:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29400 + os.getpid() % 500))
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, __file__, "--titan-worker", "--flavor", flavor, "--precision", precision]
    cmd += ["--device", args.device, "--layers", str(args.layers), "--seq-len", str(args.seq_len)]
    cmd += ["--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode or line is None:
        raise RuntimeError(f"torchtitan exited {out.returncode}: {(out.stderr or out.stdout).strip()[-600:]}")
    return json.loads(line[len("RESULT ") :])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1, help="sequences per step (one micro-batch)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=240.0, help="per engine")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--titan-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--flavor", default="8B", help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="bf16", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.titan_worker:
        titan_worker(args)
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("titan-gpu-check: no CUDA device here (torch.cuda.is_available() is False): nothing to check")
        return 0
    cuda = args.device == "cuda"
    flavor = "8B" if cuda else "debugmodel"
    precision = "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"
    where = torch.cuda.get_device_name(0) if cuda else "CPU (smoke run: gloo, fp32, SDPA attention)"
    print(
        f"titan-gpu-check on {where}: Llama-3 {flavor} shapes, {args.layers} layers, {args.batch} x {args.seq_len}"
        f" tokens per step, {precision}, {args.warmup} warm-up + {args.steps} timed steps",
        flush=True,
    )
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="titan-check-") as tmp:
        for name, run in (
            ("autotune", lambda: autotune_side(args, flavor, precision, Path(tmp))),
            ("torchtitan", lambda: titan_side(args, flavor, precision)),
        ):
            t0 = time.time()
            try:
                rows[name] = run()
            except (RuntimeError, subprocess.TimeoutExpired, ImportError) as e:
                rows[name] = {"error": str(e)}
            print(f"  {name}: {time.time() - t0:.0f} s", flush=True)
    tokens = args.batch * args.seq_len
    print(f"\n{'engine':11s} {'parameters':>13s} {'iteration s':>12s} {'tokens/s':>10s} {'peak alloc GiB':>15s}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:11s} failed: {r['error']}")
            continue
        r["tokens_per_s"] = tokens / r["iteration_s"]
        print(
            f"{name:11s} {r['parameters']:13,d} {r['iteration_s']:12.4f} {r['tokens_per_s']:10,.0f} "
            f"{r['peak_allocated_GiB']:15.2f}"
        )
    if all("error" not in r for r in rows.values()):
        a, t = rows["autotune"], rows["torchtitan"]
        memory = a["peak_allocated_GiB"] / t["peak_allocated_GiB"] if cuda else float("nan")
        print(
            f"autotune / torchtitan: tokens/s {a['tokens_per_s'] / t['tokens_per_s']:.2f}x, peak memory "
            + (f"{memory:.2f}x" if cuda else "- (CPU: not compared)")
            + f", parameters {a['parameters'] / t['parameters']:.4f}x"
        )
    if args.out:
        args.out.write_text(json.dumps({"device": where, "flavor": flavor, "rows": rows}, indent=1))
    return 0 if all("error" not in r for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
