"""The host optimizer step: AdamW on fp32 tensors in host memory, as offloaded plans and RoundPipe step it.

    .venv/bin/python experiments/speed/bench_host_adam.py [--params 20000000] [--steps 5]

Times one AdamW step (the runner's settings, ``runner.optim.ADAMW``) of ``--params`` parameters in host
memory with torch's per-tensor loop (``foreach=False``: the runner's plans outside ZeRO before 4ffce66),
``foreach=True`` and ``fused=True`` (``runner.optim.make_optimizer``: every plan), and RoundPipe's compiled CPU Adam with
decoupled weight decay (``runner.roundpipe_run.host_adamw``) where the ``roundpipe`` package is installed
(its kernel is compiled on first use; ``import roundpipe`` itself needs CUDA, so its optimizer module is
loaded on its own). Prints parameters per second and each variant's largest difference from the loop
after the warm-up and timed steps. The simulator's host step rate (``HOST_ADAM_PARAMS_PER_S``) is ZeRO-Offload's
DeepSpeed CPU-Adam on a 48-core host.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import types


def _roundpipe_adam():
    """RoundPipe's ``optim.Adam`` without ``roundpipe/__init__`` (which queries GPUs), or None."""
    spec = importlib.util.find_spec("roundpipe")
    if spec is None or not spec.submodule_search_locations:
        return None
    if "roundpipe" not in sys.modules:
        package = types.ModuleType("roundpipe")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["roundpipe"] = package
    try:
        from roundpipe.optim import Adam
    except Exception as e:  # no compiler, no ninja, no py-cpuinfo: say so and go on
        print(f"roundpipe's Adam not available: {type(e).__name__}: {e}")
        return None
    return Adam


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=20_000_000)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="1M parameters, 2 steps, no RoundPipe")
    args = ap.parse_args()
    if args.quick:
        args.params, args.steps = 1_000_000, 2
    import torch

    from runner.optim import ADAMW

    def tensor() -> torch.nn.Parameter:
        g = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(args.params, generator=g))
        p.grad = torch.randn(args.params, generator=g)
        return p

    variants = {
        "torch AdamW foreach=False": lambda p: torch.optim.AdamW([p], **ADAMW, foreach=False),
        "torch AdamW foreach=True": lambda p: torch.optim.AdamW([p], **ADAMW, foreach=True),
        "torch AdamW fused=True": lambda p: torch.optim.AdamW([p], **ADAMW, fused=True),
    }
    adam = None if args.quick else _roundpipe_adam()
    if adam is not None:
        variants["roundpipe Adam (decoupled)"] = lambda p: adam([p], **ADAMW, decoupled_weight_decay=True)
    load = os.getloadavg()[0]
    print(
        f"{args.params:,} fp32 parameters, {args.steps} timed steps after 1, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load {load:.2f}"
    )
    reference = None
    for name, make in variants.items():
        p = tensor()
        opt = make(p)
        opt.step()  # warm-up (RoundPipe: compiles its kernel the first time)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            opt.step()
        dt = (time.perf_counter() - t0) / args.steps
        if reference is None:
            reference = p.detach().clone()
        diff = float((p.detach() - reference).abs().max() / reference.abs().max())
        print(f"{name:28s} {dt * 1e3:8.1f} ms/step {args.params / dt / 1e9:7.3f} G params/s   rel. diff {diff:.1e}")


if __name__ == "__main__":
    main()
