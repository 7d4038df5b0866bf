"""Roundpipe plans on a real CUDA machine, through the ``roundpipe`` library: a check that runs in a few minutes.

Needs NVIDIA GPUs, a CUDA build of torch and the extra (``pip install -e '.[roundpipe]'``). It builds a
cluster file for this machine's GPUs (catalog GPU where the name matches, else the device's own memory),
then:

1. ``tiny`` (fp32, 4 blocks) under a hand-made roundpipe plan over every GPU: ``measure`` (3 timed steps),
   its first loss against the single-process reference (``runner.reference``; same weights and data), and
   ``train`` for 6 steps (the loss must fall);
2. ``gpt2-xl`` (1.5B, bf16, global batch 16 x 1024 tokens) under the plan RoundPipe itself would pick for
   this pool (``SearchSpace.roundpipe_start``): measured tokens/s and peak memory per GPU beside the
   simulator's prediction for the same plan on the same cluster file.

    .venv/bin/python scripts/roundpipe_gpu_check.py [--out DIR] [--skip-large]

Prints one JSON object (also written to ``DIR/roundpipe_gpu_check.json``); exit 1 when a check fails.
``tests/unit/runner/test_roundpipe_runner.py::test_gpu_roundpipe_plan_measures_and_trains`` runs part 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TINY = {
    "name": "tiny-fp32",
    "num_layers": 4,
    "hidden_size": 64,
    "num_heads": 4,
    "ffn_hidden_size": 256,
    "mlp": "gelu",
    "vocab_size": 256,
    "seq_len": 64,
    "global_batch_size": 8,
    "precision": "fp32",
}


def _host_memory_GiB() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    return 64.0


def local_cluster(directory: Path) -> Path:
    """A cluster file for this machine's GPUs: node ``gpu``, ``count`` = visible GPUs, host memory from
    /proc/meminfo; the catalog's GPU when its name is in the device's name, else the device's own memory."""
    import torch

    from autotune.catalog import GPU_CATALOG

    n = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    key = name.replace("NVIDIA", "").replace("GeForce", "").strip().replace(" ", "-").upper()
    match = next((g for g in sorted(GPU_CATALOG, key=len, reverse=True) if g.upper() in key), None)
    if match is not None:
        gpu = match
    else:
        props = torch.cuda.get_device_properties(0)
        gpu = {
            "name": key or "gpu",
            "peak_tflops": 100.0,
            "memory_GiB": props.total_memory / 2**30,
            "memory_bandwidth_GBps": 1000.0,
            "source": f"{name}: memory from the device, peaks assumed",
        }
    text = {
        "name": "local",
        "nodes": [
            {
                "name": "gpu",
                "gpu": gpu,
                "count": n,
                "intra_node": {"bandwidth_GBps": 25, "latency_us": 10},
                "host": {"memory_GiB": round(0.9 * _host_memory_GiB(), 1)},
            }
        ],
        "network": {"bandwidth_GBps": 12.5, "latency_us": 10},
    }
    path = directory / "local-cluster.json"
    path.write_text(json.dumps(text, indent=1))
    return path


def tiny_plan(n_gpus: int) -> dict:
    return {
        "micro_batch_size": 1,
        "schedule": "roundpipe",
        "pipelines": [
            {
                "num_microbatches": 8,
                "devices": [f"gpu:{i}" for i in range(n_gpus)],
                "forward_layers": [1, 2],
                "fused_layers": 1,
                "backward_layers": [1, 2],
                "recompute_grain": "stage",
            }
        ],
    }


def tiny_checks(directory: Path) -> dict:
    import torch

    from autotune.loading import load_cluster, load_config, model_from_dict
    from runner import profiled_run
    from runner.reference import reference_losses
    from runner.train import train

    directory = Path(directory)
    cluster = load_cluster(local_cluster(directory))
    model = model_from_dict(TINY, "tiny-fp32")
    plan = load_config(tiny_plan(torch.cuda.device_count()))
    t0 = time.perf_counter()
    m = profiled_run(cluster, model, plan, steps=3, warmup=1, timeout_s=240)
    measure_s = time.perf_counter() - t0
    model_file = directory / "tiny-fp32.json"
    model_file.write_text(json.dumps(TINY))
    plan_file = directory / "tiny-roundpipe.json"
    plan_file.write_text(json.dumps(tiny_plan(torch.cuda.device_count())))
    metrics = directory / "train.jsonl"
    outcome = train(
        str(directory / "local-cluster.json"),
        str(model_file),
        plan_file,
        steps=6,
        metrics_out=metrics,
        quiet=True,
        timeout_s=240,
    )
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return {
        "measure": m.to_dict(),
        "measure_wall_s": measure_s,
        "train_returncode": outcome.returncode,
        "train_error": outcome.error,
        "train_losses": losses,
        "first_loss": losses[0] if losses else None,
        "reference_first_loss": reference_losses(model, 1)[0],
    }


def large_check(directory: Path, name: str = "gpt2-xl") -> dict:
    from autotune.loading import load_cluster, load_model
    from autotune.planning.space import SearchSpace
    from autotune.simulator import Simulator
    from runner import profiled_run

    cluster = load_cluster(local_cluster(Path(directory)))
    model = load_model(name, 16)
    space = SearchSpace(cluster, model)
    params = space.roundpipe_start()
    if params is None:
        return {"error": "no roundpipe plan applies on this cluster"}
    plan = space.decode(params).config
    predicted = Simulator(cluster, model).evaluate(plan)
    t0 = time.perf_counter()
    measured = profiled_run(cluster, model, plan, steps=3, warmup=2, timeout_s=420)
    out = {
        "plan": plan.describe(),
        "measured": measured.to_dict(),
        "predicted": predicted.to_dict(),
        "wall_s": time.perf_counter() - t0,
    }
    if measured.ok and predicted.ok:
        out["tokens_per_s_error"] = predicted.tokens_per_s / measured.tokens_per_s - 1
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--skip-large", action="store_true")
    parser.add_argument("--large-model", default="gpt2-xl", help="the catalog model of check 2 (default gpt2-xl)")
    args = parser.parse_args()
    import torch

    from runner.roundpipe_run import EXTRA_HINT, library_installed

    if not torch.cuda.is_available():
        print("roundpipe_gpu_check: this machine has no CUDA; run it on a machine with NVIDIA GPUs", file=sys.stderr)
        return 2
    if not library_installed():
        print(f"roundpipe_gpu_check: the roundpipe library is not installed: {EXTRA_HINT}", file=sys.stderr)
        return 2
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="roundpipe-gpu-check-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "gpus": [torch.cuda.get_device_name(k) for k in range(torch.cuda.device_count())],
        "torch": torch.__version__,
        "tiny": tiny_checks(out_dir),
    }
    print(json.dumps({"tiny": result["tiny"]}), flush=True)  # before the large check, which may run long
    if not args.skip_large:
        result[args.large_model] = large_check(out_dir, args.large_model)
    tiny = result["tiny"]
    ok = (
        tiny["measure"]["status"] == "ok"
        and tiny["train_returncode"] == 0
        and len(tiny["train_losses"]) == 6
        and tiny["train_losses"][-1] < tiny["train_losses"][0]
        and abs(tiny["first_loss"] - tiny["reference_first_loss"]) < 2e-2 * tiny["reference_first_loss"]
    )
    result["ok"] = ok
    text = json.dumps(result, indent=1)
    (out_dir / "roundpipe_gpu_check.json").write_text(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
