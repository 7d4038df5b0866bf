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
gradient summed over the micro-batches and reduced once, so every holder makes the same calls and none pads.

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
from runner.layout import EMBED_KEY, HEAD_KEY, Layout, replicas_out_of_step
from runner.optim import local_tensor, make_optimizer

log = logging.getLogger(__name__)


def _pinned(numel: int, cuda: bool) -> torch.Tensor:
    return torch.zeros(numel, dtype=torch.float32, pin_memory=cuda)


class Unit:
    """One weight key's sharded state on this rank."""

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
    ) -> None:
        self.key, self.params, self.modules = key, params, modules
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
        local = [local_tensor(p) for p in params]
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
                if offload == "all":
                    self.host_weights = _pinned(
                        self.shard if self.n_shards > 1 and zero >= 3 else self.padded, self.cuda
                    )
                    self.host_weights.copy_(
                        mine if self.host_weights.numel() == self.shard and self.n_shards > 1 else flat
                    )
                else:
                    self.weight_shard = mine.clone()
                self.flat = flat  # the parameters become views of this buffer, freed between uses
                offset = 0
                for p, size, shape in zip(params, self.sizes, self.shapes):
                    # a DTensor (tensor parallelism) keeps its placement: its local shard becomes the view
                    local_tensor(p).data = flat[offset : offset + size].view(shape)
                    offset += size
                self._free()
            del flat, mine
        self.gathered = False
        self.backward_pending = False
        self.held = False  # layer-wise execution: one gather and one reduction per pass (``hold`` / ``release``)
        self._accumulated = False
        self._seen = 0
        self.factor = 1.0  # per-micro-batch gradient weight (set by ShardedState)
        self._handles = []
        if not self.resident:
            for p in params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._after_grad))
        if self.streamed:
            self._handles.append(modules[0].register_forward_pre_hook(self._before_forward))
            self._handles.append(modules[-1].register_forward_hook(self._after_forward))

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
            dist.all_gather_into_tensor(out, shard.contiguous(), group=self.ag_group)

    def _free(self) -> None:
        self.flat.untyped_storage().resize_(0)
        self.gathered = False

    def _served_shard(self) -> torch.Tensor:
        return self._up(self.host_weights) if self.offload == "all" else self.weight_shard

    def _serve(self) -> None:
        """Post, at the step's start, every send of this rank's weight shard its peers' gathers will take
        this step (``gathers_of``): the shard does not change before the optimizer step, so the k-th send
        answers a peer's k-th gather whenever the peer reaches it, and no rank waits for a peer's schedule."""
        shard = self._serving = self._served_shard()  # kept until the sends complete
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
                shard = self._up(self.host_weights) if self.offload == "all" else self.weight_shard
                if self.gathers_of is not None:
                    self._served_gather(self.flat, shard)
                else:
                    self._all_gather(self.flat, shard)
        self.gathered = True

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
            self.master.copy_(self._flat_weights([local_tensor(p) for p in self.params])[self.lo : self.hi])

    def _flat_grads(self, scale: float) -> torch.Tensor:
        flat = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        offset = 0
        for p, size in zip(self.params, self.sizes):
            if p.grad is not None:
                flat[offset : offset + size].copy_(local_tensor(p.grad).reshape(-1))
            offset += size
        return flat.mul_(scale)

    def reduce_microbatch(self, pad: bool = False) -> None:
        """One micro-batch's gradient of this unit: reduce-scattered (zero >= 2) and/or sent to host
        memory, accumulated; the whole gradient is freed. ``pad``: a zero-filled call for a micro-batch
        this replica does not have."""
        with torch.no_grad():
            g = torch.zeros(self.padded, device=self.device) if pad else self._flat_grads(self.factor)
            if not pad:
                for p in self.params:
                    p.grad = None
            if self.scatter_per_mb:
                part = torch.empty(self.shard, device=self.device)
                if self.asynchronous:
                    work = dist.reduce_scatter_tensor(part, g, group=self.rs_group, async_op=True)
                    self._pending.append((work, part, g))  # g kept alive until the call completed
                    self._drain(wait=False)
                    return
                dist.reduce_scatter_tensor(part, g, group=self.rs_group)
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
        self._all_gather(buf, self.weight_shard if self.weight_shard is not None else self._up(self.host_weights))

    def finish_step(self, weight: float) -> None:
        """Synchronise the step's gradient and leave it in ``master.grad``."""
        with torch.no_grad():
            self._drain(wait=True)
            if self.resident:
                g = self._flat_grads(weight)
                for p in self.params:
                    p.grad = None
            elif self.scatter_per_mb:
                g = None  # already reduce-scattered into the shard
            else:
                g = self._up(self.acc) if self.offload != "none" else self.acc
            if g is not None and self.n > 1:
                if self.n_shards > 1:
                    part = torch.empty(self.shard, device=self.device)
                    dist.reduce_scatter_tensor(part, g, group=self.rs_group)
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
            for p, size in zip(self.params, self.sizes):
                local_tensor(p).copy_(full[offset : offset + size].view_as(local_tensor(p)))
                offset += size


class ShardedState:
    """All units of one rank, their process groups and the optimizer over their master shards.

    Every rank constructs it (process groups are created by all ranks in one order)."""

    def __init__(self, layout: Layout, rank: int, module, device: torch.device, experts: bool = False) -> None:
        self.layout = layout
        self.plan = layout.ranks[rank]
        self.units: list[Unit] = []
        # micro-batches each rank runs: its share in a mixed stage (runner.mixed), else its pipeline's
        counts = {r.rank: r.share or r.num_microbatches for r in layout.ranks}
        # runner.mixed weighs each micro-batch's loss by its part of the global batch already
        self.grad_weight = 1.0 if layout.mixed else self.plan.grad_weight
        #: an MoE / SPES plan (``experts``): each key's unit is its trainers (``Layout.key_trainers``), with
        #: their gradient weights; a SPES plan's units are per expert-parallel group (its checkpoint names say which)
        self.scope = f".g{self.plan.expert_group}" if experts and layout.sync_every_steps > 1 else ""
        units = layout.key_trainers() if experts else [(*u, None) for u in layout.key_holders()]
        # experts this rank holds and does not train (SPES): no unit, but saved and restored with the shards
        names = {p: n for n, p in module.named_parameters()}
        self.frozen = {
            names[p]: p for key in self.plan.holds() if not self.plan.trains(key) for p in module.params_of(key)
        }
        # replicas whose schedules reach the units in different orders: reduce-scatters without waiting
        asynchronous = replicas_out_of_step(layout)
        # and zero 3's gathers served point to point (``Unit._serve``): every holder gathers each unit twice
        # per micro-batch it runs (forward, backward; a recomputation reuses the backward's gather)
        served = asynchronous and layout.zero >= 3 and not any(r.layerwise for r in layout.ranks)
        for key, _tp_index, holders, weights in units:
            groups = (
                (dist.new_group(list(holders)), dist.new_group(list(holders))) if len(holders) > 1 else (None, None)
            )
            if rank not in holders:
                continue
            params = module.params_of(key)
            if key == EMBED_KEY:
                modules = [module.embed]
            elif key == HEAD_KEY:
                modules = [module.norm, module.head]
            elif ".expert" in key:
                layer, _, expert = key.removeprefix("layer").partition(".expert")
                modules = [module.blocks[layer].mlp.experts[expert]]
            else:
                modules = [module.blocks[key.removeprefix("layer")]]
            unit = Unit(
                key,
                params,
                modules,
                holders,
                rank,
                layout.zero,
                self.plan.offload,
                device,
                *groups,
                max(counts[h] for h in holders),
                counts[rank],
                asynchronous=asynchronous,
                gathers_of={h: 2 * counts[h] for h in holders} if served else None,
            )
            if weights is None:  # every holder trains the key: its replica's share of the batch
                unit.weight = self.grad_weight
                unit.factor = 1.0 if layout.mixed else 1.0 / layout.total_microbatches
            else:  # the exchange's weight (of the pipeline's mean gradient), per micro-batch over its count
                unit.weight = weights[rank]
                unit.factor = weights[rank] / counts[rank]
            self.units.append(unit)
        masters = [u.master for u in self.units]
        # fused AdamW on the master shards (``runner.optim.make_optimizer``; in host memory with offload, as
        # ZeRO-Offload's CPU Adam); ``runner.engine`` sets the step's rate and weight decay
        self.optimizer = make_optimizer(masters)

    @property
    def streamed(self) -> bool:
        return any(u.streamed for u in self.units)

    def unit(self, key: str) -> Unit | None:
        """This rank's unit of weight key ``key`` (``embed``, ``layer<i>``, ``head``), if it holds one."""
        return next((u for u in self.units if u.key == key), None)

    def host_bytes(self) -> int:
        return sum(u.host_bytes() for u in self.units)

    def begin_step(self) -> None:
        for u in self.units:
            u.begin_step()

    def finish_step(self) -> None:
        """Pad the per-micro-batch collectives, synchronise gradients, step AdamW on the master shards,
        write the weights back."""
        for u in self.units:
            if u.gathers_of is not None and u.received != u.gathers_of[u.holders[u.index]]:
                raise RuntimeError(
                    f"runner.zero: {u.key} was gathered {u.received} times this step, its peers served "
                    f"{u.gathers_of[u.holders[u.index]]} (two per micro-batch): a schedule this rank runs "
                    "gathers a unit other than once per forward and once per backward"
                )
        pads = max((u.pads for u in self.units), default=0)
        with torch.no_grad():
            if self.plan.layerwise:  # every holder gathers and reduces once per layer and pass: nothing to pad
                pads = 0
            for i in range(pads):  # replay a micro-batch's collective order (check_sharded_layout: single stage)
                for u in self.units:  # forward: first unit to last
                    if i < u.pads and u.gathers and u.gathers_of is None:
                        u.pad_gather()
                for u in reversed(self.units):  # backward: last unit to first
                    if i < u.pads and u.gathers and u.gathers_of is None:
                        u.pad_gather()
                    if i < u.pads and u.scatter_per_mb:
                        u.reduce_microbatch(pad=True)
        for u in self.units:
            u.finish_step(u.weight)
        self.optimizer.step()
        for u in self.units:
            u.write_back()

    @property
    def per_microbatch(self) -> bool:
        """Whether some unit makes collective calls per micro-batch (gathers or reduce-scatters): then every
        holder must run every unit on every micro-batch (an MoE block runs each expert, tokens or none)."""
        return any(u.gathers or u.scatter_per_mb for u in self.units)

    def reload_from_params(self) -> None:
        """The master shards from the weights, after something other than the optimizer changed them (a
        SPES synchronisation averages the trainers' weights): every unit's weights are resident."""
        for u in self.units:
            u.reload_master()

    # -- checkpoints -------------------------------------------------------------------------------
    def _name(self, u: Unit) -> str:
        shard = u.index if u.n_shards > 1 else 0
        return f"{u.key}{self.scope}.tp{self.plan.tp_index}.shard{shard}of{u.n_shards if u.n_shards > 1 else 1}"

    def state_dict(self) -> dict:
        """This rank's shards under names that say which shard they are (a sharded checkpoint is
        resumed by the same plan)."""
        out = {}
        for u in self.units:
            state = self.optimizer.state.get(u.master, {})
            name = self._name(u)
            if u.n_shards == 1 and u.index > 0:
                continue  # an unsharded unit's replicas hold the same state: rank 0 of its holders saves it
            out[f"{name}.master"] = u.master.detach()
            if state:
                out[f"{name}.exp_avg"] = state["exp_avg"]
                out[f"{name}.exp_avg_sq"] = state["exp_avg_sq"]
                out[f"{name}.step"] = state["step"]
        for name, p in self.frozen.items():  # every holder's copy is the same (the last exchange's)
            out[f"frozen.{name}"] = p.detach()
        return out

    def empty_state_dict(self, steps_done: bool) -> dict:
        """Tensors of the right shapes for loading into (every unit, as a resumed rank needs them)."""
        out = {}
        for u in self.units:
            name = self._name(u)
            out[f"{name}.master"] = torch.empty_like(u.master.detach())
            if steps_done:
                out[f"{name}.exp_avg"] = torch.empty_like(u.master.detach())
                out[f"{name}.exp_avg_sq"] = torch.empty_like(u.master.detach())
                out[f"{name}.step"] = torch.zeros((), dtype=torch.float32)
        for name, p in self.frozen.items():
            out[f"frozen.{name}"] = torch.empty_like(p.detach())
        return out

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for u in self.units:
                name = self._name(u)
                u.master.copy_(state[f"{name}.master"])
                if f"{name}.exp_avg" in state:
                    self.optimizer.state[u.master] = {
                        "step": state[f"{name}.step"].clone(),
                        "exp_avg": state[f"{name}.exp_avg"].clone().to(u.master.device),
                        "exp_avg_sq": state[f"{name}.exp_avg_sq"].clone().to(u.master.device),
                    }
                u.write_back()
            for name, p in self.frozen.items():
                p.copy_(state[f"frozen.{name}"])
