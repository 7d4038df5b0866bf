"""Pipelines whose stages have several data-parallel ranks (Zorse) or hold the activation differently
(per-stage tensor parallelism, Sailor), run on plain torch.distributed.

``torch.distributed.pipelining`` wires each stage to one previous and one next rank of the same
tensor-parallel index, so a plan with a stage of several ranks (``ranks`` in the plan,
``autotune.specs.mixed_stage``) or with stages of different tensor-parallel degrees or sequence parallelism in
one pipeline (``runner.layout.uneven_handoffs``) runs here instead, every pipeline of it:

- each rank runs its micro-batches in the order ``stage_ranks.rank_orders`` gives it (the simulator's
  orders: the stage's 1F1B or GPipe order restricted to the micro-batches ``microbatch_owners`` assigns to
  the rank, round-robin by share); under ``interleaved-1f1b`` (stages of one rank at different degrees)
  Megatron's interleaved order over the rank's chunks (``autotune.simulator.schedule.stage_orders``);
- hand-offs: the activation of micro-batch ``j`` goes from its owner in stage ``s`` to its owner in stage
  ``s + 1`` (``dist.isend`` / ``dist.recv`` tagged by micro-batch and direction), its gradient back the same
  way, so stages of different width exchange with the right partner for each micro-batch; between the
  owners' tensor-parallel ranks the pieces go as ``autotune.specs.handoff`` gives them (rank ``i`` to rank
  ``i`` for the same layout; tp 2 to tp 1: rank 0 sends the activation, the gradient goes back to both;
  with sequence parallelism each receiver gets the parts of the sequence it holds), the transfers the
  simulator times;
- gradient weighting: the last stage back-propagates each micro-batch's mean loss times ``mbs / B`` (its
  part of the global batch of ``B`` sequences), so the gradient a rank accumulates is its share's part of
  the global-mean gradient (a rank running ``k`` of the step's micro-batches contributes ``k mbs / B`` of it)
  and the holders of each weight (``Layout.grad_groups``: every rank of every stage and replica that holds
  it) simply sum. The step equals the single-process step on the whole batch.

- ZeRO-1 / 2 / 3 (``runner.zero``): the peers of a weight are again all its holders (every rank of its stage in
  every replica). ZeRO-1's collectives run at the step's end only; ZeRO-2's per-micro-batch reduce-scatters
  are issued asynchronously here (``ShardedState(asynchronous=True)``): a rank with 5 micro-batches and its
  peer with 3 pair their calls by count on the key's own group, the peer making up the difference with
  zero-filled calls at the step's end, and no rank ever waits in a collective for a peer's slower queue
  (blocking calls would pair a fast rank's third backward with a slow rank's third and deadlock against
  the hand-offs). The shards are summed in issue order, so runs are deterministic and resume bit-exact.

``slowdown`` is emulated as in ``runner.engine.TimedStage`` (sleep ``slowdown - 1`` times each measured
forward / backward). A rank of a mixed stage may be tensor-parallel at its own degree (its layer's
gradients averaged part by part, ``runner.reshard``), and offload its stage's state (``runner.zero``).
ZeRO-3's per-use gathers are served point to point here (``runner.zero``: each holder posts the sends its
peers' gathers will take at the step's start), so a 5-share rank's ten gathers of a layer and its 3-share
peer's six never wait for each other; ``runner.layerwise`` gathers each layer once per pass instead."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from autotune.simulator.schedule import stage_orders
from autotune.specs import ModelSpec
from autotune.specs.handoff import Transfer, handoff, held_parts
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

    def done(self, kind: int, j: int, t0: float, virtual: int = 0) -> None:
        """One forward / backward of micro-batch ``j`` (on virtual stage ``virtual``) ended now, begun at ``t0``."""
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
            tag = f"@{virtual}" if self.recorder.tag_chunks else ""  # interleaved: "F3@2", as TimedStage names it
            self.recorder.add(("F" if kind == FORWARD else "B") + str(j) + tag, t0, t0 + elapsed)


class MixedPipeline:
    """One rank's part of a pipeline with mixed stages: its order of forwards and backwards, its partners."""

    def __init__(
        self,
        layout: Layout,
        plan: RankPlan,
        chunks: Sequence[torch.nn.Module],
        model: ModelSpec,
        device: torch.device,
        schedule: str,
    ) -> None:
        self.device = device
        self.chunks = list(chunks)  # interleaved-1f1b: the rank's model chunks, first to last
        self.chunk = self.chunks[0]
        mine = [r for r in layout.ranks if r.pipeline == plan.pipeline]
        num_stages = 1 + max(r.stage for r in mine)
        # rank id of (stage, stage_rank, tp_index); how each stage rank holds the activation; every stage's shares
        self.peer = {(r.stage, r.stage_rank, r.tp_index): r.rank for r in mine}
        self.held = {(r.stage, r.stage_rank): (r.tp_degree, r.sequence_parallel) for r in mine}
        shares = []
        for s in range(num_stages):
            ranks = sorted({(r.stage_rank, r.share) for r in mine if r.stage == s})
            shares.append(tuple(share for _, share in ranks))
        self.owners = [microbatch_owners(k) for k in shares]
        self.v, self.m = len(self.chunks), plan.num_microbatches
        if self.v > 1:  # interleaved-1f1b (stages of one rank each): Megatron's order, as the simulator runs it
            self.order = stage_orders(schedule, num_stages, self.m, self.v)[plan.stage]
        else:
            self.order = [(kind, 0, j) for kind, j in rank_orders(schedule, shares)[plan.stage][plan.stage_rank]]
        self.stage, self.num_stages = plan.stage, num_stages
        self.me = (plan.stage_rank, plan.tp_index, plan.tp_degree, plan.sequence_parallel)
        self.clock = MixedClock(plan.slowdown, device.type == "cuda")
        spec = model
        self.mbs = plan.batch_size // plan.num_microbatches
        self.seq_len, self.hidden = spec.seq_len, spec.hidden_size
        self.scale = self.mbs / spec.global_batch_size  # each micro-batch's part of the global mean loss

    def _transfers(self, other: int, j: int, incoming: bool) -> list[tuple[int, Transfer]]:
        """This rank's transfers with stage ``other``'s owner of micro-batch ``j``: (the peer's rank id, the
        transfer); ``incoming``: the ones this rank receives (an activation from the previous stage, a
        gradient from the next), else the ones it sends."""
        k = self.owners[other][j]
        tp, sp = self.held[(other, k)]
        _, index, my_tp, my_sp = self.me
        if incoming:
            return [(self.peer[(other, k, t.src)], t) for t in handoff(tp, sp, my_tp, my_sp) if t.dst == index]
        return [(self.peer[(other, k, t.dst)], t) for t in handoff(my_tp, my_sp, tp, sp) if t.src == index]

    def _receive(self, other: int, j: int, tag: int) -> torch.Tensor:
        """This rank's part of micro-batch ``j``'s activation (or gradient) from stage ``other``: its pieces,
        received and joined along the sequence."""
        import torch
        import torch.distributed as dist

        pieces = []
        for src, t in self._transfers(other, j, incoming=True):  # in sequence order
            first, end = t.tokens(self.seq_len)
            buf = torch.empty((self.mbs, end - first, self.hidden), dtype=torch.float32, device=self.device)
            dist.recv(buf, src=src, tag=tag)
            pieces.append(buf)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def _send(self, tensor: torch.Tensor, other: int, j: int, tag: int, sends: list) -> None:
        """Send the parts of ``tensor`` (this rank's part of the sequence) that stage ``other``'s ranks need."""
        import torch.distributed as dist

        _, index, my_tp, my_sp = self.me
        for dst, t in self._transfers(other, j, incoming=False):
            first, end = t.tokens(self.seq_len)
            held = held_parts(my_tp, my_sp, index, t.parts)[0] * self.seq_len // t.parts
            msg = tensor[:, first - held : end - held].detach().float().contiguous()
            sends.append((msg, dist.isend(msg, dst=dst, tag=tag)))

    def _tag(self, into: int, j: int, grad: int) -> int:
        """The message tag of micro-batch ``j``'s activation (``grad`` 0) entering virtual stage ``into`` or its
        gradient (1) leaving it (one pair per micro-batch without interleaving)."""
        return 2 * ((into if self.v > 1 else 0) * self.m + j) + grad

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None) -> list[torch.Tensor]:
        """Run this rank's forwards and backwards of one step; the last stage returns its micro-batches'
        (unscaled) mean losses. Gradients accumulate in the chunks' parameters (sum over micro-batches,
        each already weighted by ``mbs / B``). Interleaved: chunk ``c`` of stage ``s`` is virtual stage
        ``c p + s``; the last stage's chunk hands off to the first stage's next chunk."""
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        losses: list[torch.Tensor] = []
        sends: list = []
        for kind, c, j in self.order:
            if kind == FORWARD:
                self._forward(c, j, x, y, inputs, outputs, losses, sends)
            else:
                self._backward(c, j, inputs, outputs, sends)
        for _, work in sends:  # each message kept alive until its send completed
            work.wait()
        return losses

    def _forward(self, c: int, j: int, x, y, inputs: dict, outputs: dict, losses: list, sends: list) -> None:
        from runner.model import lm_loss

        p, s, mbs = self.num_stages, self.stage, self.mbs
        vs = c * p + s
        if vs == 0:
            inp = x[j * mbs : (j + 1) * mbs]
        else:
            inp = self._receive((s - 1) % p, j, tag=self._tag(vs, j, 0))
            inp.requires_grad_()
            inputs[(c, j)] = inp
        t0 = self.clock.now()  # the receive's wait is not compute
        chunk = self.chunks[c]
        out = chunk(inp)
        if vs == self.v * p - 1:
            loss = lm_loss(out, y[j * mbs : (j + 1) * mbs], chunk.vocab_mesh)
            losses.append(loss.detach())
            outputs[(c, j)] = loss * self.scale
        else:
            outputs[(c, j)] = out
            self._send(out, (s + 1) % p, j, self._tag(vs + 1, j, 0), sends)
        self.clock.done(FORWARD, j, t0, vs)

    def _backward(self, c: int, j: int, inputs: dict, outputs: dict, sends: list) -> None:
        p, s = self.num_stages, self.stage
        vs = c * p + s
        out = outputs.pop((c, j))
        if vs == self.v * p - 1:
            t0 = self.clock.now()
            out.backward()
        else:
            grad = self._receive((s + 1) % p, j, tag=self._tag(vs + 1, j, 1))
            t0 = self.clock.now()
            out.backward(grad.to(out.dtype))
        if vs > 0:
            self._send(inputs.pop((c, j)).grad, (s - 1) % p, j, self._tag(vs, j, 1), sends)
        self.clock.done(BACKWARD, j, t0, vs)
