"""Bytes per logit the loss holds at its peak, measured on CPU: the simulator's ``loss_bytes_per_logit``.

The last pipeline stage's peak is the loss's backward, where the fp32 cross-entropy holds its saved
log-softmax output, the incoming gradient and the outgoing one at once. Two ways engines call it:

- autotune's runner (``runner.model.lm_loss`` on the stage's output): torch.distributed.pipelining keeps
  the last stage's output (fp32 logits: the chunk returns ``.float()``) for the backward;
- torchtitan: ``F.cross_entropy(pred.float(), ...)`` then ``del pred`` before ``loss.backward()``.

Each case runs in a fresh process (bf16 logits of ``--tokens`` x ``--vocab``, the loss, its backward) and
reports the growth of its resident set's peak (``VmHWM``) over the start, per logit: with
``MALLOC_MMAP_THRESHOLD_`` set, glibc maps every large tensor from the operating system and returns it when
freed, so the growth is the peak of the live tensors.

    .venv/bin/python experiments/fidelity/loss_peak.py [--tokens 2048] [--vocab 50257]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = """
import sys
import torch
from runner.model import lm_loss
torch.set_num_threads(1)
tokens, vocab, keep = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "keep"
x = torch.randn(1, tokens, 64).bfloat16()
w = torch.randn(vocab, 64).bfloat16().requires_grad_()
y = torch.randint(0, vocab, (1, tokens))
def status_kib(field):  # VmHWM is this process's own peak (ru_maxrss keeps the forking parent's across exec)
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))
# warm up the same operations on a tiny case first: the first backward loads code and buffers (~21 MiB
# on torch 2.13) that are the process's, not the loss's, and would be counted against the logits
warm = (x[:, :8] @ w[:64].detach().t().requires_grad_()).float()
lm_loss(warm, y[:, :8] % 64).backward()
del warm
start = status_kib("VmRSS") * 1024
out = (x @ w.t()).float()  # the head's bf16 matmul, returned in fp32 as the runner's last chunk does
loss = lm_loss(out, y)
if not keep:
    del out
loss.backward()
peak = status_kib("VmHWM") * 1024
print((peak - start - w.numel() * 2) / (tokens * vocab))
"""


def measure(tokens: int, vocab: int, keep: bool) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tokens), str(vocab), "keep" if keep else "del"],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"},
    )
    return float(out.stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--quick", action="store_true", help="a smaller vocabulary (the same code path)")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.vocab = 1024, 8192
    from autotune.simulator.engine_terms import loss_bytes_per_logit

    print(f"{args.tokens} tokens x {args.vocab} vocabulary, bf16 logits, fp32 loss")
    for name, engine, keep in (
        ("autotune runner (output kept)", "autotune", True),
        ("torchtitan (del pred)", "torchtitan", False),
    ):
        print(
            f"{name:32s} measured {measure(args.tokens, args.vocab, keep):5.2f} bytes/logit, simulator {loss_bytes_per_logit(engine, 2):.0f}"
        )


if __name__ == "__main__":
    main()
