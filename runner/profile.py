"""A short profiled run on one rank, and how rank 0 turns all ranks' readings into a ``Measurement``.

Readings, per rank, over the timed steps (after warm-up):
- step wall time; the iteration time is the slowest rank's mean (steps end in a global all-reduce,
  so ranks agree to within that collective);
- forward and backward compute time of its stage(s) (``TimedStage``), including emulated slowdown
  (``emulated_s``: the part that is slowdown's sleeps; ``result.json`` keeps every rank's readings);
- peak memory: CUDA: ``peak_memory_GiB`` the device's view (``total - free`` of ``torch.cuda.mem_get_info``
  after the timed steps: the allocator's cached pool, CUDA context and NCCL buffers included, as
  nvidia-smi shows it) and ``allocated_memory_GiB`` = ``torch.cuda.max_memory_allocated``; CPU both are
  the growth of the process's peak RSS
  (``getrusage`` max RSS minus the RSS before the model was built), which also counts allocator
  and communication buffers, less the state the rank keeps in host memory (offload, ``runner.zero``:
  on the CPU it lives in the same process). A CPU rank whose growth exceeds its device's ``memory_GiB``
  is reported as ``oom`` (emulation: the process itself did not run out);
- host memory (plans that offload): the bytes of the ranks' host-held state, summed per node
  (``host_memory_GiB``), ``oom`` beyond the node's ``host.memory_GiB``.

Derived:
- ``stage_busy_s``: per stage of the slowest pipeline, forward + backward seconds per step (the
  slowest tensor-parallel rank of each stage); the slowest pipeline is the one with the largest
  ``max_stage_busy * (1 + (S - 1) / m)``, the 1F1B estimate of its step time;
- ``bubble_fraction``: ``1 - mean over ranks (busy / iteration time)``: the share of rank-time not
  spent computing (pipeline bubbles, communication, gradient sync, optimizer);
- ``timeline``: the last timed step's events per device: ``F<mb>`` / ``B<mb>`` (forward / backward of
  micro-batch ``mb``; ``F<mb>@<v>`` on virtual stage ``v`` when interleaved), ``allreduce`` (gradient
  sync) and ``optimizer``, in seconds from that step's start on each rank (ranks' clocks are the
  host's monotonic clock; steps start together after the previous step's all-reduce);
- ``sync_time_s`` (SPES plans): one synchronisation, timed on its own after the timed local steps
  (which do not synchronise); ``iteration_time_s`` adds it divided by ``sync_every_steps``;
- ``mfu``: model FLOPs per second (``runner.model.flops_per_token``) over the plan's devices' summed
  datasheet peaks at the model's precision (16-bit tensor rate for bf16/fp16, TF32 for fp32; for ``cpu``
  the catalog's nominal fp32 core), as the simulator counts it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from autotune.simulator.efficiency import effective_precision
from autotune.specs import ClusterSpec, Measurement, ModelSpec, ParallelConfig, TimelineEvent
from runner.data import TokenSource
from runner.engine import Engine
from runner.layout import Layout
from runner.model import flops_per_token

log = logging.getLogger(__name__)
GiB = 2**30


def profile_rank(
    job: dict,
    layout: Layout,
    cluster: ClusterSpec,
    model: ModelSpec,
    config: ParallelConfig,
    rank: int,
    device: torch.device,
    baseline_rss: int,
    peak_rss: Callable[[], int],
    fault: Callable[[int], None],
) -> None:
    steps, warmup = int(job["steps"]), int(job["warmup"])
    engine = Engine(
        layout,
        model,
        rank,
        device,
        schedule=config.schedule,
        seed=int(job.get("seed", 0)),
        tokens=TokenSource(model, int(job.get("seed", 0))),
    )
    fault(rank)
    spes = engine.expert_sync is not None and layout.sync_every_steps > 1
    if spes:  # SPES: time the local steps, then one synchronisation on its own
        engine.expert_sync.periodic = False
    losses = []
    for i in range(warmup):
        losses.append(engine.step(i).loss)
    dist.barrier()
    fwd0, bwd0 = engine.busy()
    emulated0 = engine.emulated()
    t0 = time.perf_counter()
    recorder = None
    for i in range(warmup, warmup + steps):
        if i == warmup + steps - 1:
            recorder = engine.record_next_step()
        losses.append(engine.step(i).loss)
    elapsed = time.perf_counter() - t0
    fwd, bwd = engine.busy()
    sync_s = 0.0
    if spes:
        dist.barrier()
        t1 = time.perf_counter()
        engine.expert_sync.synchronise(engine.zero.in_turn if engine.zero is not None else None)
        dist.barrier()
        sync_s = time.perf_counter() - t1
    host_bytes = engine.zero.host_bytes() if engine.zero is not None else 0
    if device.type == "cuda":
        allocated_GiB = torch.cuda.max_memory_allocated(device) / GiB
        free, total = torch.cuda.mem_get_info(device)
        # the device's view, as nvidia-smi shows it: the allocator keeps its peak pool cached, plus the
        # CUDA context, library workspaces and NCCL buffers (the simulator's peak_memory_GiB)
        peak_GiB = max(allocated_GiB, (total - free) / GiB)
    else:  # host-held (offloaded) state lives in the same process memory on CPU: count it apart
        peak_GiB = allocated_GiB = max(0, peak_rss() - baseline_rss - host_bytes) / GiB
    plan = layout.ranks[rank]
    reading = {
        "rank": rank,
        "device": plan.device_id,
        "pipeline": plan.pipeline,
        "stage": plan.stage,
        "forward_s": (fwd - fwd0) / steps,
        "backward_s": (bwd - bwd0) / steps,
        "emulated_s": (engine.emulated() - emulated0) / steps,
        "iteration_time_s": elapsed / steps,
        "peak_memory_GiB": peak_GiB,
        "allocated_memory_GiB": allocated_GiB,
        "timeline": recorder.events,
        "sync_time_s": sync_s,
        "host_GiB": host_bytes / GiB,
        "node": cluster.node_of(plan.device_id).name,
    }
    readings: list[dict] = [None] * layout.world_size  # type: ignore[list-item]
    dist.all_gather_object(readings, reading)
    if rank == 0:
        m = summarize(readings, cluster, model, config)
        log.info("measured %.1f tokens/s, %.3f s/iteration", m.tokens_per_s, m.iteration_time_s)
        out = {
            "measurement": m.to_dict(timeline=True),
            "losses": losses,
            "readings": [{k: v for k, v in r.items() if k != "timeline"} for r in readings],
        }
        Path(job["out_dir"], "result.json").write_text(json.dumps(out))


def summarize(readings: list[dict], cluster: ClusterSpec, model: ModelSpec, config: ParallelConfig) -> Measurement:
    # SPES: local steps plus one synchronisation (timed on its own) every sync_every_steps steps
    sync = max((r.get("sync_time_s", 0.0) for r in readings), default=0.0)
    iteration = max(r["iteration_time_s"] for r in readings) + sync / config.sync_every_steps
    tokens_per_s = model.global_batch_size * model.seq_len / iteration
    stage_busy: dict[tuple[int, int], float] = {}
    for r in readings:
        key = (r["pipeline"], r["stage"])
        stage_busy[key] = max(stage_busy.get(key, 0.0), r["forward_s"] + r["backward_s"])

    def estimate(p: int) -> float:
        busy = [b for (q, _), b in stage_busy.items() if q == p]
        pipe = config.pipelines[p]
        return max(busy) * (1 + (len(pipe.stages) - 1) / pipe.num_microbatches)

    slowest = max(range(len(config.pipelines)), key=estimate)
    busy_of_slowest = tuple(stage_busy[(slowest, s)] for s in range(len(config.pipelines[slowest].stages)))
    bubble = 1.0 - sum((r["forward_s"] + r["backward_s"]) / iteration for r in readings) / len(readings)
    peak_flops = (
        sum(
            cluster.device(d).matmul_peak_tflops(effective_precision(cluster.device(d), model.precision))
            for d in config.devices
        )
        * 1e12
    )
    mfu = tokens_per_s * flops_per_token(model) / peak_flops
    memory = {r["device"]: r["peak_memory_GiB"] for r in readings}
    allocated = {r["device"]: r.get("allocated_memory_GiB", r["peak_memory_GiB"]) for r in readings}
    over = [(d, gib, cluster.device(d).memory_GiB) for d, gib in memory.items() if gib > cluster.device(d).memory_GiB]
    status, error = "ok", ""
    host: dict[str, float] = {}  # node -> GiB of offloaded state (plans that offload)
    for r in readings:
        if r.get("host_GiB"):
            host[r["node"]] = host.get(r["node"], 0.0) + r["host_GiB"]
    host_over = [
        (n, gib) for n, gib in host.items() if gib > next(x.host.memory_GiB for x in cluster.nodes if x.name == n)
    ]
    if over:
        d, gib, cap = over[0]
        status, error = "oom", f"device {d} used {gib:.2f} GiB, more than its {cap:.2f} GiB"
    elif host_over:
        n, gib = host_over[0]
        status, error = "oom", f"host memory of node {n!r} out of memory: offloaded state used {gib:.2f} GiB"
        over = host_over
    timeline = tuple(
        sorted(
            (TimelineEvent(r["device"], op, start, end) for r in readings for op, start, end in r.get("timeline", ())),
            key=lambda e: (e.start_s, e.device),
        )
    )
    return Measurement(
        tokens_per_s=tokens_per_s,
        iteration_time_s=iteration,
        oom=bool(over),
        peak_memory_GiB=memory,
        mfu=mfu,
        bubble_fraction=max(0.0, bubble),
        stage_busy_s=busy_of_slowest,
        timeline=timeline,
        status=status,
        error=error,
        allocated_memory_GiB=allocated,
        sync_time_s=sync,
        host_memory_GiB=host,
    )
