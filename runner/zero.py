"""ZeRO-1/2/3 sharding and CPU offload of one rank's training state, on plain torch.distributed.

The unit of sharding is one weight key of ``runner.layout`` (``embed``, ``layer<i>``, ``head``: the
embedding, one transformer block, the final norm + LM head) and its holders: the ranks of every
replica that hold that key (same tensor-parallel shard). In an MoE / SPES plan an expert
(``layer<i>.expert<e>``) is a key of its own and a block's key its shared part, and a unit's ranks are the
key's trainers that step together (``Layout.key_trainers``: an expert's holders across expert-parallel
groups; under SPES with ``sync_every_steps`` > 1 the replicas of one group), each gradient weighted as the
exchange weighs it (``runner.moe``); an MoE block then runs every expert on every micro-batch where
collectives go per micro-batch, and a SPES synchronisation reloads the master shards from the averaged
weights. Each key's parameters are flattened into one
buffer, padded to a multiple of the holders ``N``; rank ``i`` of them owns slice ``i`` (ZeRO's
partitioning, Rajbhandari et al. 2020). Per unit the rank keeps, as ``autotune.simulator.zero``
counts them:

- the optimizer's fp32 master shard and its two AdamW moments (``torch.optim.AdamW`` on the shards;
  the same elementwise math as the single-process reference) -- with ``zero >= 1`` 1/N of them,
  else all -- held apart from the model's parameters (in host memory with ``offload``);
- gradients: whole, accumulated on the device until the step's synchronisation (zero 0 / 1: all-reduce
  / reduce-scatter), or reduce-scattered after every micro-batch's backward of the unit (zero 2 / 3)
  and accumulated into a gradient shard, or copied to host memory after every micro-batch (offload
  with gradients not resident: ``autotune.simulator.zero.gradients_resident``);
- parameters: whole on the device (zero < 3, no ``all``); or ``streamed``: only while the unit
  computes. The parameters are views into one flat buffer whose storage is freed after the unit's
  forward and backward and refilled before them (FSDP's technique): by an all-gather of the owners'
  weight shards (zero 3), by a copy from host memory (offload ``all``), or both (a shard copied up,
  then all-gathered). Forward pre/post hooks on the unit's modules, a hook on its output's gradient
  (before its backward) and post-accumulate-grad hooks on its parameters (after it) drive this.

Communication: one process group per unit for all-gathers and one for reduce-scatters, so every
collective call on a group moves the same buffer and calls pair up whatever order forward and
backward run in. Replicas with fewer micro-batches than their peers make up the difference with
zero-filled calls at the end of the step, so every holder makes the same number of calls. Where the
replicas' schedules reach the units in different orders (different layer splits, different micro-batch
counts in pipelines of several stages, mixed stages: ``runner.layout.replicas_out_of_step``), zero 2/3's
per-micro-batch reduce-scatters are issued without waiting (``async_op``) and their shards summed in issue
order when they complete: calls on one unit's group pair up in order (each moves the same buffer and the
shards are summed, so which micro-batch pairs with which does not matter), and a rank never blocks on a
call its peers issue later. The price is memory: a micro-batch's whole gradient of a unit stays until its
call completes, so a replica ahead of its peers holds several (measured on two even single-stage replicas
issuing every call this way: +0.35 GiB peak at 25.4M parameters, whose fp32 gradient is 0.1 GiB, against
waiting for each call); replicas in step wait for each call, as the simulator counts. Zero 3's per-use gathers cannot wait (the
weights are needed now): in step they are all-gathers; out of step a blocking all-gather would pair a fast
rank's third gather with a slow rank's third and deadlock against the pipeline's hand-offs, so there they
are served point to point (``Unit._serve``): at the step's start each holder posts one send of its weight
shard per gather each peer will make this step (two per micro-batch the peer runs: forward and backward),
and a gather receives one shard from each peer. The shard does not change before the optimizer step, so
which send answers which gather does not matter, and no rank waits for a peer's schedule (the sends are
waited for before the write-back). ZeRO-3 thus runs over any layer split, micro-batch counts and mixed
stages (Zorse's ZeRO-sharded mixed stages under 1F1B, as well as layer-wise ones). Under tensor parallelism
a weight is a DTensor whose local shard is the view into the flat buffer (the unit holds the rank's
tensor-parallel shard of each weight, its holders the ranks of the same shard). Single-stage
replicas may differ in micro-batches: the padding calls replay a micro-batch's order (forward
gathers first to last unit, then per unit from the last: gather, reduce-scatter). Under layer-wise
execution (``runner.layerwise``) a unit is held for a whole pass (``Unit.hold``): gathered once, its
gradient summed over the micro-batches and reduced once, so layer-wise holders make the same calls and none
pads; beside holders that run per micro-batch it pads its reductions to their count (zero-filled, issued
without waiting) and zero 3's gathers are served point to point (two per pass).

Offload: host tensors live on the CPU (pinned when the device is CUDA) and every move between host and
device is an explicit copy (``_up`` / ``_down``); on the CPU runner device and host are the same memory
and the copies are real memcpys, a faithful code path that the CUDA runner shares (copies there go over
PCIe, non-blocking from pinned memory). The optimizer step of offloaded units runs on host tensors
(the host CPU).

Gradient weighting is the engine's: a micro-batch's gradient counts ``1 / total micro-batches`` (the
global loss is the mean over all sequences), a replica's whole accumulated gradient ``B_p / B``.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch import nn

from autotune.simulator.zero import gradients_resident
from runner.optim import local_tensor
from runner.reshard import WHOLE, Piece

log = logging.getLogger(__name__)

# torch 2.13 names them ``*_single`` and warns on the old names (same arguments); torch 2.8 has only the old ones
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _pinned(numel: int, cuda: bool) -> torch.Tensor:
    return torch.zeros(numel, dtype=torch.float32, pin_memory=cuda)


class SharedWeights:
    """A rank's weights that several of its units hold parts of (``Piece``): each one's gradient is dropped
    once every such unit has taken its part, and its storage (streamed units) freed once none is gathered."""

    def __init__(self) -> None:
        self.users: dict[nn.Parameter, int] = {}
        self._taken: dict[nn.Parameter, int] = {}
        self.live: dict[nn.Parameter, set] = {}

    def taken(self, p: nn.Parameter) -> bool:
        """One unit took its part of ``p``'s gradient: whether it was the last."""
        users = self.users.get(p, 1)
        n = self._taken.get(p, 0) + 1
        self._taken[p] = 0 if n == users else n
        return n == users


class Unit:
    """One weight key's sharded state on this rank (or one part of it: ``pieces``)."""

    def __init__(
        self,
        key: str,
        params: list[nn.Parameter],
        modules: list[nn.Module],
        holders: tuple[int, ...],
        rank: int,
        zero: int,
        offload: str,
        device: torch.device,
        ag_group,
        rs_group,
        max_microbatches: int,
        own_microbatches: int,
        asynchronous: bool = False,
        gathers_of: dict[int, int] | None = None,
        pieces: list[Piece] | None = None,
        shared: SharedWeights | None = None,
    ) -> None:
        self.key, self.params, self.modules = key, params, modules
        self.label = ""  # its checkpoint name's part (``runner.sharded_state``)
        self.pieces = pieces or [WHOLE] * len(params)
        self.shared = shared or SharedWeights()
        # streamed parameters become views of the unit's buffer where it holds them whole; parts of weights
        # are copied in after a gather (a column of a row-parallel weight is not contiguous)
        self.views = all(pc.n == 1 for pc in self.pieces)
        self.device, self.offload = device, offload
        self.cuda = device.type == "cuda"
        n = len(holders)
        self.n, self.index = n, holders.index(rank)
        self.ag_group, self.rs_group = ag_group, rs_group
        self.zero = zero
        self.n_shards = n if zero >= 1 and n > 1 else 1
        self.streamed = offload == "all" or (zero >= 3 and n > 1)
        self.resident = gradients_resident(zero, offload, n)
        self.scatter_per_mb = not self.resident and zero >= 2 and n > 1
        local = [pc.of(local_tensor(p)) for p, pc in zip(params, self.pieces)]
        self.shapes = [t.shape for t in local]
        self.sizes = [t.numel() for t in local]
        self.numel = sum(self.sizes)
        self.shard = math.ceil(self.numel / self.n_shards)
        self.padded = self.shard * self.n_shards
        self.lo, self.hi = (
            self.index * self.shard if self.n_shards > 1 else 0,
            (self.index + 1) * self.shard if self.n_shards > 1 else self.padded,
        )
        self.pads = max(0, max_microbatches - own_microbatches)
        # per-micro-batch reduce-scatters issued without waiting, summed in issue order (replicas out of step)
        self.asynchronous = asynchronous
        self._pending: list = []  # (work, shard) of reduce-scatters in flight, in issue order
        # zero 3 over replicas out of step: gathers served point to point (``_serve``), the number of gathers
        # each holder makes per step (global rank -> count) known in advance; None: all-gathers
        self.holders = holders
        self.gathers_of = gathers_of if zero >= 3 and n > 1 else None
        self._sends: list = []  # this step's posted sends of the weight shard to the peers
        self.received = 0  # gathers served to this rank this step
        host = offload != "none"
        with torch.no_grad():
            flat = self._flat_weights(local)
            mine = flat[self.lo : self.hi]
            # the optimizer's master shard, apart from the parameters (host memory with offload)
            self.master = nn.Parameter(_pinned(self.shard, self.cuda).copy_(mine) if host else mine.clone())
            # gradients accumulated between micro-batches: a shard (zero >= 2), else the whole buffer
            acc_numel = self.shard if self.scatter_per_mb else self.padded
            self.acc = (
                None
                if self.resident
                else (_pinned(acc_numel, self.cuda) if host else torch.zeros(acc_numel, device=device))
            )
            self.weight_shard = None  # zero 3 without 'all': this rank's slice of the weights, on the device
            self.host_weights = None  # offload 'all': the weights in host memory (a shard with zero 3)
            self.flat = None
            if self.streamed:
                self._stream(flat, mine)
            del flat, mine
        self.gathered = False
        self.backward_pending = False
        self.held = False  # layer-wise execution: one gather and one reduction per pass (``hold`` / ``release``)
        self._accumulated = False
        self._seen = 0
        self.factor = 1.0  # per-micro-batch gradient weight (set by ShardedState)
        self.tp_copies = [1] * len(params)  # ranks of its tensor-parallel group keeping each weight whole (clipping)
        self._handles = []
        if not self.resident:
            for p in params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._after_grad))
        if self.streamed:
            self._handles.append(modules[0].register_forward_pre_hook(self._before_forward))
            self._handles.append(modules[-1].register_forward_hook(self._after_forward))

    def _stream(self, flat: torch.Tensor, mine: torch.Tensor) -> None:
        """Streamed parameters (zero 3, offload ``all``): the weights kept as a device shard or in host memory,
        the parameters views of ``flat`` (or, parts of weights, copied in: ``_copy_in``), freed between uses."""
        if self.offload == "all":
            self.host_weights = _pinned(self.shard if self.n_shards > 1 and self.zero >= 3 else self.padded, self.cuda)
            self.host_weights.copy_(mine if self.host_weights.numel() == self.shard and self.n_shards > 1 else flat)
        else:
            self.weight_shard = mine.clone()
        self.flat = flat
        offset = 0
        for p, size, shape in zip(self.params if self.views else (), self.sizes, self.shapes):
            # a DTensor (tensor parallelism) keeps its placement: its local shard becomes the view
            local_tensor(p).data = flat[offset : offset + size].view(shape)
            offset += size
        for p in self.params if not self.views else ():
            self.shared.live.setdefault(p, set()).add(self)
        if self.views:
            self._free()
        else:  # the weights stay until every unit holding a part is built (``free_parts``)
            self.flat.untyped_storage().resize_(0)

    # -- bytes -------------------------------------------------------------------------------------
    def host_bytes(self) -> int:
        """Bytes of this unit's state in host memory (master, two moments, accumulators, weights)."""
        if self.offload == "none":
            return 0
        total = 3 * self.master.numel() + (self.acc.numel() if self.acc is not None else 0)
        total += self.host_weights.numel() if self.host_weights is not None else 0
        return 4 * total

    # -- moving data ---------------------------------------------------------------------------------
    def _up(self, t: torch.Tensor) -> torch.Tensor:
        """Host -> device (a real copy, also on the CPU runner)."""
        return t.to(self.device, non_blocking=True, copy=True)

    def _down(self, t: torch.Tensor, into: torch.Tensor, add: bool = False) -> None:
        """Device -> host buffer ``into`` (copy or accumulate)."""
        host = t.to("cpu", non_blocking=False, copy=True) if self.cuda else t.clone()
        if add:
            into.add_(host)
        else:
            into.copy_(host)

    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        if self.ag_group is None:
            out.copy_(shard)
        else:
            _all_gather(out, shard.contiguous(), group=self.ag_group)

    def _free(self) -> None:
        self.flat.untyped_storage().resize_(0)
        self.gathered = False
        for p in self.params if not self.views else ():  # parts copied in: free a weight no unit still holds
            live = self.shared.live[p]
            live.discard(self)
            if not live:
                local_tensor(p).untyped_storage().resize_(0)

    def free_parts(self) -> None:
        """After every unit of the rank is built: a streamed unit of parts frees the weights (``_free``)."""
        if self.streamed and not self.views:
            self._free()

    def _copy_in(self) -> None:
        """The gathered buffer into this unit's parts of the weights (their storage refilled if freed)."""
        offset = 0
        for p, pc, size, shape in zip(self.params, self.pieces, self.sizes, self.shapes):
            t = local_tensor(p).data  # not an autograd write: a saved weight is refilled, not changed
            if t.untyped_storage().size() == 0:
                t.untyped_storage().resize_((t.storage_offset() + t.numel()) * t.element_size())
            pc.of(t).copy_(self.flat[offset : offset + size].view(shape))
            self.shared.live[p].add(self)
            offset += size

    def _weight_shard(self) -> torch.Tensor:
        """This rank's shard of the weights on the device (zero 3; copied up from host memory with ``all``)."""
        return self._up(self.host_weights) if self.offload == "all" else self.weight_shard

    def _serve(self) -> None:
        """Post, at the step's start, every send of this rank's weight shard its peers' gathers will take
        this step (``gathers_of``): the shard does not change before the optimizer step, so the k-th send
        answers a peer's k-th gather whenever the peer reaches it, and no rank waits for a peer's schedule."""
        shard = self._serving = self._weight_shard()  # kept until the sends complete
        for peer in self.holders:
            if peer != self.holders[self.index]:
                for _ in range(self.gathers_of[peer]):
                    self._sends.append(dist.isend(shard, dst=peer, group=self.ag_group))
        self.received = 0

    def _served_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """``out`` from this rank's shard and one receive per peer (the sends ``_serve`` posted)."""
        recvs = []
        for i, peer in enumerate(self.holders):
            part = out[i * self.shard : (i + 1) * self.shard]
            if i == self.index:
                part.copy_(shard)
            else:
                recvs.append(dist.irecv(part, src=peer, group=self.ag_group))
        for r in recvs:
            r.wait()
        self.received += 1

    def gather(self) -> None:
        """Materialise the unit's parameters on the device (streamed units)."""
        if self.gathered:
            return
        with torch.no_grad():
            self.flat.untyped_storage().resize_(self.padded * self.flat.element_size())
            if self.offload == "all" and self.host_weights.numel() == self.padded:
                self.flat.copy_(self._up(self.host_weights))
            else:
                shard = self._weight_shard()
                if self.gathers_of is not None:
                    self._served_gather(self.flat, shard)
                else:
                    self._all_gather(self.flat, shard)
            if not self.views:
                self._copy_in()
        self.gathered = True

    def materialise(self) -> None:
        """The unit's parameters whole on the device outside a pass (an MoE / SPES exchange reads and writes
        them after the optimizer step): a blocking all-gather among its holders, whose sends of the step
        have all completed by then (``write_back``), or a copy from host memory. Resident units: nothing."""
        if self.gathered or not self.streamed:
            return
        served, self.gathers_of = self.gathers_of, None
        try:
            self.gather()
        finally:
            self.gathers_of = served

    def unmaterialise(self) -> None:
        """Free the parameters ``materialise`` brought in, unchanged (nothing to write back)."""
        if self.streamed and self.gathered:
            self._free()

    def settle(self) -> None:
        """After an exchange changed the weights ``materialise`` brought in: the master shard reloaded from
        them, the weight shard (or host copy) rewritten, the parameters freed."""
        self.reload_master()
        self.write_back()
        self._free()

    # -- hooks ---------------------------------------------------------------------------------------
    def _before_forward(self, module, args):
        self.gather()

    def _after_forward(self, module, args, output):
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._before_backward)
        if not self.backward_pending and not self.held:  # not a recomputation inside the unit's backward
            self._free()
        return output

    def hold(self) -> None:
        """Keep the unit through every micro-batch of one layer-wise pass (``runner.layerwise``): its
        parameters gathered once (streamed units) and its gradient summed over the micro-batches, to be
        reduce-scattered (or sent to host memory) once, at ``release``."""
        if self.streamed:
            self.gather()
        self.held = True
        self._accumulated = False

    def release(self) -> None:
        """End ``hold`` after the layer's last micro-batch: a backward pass's gradient goes out once, the
        parameters are freed."""
        if not self.held:
            return
        self.held = False
        if self._accumulated:
            self._accumulated = False
            self.reduce_microbatch()
        if self.streamed:
            self.backward_pending = False
            self._free()

    def _before_backward(self, grad):
        self.backward_pending = True
        self.gather()
        return grad

    def _after_grad(self, param) -> None:
        self._seen += 1
        if self._seen < len(self.params):
            return
        self._seen = 0
        if self.held:  # layer-wise: summed in the parameters' gradients until ``release``
            self._accumulated = True
            return
        self.reduce_microbatch()
        if self.streamed:
            self.backward_pending = False
            self._free()

    def _flat_weights(self, local: list[torch.Tensor]) -> torch.Tensor:
        """The unit's weights (their local tensors ``local``) in one fp32 buffer padded to the shards' length."""
        flat = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        flat[: self.numel].copy_(torch.cat([t.detach().reshape(-1).float() for t in local]))
        return flat

    def reload_master(self) -> None:
        """This rank's master shard from the (resident) weights, after something other than the optimizer
        changed them."""
        with torch.no_grad():
            local = [pc.of(local_tensor(p)) for p, pc in zip(self.params, self.pieces)]
            self.master.copy_(self._flat_weights(local)[self.lo : self.hi])

    def _flat_grads(self, scale: float) -> torch.Tensor:
        flat = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        offset = 0
        for p, pc, size in zip(self.params, self.pieces, self.sizes):
            if p.grad is not None:
                flat[offset : offset + size].copy_(pc.of(local_tensor(p.grad)).reshape(-1))
            offset += size
        return flat.mul_(scale)

    def _drop_grads(self) -> None:
        """The gradients this unit has taken: dropped (a weight other units hold parts of: after the last)."""
        for p in self.params:
            if self.shared.taken(p):
                p.grad = None

    def reduce_microbatch(self, pad: bool = False) -> None:
        """One micro-batch's gradient of this unit: reduce-scattered (zero >= 2) and/or sent to host
        memory, accumulated; the whole gradient is freed. ``pad``: a zero-filled call for a micro-batch
        this replica does not have."""
        with torch.no_grad():
            g = torch.zeros(self.padded, device=self.device) if pad else self._flat_grads(self.factor)
            if not pad:
                self._drop_grads()
            if self.scatter_per_mb:
                part = torch.empty(self.shard, device=self.device)
                if self.asynchronous:
                    work = _reduce_scatter(part, g, group=self.rs_group, async_op=True)
                    self._pending.append((work, part, g))  # g kept alive until the call completed
                    self._drain(wait=False)
                    return
                _reduce_scatter(part, g, group=self.rs_group)
                g = part
            if pad and not self.scatter_per_mb:
                return
            if self.offload != "none":
                self._down(g, self.acc, add=True)
            else:
                self.acc.add_(g)

    def _drain(self, wait: bool) -> None:
        """Add the finished asynchronous reduce-scatters' shards to the accumulator, oldest first (all of
        them, waiting, with ``wait``): the sum's order is the issue order whatever the timing."""
        while self._pending and (wait or self._pending[0][0].is_completed()):
            work, part, _ = self._pending.pop(0)
            work.wait()
            if self.offload != "none":  # the shard accumulates in host memory
                self._down(part, self.acc, add=True)
            else:
                self.acc.add_(part)

    # -- the step ----------------------------------------------------------------------------------
    def begin_step(self) -> None:
        if self.acc is not None:
            self.acc.zero_()
        self._seen = 0
        self.backward_pending = False
        if self.gathers_of is not None:
            self._serve()

    @property
    def gathers(self) -> bool:
        """Whether the unit's parameters are all-gathered per use (zero 3 among peers)."""
        return self.streamed and self.zero >= 3 and self.n > 1

    def pad_gather(self) -> None:
        """A zero-cost stand-in for one all-gather of a micro-batch this replica does not have."""
        buf = torch.empty(self.padded, device=self.device)
        self._all_gather(buf, self._weight_shard())

    def finish_step(self, weight: float) -> None:
        """Synchronise the step's gradient and leave it in ``master.grad``."""
        with torch.no_grad():
            self._drain(wait=True)
            if self.resident:
                g = self._flat_grads(weight)
                self._drop_grads()
            elif self.scatter_per_mb:
                g = None  # already reduce-scattered into the shard
            else:
                g = self._up(self.acc) if self.offload != "none" else self.acc
            if g is not None and self.n > 1:
                if self.n_shards > 1:
                    part = torch.empty(self.shard, device=self.device)
                    _reduce_scatter(part, g, group=self.rs_group)
                    g = part
                else:
                    dist.all_reduce(g, group=self.rs_group)
            if g is None:
                grad = self.acc.clone()
            elif g.numel() == self.shard:
                grad = g
            else:
                grad = g[self.lo : self.hi]
            if self.offload != "none":
                host = _pinned(self.shard, self.cuda)
                self._down(grad, host)
                grad = host
            self.master.grad = grad.to(self.master.device) if grad.device != self.master.device else grad

    def grad_square(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm from ``master.grad`` (after ``finish_step``):
        an element of a sharded unit is held by one holder, of an unsharded one by all ``n``; a weight that
        the rank's tensor-parallel peers each keep whole (``tp_copies``) counts ``1 / copies`` on each."""
        g = self.master.grad.double()
        sq = g.pow(2).sum()
        offset = 0
        for size, copies in zip(self.sizes, self.tp_copies):
            lo, hi = max(offset, self.lo) - self.lo, min(offset + size, self.hi) - self.lo
            if copies > 1 and hi > lo:
                sq -= g[lo:hi].pow(2).sum() * (1.0 - 1.0 / copies)
            offset += size
        return sq / (self.n if self.n_shards == 1 else 1)

    def write_back(self) -> None:
        """After the optimizer step: the updated master shard back into the weights."""
        for work in self._sends:  # the peers have taken the old shard (every gather of theirs this step)
            work.wait()
        self._sends.clear()
        with torch.no_grad():
            self.master.grad = None
            if self.weight_shard is not None:  # zero 3: the device's weight shard
                self.weight_shard.copy_(self._up(self.master) if self.offload != "none" else self.master)
                return
            if self.host_weights is not None:  # offload 'all': the weights in host memory
                if self.host_weights.numel() == self.shard and self.n_shards > 1:
                    self.host_weights.copy_(self.master)
                else:
                    full = torch.empty(self.padded, device=self.device)
                    self._all_gather(full, self._up(self.master)) if self.n_shards > 1 else full.copy_(
                        self._up(self.master)
                    )
                    self._down(full, self.host_weights)
                return
            full = torch.empty(self.padded, device=self.device)
            shard = self._up(self.master) if self.offload != "none" else self.master
            if self.n_shards > 1:
                self._all_gather(full, shard)
            else:
                full.copy_(shard)
            offset = 0
            for p, pc, size, shape in zip(self.params, self.pieces, self.sizes, self.shapes):
                pc.of(local_tensor(p)).copy_(full[offset : offset + size].view(shape))
                offset += size
