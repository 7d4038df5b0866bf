"""Averaging the gradients of weights that replicas shard with different tensor-parallel degrees
(``Layout.resharded``): a replica at tp 2 beside one at tp 1 over the same layers (Metis, Sailor: each GPU
type at its own degree).

A sharded weight (a ``DTensor`` split along one dimension) is cut into ``t`` equal parts, ``t`` the
largest degree among its holders; the rank of a degree-``d`` replica with tensor-parallel index ``i``
holds parts ``i t/d .. (i+1) t/d - 1``. Each part's gradient is all-reduced among the ranks holding it,
one per replica (each weighted by its replica's share of the batch): every rank moves only its own
shard, as the simulator's data-parallel term counts a stage's devices together. A weight every
tensor-parallel rank holds whole (norms, embedding, head) is all-reduced among every holder, each
weighted by its replica's share over the replica's degree (its ranks hold the same gradient). The
embedding and the head are split by vocabulary rows where the largest degree divides the vocabulary
(``runner.engine.apply_tensor_parallel``), else held whole. One
flat all-reduce per group and step, the groups in one global order on every rank. Under ZeRO / offload the
same parts are units of ``runner.zero`` instead (``runner.sharded_state``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autotune.simulator.engine_terms import vocab_split
from runner.layout import WHOLE_PART
from runner.optim import local_tensor

#: the dimension ``runner.engine.apply_tensor_parallel`` shards each block weight along (column-parallel
#: projections and their biases: 0; row-parallel projections: 1, their biases stay whole)
SHARD_DIM = {
    "attn.q_proj.weight": 0,
    "attn.k_proj.weight": 0,
    "attn.v_proj.weight": 0,
    "attn.q_proj.bias": 0,
    "attn.k_proj.bias": 0,
    "attn.v_proj.bias": 0,
    "mlp.up_proj.weight": 0,
    "mlp.gate_proj.weight": 0,
    "mlp.up_proj.bias": 0,
    "mlp.gate_proj.bias": 0,
    "attn.o_proj.weight": 1,
    "mlp.down_proj.weight": 1,
}


#: the vocabulary-parallel embedding and head (where the degree divides the vocabulary): split by rows
VOCAB_SHARD_DIM = {"embed.weight": 0, "head.weight": 0}


def shard_dim(name: str, p: nn.Parameter, vocab_parts: bool = False) -> int | None:
    """The dimension a tensor-parallel replica splits weight ``name`` along (None: held whole), the same
    on a replica of degree 1, which holds every part; ``vocab_parts``: the embedding and the head are
    split (``autotune.simulator.engine_terms.vocab_split`` at the largest degree)."""
    if name.startswith("blocks."):  # an expert's weights split as the dense MLP's
        dim = SHARD_DIM.get(re.sub(r"^mlp\.experts\.\d+\.", "mlp.", name.split(".", 2)[-1]))
    else:
        dim = VOCAB_SHARD_DIM.get(name) if vocab_parts else None
    if isinstance(p, DTensor):  # the placement tensor parallelism gave it must agree
        placed = next((pl.dim for pl in p.placements if pl.is_shard()), None)
        assert placed == dim, f"{name}: sharded along {placed}, the resharding expects {dim}"
    return dim


@dataclass(frozen=True)
class Piece:
    """The part of a weight's local tensor a unit holds: all of it (``n`` 1), or part ``k`` of ``n`` equal
    parts along ``dim`` (a key that replicas shard at different tensor-parallel degrees: the unit of one of
    ``runner.reshard``'s parts, which a lower-degree rank holds several of)."""

    dim: int | None = None
    k: int = 0
    n: int = 1

    def of(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.n == 1 else t.chunk(self.n, self.dim)[self.k]


WHOLE = Piece()


def parts_of(
    params: list[nn.Parameter],
    names: dict[nn.Parameter, str],
    part: tuple[int, int] | None,
    tp_degree: int,
    tp_index: int,
    vocab_size: int,
) -> tuple[list[nn.Parameter], list[Piece]]:
    """The weights (of one key, ``params``) a rank of degree ``tp_degree`` and index ``tp_index`` holds of
    ``part`` (``runner.layout``'s ``(c, t)``; None: all of every one) and which piece of each."""
    if part is None:
        return params, [WHOLE] * len(params)
    c, t = part
    dims = [shard_dim(names[p], p, vocab_split(vocab_size, t)) for p in params]
    if c == WHOLE_PART:
        kept = [p for p, d in zip(params, dims) if d is None]
        return kept, [WHOLE] * len(kept)
    per_rank = t // tp_degree  # the rank holds parts tp_index * per_rank ... + per_rank - 1
    kept = [(p, Piece(d, c - tp_index * per_rank, per_rank)) for p, d in zip(params, dims) if d is not None]
    return [p for p, _ in kept], [pc for _, pc in kept]


class ReshardedGradients:
    """The gradient average of a plan whose replicas shard some keys at different degrees, without ZeRO: one
    flat all-reduce per group of ranks holding a part (``parts_of``), the groups in one order on every rank."""

    def __init__(
        self,
        layout,
        rank: int,
        params_of: Callable[[str], list[nn.Parameter]],
        names: dict[nn.Parameter, str],
        vocab_size: int,
    ) -> None:
        plan = layout.ranks[rank]
        groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        #: group members -> this rank's pieces they all-reduce: (weight, its piece, whether every tensor-parallel
        #: rank holds it whole)
        self.pieces: dict[tuple[int, ...], list[tuple[nn.Parameter, Piece, bool]]] = {}
        self.copies: dict[nn.Parameter, int] = {}  # ranks holding each of this rank's tensors (gradient clipping)
        tp = (plan.tp_degree, plan.tp_index)
        for key, (t, parts, holders) in layout.resharded().items():
            for members in (*parts, holders):  # every rank creates every group, in the same order
                if members not in groups:
                    groups[members] = dist.new_group(list(members)) if len(members) > 1 else None
            if rank not in holders:
                continue
            per_rank = t // plan.tp_degree
            mine = range(plan.tp_index * per_rank, (plan.tp_index + 1) * per_rank)
            for c in (WHOLE_PART, *mine):
                members = holders if c == WHOLE_PART else parts[c]
                for p, pc in zip(*parts_of(params_of(key), names, (c, t), *tp, vocab_size)):
                    self.pieces.setdefault(members, []).append((p, pc, c == WHOLE_PART))
                    self.copies[p] = len(members)
        self.groups = {m: groups[m] for m in self.pieces}
        self.tp = plan.tp_degree

    def sync(self, weight: float) -> None:
        """All-reduce this rank's pieces, weighted: ``weight`` (its replica's share of the batch) for a
        part of a sharded weight, ``weight / tp`` for a weight its tensor-parallel ranks all hold."""
        for members in sorted(self.pieces):
            views = []
            for p, pc, whole in self.pieces[members]:
                if p.grad is None:  # a weight the schedule did not touch still takes part in the sum
                    p.grad = torch.zeros_like(p)
                views.append((pc.of(local_tensor(p.grad)), weight / self.tp if whole else weight))
            flat = torch.cat([v.reshape(-1) * w for v, w in views])
            if self.groups[members] is not None:
                dist.all_reduce(flat, group=self.groups[members])
            offset = 0
            for v, _ in views:
                v.copy_(flat[offset : offset + v.numel()].view_as(v))
                offset += v.numel()
