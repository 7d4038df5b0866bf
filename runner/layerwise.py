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
so stages of several data-parallel ranks (each with its own share) run layer-wise too. Each layer's sharded
or streamed parameters (``runner.zero``: ZeRO-3, offload ``all``) are gathered once per pass and kept
through all of the rank's micro-batches (``Unit.hold``, as Zorse does), and its gradient, summed over the
rank's micro-batches, is reduce-scattered (or sent to host memory) once, after the layer's backward. Every
holder of a layer thus makes two gathers and one reduction per step, in layer order, whatever its share:
ZeRO-2/3 run here beside ranks with other shares, with the collectives the simulator counts
(``autotune.simulator.layerwise``). The step equals single-process training.
"""

from __future__ import annotations

import contextlib

import torch

from autotune.specs.mixed_stage import BACKWARD, FORWARD
from runner.layout import EMBED_KEY, HEAD_KEY
from runner.mixed import MixedPipeline
from runner.model import lm_loss


class LayerwisePipeline(MixedPipeline):
    """One rank's part of a layer-wise pipeline (same construction as ``MixedPipeline``)."""

    def __init__(self, *args, offload: str = "none", zero=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.offload = offload
        self.mine = [j for j, owner in enumerate(self.owners[self.stage]) if owner == self.me[0]]
        chunk = self.chunk
        keys = ([EMBED_KEY] if chunk.embed is not None else []) + [f"layer{i}" for i in chunk.blocks]
        keys += [HEAD_KEY] if chunk.head is not None else []
        # each layer's sharded / streamed state (runner.zero; an MoE block's experts are units of their own):
        # gathered once per pass, not per micro-batch
        self.units = [zero.units_of(k) if zero is not None else [] for k in keys]

    @contextlib.contextmanager
    def _held(self, i: int):
        """Layer ``i``'s parameters gathered for all of its micro-batches (ZeRO-3, offload ``all``)."""
        for unit in self.units[i]:
            unit.hold()
        try:
            yield
        finally:
            for unit in self.units[i]:
                unit.release()

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
        pieces = self.chunk.pieces()
        mbs = self.mbs
        current = {j: x[j * mbs : (j + 1) * mbs] for j in self.mine} if self.stage == 0 else {}
        saved: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in pieces]
        losses: dict[int, torch.Tensor] = {}
        sends: list = []
        for i, piece in enumerate(pieces):
            with self._held(i):
                self._forward_layer(i, piece, current, saved, losses, sends, y)
        grads: dict[int, torch.Tensor] = {}
        for i in range(len(pieces) - 1, -1, -1):
            with self._held(i):
                self._backward_layer(i, saved, grads, sends)
        for _, work in sends:  # each message kept alive until its send completed
            work.wait()
        return [losses[j] for j in sorted(losses)]

    def _forward_layer(self, i: int, piece, current: dict, saved: list, losses: dict, sends: list, y) -> None:
        """Layer ``i`` over the rank's micro-batches, in order; the last layer sends each on (or takes its loss)."""
        s, mbs = self.stage, self.mbs
        top, last = len(saved) - 1, self.stage == self.num_stages - 1
        for j in self.mine:
            inp = self._receive(s - 1, j, tag=2 * j) if i == 0 and s > 0 else current[j]
            if inp.is_floating_point():  # a leaf: the backward runs this layer on its own
                inp = inp.detach().requires_grad_()
            t0 = self.clock.now()
            with self._context():
                out = piece(inp)
                if i == top and last:
                    loss = lm_loss(out, y[j * mbs : (j + 1) * mbs], self.chunk.vocab_mesh)
                    losses[j] = loss.detach()
                    out = loss * self.scale
            if i == top and not last:
                self._send(out, s + 1, j, 2 * j, sends)
            saved[i][j] = (inp, out)
            current[j] = out
            self.clock.done(FORWARD, j, t0)

    def _backward_layer(self, i: int, saved: list, grads: dict, sends: list) -> None:
        """Layer ``i``'s backward over the rank's micro-batches, last first; the first layer sends each
        gradient back."""
        s, top, last = self.stage, len(saved) - 1, self.stage == self.num_stages - 1
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
            elif s > 0:
                self._send(inp.grad, s - 1, j, 2 * j + 1, sends)
            self.clock.done(BACKWARD, j, t0)
