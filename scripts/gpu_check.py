"""GPU check: the simulator against real runs on the one CUDA GPU here (``make gpu-check``).

    .venv/bin/python scripts/gpu_check.py [--out gpu_check.json] [--steps 3] [--model gpt2-xl]

1. Writes a one-node cluster of the GPU found here (its catalog type when ``torch.cuda.get_device_name``
   names one, else an inline GPU with the measured memory) and a small GPT model (12 layers, hidden 768,
   sequence 1024, GPT-2's vocabulary; ``precision: bf16`` where the GPU has bf16, else ``fp32``).
2. ``autotune profile`` of that cluster and model on the GPU (micro-batches 1-8, tp 1).
3. For 5 single-GPU plans (micro-batch 1-8, no / full / selective recomputation): ``autotune simulate
   --json`` without and with the profile, and ``autotune measure --json`` (the runner, 1 warm-up + 3
   timed steps).
4. One table: measured iteration time and ``torch.cuda.max_memory_allocated`` (``allocated_memory_GiB``)
   and device memory (``peak_memory_GiB``, as nvidia-smi sees it), the predictions and their errors.

Without a CUDA device it says so and exits 0. Everything runs through the CLI, in subprocesses, each
with a timeout, so the whole check stays under ~8 minutes on one GPU (the profile takes most of it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AUTOTUNE = [sys.executable, "-m", "autotune.cli"]

#: substrings of ``torch.cuda.get_device_name`` -> catalog name (first match wins)
NAMES = (
    ("GH200", "GH200"),
    ("H200", "H200"),
    ("H100", "H100-80GB"),
    ("A800", "A800-80GB"),
    ("L40S", "L40S"),
    ("A10G", "A10G"),
    ("L4", "L4"),
    ("T4", "T4"),
    ("V100", "V100-32GB"),
    ("4090", "RTX-4090"),
    ("3090", "RTX-3090"),
    ("A6000", "A6000"),
    ("TITAN RTX", "TITAN-RTX"),
    ("2080 Ti", "RTX-2080-Ti"),
    ("2080", "RTX-2080"),
)
MODEL = {
    "name": "gpt-check",
    "num_layers": 12,
    "hidden_size": 768,
    "num_heads": 12,
    "ffn_hidden_size": 3072,
    "mlp": "gelu",
    "vocab_size": 50257,
    "seq_len": 1024,
    "global_batch_size": 16,
}
# name -> (micro-batch size, recompute)
PLANS = {
    "mbs1": (1, False),
    "mbs2": (2, False),
    "mbs4": (4, False),
    "mbs8 full recompute": (8, True),
    "mbs8 selective": (8, "selective"),
}


def catalog_name(device_name: str, memory_GiB: float) -> str | None:
    if "A100" in device_name:
        return "A100-80GB" if memory_GiB > 50 else "A100-40GB"
    for key, name in NAMES:
        if key in device_name:
            return name
    return None


def one_gpu_cluster(name: str, device_name: str, memory_GiB: float) -> dict:
    """A one-node cluster file of the GPU here: its catalog type when ``catalog_name`` knows ``device_name``,
    else an inline GPU with the measured memory (datasheet peaks unknown)."""
    gpu = catalog_name(device_name, memory_GiB) or {
        "name": "local-gpu",
        "peak_tflops": 100.0,
        "memory_GiB": round(memory_GiB, 2),
        "memory_bandwidth_GBps": 1000.0,
    }
    return {
        "name": name,
        "nodes": [{"name": "gpu", "gpu": gpu, "count": 1, "intra_node": {"bandwidth_GBps": 300}}],
        "network": {"bandwidth_GBps": 25},
    }


def single_gpu_plan(model: dict, mbs: int, recompute: bool | str) -> dict:
    """The plan file of one of ``PLANS``: the whole model ``model`` (a model file's fields) as one stage on
    ``gpu:0``, 1F1B over the global batch (``experiments/fidelity/error_bars.py`` simulates the same plans)."""
    return {
        "micro_batch_size": mbs,
        "schedule": "1f1b",
        "pipelines": [
            {
                "num_microbatches": model["global_batch_size"] // mbs,
                "stages": [{"devices": ["gpu:0"], "layers": model["num_layers"], "recompute": recompute}],
            }
        ],
    }


def run(cmd: list[str], timeout_s: float) -> dict:
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[2:5])}... exited {out.returncode}: {out.stderr.strip()[-400:]}")
    return json.loads(out.stdout) if out.stdout.strip().startswith("{") else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--model",
        default=None,
        help="a catalog model (e.g. gpt2-xl) instead of the 12-layer default, at the same global batch 16",
    )
    args = ap.parse_args()
    spec = MODEL
    if args.model:
        from autotune.catalog import MODEL_PRESETS

        if args.model not in MODEL_PRESETS:
            ap.error(f"--model {args.model}: not a catalog model ({', '.join(sorted(MODEL_PRESETS))})")
        spec = {**MODEL_PRESETS[args.model], "name": args.model, "global_batch_size": MODEL["global_batch_size"]}
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False): nothing to check")
        return 0
    t_start = time.time()
    props = torch.cuda.get_device_properties(0)
    memory_GiB = props.total_memory / 2**30
    name = catalog_name(props.name, memory_GiB)
    bf16 = torch.cuda.is_bf16_supported()
    print(
        f"gpu-check on {props.name} ({memory_GiB:.1f} GiB, compute capability {props.major}.{props.minor}); "
        f"catalog type: {name or 'none (inline GPU, datasheet peaks unknown)'}; precision "
        f"{'bf16' if bf16 else 'fp32'}",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    cluster = work / "cluster.json"
    cluster.write_text(json.dumps(one_gpu_cluster("gpu-check", props.name, memory_GiB)))
    model = work / "model.json"
    model.write_text(json.dumps({**spec, "precision": "bf16" if bf16 else "fp32"}))
    profile = work / "profile.json"
    t0 = time.time()
    # not --quick: that stops at micro-batch 2, and the plans below go to 8 (a GPU profiles them in ~1 min)
    run(
        AUTOTUNE + ["profile", "--cluster", str(cluster), "--model", str(model), "--output", str(profile)],
        timeout_s=360,
    )
    print(f"profiled in {time.time() - t0:.0f} s -> {profile}", flush=True)
    rows = []
    for label, (mbs, recompute) in PLANS.items():
        cfg = work / f"{label.replace(' ', '_')}.json"
        cfg.write_text(json.dumps(single_gpu_plan(spec, mbs, recompute)))
        base = ["--cluster", str(cluster), "--model", str(model), "--config", str(cfg), "--json"]
        sim = run(AUTOTUNE + ["simulate"] + base, timeout_s=60)
        simp = run(AUTOTUNE + ["simulate"] + base + ["--profile", str(profile)], timeout_s=60)
        try:
            meas = run(AUTOTUNE + ["measure"] + base + ["--steps", str(args.steps), "--timeout", "120"], timeout_s=150)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            meas = {"status": "failed", "error": str(e)}
        rows.append({"plan": label, "simulated": sim, "simulated_with_profile": simp, "measured": meas})
        print(  # each plan as it comes (a run stopped early keeps what it measured)
            f"  {label}: measured {meas.get('status')} {meas.get('iteration_time_s', float('nan')):.4f} s, "
            f"simulated {sim.get('iteration_time_s', float('nan')):.4f} s, "
            f"with the profile {simp.get('iteration_time_s', float('nan')):.4f} s",
            flush=True,
        )

    def one(d: dict, key: str) -> float:
        v = d.get(key) or {}
        return float(next(iter(v.values()))) if v else float("nan")

    def err(p: float, m: float) -> str:
        return f"{100 * (p - m) / m:+6.1f}%" if m == m and m > 0 and p == p else "     -"

    print(
        f"\n{'plan':22s} {'meas s':>8s} {'sim s':>8s} {'err':>7s} {'+prof s':>8s} {'err':>7s} | "
        f"{'alloc GiB':>9s} {'sim':>6s} {'err':>7s} {'+prof':>6s} {'err':>7s} | {'device GiB':>10s} {'sim':>6s} {'err':>7s}"
    )
    for r in rows:
        m, s, p = r["measured"], r["simulated"], r["simulated_with_profile"]
        if m.get("status") != "ok":
            print(f"{r['plan']:22s} measure {m.get('status')}: {m.get('error', '')[:120]}")
            continue
        mt, st, pt = m["iteration_time_s"], s["iteration_time_s"], p["iteration_time_s"]
        ma, sa, pa = one(m, "allocated_memory_GiB"), one(s, "allocated_memory_GiB"), one(p, "allocated_memory_GiB")
        md, sd = one(m, "peak_memory_GiB"), one(s, "peak_memory_GiB")
        print(
            f"{r['plan']:22s} {mt:8.4f} {st:8.4f} {err(st, mt)} {pt:8.4f} {err(pt, mt)} | {ma:9.2f} {sa:6.2f} "
            f"{err(sa, ma)} {pa:6.2f} {err(pa, ma)} | {md:10.2f} {sd:6.2f} {err(sd, md)}"
        )
    print(f"\ngpu-check took {time.time() - t_start:.0f} s")
    if args.out:
        args.out.write_text(json.dumps({"device": props.name, "catalog": name, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
