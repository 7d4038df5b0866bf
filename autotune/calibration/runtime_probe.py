"""What the runner itself costs beyond the model's math, measured by running it.

``python -m autotune.calibration.runtime_probe`` starts one gloo rank (world size 1) and does what a
runner worker does (``runner/worker.py``): import torch, read the RSS, start the process group, build
the runner's ``Engine`` (torch.distributed.pipelining stages, AdamW) for a model so small that its own
math and memory are negligible, and time steps with 1 and with ``M`` micro-batches. That gives:

- ``microbatch_overhead_s``: the pipelining framework's time per micro-batch (forward + backward of a
  stage: scheduling, loss bookkeeping, autograd set-up), the slope of step time in micro-batches;
- ``step_overhead_s``: the per-step constant (zero_grad, optimizer call set-up, the runner's closing
  loss all-reduce), the intercept;
- ``memory_baseline_GiB``: the growth of peak RSS from before the process group to the end, which the
  runner counts in every rank's "peak memory" on CPU (gloo buffers, imported modules, allocator
  arenas) and which a model of weights and activations alone does not predict.

It prints one JSON object. ``probe_runtime()`` runs it in a subprocess and returns the numbers.

``probe_parallel_overheads`` (``... runtime_probe ranks ...``, one process per rank, one launch per rank
count for all three) runs the same negligible model on several ranks as a pipeline, as data-parallel
replicas and as a tensor-parallel stage, and returns what each costs beyond one rank: per micro-batch
and stage, per step, and per layer and micro-batch (the profile's ``pipeline_overhead``,
``data_parallel_overhead`` and ``tensor_parallel_overhead`` curves).

``probe_model_memory()`` (``... runtime_probe model ...``) trains the profiled model itself on one
rank, all layers on one stage, and returns the rank's peak-RSS growth. The profiler runs it at two
micro-batch sizes and solves ``peak - baseline = s * params + a * activations`` for ``s``
(``state_bytes_per_param``: weights, gradients, AdamW moments and what the allocator keeps around
them; fp32 AdamW alone would be 16) and ``a`` (``activation_memory_factor``: peak RSS per byte that
autograd saves, above 1 because of backward temporaries and allocator retention).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from autotune.lifeline import child_env, communicate_all

log = logging.getLogger(__name__)

GiB = 2**30
PROBE_MICROBATCHES = 4  # per step in the model-memory probe (allocator state settles over several)
PROBE_MODEL = dict(
    name="probe",
    num_layers=1,
    hidden_size=8,
    num_heads=1,
    ffn_hidden_size=8,
    vocab_size=8,
    seq_len=8,
    global_batch_size=8,
)


@dataclass(frozen=True, slots=True)
class RuntimeOverheads:
    microbatch_overhead_s: float
    step_overhead_s: float
    memory_baseline_GiB: float


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    """This process's own peak RSS (``VmHWM``). Not ``getrusage().ru_maxrss``: Linux carries that over
    from the parent across fork + exec, so a child of a big process would report the parent's size."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _probe(init_file: str, repeats: int) -> dict:
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    from autotune.loading import load_cluster, load_config, model_from_dict

    baseline = _rss()  # the runner worker reads its baseline here too: after torch, before the group
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        from runner.data import TokenSource
        from runner.engine import Engine
        from runner.layout import build_layout

        cluster = load_cluster("cpu-2")
        engines = {}
        for m in (1, 8):
            model = model_from_dict({**PROBE_MODEL, "global_batch_size": m}, "probe")
            config = load_config(
                {
                    "micro_batch_size": 1,
                    "pipelines": [{"num_microbatches": m, "stages": [{"devices": ["cpu:0"], "layers": 1}]}],
                }
            )
            layout = build_layout(cluster, model, config)
            engines[m] = Engine(
                layout, model, 0, torch.device("cpu"), schedule="1f1b", seed=0, tokens=TokenSource(model, 0)
            )
            for i in range(3):
                engines[m].step(i)
        # the two step sizes alternate, so a burst of load from other processes lands on both; a slope
        # that comes out <= 0 is noise (a micro-batch always costs something), measured again
        samples: dict[int, list[float]] = {1: [], 8: []}
        per_mb = 0.0
        for _ in range(3):
            for _ in range(repeats):
                for m, engine in engines.items():
                    t0 = time.perf_counter()
                    engine.step(3 + len(samples[m]))
                    samples[m].append(time.perf_counter() - t0)
            # lower quartile: see bench._lower_quartile
            step_times = {m: sorted(v)[len(v) // 4] for m, v in samples.items()}
            per_mb = (step_times[8] - step_times[1]) / 7
            if per_mb > 0:
                break
        per_mb = max(0.0, per_mb)
        return {
            "microbatch_overhead_s": per_mb,
            "step_overhead_s": max(0.0, step_times[1] - per_mb),
            "memory_baseline_GiB": max(0, _peak_rss() - baseline) / GiB,
        }
    finally:
        dist.destroy_process_group()


def _probe_ranks(init_file: str, rank: int, world: int, jobs: dict[str, tuple[int, ...]], repeats: int) -> dict:
    """One rank of ``world`` runner ranks training the negligible probe model, for each ``shape: sizes`` of
    ``jobs`` in turn (one process group for all: starting the ranks costs more than the probes): one layer
    per rank as one ``world``-stage pipeline ("pipeline") or as ``world`` one-stage data-parallel replicas
    ("replicas"), each at ``sizes`` micro-batches; or one ``world``-way tensor-parallel stage of ``sizes``
    layers at ``TENSOR_MICROBATCHES`` micro-batches ("tensor"). Returns the step time of each shape at
    each size, as every rank sees it (the step ends in an all-reduce)."""
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    from autotune.loading import cluster_from_dict, load_config, model_from_dict

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from runner.data import TokenSource
        from runner.engine import Engine
        from runner.layout import build_layout

        cluster = cluster_from_dict(
            {
                "name": "probe",
                "nodes": [{"name": "cpu", "gpu": "cpu", "count": world}],
                "network": {"bandwidth_GBps": 5, "latency_us": 20},
            },
            "probe",
        )
        step_s: dict[str, dict[str, float]] = {}
        for shape, m in [(shape, m) for shape, sizes in jobs.items() for m in sizes]:
            if shape == "tensor":  # m layers; heads and FFN split across the world ranks
                model = model_from_dict(
                    {
                        **PROBE_MODEL,
                        "num_layers": m,
                        "hidden_size": 16,
                        "num_heads": 4,
                        "ffn_hidden_size": 16,
                        "global_batch_size": TENSOR_MICROBATCHES,
                    },
                    "probe",
                )
                pipelines = [
                    {
                        "num_microbatches": TENSOR_MICROBATCHES,
                        "stages": [{"devices": [f"cpu:{i}" for i in range(world)], "layers": m}],
                    }
                ]
            elif shape == "pipeline":
                model = model_from_dict({**PROBE_MODEL, "num_layers": world, "global_batch_size": m}, "probe")
                pipelines = [
                    {"num_microbatches": m, "stages": [{"devices": [f"cpu:{i}"], "layers": 1} for i in range(world)]}
                ]
            else:
                model = model_from_dict({**PROBE_MODEL, "num_layers": 1, "global_batch_size": m * world}, "probe")
                pipelines = [
                    {"num_microbatches": m, "stages": [{"devices": [f"cpu:{i}"], "layers": 1}]} for i in range(world)
                ]
            config = load_config({"micro_batch_size": 1, "pipelines": pipelines})
            layout = build_layout(cluster, model, config)
            engine = Engine(
                layout, model, rank, torch.device("cpu"), schedule="1f1b", seed=0, tokens=TokenSource(model, 0)
            )
            for i in range(2):
                engine.step(i)
            samples = []
            for i in range(repeats):
                samples.append(engine.step(2 + i).time_s)
            # ranks on shared cores: the middle, not the luckiest
            step_s.setdefault(shape, {})[str(m)] = statistics.median(samples)
        return {"step_s": step_s}
    finally:
        dist.destroy_process_group()


PIPELINE_MICROBATCHES = (4, 16)
TENSOR_MICROBATCHES = 4
TENSOR_LAYERS = (1, 4)
DATA_PARALLEL_MICROBATCHES = (2, 8)


def _step_times(
    world: int, jobs: dict[str, tuple[int, ...]], repeats: int, timeout_s: float
) -> dict[str, dict[int, float]]:
    """Run ``_probe_ranks`` as ``world`` processes (as the runner's ranks are); rank 0's step times per
    shape and size."""
    from runner.launch import run_dir

    with run_dir("autotune-probe-") as d:  # swept by a later run when this process is killed
        env = child_env(dict(os.environ, OMP_NUM_THREADS="1"))  # children die with this process
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "autotune.calibration.runtime_probe",
                    "ranks",
                    f"{d}/rendezvous",
                    str(r),
                    str(world),
                    json.dumps(jobs),
                    str(repeats),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for r in range(world)
        ]
        outs = communicate_all(procs, timeout_s)  # all killed and reaped; Ctrl-C raised only after that
    if any(proc.returncode != 0 for proc in procs):
        err = next((o[1] for proc, o in zip(procs, outs) if proc.returncode != 0), "")
        lines = err.strip().splitlines()
        raise RuntimeError(f"{'/'.join(jobs)} probe with {world} ranks failed: {lines[-1] if lines else 'no output'}")
    step_s = json.loads(outs[0][0].strip().splitlines()[-1])["step_s"]
    return {shape: {int(m): t for m, t in times.items()} for shape, times in step_s.items()}


@dataclass(frozen=True, slots=True)
class ParallelOverheads:
    """The profile's ``pipeline_overhead``, ``data_parallel_overhead`` and ``tensor_parallel_overhead``
    curves (``probe_parallel_overheads``)."""

    pipeline: tuple[tuple[int, float], ...]
    data_parallel: tuple[tuple[int, float], ...]
    tensor_parallel: tuple[tuple[int, float], ...]


def probe_parallel_overheads(
    max_ranks: int, repeats: int = 10, rounds: int = 2, timeout_s: float = 300.0
) -> ParallelOverheads:
    """What the runner's parallelism costs on this host beyond one rank, on the negligible probe model
    (the ranks run as separate processes, as the runner's do; one launch per rank count and round runs
    all three shapes):

    - ``pipeline``: ``(ranks, seconds)``, what each micro-batch costs each stage of a ``ranks``-stage
      pipeline beyond one rank alone: the pipelining runtime's hand-offs (gloo send/recv, waking the next
      rank) and the ranks' runtime overheads competing for the host's cores. The slope of step time in
      ``microbatches + ranks - 1`` (the 1F1B critical path in stage slots) at ``ranks`` minus at one rank.
    - ``data_parallel``: ``(replicas, seconds)``, what a step of one-rank replicas costs beyond one rank's
      step: the intercept (micro-batch count 0) of step time against micro-batches, minus one rank's. That
      is the gradient all-reduce call and the wait for the slowest replica (ranks on shared cores do not
      finish together), not the bytes moved, which the simulator's link model already prices.
    - ``tensor_parallel``: ``(tp, seconds)``, what each layer costs per micro-batch (forward + backward)
      in a ``tp``-way tensor-parallel stage beyond one rank's layer: the slope of step time in layers,
      minus one rank's. The per-layer collectives' fixed costs (DTensor dispatch, gloo calls, waiting for
      the other shard's rank), not the activation bytes. ``tp`` runs over the powers of two up to
      ``max_ranks``."""
    worlds = list(range(1, max(2, max_ranks) + 1))
    degrees = {1} | {t for t in (2, 4, 8) if t <= max_ranks}
    pipe_lo, pipe_hi = PIPELINE_MICROBATCHES
    dp_lo, dp_hi = DATA_PARALLEL_MICROBATCHES
    tp_lo, tp_hi = TENSOR_LAYERS
    slopes: dict[int, list[float]] = {}
    intercepts: dict[int, list[float]] = {}
    tp_slopes: dict[int, list[float]] = {}
    for world in [w for _ in range(rounds) for w in worlds]:
        jobs = {"pipeline": PIPELINE_MICROBATCHES, "replicas": DATA_PARALLEL_MICROBATCHES}
        if world in degrees:
            jobs["tensor"] = TENSOR_LAYERS
        times = _step_times(world, jobs, repeats, timeout_s)
        pipe = times["pipeline"]
        slopes.setdefault(world, []).append(max(0.0, (pipe[pipe_hi] - pipe[pipe_lo]) / (pipe_hi - pipe_lo)))
        dp = times["replicas"]
        slope = (dp[dp_hi] - dp[dp_lo]) / (dp_hi - dp_lo)
        intercepts.setdefault(world, []).append(dp[dp_lo] - slope * dp_lo)
        if "tensor" in times:
            tp = times["tensor"]
            tp_slopes.setdefault(world, []).append(
                max(0.0, (tp[tp_hi] - tp[tp_lo]) / ((tp_hi - tp_lo) * TENSOR_MICROBATCHES))
            )
    return ParallelOverheads(_beyond_one(slopes), _beyond_one(intercepts), _beyond_one(tp_slopes))


def _beyond_one(samples: dict[int, list[float]]) -> tuple[tuple[int, float], ...]:
    """``(n, mean at n - mean at 1)`` for each ``n > 1``, at least 0."""
    mean = {n: statistics.fmean(v) for n, v in samples.items()}
    return tuple((n, max(0.0, mean[n] - mean[1])) for n in sorted(mean) if n > 1)


def _probe_model_memory(init_file: str, model_json: str, micro_batch_size: int, steps: int = 3) -> dict:
    """Peak-RSS growth of one rank training the whole model on one stage, as a runner worker counts it."""
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    from autotune.loading import load_cluster, load_config, model_from_dict

    baseline = _rss()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        from runner.data import TokenSource
        from runner.engine import Engine
        from runner.layout import build_layout

        raw = json.loads(model_json)
        model = model_from_dict({**raw, "global_batch_size": PROBE_MICROBATCHES * micro_batch_size}, "probe")
        config = load_config(
            {
                "micro_batch_size": micro_batch_size,
                "pipelines": [
                    {
                        "num_microbatches": PROBE_MICROBATCHES,
                        "stages": [{"devices": ["cpu:0"], "layers": model.num_layers}],
                    }
                ],
            }
        )
        layout = build_layout(load_cluster("cpu-2"), model, config)
        engine = Engine(layout, model, 0, torch.device("cpu"), schedule="1f1b", seed=0, tokens=TokenSource(model, 0))
        for i in range(steps):
            engine.step(i)
        return {"peak_growth_GiB": max(0, _peak_rss() - baseline) / GiB}
    finally:
        dist.destroy_process_group()


def probe_model_memory(model, micro_batch_size: int, timeout_s: float = 300.0) -> float:
    """Peak memory (GiB, RSS growth) of one runner rank holding all of ``model`` at ``micro_batch_size``."""
    raw = {
        k: getattr(model, k)
        for k in (
            "name",
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "ffn_hidden_size",
            "mlp",
            "vocab_size",
            "seq_len",
        )
    }
    from runner.launch import run_dir

    with run_dir("autotune-probe-") as d:  # swept by a later run when this process is killed
        env = child_env(dict(os.environ, OMP_NUM_THREADS="1"))  # children die with this process
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "autotune.calibration.runtime_probe",
                "model",
                f"{d}/rendezvous",
                json.dumps(raw),
                str(micro_batch_size),
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        raise RuntimeError(f"model memory probe failed: {lines[-1] if lines else 'no output'}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_growth_GiB"])


def probe_runtime(repeats: int = 20, timeout_s: float = 120.0) -> RuntimeOverheads:
    """Run the probe in a fresh process (so its RSS is a runner rank's, not this one's)."""
    from runner.launch import run_dir

    with run_dir("autotune-probe-") as d:  # swept by a later run when this process is killed
        env = child_env(dict(os.environ, OMP_NUM_THREADS="1"))  # children die with this process
        out = subprocess.run(
            [sys.executable, "-m", "autotune.calibration.runtime_probe", f"{d}/rendezvous", str(repeats)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        raise RuntimeError(f"runtime probe failed: {lines[-1] if lines else 'no output'}")
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return RuntimeOverheads(
        float(data["microbatch_overhead_s"]), float(data["step_overhead_s"]), float(data["memory_baseline_GiB"])
    )


if __name__ == "__main__":
    from autotune.lifeline import die_with_parent

    die_with_parent()  # `autotune profile` may be killed: the probe processes go with it
    if sys.argv[1] == "model":  # model INIT_FILE MODEL_JSON MICRO_BATCH_SIZE
        print(json.dumps(_probe_model_memory(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
    elif sys.argv[1] == "ranks":  # ranks INIT_FILE RANK WORLD {"pipeline"|"replicas"|"tensor": [sizes]} REPEATS
        jobs = {shape: tuple(int(m) for m in sizes) for shape, sizes in json.loads(sys.argv[5]).items()}
        result = _probe_ranks(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), jobs, int(sys.argv[6]))
        if int(sys.argv[3]) == 0:
            print(json.dumps(result))
    else:  # INIT_FILE [REPEATS]
        print(json.dumps(_probe(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20)))
