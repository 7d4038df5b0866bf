"""Micro-benchmarks on a CUDA GPU, for ``autotune profile`` on a cluster whose GPU type is the one here.

The CPU benchmarks (``autotune.calibration.bench``) time in thread CPU time on a shared host; on a GPU
the work is asynchronous, so every timing here is wall time between ``torch.cuda.synchronize()`` calls
(the median of ``repeats`` runs after warm-up), which includes the host's time to issue the kernels:
exactly what a small, launch-bound layer costs in training. Everything runs on ``cuda:0`` in the
model's precision as the runner computes it (``runner.model``: bf16 under ``torch.autocast``, fp32 with
TF32 matmuls).

- ``cuda_matmul``: sustained TFLOP/s of the model's GEMM shapes, in the precision's dtype.
- ``cuda_memory_bandwidth``: device-to-device copy (read + write) bandwidth.
- ``cuda_layer``: one block of the runner (``runner.model.StageChunk`` of one layer, the model's
  attention, dropout and recompute mode) forward and backward, and the bytes autograd keeps.
- ``cuda_edges``: embedding, and final norm + LM head + loss, forward and backward.
- ``cuda_optimizer``: the runner's AdamW step per parameter.
- ``cuda_memory_baseline``: device memory used besides the allocator's pool once a CUDA context,
  cuBLAS and a few kernels exist (what the simulator's device view adds per process).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from autotune.calibration.bench import EdgeTiming, LayerTiming, MatmulPoint, saved_activation_bytes
from autotune.specs import ModelSpec


def _torch():
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True  # precision fp32 means TF32 matmuls (as the runner)
    torch.backends.cudnn.allow_tf32 = True
    return torch


def _cuda_time(fn: Callable[[], object], *, warmup: int = 3, repeats: int = 10) -> float:
    """Median wall time of ``fn`` on the GPU, synchronised before and after each run."""
    torch = _torch()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _dtype(precision: str):
    torch = _torch()
    return torch.float32 if precision == "fp32" else torch.bfloat16 if precision == "bf16" else torch.float16


def _autocast(precision: str):
    torch = _torch()
    import contextlib

    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=_dtype(precision))


def cuda_matmul(shapes: list[tuple[int, int, int]], precision: str, repeats: int = 10) -> list[MatmulPoint]:
    torch = _torch()
    dt = _dtype(precision)
    out = []
    for m, k, n in shapes:
        a = torch.randn(m, k, dtype=dt, device="cuda")
        b = torch.randn(k, n, dtype=dt, device="cuda")
        reps = max(1, int(2e-3 / max(2.0 * m * k * n / 100e12, 1e-7)))  # ~2 ms per timing
        seconds = _cuda_time(lambda: [torch.mm(a, b) for _ in range(reps)], repeats=repeats) / reps
        out.append(MatmulPoint(m, k, n, seconds))
    return out


def cuda_memory_bandwidth(num_bytes: int = 512 * 2**20, repeats: int = 10) -> float:
    torch = _torch()
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    return 2.0 * num_bytes / _cuda_time(lambda: dst.copy_(src), repeats=repeats) / 1e9


def _forward_and_backward_s(module, inp, grad, precision: str, repeats: int) -> tuple[float, float]:
    """CUDA seconds of ``module(inp)`` without grad, and of ``module(inp)`` plus the backward of ``grad``
    (cast to the output's dtype, as autograd would), both under the precision's autocast."""
    torch = _torch()

    def fwd():
        with torch.no_grad(), _autocast(precision):
            module(inp)

    def fwd_bwd():
        with _autocast(precision):
            y = module(inp)
        y.backward(grad.to(y.dtype))

    return _cuda_time(fwd, repeats=repeats), _cuda_time(fwd_bwd, repeats=repeats)


def cuda_layer(
    model: ModelSpec, micro_batch_size: int, recompute: bool | str = False, repeats: int = 10
) -> LayerTiming:
    """One runner block (tp 1) on ``cuda:0``: forward (no grad) and forward + backward."""
    torch = _torch()
    from runner.model import StageChunk

    chunk = StageChunk(model, [0], first=False, last=False, seed=0, recompute=recompute).to("cuda")
    chunk.train()
    x = torch.randn(micro_batch_size, model.seq_len, model.hidden_size, device="cuda", requires_grad=True)
    grad = torch.randn(micro_batch_size, model.seq_len, model.hidden_size, device="cuda")

    fwd_s, fwd_bwd_s = _forward_and_backward_s(chunk, x, grad, model.precision, repeats)

    def run(inp):
        with _autocast(model.precision):
            return chunk(inp)

    saved = saved_activation_bytes(run, x, [p.data_ptr() for p in chunk.parameters()])
    return LayerTiming(micro_batch_size, 1, fwd_s, max(fwd_bwd_s - fwd_s, 0.0), recompute, saved)


def cuda_edges(model: ModelSpec, micro_batch_size: int, repeats: int = 10) -> EdgeTiming:
    torch = _torch()
    from runner.model import StageChunk, lm_loss

    emb = StageChunk(model, [], first=True, last=False, seed=0).to("cuda")
    head = StageChunk(model, [], first=False, last=True, seed=0).to("cuda")
    tokens = torch.randint(0, model.vocab_size, (micro_batch_size, model.seq_len), device="cuda")
    hidden = torch.randn(micro_batch_size, model.seq_len, model.hidden_size, device="cuda", requires_grad=True)
    grad = torch.randn(micro_batch_size, model.seq_len, model.hidden_size, device="cuda")

    def head_fwd():
        with torch.no_grad(), _autocast(model.precision):
            lm_loss(head(hidden), tokens)

    def head_fwd_bwd():
        with _autocast(model.precision):
            loss = lm_loss(head(hidden), tokens)
        loss.backward()

    ef, efb = _forward_and_backward_s(emb, tokens, grad, model.precision, repeats)
    hf, hfb = _cuda_time(head_fwd, repeats=repeats), _cuda_time(head_fwd_bwd, repeats=repeats)
    return EdgeTiming(micro_batch_size, ef, max(efb - ef, 0.0), hf, max(hfb - hf, 0.0))


def cuda_optimizer(num_params: int = 16_000_000, repeats: int = 10) -> float:
    """The runner's AdamW step (``runner.optim.make_optimizer``) per parameter, on 8 tensors."""
    torch = _torch()
    from runner.optim import make_optimizer

    chunk = max(1, num_params // 8)
    params = [torch.nn.Parameter(torch.randn(chunk, device="cuda")) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = make_optimizer(params)
    return _cuda_time(opt.step, repeats=repeats) / (chunk * 8)


def cuda_memory_baseline() -> float:
    """GiB the device uses beyond the caching allocator's pool once a context, cuBLAS and a few kernels
    exist: ``total - free - reserved``."""
    torch = _torch()
    a = torch.randn(1024, 1024, device="cuda")
    (a @ a).sum().item()
    free, total = torch.cuda.mem_get_info()
    return max(0.0, (total - free - torch.cuda.memory_reserved()) / 2**30)
