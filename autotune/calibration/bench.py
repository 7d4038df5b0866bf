"""Micro-benchmarks that calibrate the simulator on the devices and links that are really here.

Every benchmark runs with ``torch.set_num_threads(1)`` (one core per rank, like the CPU runner) and
returns typed values in seconds, bytes and TFLOP/s. Compute timings are the lower quartile of repeated
runs after warm-up, in this thread's CPU time (``_median_time``): the device's own speed, whatever
else the shared host runs. ``bench_contention`` measures, in wall time, how ranks sharing the host
slow each other down; ``bench_links`` times gloo in wall time (lower quartile).

- ``bench_matmul``: sustained dense matmul throughput at the GEMM shapes a transformer layer uses.
- ``bench_memory_bandwidth``: large tensor copy (read + write) bandwidth.
- ``bench_layer``: forward and backward wall time of one transformer block at a micro-batch size and
  tensor-parallel degree (each rank holds 1/tp of the heads and of the MLP columns, as in Megatron).
- ``bench_edges``: embedding forward/backward, final norm + LM head + loss forward/backward, and
  the optimizer step time per parameter: costs the runner pays that are not transformer blocks.
- ``bench_links``: point-to-point (ping-pong) and all-reduce time over gloo between two processes
  on this machine, fitted to latency + bytes / bandwidth (alpha-beta).
- ``bench_contention``: wall time per CPU-second of work with 1..n processes computing at once.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


def _torch():
    import torch

    torch.set_num_threads(1)
    return torch


def _median_time(
    fn: Callable[[], object],
    *,
    warmup: int = 2,
    repeats: int = 5,
    min_time_s: float = 0.0,
    clock: Callable[[], float] = time.thread_time,
) -> float:
    """Undisturbed time of ``fn``: the lower quartile of ``repeats`` runs after ``warmup`` runs, timed by
    default with this thread's CPU time.

    The host is shared (other processes come and go, and take the core away for milliseconds at a
    time); CPU time leaves out the time this thread was not running, so it measures the device's own
    speed: what the compute takes when the rank has its core, which is what the profile is for. How
    ranks that share cores slow each other down is measured on its own (``bench_contention``) and
    applied by the simulator as a separate term. The lower quartile guards against the rest (cache
    disturbance, frequency changes)."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    spent = 0.0
    while len(samples) < repeats or spent < min_time_s:
        t0 = clock()
        fn()
        dt = clock() - t0
        samples.append(dt)
        spent += dt
        if len(samples) >= 4 * repeats:
            break
    return _lower_quartile(samples)


# --------------------------------------------------------------------------------------------------
# Matmul and memory bandwidth


@dataclass(frozen=True, slots=True)
class MatmulPoint:
    m: int
    k: int
    n: int
    seconds: float

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n

    @property
    def tflops(self) -> float:
        return self.flops / self.seconds / 1e12


def bench_matmul(shapes: list[tuple[int, int, int]], *, dtype: str = "float32", repeats: int = 5) -> list[MatmulPoint]:
    """Sustained throughput of ``(m, k) @ (k, n)`` at each shape."""
    torch = _torch()
    dt = getattr(torch, dtype)
    out = []
    for m, k, n in shapes:
        a = torch.randn(m, k, dtype=dt)
        b = torch.randn(k, n, dtype=dt)
        # Enough back-to-back calls that one timing is >= ~2 ms, so timer resolution does not matter.
        reps = max(1, int(2e-3 / max(2.0 * m * k * n / 20e9, 1e-7)))
        seconds = _median_time(lambda: [torch.mm(a, b) for _ in range(reps)], repeats=repeats) / reps
        out.append(MatmulPoint(m, k, n, seconds))
        log.info("matmul %dx%dx%d: %.1f GFLOP/s", m, k, n, out[-1].tflops * 1e3)
    return out


def bench_memory_bandwidth(num_bytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """Copy bandwidth in GB/s (1e9 B/s), counting the bytes read plus the bytes written."""
    torch = _torch()
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = _median_time(lambda: dst.copy_(src), repeats=repeats)
    return 2.0 * num_bytes / seconds / 1e9


# --------------------------------------------------------------------------------------------------
# One transformer block, the way a tensor-parallel rank holds it


@dataclass(frozen=True, slots=True)
class LayerShape:
    """What sets the cost of one transformer block on one rank."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    seq_len: int
    mlp: str = "gelu"

    @classmethod
    def of(cls, model) -> LayerShape:
        return cls(
            model.hidden_size, model.num_heads, model.num_kv_heads, model.ffn_hidden_size, model.seq_len, model.mlp
        )

    def key(self) -> str:
        return (
            f"h{self.hidden_size}_a{self.num_heads}_kv{self.num_kv_heads}_f{self.ffn_hidden_size}"
            f"_s{self.seq_len}_{self.mlp}"
        )

    def layer_flops(self, micro_batch_size: int, tp: int) -> float:
        """Forward FLOPs of one block on one rank (2 per multiply-add; Megatron-LM paper, Narayanan et al.
        2021, eq. 2 without the logit layer): QKV/O/MLP projections plus the two attention matmuls."""
        tokens = micro_batch_size * self.seq_len
        h = self.hidden_size
        kv = self.num_kv_heads * (h // self.num_heads)
        mats = 3 if self.mlp == "swiglu" else 2
        proj = 2 * tokens * (2 * h * h + 2 * h * kv + mats * h * self.ffn_hidden_size)
        attn = 2 * 2 * micro_batch_size * self.seq_len * self.seq_len * h
        return (proj + attn) / tp


def build_block(shape: LayerShape, tp: int):
    """One block as a tensor-parallel rank of the runner holds it (``runner/model.py``: pre-norm, no
    biases, separate q/k/v projections, SDPA causal attention, GELU-tanh or SwiGLU MLP), with 1/tp of
    the heads and of the MLP columns (Megatron column/row split)."""
    torch = _torch()
    nn = torch.nn
    F = torch.nn.functional
    if shape.num_heads % tp or shape.ffn_hidden_size % tp or shape.num_kv_heads % tp:
        raise ValueError(
            f"tp={tp} must divide heads {shape.num_heads}, kv heads {shape.num_kv_heads} "
            f"and ffn {shape.ffn_hidden_size}"
        )
    h = shape.hidden_size
    head_dim = h // shape.num_heads
    q_out = shape.num_heads // tp * head_dim
    kv_out = shape.num_kv_heads // tp * head_dim
    ffn = shape.ffn_hidden_size // tp
    swiglu = shape.mlp == "swiglu"

    def norm():
        return nn.RMSNorm(h, eps=1e-6) if swiglu else nn.LayerNorm(h, bias=False)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn_norm = norm()
            self.q_proj = nn.Linear(h, q_out, bias=False)
            self.k_proj = nn.Linear(h, kv_out, bias=False)
            self.v_proj = nn.Linear(h, kv_out, bias=False)
            self.o_proj = nn.Linear(q_out, h, bias=False)
            self.mlp_norm = norm()
            self.up_proj = nn.Linear(h, ffn, bias=False)
            self.gate_proj = nn.Linear(h, ffn, bias=False) if swiglu else None
            self.down_proj = nn.Linear(ffn, h, bias=False)

        def forward(self, x):
            b, t, _ = x.shape
            y = self.attn_norm(x)
            q = self.q_proj(y).view(b, t, -1, head_dim).transpose(1, 2)
            k = self.k_proj(y).view(b, t, -1, head_dim).transpose(1, 2)
            v = self.v_proj(y).view(b, t, -1, head_dim).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
            x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
            y = self.mlp_norm(x)
            if swiglu:
                u = F.silu(self.gate_proj(y)) * self.up_proj(y)
            else:
                u = F.gelu(self.up_proj(y), approximate="tanh")
            return x + self.down_proj(u)

    return Block()


@dataclass(frozen=True, slots=True)
class LayerTiming:
    micro_batch_size: int
    tp: int
    forward_s: float
    backward_s: float
    recompute: bool = False  # backward_s then includes the re-run forward (activation checkpointing)
    activation_bytes: int = 0  # bytes autograd keeps for this block's backward (weights excluded)


def bench_layer(
    shape: LayerShape,
    micro_batch_size: int,
    tp: int,
    *,
    recompute: bool = False,
    repeats: int = 5,
    block_factory: Callable | None = None,
) -> LayerTiming:
    """Forward and backward (gradient of input and weights) wall time of one block on one rank.

    With ``recompute`` the block runs under ``torch.utils.checkpoint`` (non-reentrant, as the runner
    does), so the backward time includes the recomputed forward and its bookkeeping."""
    torch = _torch()
    inner = (block_factory or build_block)(shape, tp)
    if recompute:
        from torch.utils.checkpoint import checkpoint

        def block(x):
            if torch.is_grad_enabled():
                return checkpoint(inner, x, use_reentrant=False)
            return inner(x)
    else:
        block = inner
    x = torch.randn(micro_batch_size, shape.seq_len, shape.hidden_size, requires_grad=True)
    grad = torch.randn(micro_batch_size, shape.seq_len, shape.hidden_size)

    def fwd():
        with torch.no_grad():
            block(x)

    fwd_s = _median_time(fwd, repeats=repeats)

    def fwd_bwd():
        y = block(x)
        y.backward(grad)

    fwd_bwd_s = _median_time(fwd_bwd, repeats=repeats)
    saved = saved_activation_bytes(block, x, [p.data_ptr() for p in inner.parameters()])
    # Backward = (forward with autograd graph + backward) - plain forward. The graph-recording forward
    # costs a little more than a no-grad one; that difference is charged to backward, where the
    # runner pays it too (it always records the graph for training).
    return LayerTiming(micro_batch_size, tp, fwd_s, max(fwd_bwd_s - fwd_s, 0.0), recompute, saved)


def saved_activation_bytes(fn: Callable, x, weight_ptrs: list[int]) -> int:
    """Bytes autograd saves for the backward of ``fn(x)``: every saved tensor's storage once, weights
    excluded. Under non-reentrant checkpointing only the checkpoint's inputs are saved, as in the runner."""
    torch = _torch()
    weights = set(weight_ptrs)
    storages: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in weights:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(storages.values())


# --------------------------------------------------------------------------------------------------
# Non-block costs: embedding, LM head + loss, optimizer step


@dataclass(frozen=True, slots=True)
class EdgeTiming:
    micro_batch_size: int
    embedding_forward_s: float
    embedding_backward_s: float
    head_forward_s: float  # final norm + LM head + cross-entropy
    head_backward_s: float


def bench_edges(
    hidden_size: int, vocab_size: int, seq_len: int, micro_batch_size: int, *, repeats: int = 5
) -> EdgeTiming:
    torch = _torch()
    nn = torch.nn
    F = torch.nn.functional
    emb = nn.Embedding(vocab_size, hidden_size)
    norm = nn.LayerNorm(hidden_size, bias=False)
    head = nn.Linear(hidden_size, vocab_size, bias=False)
    tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_len))
    hidden = torch.randn(micro_batch_size, seq_len, hidden_size, requires_grad=True)
    grad = torch.randn(micro_batch_size, seq_len, hidden_size)

    def emb_fwd():
        with torch.no_grad():
            emb(tokens)

    def emb_fwd_bwd():
        (emb(tokens)).backward(grad)

    def head_fwd():
        with torch.no_grad():
            F.cross_entropy(head(norm(hidden)).flatten(0, 1).float(), tokens.flatten())

    def head_fwd_bwd():
        F.cross_entropy(head(norm(hidden)).flatten(0, 1).float(), tokens.flatten()).backward()

    ef = _median_time(emb_fwd, repeats=repeats)
    efb = _median_time(emb_fwd_bwd, repeats=repeats)
    hf = _median_time(head_fwd, repeats=repeats)
    hfb = _median_time(head_fwd_bwd, repeats=repeats)
    return EdgeTiming(micro_batch_size, ef, max(efb - ef, 0.0), hf, max(hfb - hf, 0.0))


def bench_optimizer(num_params: int = 1_000_000, repeats: int = 5) -> float:
    """AdamW step time per parameter (seconds), the runner's optimizer, on ``num_params`` weights
    split into a few tensors the way a model's layers hold them."""
    torch = _torch()
    chunk = max(1, num_params // 8)
    params = [torch.nn.Parameter(torch.randn(chunk)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)  # the runner's (runner.optim.make_optimizer)
    seconds = _median_time(opt.step, repeats=repeats)
    return seconds / (chunk * 8)


def bench_step_overhead(repeats: int = 20) -> float:
    """Fixed per-call Python/autograd overhead of a tiny module's forward+backward (seconds): what a
    micro-batch costs beyond its FLOPs on a CPU rank."""
    torch = _torch()
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(1, 4, requires_grad=True)

    def step():
        lin(x).sum().backward()

    return _median_time(step, warmup=5, repeats=repeats)


# --------------------------------------------------------------------------------------------------
# Links: gloo point-to-point and all-reduce between two processes on this machine


@dataclass(frozen=True, slots=True)
class LinkFit:
    """``time(bytes) = latency_us * 1e-6 + bytes / (bandwidth_GBps * 1e9)``, fitted to ``samples``."""

    bandwidth_GBps: float
    latency_us: float
    samples: tuple[tuple[int, float], ...]  # (bytes, seconds)


def fit_alpha_beta(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares latency (us) and bandwidth (GB/s) through (bytes, seconds) points, weighted so
    that each point counts by its relative error (small messages fix latency, large fix bandwidth)."""
    import numpy as np

    x = np.array([b for b, _ in samples], dtype=float)
    y = np.array([s for _, s in samples], dtype=float)
    w = 1.0 / y
    a = np.stack([np.ones_like(x), x], 1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(a, y * w, rcond=None)
    alpha = max(float(alpha), 0.0)
    beta = max(float(beta), 1e-15)
    return alpha * 1e6, 1.0 / beta / 1e9


def _lower_quartile(samples: list[float]) -> float:
    """25th percentile: on a shared 2-core host gloo timings carry rare millisecond scheduling spikes
    (a rank descheduled while its peer spins); the lower quartile keeps the transfer cost, not those."""
    ordered = sorted(samples)
    return ordered[(len(ordered) - 1) // 4]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _link_worker(rank: int, world: int, port: int, sizes: list[int], repeats: int) -> dict | None:
    """One rank of the link benchmark (run as ``python -m autotune.calibration.bench``)."""
    torch = _torch()
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        p2p: list[tuple[int, float]] = []
        allreduce: list[tuple[int, float]] = []
        for nbytes in sizes:
            t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)

            def ping_pong():
                if rank == 0:
                    dist.send(t, 1)
                    dist.recv(t, 1)
                else:
                    dist.recv(t, 0)
                    dist.send(t, 0)

            def all_reduce():
                dist.all_reduce(t)

            for fn, out, per in ((ping_pong, p2p, 2.0), (all_reduce, allreduce, 1.0)):
                for _ in range(2):
                    fn()
                samples = []
                for _ in range(repeats):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    samples.append((time.perf_counter() - t0) / per)
                out.append((t.numel() * 4, _lower_quartile(samples)))
        return {"p2p": p2p, "allreduce": allreduce} if rank == 0 else None
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True, slots=True)
class LinkBench:
    p2p: LinkFit
    allreduce: LinkFit  # two ranks: ring all-reduce moves 2 (n-1)/n = 1x the bytes per rank


def bench_links(sizes: list[int] | None = None, repeats: int = 12, timeout_s: float = 60.0) -> LinkBench:
    """Start two gloo processes on this machine and time p2p ping-pong and all-reduce at ``sizes``.

    The workers are plain subprocesses (``python -m autotune.calibration.bench``), so this works from
    any caller, with or without a ``__main__`` guard."""
    import json
    import subprocess
    import sys

    sizes = sizes or [4, 16 * 2**10, 256 * 2**10, 2**20, 4 * 2**20]
    port = _free_port()
    args = [sys.executable, "-m", "autotune.calibration.bench", str(port), ",".join(map(str, sizes)), str(repeats)]
    from autotune.lifeline import child_env, communicate_all

    # a pair of its own, not a part of a torchrun job this may run in (autotune discover under torchrun)
    torchrun = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in child_env().items() if k not in torchrun and not k.startswith("TORCHELASTIC_")}
    procs = [
        subprocess.Popen(args + [str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for r in range(2)
    ]
    try:  # killed and reaped however it ends; Ctrl-C raised only after that (lifeline.stop_signals_end)
        outs = communicate_all(procs, timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"link benchmark timed out after {timeout_s:.0f} s") from None
    if any(p.returncode != 0 for p in procs):
        err = next(e for (_, e), p in zip(outs, procs) if p.returncode != 0).strip().splitlines()
        raise RuntimeError(f"link benchmark failed: {err[-1] if err else 'no output'}")
    data = json.loads(outs[0][0])
    fits = []
    for key in ("p2p", "allreduce"):
        samples = [(int(b), float(s)) for b, s in data[key]]
        lat, bw = fit_alpha_beta(samples)
        fits.append(LinkFit(bw, lat, tuple(samples)))
    return LinkBench(*fits)


# --------------------------------------------------------------------------------------------------
# Host contention: ranks of one machine share its cores


def _contention_worker(index: int, max_procs: int, start_at: float, window_s: float, rounds: int = 1) -> dict:
    """Worker ``index`` of ``bench_contention``. Windows alternate: window ``2(n-1)`` runs worker 0
    alone, window ``2(n-1)+1`` runs workers ``0..n-1`` together. In each window it is active in, the
    worker repeats one small fixed unit of work (a 256-wide block's forward + backward) and records the
    window's wall time per unit (throughput, so time taken away by other processes counts); it also
    records the unit's CPU time (what the unit costs when it has the core)."""
    torch = _torch()
    block = build_block(LayerShape(256, 8, 8, 1024, 128), 1)
    x = torch.randn(1, 128, 256, requires_grad=True)
    block(x).sum().backward()
    wall: list[float | None] = []
    cpu: list[float] = []
    for w in range(2 * max_procs * rounds):
        n = (w % (2 * max_procs)) // 2 + 1
        active = index == 0 if w % 2 == 0 else index < n
        begin, end = start_at + w * window_s, start_at + (w + 1) * window_s
        if not active:  # sit the window out in one sleep: no polling to steal the active ones' cores
            wall.append(None)
            continue
        if time.time() < begin:
            time.sleep(begin - time.time())
        units = 0
        t0 = time.perf_counter()
        while time.time() < end or units == 0:
            c0 = time.thread_time()
            block(x).sum().backward()
            cpu.append(time.thread_time() - c0)
            units += 1
        wall.append((time.perf_counter() - t0) / units)
    return {"wall": wall, "cpu": _lower_quartile(cpu)}


def bench_contention(
    max_procs: int, duration_s: float = 0.5, rounds: int = 3, timeout_s: float = 180.0
) -> tuple[tuple[int, float], ...]:
    """``(n, stretch)``: wall time per unit of CPU work when ``n`` single-threaded processes compute at
    once on this host (n = 1 .. max_procs), relative to the work's CPU time. ``stretch(1)`` above 1 is
    the share of the core other programs take (the host is shared); above that, ranks of one plan
    time-share the cores (the CPU runner starts one process per device, possibly more than cores).

    Windows of ``n`` processes alternate with one-process windows, the sequence runs ``rounds`` times
    and the median per ``n`` is kept (made non-decreasing in ``n``)."""
    import json
    import subprocess
    import sys

    from autotune.lifeline import child_env, communicate_all

    start_at = time.time() + 4.0  # after every worker has imported torch
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "autotune.calibration.bench",
                "contention",
                str(i),
                str(max_procs),
                f"{start_at:.3f}",
                str(duration_s),
                str(rounds),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        for i in range(max_procs)
    ]
    results = []
    for p, (stdout, stderr) in zip(procs, communicate_all(procs, timeout_s)):  # all killed and reaped
        if p.returncode != 0:
            raise RuntimeError(f"contention benchmark failed: {stderr.strip().splitlines()[-1:]}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    cpu_unit = min(r["cpu"] for r in results)
    per_round = 2 * max_procs
    out: list[tuple[int, float]] = []
    alone = statistics.median(
        results[0]["wall"][r * per_round + 2 * (n - 1)] for r in range(rounds) for n in range(1, max_procs + 1)
    )
    out.append((1, max(1.0, alone / cpu_unit)))
    for n in range(2, max_procs + 1):
        together = statistics.median(
            statistics.mean(results[i]["wall"][r * per_round + 2 * (n - 1) + 1] for i in range(n))
            for r in range(rounds)
        )
        out.append((n, max(1.0, together / cpu_unit, out[-1][1])))
    for n, k in out:
        log.info("contention: %d processes -> x%.2f", n, k)
    return tuple(out)


def process_rss_bytes() -> int:
    """Resident set size of this process (Linux /proc), the CPU runner's memory measure."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


if __name__ == "__main__":  # one rank of bench_links (PORT SIZES REPEATS RANK) or a contention worker
    import json
    import sys

    from autotune.lifeline import die_with_parent

    die_with_parent()  # `autotune profile` may be killed: the benchmark processes go with it

    if sys.argv[1] == "contention":  # contention INDEX MAX_PROCS START_AT WINDOW_S
        print(
            json.dumps(
                _contention_worker(
                    int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])
                )
            )
        )
        sys.exit(0)
    _port, _sizes, _repeats, _rank = sys.argv[1:5]
    _result = _link_worker(int(_rank), 2, int(_port), [int(x) for x in _sizes.split(",")], int(_repeats))
    if _result is not None:
        print(json.dumps(_result))
