"""Mixture of experts in the runner: the MoE block's MLP (top-k routing), expert parallelism by
all-to-all, and the data-parallel exchange of MoE and SPES plans.

**The block.** ``MoEMLP`` replaces a block's MLP in the model's MoE blocks (``ModelSpec.is_moe_layer``):
a router (``h -> E`` logits, no bias) picks each token's top ``k`` experts, whose outputs are summed
with the softmax of the ``k`` selected logits as weights (Mixtral's routing); every expert is an MLP
of the model's kind (``mlp``) and width ``expert_ffn_hidden_size``. Nothing is dropped (no capacity
limit; the simulator's capacity factor only sizes the busiest expert's work) and there is no
load-balancing loss (a training objective choice this runner leaves out: the equivalences below
compare plans of the same objective). Expert ``e`` of block ``i`` draws its weights from its own
seed, so it starts the same wherever it is held.

**Expert parallelism.** In a plan with ``expert_parallel = g`` the replica at position ``j`` of an
expert-parallel group holds experts ``[j E / g, (j + 1) E / g)`` of every MoE block; a token's copies go
to their experts' holders and back by ``all_to_all_single`` in the group (``AllToAll``, whose backward
sends the gradients back the same way; gloo on CPU has the collective in torch 2.13, NCCL on CUDA),
counts exchanged first. The group's replicas run the same schedule on the same shapes (the plan rules
say so), so their all-to-alls pair up in order, forward and backward.

**Tensor parallelism** (``MoEMLP.set_tensor_parallel``): on a stage of several devices every expert is split as
the dense MLP is (Megatron-LM's expert tensor parallelism), the router whole; the block's input is gathered, its
output reduced once for all experts. With ZeRO-2/3 every held expert runs on every micro-batch (``every_expert``).

**Exchange of MoE / SPES plans** (``ExpertSync``). Every weight key (``Layout`` holder keys: the shared
part of a block, each expert, embedding, head) is held by some ranks and trained by some of them (an
expert by the replicas whose group trains it; everything else by all). A holder's gradient covers its
own pipeline's batch (``B_p``), an expert holder's its whole group's (``g B_p``, the tokens routed to
it); it is weighted by ``B_p / (sum of the covered batches of the key's trainers)`` so the sum over
trainers is the gradient of the mean loss over their sequences.

- ``sync_every_steps`` 1: every step the trainers all-reduce the weighted gradients; after the
  optimizer step a trainer broadcasts the new weights of an expert to the holders that do not train
  it. With every expert trained everywhere this is ordinary data parallelism.
- replicas holding a key at different tensor-parallel degrees exchange it part by part
  (``Layout.exchange_groups``' ``part``, ``runner.reshard``): each part of its sharded weights among the
  ranks holding it, the weights every rank keeps whole among all of them, each over its degree.
- ``sync_every_steps`` H > 1 (SPES): every step only the holders inside one expert-parallel group
  all-reduce (weights over the group's batch); after every H-th step the trainers of each key average
  its weights (weighted by covered batch) and one of them broadcasts the result to the key's other
  holders. Optimizer states stay local; untrained experts are frozen (``requires_grad`` off, not in
  the optimizer) and only change at a synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autotune.specs import ModelSpec
from runner.optim import local_tensor
from runner.reshard import Piece, parts_of


class AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` of rows (``input_sizes`` rows to each peer, ``output_sizes`` from each)
    whose backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_sizes: list[int], input_sizes: list[int], group) -> torch.Tensor:
        ctx.sizes, ctx.group = (output_sizes, input_sizes), group
        out = x.new_empty((sum(output_sizes),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_sizes, input_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_sizes, input_sizes = ctx.sizes
        back = grad.new_empty((sum(input_sizes),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), input_sizes, output_sizes, group=ctx.group)
        return back, None, None, None


class ExpertMLP(nn.Module):
    """One expert: the dense MLP's shape at ``expert_ffn_hidden_size``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, f = spec.hidden_size, spec.expert_ffn_hidden_size
        self.swiglu = spec.mlp == "swiglu"
        self.up_proj = nn.Linear(h, f, bias=False)
        if self.swiglu:
            self.gate_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """On a tensor-parallel stage (``MoEMLP.set_tensor_parallel``) the weights are this rank's shards and the
        output its partial sum (reduced once for the whole block)."""
        up, down = _local(self.up_proj.weight), _local(self.down_proj.weight)
        if self.swiglu:
            return F.linear(F.silu(F.linear(x, _local(self.gate_proj.weight))) * F.linear(x, up), down)
        return F.linear(F.gelu(F.linear(x, up), approximate="tanh"), down)


def _local(w: torch.Tensor) -> torch.Tensor:
    """A weight's local shard (a DTensor's, its gradient a shard of the weight's), else the weight."""
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


def _all_reduce_grad(group, grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


class MoEMLP(nn.Module):
    """Router + the experts this rank holds (``experts``; all by default). Parameter names carry the
    global expert index: ``mlp.experts.<e>.up_proj.weight``."""

    def __init__(self, spec: ModelSpec, experts: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.num_experts = spec.num_experts
        self.top_k = spec.experts_per_token
        self.router = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        held = tuple(range(spec.num_experts)) if experts is None else tuple(experts)
        self.experts = nn.ModuleDict({str(e): ExpertMLP(spec) for e in held})
        self.group: dist.ProcessGroup | None = None  # expert-parallel group (None: every expert is local)
        self.group_size = 1
        #: run every held expert on every micro-batch, those no token chose on no rows (ZeRO-2/3 units make
        #: collective calls around each expert's forward and backward: every holder must make them)
        self.every_expert = False
        self.tp_mesh = None  # tensor parallelism inside the block (``set_tensor_parallel``)
        self.tp_sequence = False

    def set_expert_parallel(self, group: dist.ProcessGroup, size: int) -> None:
        self.group, self.group_size = group, size

    def set_tensor_parallel(self, mesh, sequence_parallel: bool) -> None:
        """Megatron-LM's expert tensor parallelism (what the simulator counts, ``autotune.simulator.moe``):
        every expert's up / gate projections split by rows and its down projection by columns across
        ``mesh`` (DTensor shards), the router whole on every rank. Each rank routes the whole input alike,
        runs its shard of every expert it holds and combines them into a partial sum, reduced once per block
        (an all-reduce; a reduce-scatter along the sequence with ``sequence_parallel``, whose input is
        gathered first). The router's gradient is a partial sum on each rank: all-reduced over ``mesh``."""
        from torch.distributed.tensor import Shard, distribute_tensor

        for expert in self.experts.values():
            for name, dim in (("up_proj", 0), ("gate_proj", 0), ("down_proj", 1)):
                linear = getattr(expert, name, None)
                if linear is not None:
                    linear.weight = nn.Parameter(distribute_tensor(linear.weight.data, mesh, [Shard(dim)]))
        self.tp_mesh, self.tp_sequence = mesh, sequence_parallel
        self.router.weight.register_hook(partial(_all_reduce_grad, mesh.get_group()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_mesh is None:
            return self._forward(x)
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        mesh, held = self.tp_mesh, [Shard(1)] if self.tp_sequence else [Replicate()]
        # the whole input on every rank; its gradient is a partial sum here (reduced, or reduce-scattered)
        if not isinstance(x, DTensor):  # (a sequence-parallel norm hands its output on as a DTensor)
            x = DTensor.from_local(x, mesh, held, run_check=False)
        x = x.redistribute(mesh, [Replicate()])
        out = self._forward(x.to_local(grad_placements=[Partial()]))
        return DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(mesh, held).to_local()

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = self.router(tokens)
        top, index = torch.topk(logits, self.top_k, dim=-1)
        weight = torch.softmax(top, dim=-1)
        # one row per (token, slot): which token, which expert, its weight; grouped by expert
        expert = index.reshape(-1)
        order = torch.argsort(expert, stable=True)
        expert = expert[order]
        token = torch.arange(tokens.shape[0], device=x.device).repeat_interleave(self.top_k)[order]
        w = weight.reshape(-1)[order]
        if self.group is None:
            y = self._experts(tokens[token], expert)
        else:
            y = self._dispatch_compute_combine(tokens[token], expert)
        out = torch.zeros_like(tokens).index_add(0, token, y * w.unsqueeze(-1).to(y.dtype))
        return out.reshape(shape)

    def _experts(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Each row through its expert (rows sorted by expert; every expert local)."""
        counts = torch.bincount(expert, minlength=self.num_experts).tolist()
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n or (self.every_expert and str(e) in self.experts):
                outs.append(self.experts[str(e)](rows[start : start + n]))
            start += n
        return torch.cat(outs) if outs else rows[:0]

    def _dispatch_compute_combine(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """All-to-all the rows to their experts' holders in the group, run them, all-to-all them back."""
        g = self.group_size
        per = self.num_experts // g
        send = torch.bincount(expert // per, minlength=g)  # rows are sorted by expert, so by holder too
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        got_expert = torch.empty(sum(recv_sizes), dtype=expert.dtype, device=expert.device)
        dist.all_to_all_single(got_expert, expert, recv_sizes, send_sizes, group=self.group)
        got = AllToAll.apply(rows, recv_sizes, send_sizes, self.group)
        # rows from each sender arrive sorted by expert; sort all by expert to run each expert once
        order = torch.argsort(got_expert, stable=True)
        done = self._local_experts(got[order], got_expert[order])
        y = torch.empty_like(done).index_copy(0, order, done)  # back in arrival order
        return AllToAll.apply(y, send_sizes, recv_sizes, self.group)

    def _local_experts(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        held = sorted(int(e) for e in self.experts)
        counts = torch.bincount(expert - held[0], minlength=len(held)).tolist() if expert.numel() else []
        counts += [0] * (len(held) - len(counts)) if self.every_expert else []
        outs, start = [], 0
        for i, n in enumerate(counts):
            if n or self.every_expert:
                outs.append(self.experts[str(held[0] + i)](rows[start : start + n]))
            start += n
        return torch.cat(outs) if outs else rows[:0] * 0.0


def expert_seed(layer_seed: int, expert: int) -> int:
    return layer_seed * 131 + 7 + expert


def setup_experts(
    chunks, params_of, layout, rank: int, names=None, vocab_size: int = 0, exchange: bool = True
) -> ExpertSync | None:
    """An MoE / SPES plan on one rank's ``chunks`` (``params_of(key)``: the rank's parameters of a layer key,
    ``RankModel.params_of``): expert-parallel groups on its MoE blocks, untrained experts frozen
    (no gradient, not in the optimizer), and the exchange that replaces the plain gradient all-reduce.
    Every rank creates every process group, in the same order. ``names`` (parameter -> name) and
    ``vocab_size`` say which part of each weight a rank holds where replicas shard a key differently.
    ``exchange`` False (FSDP2 reduces every gradient, ``runner.fsdp``): no exchange (None), and every held
    expert runs on every micro-batch, as FSDP2's collectives around each unit need every holder to call them."""
    plan = layout.ranks[rank]
    for ranks in layout.expert_parallel_groups():
        group = dist.new_group(list(ranks))
        if rank in ranks:
            for block in (b for chunk in chunks for b in chunk.blocks.values() if isinstance(b.mlp, MoEMLP)):
                block.mlp.set_expert_parallel(group, len(ranks))
    if not exchange:
        run_every_expert(chunks)
    for key in plan.holds():
        if not plan.trains(key):
            for p in params_of(key):
                p.requires_grad_(False)
    return ExpertSync(layout, rank, params_of, layout.sync_every_steps, names or {}, vocab_size) if exchange else None


def run_every_expert(chunks) -> None:
    """Every MoE block of ``chunks`` runs each held expert on every micro-batch (``MoEMLP.every_expert``): what
    collectives made around each expert's unit (FSDP2's, ``runner.zero``'s per micro-batch) need of every holder."""
    for block in (b for chunk in chunks for b in chunk.blocks.values()):
        if isinstance(block.mlp, MoEMLP):
            block.mlp.every_expert = True


# --------------------------------------------------------------------------------------------------
# The exchange of MoE / SPES plans


@dataclass
class _Group:
    keys: tuple[str, ...]
    group: dist.ProcessGroup | None  # among the trainers (gradient / weight averaging)
    trainers: tuple[int, ...]
    bcast: dist.ProcessGroup | None  # among all holders, when some do not train (trainer -> others)
    holders: tuple[int, ...]
    grad_weight: float  # this rank's weight in the gradient sum (0 when it does not train the keys)
    param_weight: float  # its weight in a parameter average (SPES)
    params: list[nn.Parameter]
    pieces: list[Piece]  # the part of each weight the exchange moves (``runner.reshard``: all of it, or a part)
    parted: bool = False  # its keys' holders shard them at different degrees: one rank per replica, or all

    def grads(self) -> list[torch.Tensor]:
        """This rank's parts of the gradients (a missing one zero-filled: it still takes part in the sum)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [pc.of(local_tensor(p.grad)) for p, pc in zip(self.params, self.pieces)]

    def weights(self) -> list[torch.Tensor]:
        """This rank's parts of the weights, written outside autograd."""
        return [pc.of(local_tensor(p).data) for p, pc in zip(self.params, self.pieces)]


class ExpertSync:
    """The gradient / weight exchange of one rank under an MoE or SPES plan (see the module docstring).
    Every rank builds every process group in the same order."""

    def __init__(self, layout, rank: int, params_of, sync_every_steps: int, names=None, vocab_size: int = 0) -> None:
        self.rank = rank
        plan = layout.ranks[rank]
        self._parts = (names or {}, plan.tp_degree, plan.tp_index, vocab_size)
        self.sync_every = sync_every_steps
        #: False: no synchronisation every sync_every steps (a profiled run times local steps and one
        #: ``synchronise`` apart)
        self.periodic = True
        self.step_groups: list[_Group] = []  # per step: H = 1 all trainers; H > 1 within an expert-parallel group
        self.sync_groups: list[_Group] = []  # every H steps (H > 1)
        local = sync_every_steps > 1
        for spec in layout.exchange_groups(local=local):
            self.step_groups.append(self._build(spec, params_of))
        if local:
            for spec in layout.exchange_groups(local=False):
                self.sync_groups.append(self._build(spec, params_of))

    def _build(self, spec, params_of) -> _Group:
        holders, trainers, keys, weights, part = spec
        group = dist.new_group(list(trainers)) if len(trainers) > 1 else None
        bcast = dist.new_group(list(holders)) if trainers and len(holders) > len(trainers) else None
        names, tp_degree, tp_index, vocab_size = self._parts
        params, pieces = [], []
        for key in keys if self.rank in holders else ():
            ps, pcs = parts_of(params_of(key), names, part, tp_degree, tp_index, vocab_size)
            params += ps
            pieces += pcs
        gw, pw = weights.get(self.rank, (0.0, 0.0))
        return _Group(keys, group, trainers, bcast, holders, gw, pw, params, pieces, part is not None)

    def sync_gradients(self) -> None:
        """Weighted gradients all-reduced among each key's trainers (per step)."""
        for g in self._in_turn(self.step_groups, None):
            if self.rank not in g.trainers:
                continue
            grads = g.grads()
            if g.group is None:
                if g.grad_weight != 1.0:
                    for t in grads:
                        t.mul_(g.grad_weight)
                continue
            flat = torch.cat([t.reshape(-1) for t in grads]).mul_(g.grad_weight)
            dist.all_reduce(flat, group=g.group)
            _unflatten(flat, grads)

    def after_step(self, step: int, in_turn=None) -> bool:
        """After the optimizer step of step ``step`` (0-based): H = 1, send updated experts to the holders
        that do not train them; H > 1, every H-th step, average the trainers' weights and send them to
        every holder. Returns whether this step ended with a SPES synchronisation. ``in_turn``: the ZeRO
        state's (``ShardedState.in_turn``), which brings streamed weights in around each group and reloads
        the master shards from what the exchange wrote."""
        with torch.no_grad():
            if self.sync_every == 1:
                for g in self._in_turn([g for g in self.step_groups if g.bcast is not None], in_turn):
                    _broadcast(g)
                return False
        if not self.periodic or (step + 1) % self.sync_every:
            return False
        self.synchronise(in_turn)
        return True

    def synchronise(self, in_turn=None) -> None:
        """One SPES synchronisation: every key's trainers average its weights (weighted by the batch they
        cover), then one of them sends the result to the key's other holders."""
        with torch.no_grad():
            moving = [g for g in self.sync_groups if g.group is not None or g.bcast is not None]
            for g in self._in_turn(moving, in_turn):
                if self.rank in g.trainers and g.group is not None:
                    flat = torch.cat([t.reshape(-1) for t in g.weights()]).mul_(g.param_weight)
                    dist.all_reduce(flat, group=g.group)
                    _unflatten(flat, g.weights())
                _broadcast(g)

    def _in_turn(self, groups: list[_Group], in_turn):
        """This rank's groups among ``groups`` (the same list on every rank; a part may have no weights here:
        ``whole``), each inside ``in_turn``'s turn (None: no ZeRO state to bring in)."""
        order = in_turn([g.keys for g in groups]) if in_turn is not None else range(len(groups))
        for i in order:
            if self.rank in groups[i].holders and groups[i].params:
                yield groups[i]


def _broadcast(g: _Group) -> None:
    if g.bcast is None:
        return
    flat = torch.cat([t.reshape(-1) for t in g.weights()])
    dist.broadcast(flat, src=g.trainers[0], group=g.bcast)
    if g.trainers[0] != dist.get_rank():
        _unflatten(flat, g.weights())


def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
