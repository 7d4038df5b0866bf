"""Roundpipe plans (``"schedule": "roundpipe"``) on the runner, through the ``roundpipe`` library (CUDA only).

A roundpipe plan is not one rank per device: one process drives a node's pool of GPUs, as RoundPipe runs.
The launcher (``runner.launch.profiled_run``, ``runner.train.train``) starts a single worker with
``CUDA_VISIBLE_DEVICES`` set to the pool (``box:3`` is ``cuda:3`` of this machine, as for other plans),
and that worker (``runner.worker`` -> ``run_job``) builds, from the autotune plan:

- the model as RoundPipe's *layers*, an ``nn.Sequential`` of the runner's own modules
  (``runner.model.StageChunk``, initialised per layer index exactly as for every other plan): layer 0 the
  embedding, layer ``i + 1`` block ``i``, layer ``L + 1`` the final norm and LM head; weights in the model's
  precision (bf16 weights for ``precision: bf16``) and the optimizer's copy in fp32 on the host, as
  RoundPipe's examples train;
- RoundPipe's ``ModelExecutePlan`` from the plan's partitions (``execute_ranges``): ``fwd_plan`` the
  forward stages, ``bwd_plan`` the fused stage first, then the backward stages last first; and a
  ``RoundPipeRunConfig`` with the pass's micro-batch count and the recompute grain.

Each step runs ``accumulation_steps`` calls of ``RoundPipe.forward_backward`` (each on its share of the
global batch, loss = mean next-token cross entropy over the whole global batch, as every other plan) and
one asynchronous host optimizer ``step`` (AdamW with the runner's settings, on the fp32 host copy, through
RoundPipe's own compiled CPU Adam: ``host_adamw``), RoundPipe's default: the next step runs on weights one step
old. ``memory_limit_GiB`` is not passed to the library:
it only shapes RoundPipe's *automatic* partition, and an explicit plan is checked against it by autotune
(``autotune.specs.roundpipe``, the simulator) before it gets here.

What the runner cannot run is said before anything is launched (``preflight``, one ``SpecError`` line):
no CUDA on this machine, the ``roundpipe`` extra not installed (``pip install -e '.[roundpipe]'``), a pool
of ``cpu`` devices, GPU indices this machine does not have, several pools (data-parallel roundpipe replicas
across nodes are simulated only), ``fp16`` (no loss scaling), and checkpoints (not implemented for roundpipe
plans: ``--checkpoint-dir`` / ``--resume`` are refused).

The library is imported only in the worker: ``import roundpipe`` itself fails on a machine without CUDA
(its defaults query the GPUs at import).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import SpecError
from autotune.specs import ClusterSpec, Measurement, ModelSpec, ParallelConfig
from autotune.specs.roundpipe import RoundPipeStages

log = logging.getLogger(__name__)
GiB = 2**30
EXTRA_HINT = "pip install -e '.[roundpipe]'"


# --------------------------------------------------------------------------------------------------
# The plan as RoundPipe's execute plan (pure Python)


def execute_ranges(rp: RoundPipeStages, num_layers: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(fwd_plan, bwd_plan)`` of RoundPipe's ``ModelExecutePlan`` as ``[start, stop)`` ranges of RoundPipe
    layers (0: embedding, ``i + 1``: block ``i``, ``num_layers + 1``: final norm + LM head).

    ``fwd_plan``: the forward stages in layer order (the first with the embedding). ``bwd_plan``: the fused
    stage (its blocks and the head: forward and backward), then the backward stages from the last layers
    down (the last one with the embedding), the order RoundPipe hands them out in."""
    L = num_layers
    fwd = [(0 if k == 0 else a + 1, b + 1) for k, (a, b) in enumerate(rp.forward_ranges(L)[:-1])]
    fused_start = rp.forward_ranges(L)[-1][0] + 1
    bwd = [(fused_start, L + 2)]
    back = rp.backward_ranges(L)[:-1]
    bwd += [(0 if k == 0 else back[k][0] + 1, back[k][1] + 1) for k in range(len(back) - 1, -1, -1)]
    return fwd, bwd


def check_execute_ranges(fwd: list[tuple[int, int]], bwd: list[tuple[int, int]], num_layers: int) -> None:
    """RoundPipe's ``ModelExecutePlan.check_valid(n, "fused")`` on the ranges (ValueError as it raises), so
    a plan the library would refuse is caught here, on any machine."""
    n = num_layers + 2
    cur = -1
    for a, b in fwd:
        if b <= a:
            raise ValueError("Empty layer range in forward plan")
        if a != cur + 1:
            raise ValueError(f"Specify {a} after {cur} in forward plan")
        cur = b - 1
    cur_b = -1
    for a, b in reversed(bwd):
        if b <= a:
            raise ValueError("Empty layer range in backward plan")
        if a != cur_b + 1:
            raise ValueError(f"Specify {a} before {cur_b} in backward plan")
        cur_b = b - 1
    if cur + 1 != bwd[0][0]:
        raise ValueError(f"Fused plan does not cover all layers, mismatch forward between {cur} and {bwd[0][0]}")
    if cur_b != n - 1:
        raise ValueError(f"Backward plan does not cover all layers, ending at {cur_b}")


# --------------------------------------------------------------------------------------------------
# Before launching


def library_installed() -> bool:
    """Whether the ``roundpipe`` package is installed (found without importing it)."""
    return importlib.util.find_spec("roundpipe") is not None


@dataclass(frozen=True, slots=True)
class RoundPipeLaunch:
    """What the launcher needs: one process (``world_size`` 1) that sees the pool's GPUs."""

    pool: tuple[str, ...]
    gpu_indices: tuple[int, ...]
    world_size: int = 1

    def cuda_visible_devices(self, inherited: str | None = None) -> str:
        """``CUDA_VISIBLE_DEVICES`` for the worker: the pool's indices, read through an inherited
        ``CUDA_VISIBLE_DEVICES`` when this process has one (index ``k`` is this process's ``cuda:k``)."""
        visible = [v.strip() for v in inherited.split(",")] if inherited else None
        return ",".join(visible[i] if visible else str(i) for i in self.gpu_indices)

    def env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": self.cuda_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))}


def preflight(
    cluster: ClusterSpec,
    model: ModelSpec,
    config: ParallelConfig,
    *,
    cuda_available: bool | None = None,
    gpu_count: int | None = None,
    library: bool | None = None,
) -> RoundPipeLaunch:
    """Everything checked before a roundpipe plan is launched; ``SpecError("runner", ...)`` naming what
    stops it (an invalid plan raises the plan's own ``SpecError`` first). ``cuda_available``, ``gpu_count``
    and ``library`` default to this machine's."""
    config.validate(cluster, model)
    if len(config.pipelines) > 1:
        raise SpecError(
            "runner",
            "pipelines",
            f"the runner runs one roundpipe pool (one node), this plan has "
            f"{len(config.pipelines)} data-parallel pools: replicas across "
            f"nodes are simulated only",
        )
    rp = config.pipelines[0].roundpipe
    assert rp is not None
    kinds = sorted({cluster.device(d).name for d in rp.devices})
    if "cpu" in kinds:
        raise SpecError(
            "runner",
            "pipelines[0].devices",
            "a roundpipe plan runs through the roundpipe library on CUDA GPUs; this pool has cpu devices",
        )
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if library is None:
        library = library_installed()
    if not cuda_available:
        extra = "" if library else f", and the roundpipe extra ({EXTRA_HINT})"
        raise SpecError(
            "runner",
            "schedule",
            f"roundpipe plans run through the roundpipe library on CUDA GPUs: "
            f"this machine has no CUDA; run it on a machine with NVIDIA GPUs{extra}",
        )
    if not library:
        raise SpecError("runner", "schedule", f"roundpipe plans need the roundpipe library: {EXTRA_HINT}")
    if model.precision == "fp16":
        raise SpecError(
            "runner",
            "precision",
            "fp16 training needs loss scaling, which the runner does not implement; use bf16 (or fp32) on CUDA",
        )
    indices = []
    for d in rp.devices:
        idx = d.rpartition(":")[2]
        if not idx.isdigit():
            raise SpecError(
                "runner",
                "pipelines[0].devices",
                f"device {d!r}: the runner maps a device <node>:<k> to cuda:k, {idx!r} is not an index",
            )
        indices.append(int(idx))
    if gpu_count is None:
        import torch

        gpu_count = torch.cuda.device_count()
    missing = [d for d, i in zip(rp.devices, indices) if i >= gpu_count]
    if missing:
        raise SpecError(
            "runner",
            "pipelines[0].devices",
            f"the pool needs {', '.join(missing)} (cuda:{max(indices)}), this machine has {gpu_count} GPU(s)",
        )
    fwd, bwd = execute_ranges(rp, model.num_layers)
    check_execute_ranges(fwd, bwd, model.num_layers)  # the plan's own validation makes this hold
    return RoundPipeLaunch(pool=rp.devices, gpu_indices=tuple(indices))


def refuse_checkpoints(checkpoint_dir: Any, resume: bool) -> None:
    """``autotune train`` of a roundpipe plan: checkpoints are not implemented, said before launching."""
    if checkpoint_dir is not None or resume:
        flag = "--resume" if resume else "--checkpoint-dir"
        raise SpecError(
            flag,
            "",
            "checkpoints of roundpipe plans are not implemented yet; train without --checkpoint-dir / --resume",
        )


# --------------------------------------------------------------------------------------------------
# The worker (CUDA; imports torch and roundpipe)


class RoundPipeTrainer:
    """The model as RoundPipe layers, its execute plan, the host optimizer, and one training step."""

    def __init__(self, model: ModelSpec, config: ParallelConfig, seed: int, tokens) -> None:
        import roundpipe
        import torch
        from torch import nn

        from runner.model import StageChunk

        self.model_spec, self.config, self.tokens = model, config, tokens
        pipe = config.pipelines[0]
        self.rp_plan: RoundPipeStages = pipe.roundpipe
        L = model.num_layers
        dtype = torch.bfloat16 if model.precision == "bf16" else torch.float32
        layers = [StageChunk(model, (), first=True, last=False, seed=seed)]
        layers += [StageChunk(model, (i,), first=False, last=False, seed=seed) for i in range(L)]
        layers.append(StageChunk(model, (), first=False, last=True, seed=seed))
        sequential = nn.Sequential(*layers).to(dtype)
        plan = roundpipe.ModelExecutePlan()
        fwd, bwd = execute_ranges(self.rp_plan, L)
        plan.fwd_plan = [range(a, b) for a, b in fwd]
        plan.bwd_plan = [range(a, b) for a, b in bwd]
        plan.check_valid(L + 2, "fused")
        self.passes = self.rp_plan.accumulation_steps
        self.per_pass = pipe.num_microbatches // self.passes
        self.total_microbatches = pipe.num_microbatches
        self.run_config = roundpipe.RoundPipeRunConfig(
            num_microbatch=self.per_pass, recompute_grain=self.rp_plan.recompute_grain, execute_plan=plan
        )
        self.model = roundpipe.RoundPipe(
            sequential, optim_dtype=torch.float32, name="autotune", model_run_config=self.run_config
        )
        self.optimizer = host_adamw(list(self.model.optim_parameters()))
        self.rows_per_pass = self.per_pass * config.micro_batch_size

    def _loss(self, logits, targets):
        from runner.model import lm_loss

        return lm_loss(logits, targets) / self.total_microbatches  # equal micro-batches: the global mean

    def _step_fn(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, index: int) -> float:
        """One optimizer step on the global batch of step ``index``; its loss (mean over the batch)."""
        inputs, targets = self.tokens.pipeline_batch(index, 0, self.model_spec.global_batch_size)
        total = 0.0
        for a in range(self.passes):
            rows = slice(a * self.rows_per_pass, (a + 1) * self.rows_per_pass)
            loss = self.model.forward_backward(
                input_args=(inputs[rows],), label=targets[rows], loss_fn=self._loss, run_config=self.run_config
            )
            total += float(loss)
        self.model.step(self._step_fn)  # asynchronous host optimizer (RoundPipe's default)
        return total

    def synchronize(self) -> None:
        """Wait for the last optimizer step and every GPU."""
        import torch

        self.model.synchronize()
        for k in range(torch.cuda.device_count()):
            torch.cuda.synchronize(k)

    def stage_busy_s(self) -> tuple[float, ...]:
        """Compute seconds per step of each stage in hand-out order, from RoundPipe's own per-layer CUDA-event
        timer (``get_estimate``: per layer and micro-batch, the forward, and the forward (recompute) plus
        backward), or ``()`` where the library has no timings yet."""
        try:
            self.model.model_timer.update_times()  # the last steps' CUDA events (synchronize() ran)
            src, fwd_ms, bwd_ms = self.model.model_timer.get_estimate("fused")
        except Exception:  # a private part of the library: no timings rather than no measurement
            return ()
        if src != "time":
            return ()
        fwd, bwd = execute_ranges(self.rp_plan, self.model_spec.num_layers)
        per_step = self.total_microbatches / 1e3  # ms per micro-batch -> s per step
        out = [sum(fwd_ms[a:b]) * per_step for a, b in fwd]
        fa, fb = bwd[0]
        out.append(sum(bwd_ms[fa:fb]) * per_step)  # fused: forward + backward (RoundPipe's "re" + "bwd")
        out += [sum(bwd_ms[a:b]) * per_step for a, b in bwd[1:]]
        return tuple(out)


def host_adamw(params):
    """AdamW with the runner's settings (``runner.optim.ADAMW``) as RoundPipe trains: ``roundpipe.optim.Adam``
    with decoupled weight decay, its C++ CPU kernel (compiled on first use, cached by torch). torch's own
    AdamW on the host was the step's bottleneck on an H200 (gpt2-xl: 2.31 s per iteration against 0.59 s of
    GPU work); on this repository's 2-core CPU machine the library's Adam steps 20M parameters 7x faster than
    ``torch.optim.AdamW(foreach=False)`` and agrees with it to 2e-7 (relative) after 6 steps
    (``experiments/speed/bench_host_adam.py``)."""
    import roundpipe.optim

    from runner.optim import ADAMW

    return roundpipe.optim.Adam(
        params,
        lr=ADAMW["lr"],
        betas=ADAMW["betas"],
        eps=ADAMW["eps"],
        weight_decay=ADAMW["weight_decay"],
        decoupled_weight_decay=True,
    )


def run_job(job: dict, cluster: ClusterSpec, model: ModelSpec, config: ParallelConfig, fault) -> None:
    """The worker side of a roundpipe job: ``profile`` writes a measurement, ``train`` trains."""
    import torch

    from runner.data import TokenSource

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    seed = int(job.get("seed", 0))
    tokens = TokenSource(model, seed, job.get("data"))
    trainer = RoundPipeTrainer(model, config, seed, tokens)
    fault(0)
    if job["mode"] == "profile":
        _profile(job, cluster, model, config, trainer)
    elif job["mode"] == "train":
        _train(job, config, model, trainer)
    else:
        raise ValueError(f"unknown job mode {job['mode']!r}")


def _profile(job: dict, cluster: ClusterSpec, model: ModelSpec, config: ParallelConfig, trainer) -> None:
    import torch

    from autotune.simulator.efficiency import effective_precision
    from runner.model import flops_per_token

    steps, warmup = int(job["steps"]), int(job["warmup"])
    losses = [trainer.step(i) for i in range(warmup)]
    trainer.synchronize()
    for k in range(torch.cuda.device_count()):
        torch.cuda.reset_peak_memory_stats(k)
    t0 = time.perf_counter()
    losses += [trainer.step(i) for i in range(warmup, warmup + steps)]
    trainer.synchronize()  # the last asynchronous optimizer step counts
    iteration = (time.perf_counter() - t0) / steps
    pool = config.pipelines[0].roundpipe.devices
    peak, allocated = {}, {}
    for k, device in enumerate(pool):  # the worker sees the pool as cuda:0..n-1, in pool order
        allocated[device] = torch.cuda.max_memory_allocated(k) / GiB
        free, total = torch.cuda.mem_get_info(k)
        peak[device] = max(allocated[device], (total - free) / GiB)
    tokens_per_s = model.global_batch_size * model.seq_len / iteration
    peak_flops = (
        sum(cluster.device(d).matmul_peak_tflops(effective_precision(cluster.device(d), model.precision)) for d in pool)
        * 1e12
    )
    busy = trainer.stage_busy_s()
    bubble = max(0.0, 1.0 - sum(busy) / (len(pool) * iteration)) if busy else 0.0
    over = [(d, g, cluster.device(d).memory_GiB) for d, g in peak.items() if g > cluster.device(d).memory_GiB]
    m = Measurement(
        tokens_per_s=tokens_per_s,
        iteration_time_s=iteration,
        oom=bool(over),
        peak_memory_GiB=peak,
        mfu=tokens_per_s * flops_per_token(model) / peak_flops,
        bubble_fraction=bubble,
        stage_busy_s=busy,
        status="oom" if over else "ok",
        error=f"device {over[0][0]} used {over[0][1]:.2f} GiB, more than its {over[0][2]:.2f} GiB" if over else "",
        allocated_memory_GiB=allocated,
    )
    log.info("measured %.1f tokens/s, %.3f s/iteration", m.tokens_per_s, m.iteration_time_s)
    Path(job["out_dir"], "result.json").write_text(json.dumps({"measurement": m.to_dict(), "losses": losses}))


def _train(job: dict, config: ParallelConfig, model: ModelSpec, trainer) -> None:
    from runner.metrics import MlflowLogger

    stop = {"requested": False}

    def on_stop(signum, frame):  # finish the step, then exit
        stop["requested"] = True

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    metrics = open(job["metrics_out"], "a") if job.get("metrics_out") else None
    tracker = MlflowLogger(job, config, model) if job.get("tracking_uri") else None
    tokens_per_step = model.global_batch_size * model.seq_len
    done = 0
    try:
        for index in range(int(job["steps"])):
            t0 = time.perf_counter()
            loss = trainer.step(index)
            done = index + 1
            record = {"step": done, "loss": loss, "tokens_per_s": tokens_per_step / (time.perf_counter() - t0)}
            log.info("step %d loss %.4f %.0f tokens/s", done, loss, record["tokens_per_s"])
            if metrics:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            if tracker:
                tracker.log(record)
            if stop["requested"]:
                log.info("stopped by a signal after step %d", done)
                break
        trainer.synchronize()
        Path(job["out_dir"], "result.json").write_text(json.dumps({"steps_done": done, "stopped": stop["requested"]}))
    finally:
        if metrics:
            metrics.close()
        if tracker:
            tracker.close()
