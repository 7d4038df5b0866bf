"""Pipelines whose stages have several data-parallel ranks (Zorse), run on plain torch.distributed.

``torch.distributed.pipelining`` wires each stage to one previous and one next rank, so a plan with a stage of
several ranks (``ranks`` in the plan, ``autotune.specs.mixed_stage``) runs here instead, every pipeline of it:

- each rank runs its micro-batches in the order ``stage_ranks.rank_orders`` gives it (the simulator's
  orders: the stage's 1F1B or GPipe order restricted to the micro-batches ``microbatch_owners`` assigns to
  the rank, round-robin by share);
- hand-offs: the activation of micro-batch ``j`` goes from its owner in stage ``s`` to its owner in stage
  ``s + 1`` (``dist.isend`` / ``dist.recv`` tagged by micro-batch and direction), its gradient back the same
  way, so stages of different width exchange with the right partner for each micro-batch;
- gradient weighting: the last stage back-propagates each micro-batch's mean loss times ``mbs / B`` (its
  part of the global batch of ``B`` sequences), so the gradient a rank accumulates is its share's part of
  the global-mean gradient (a rank running ``k`` of the step's micro-batches contributes ``k mbs / B`` of it)
  and the holders of each weight (``Layout.grad_groups``: every rank of every stage and replica that holds
  it) simply sum. The step equals the single-process step on the whole batch.

- ZeRO-1 / 2 (``runner.zero``): the peers of a weight are again all its holders (every rank of its stage in
  every replica). ZeRO-1's collectives run at the step's end only; ZeRO-2's per-micro-batch reduce-scatters
  are issued asynchronously here (``ShardedState(asynchronous=True)``): a rank with 5 micro-batches and its
  peer with 3 pair their calls by count on the key's own group, the peer making up the difference with
  zero-filled calls at the step's end, and no rank ever waits in a collective for a peer's slower queue
  (blocking calls would pair a fast rank's third backward with a slow rank's third and deadlock against
  the hand-offs). The shards are summed in issue order, so runs are deterministic and resume bit-exact.

``slowdown`` is emulated as in ``runner.engine.TimedStage`` (sleep ``slowdown - 1`` times each measured
forward / backward). Not run here (refused before launch, ``runner.layout.check_mixed_plan``): ZeRO-3, CPU offload and tensor
parallelism inside plans with mixed stages (all three simulated and searched).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from autotune.specs import ModelSpec
from autotune.specs.mixed_stage import BACKWARD, FORWARD, microbatch_owners, rank_orders
from runner.layout import Layout, RankPlan

if TYPE_CHECKING:  # pragma: no cover
    import torch


class MixedClock:
    """Forward / backward busy time and timeline events of one rank (``Engine.busy`` reads ``forward_s``
    and ``backward_s``; ``Engine.record_next_step`` sets ``recorder``), as ``TimedStage`` keeps them."""

    def __init__(self, slowdown: float, cuda: bool) -> None:
        self.slowdown = slowdown
        self.cuda = cuda
        self.forward_s = 0.0
        self.backward_s = 0.0
        self.emulated_s = 0.0  # of forward_s + backward_s, the sleeps that emulate ``slowdown``
        self.recorder = None

    def now(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def done(self, kind: int, j: int, t0: float) -> None:
        elapsed = self.now() - t0
        if self.slowdown > 1.0:
            extra = (self.slowdown - 1.0) * elapsed
            time.sleep(extra)
            self.emulated_s += extra
            elapsed += extra
        if kind == FORWARD:
            self.forward_s += elapsed
        else:
            self.backward_s += elapsed
        if self.recorder:
            self.recorder.add(("F" if kind == FORWARD else "B") + str(j), t0, t0 + elapsed)


class MixedPipeline:
    """One rank's part of a pipeline with mixed stages: its order of forwards and backwards, its partners."""

    def __init__(
        self,
        layout: Layout,
        plan: RankPlan,
        chunk: torch.nn.Module,
        model: ModelSpec,
        device: torch.device,
        schedule: str,
    ) -> None:
        self.device = device
        self.chunk = chunk
        mine = [r for r in layout.ranks if r.pipeline == plan.pipeline]
        num_stages = 1 + max(r.stage for r in mine)
        # rank id of (stage, stage_rank), and the shares of every stage of this pipeline
        self.peer = {(r.stage, r.stage_rank): r.rank for r in mine}
        shares = []
        for s in range(num_stages):
            ranks = sorted({(r.stage_rank, r.share) for r in mine if r.stage == s})
            shares.append(tuple(share for _, share in ranks))
        self.owners = [microbatch_owners(k) for k in shares]
        self.order = rank_orders(schedule, shares)[plan.stage][plan.stage_rank]
        self.stage, self.num_stages = plan.stage, num_stages
        self.clock = MixedClock(plan.slowdown, device.type == "cuda")
        spec = model
        self.mbs = plan.batch_size // plan.num_microbatches
        self.shape = (self.mbs, spec.seq_len, spec.hidden_size)
        self.scale = self.mbs / spec.global_batch_size  # each micro-batch's part of the global mean loss

    def _partner(self, stage: int, j: int) -> int:
        return self.peer[(stage, self.owners[stage][j])]

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None) -> list[torch.Tensor]:
        """Run this rank's forwards and backwards of one step; the last stage returns its micro-batches'
        (unscaled) mean losses. Gradients accumulate in the chunk's parameters (sum over micro-batches,
        each already weighted by ``mbs / B``)."""
        import torch
        import torch.distributed as dist

        from runner.model import lm_loss

        s, first, last = self.stage, self.stage == 0, self.stage == self.num_stages - 1
        device, mbs = self.device, self.mbs
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        losses: list[torch.Tensor] = []
        sends = []
        for kind, j in self.order:
            t0 = self.clock.now()
            if kind == FORWARD:
                if first:
                    inp = x[j * mbs : (j + 1) * mbs]
                else:
                    inp = torch.empty(self.shape, dtype=torch.float32, device=device)
                    dist.recv(inp, src=self._partner(s - 1, j), tag=2 * j)
                    inp.requires_grad_()
                    inputs[j] = inp
                t0 = self.clock.now()  # the receive's wait is not compute
                out = self.chunk(inp)
                if last:
                    loss = lm_loss(out, y[j * mbs : (j + 1) * mbs])
                    losses.append(loss.detach())
                    outputs[j] = loss * self.scale
                else:
                    outputs[j] = out
                    msg = out.detach().float().contiguous()
                    sends.append((msg, dist.isend(msg, dst=self._partner(s + 1, j), tag=2 * j)))
                self.clock.done(FORWARD, j, t0)
            else:
                out = outputs.pop(j)
                if last:
                    t0 = self.clock.now()
                    out.backward()
                else:
                    grad = torch.empty(self.shape, dtype=torch.float32, device=device)
                    dist.recv(grad, src=self._partner(s + 1, j), tag=2 * j + 1)
                    t0 = self.clock.now()
                    out.backward(grad.to(out.dtype))
                if not first:
                    inp = inputs.pop(j)
                    msg = inp.grad.contiguous()
                    sends.append((msg, dist.isend(msg, dst=self._partner(s - 1, j), tag=2 * j + 1)))
                self.clock.done(BACKWARD, j, t0)
        for _, work in sends:  # each message kept alive until its send completed
            work.wait()
        return losses
