"""Zorse's layer-wise execution (``execution: "layerwise"``, ``autotune.specs.execution``) on one rank.

The rank runs its chunk one layer at a time (``StageChunk.pieces``: the embedding, each block, the final
norm + LM head) over all of its micro-batches, as Zorse's ``PipelineScheduleGpipe`` does:

- forward, layer by layer, each over the rank's micro-batches in order: the first layer receives each
  micro-batch from its owner in the previous stage, the last sends it on as soon as it is done (the last
  stage takes each micro-batch's loss there). Each layer's input is cut from the previous layer's graph
  (a leaf), so the backward can run one layer at a time too. With the stage's ``offload`` the tensors
  the backward needs wait in host memory (``torch.autograd.graph.save_on_cpu``);
- backward, layers in reverse, each over the micro-batches last first: the last layer receives each
  micro-batch's gradient from the next stage (the last stage back-propagates the loss times ``mbs / B``),
  every other layer takes the gradient of the layer after it, the first sends each gradient back.

Hand-offs, partners, slowdown emulation and gradient weighting are ``runner.mixed``'s (``MixedPipeline``),
so stages of several data-parallel ranks (each with its own share) run layer-wise too. ZeRO-1/2's hooks
(``runner.zero``) fire per layer and micro-batch as they do under micro-batch execution: the gradients and
the step equal single-process training; the once-per-layer batching of the collectives that makes
layer-wise execution pay off on GPUs is the simulator's (``autotune.simulator.layerwise``), not done here.
"""

from __future__ import annotations

import contextlib

import torch

from autotune.specs.mixed_stage import BACKWARD, FORWARD
from runner.mixed import MixedPipeline
from runner.model import lm_loss


class LayerwisePipeline(MixedPipeline):
    """One rank's part of a layer-wise pipeline (same construction as ``MixedPipeline``)."""

    def __init__(self, *args, offload: str = "none", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.offload = offload
        self.mine = [j for j, owner in enumerate(self.owners[self.stage]) if owner == self.me[0]]

    def _context(self):
        """Autocast as the chunk's forward uses it, and host memory for saved tensors with offload."""
        stack = contextlib.ExitStack()
        dtype = getattr(self.chunk, "autocast_dtype", None)
        if dtype is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=dtype))
        if self.offload != "none":
            pin = self.device.type == "cuda"
            stack.enter_context(torch.autograd.graph.save_on_cpu(pin_memory=pin))
        return stack

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None) -> list[torch.Tensor]:
        """Run this rank's layers of one step; the last stage returns its micro-batches' (unscaled) mean
        losses in micro-batch order. Gradients accumulate in the chunk's parameters as in ``MixedPipeline``."""
        s, first, last = self.stage, self.stage == 0, self.stage == self.num_stages - 1
        mbs = self.mbs
        pieces = self.chunk.pieces()
        current: dict[int, torch.Tensor] = {j: x[j * mbs : (j + 1) * mbs] for j in self.mine} if first else {}
        saved: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in pieces]
        losses: dict[int, torch.Tensor] = {}
        sends = []
        top = len(pieces) - 1
        for i, piece in enumerate(pieces):
            for j in self.mine:
                if i == 0 and not first:
                    inp = self._receive(s - 1, j, tag=2 * j)
                else:
                    inp = current[j]
                if inp.is_floating_point():  # a leaf: the backward runs this layer on its own
                    inp = inp.detach().requires_grad_()
                t0 = self.clock.now()
                with self._context():
                    out = piece(inp)
                    if i == top and last:
                        loss = lm_loss(out, y[j * mbs : (j + 1) * mbs])
                        losses[j] = loss.detach()
                        out = loss * self.scale
                if i == top and not last:
                    self._send(out, s + 1, j, 2 * j, sends)
                saved[i][j] = (inp, out)
                current[j] = out
                self.clock.done(FORWARD, j, t0)
        grads: dict[int, torch.Tensor] = {}
        for i in range(top, -1, -1):
            for j in reversed(self.mine):
                inp, out = saved[i].pop(j)
                if i == top and last:
                    grad = None
                elif i == top:
                    grad = self._receive(s + 1, j, tag=2 * j + 1).to(out.dtype)
                else:
                    grad = grads.pop(j)
                t0 = self.clock.now()
                out.backward(grad)
                if i > 0:
                    grads[j] = inp.grad
                elif not first:
                    self._send(inp.grad, s - 1, j, 2 * j + 1, sends)
                self.clock.done(BACKWARD, j, t0)
        for _, work in sends:  # each message kept alive until its send completed
            work.wait()
        return [losses[j] for j in sorted(losses)]
