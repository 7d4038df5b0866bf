"""Hand-offs between pipeline stages that hold the activation differently (per-stage tensor parallelism).

The plan part of a feature: it takes two stages' layouts (tensor-parallel degree, sequence parallelism),
never the plan. The simulator times these transfers (``CostModel.p2p``) and the runner sends exactly them
(``runner.mixed``), so both count the same bytes.

A stage of tensor-parallel degree ``t`` holds its output, the ``b x s x h`` activation, on each of its ``t``
ranks: whole on every rank without sequence parallelism; with it, rank ``i`` holds the ``i``-th of ``t``
equal parts of the sequence (Korthikanti et al. 2022). The next stage's rank ``j`` needs its input the same
way: the whole sequence, or its ``j``-th part. Each receiver gets exactly what it needs, each part from
one sender:

- a part that only one sender holds (sequence parallelism) comes from that sender;
- a part every sender holds (no sequence parallelism) comes from sender ``j mod t``, so the senders share
  the work (Megatron-LM's rank ``i`` to rank ``i`` when both stages have the same degree).

The gradient goes back the same way with the roles swapped: ``handoff(next stage, this stage)``. With the
same degree and layout on both sides this is rank ``i`` to rank ``i`` of its whole tensor (its part with
sequence parallelism), what ``torch.distributed.pipelining`` does. Stage ``t = 2`` to stage ``t = 1``
without sequence parallelism: sender 0 sends the whole activation to the receiver, sender 1 sends
nothing; the gradient goes back to both. With sequence parallelism on the sender, the receiver gets one
half from each sender.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm


@dataclass(frozen=True, slots=True)
class Transfer:
    """Sequence parts ``start .. stop - 1`` of ``parts`` equal parts, from tensor-parallel rank ``src`` of
    the sending stage to rank ``dst`` of the receiving one."""

    src: int
    dst: int
    start: int
    stop: int
    parts: int

    @property
    def fraction(self) -> float:
        """Of the whole activation."""
        return (self.stop - self.start) / self.parts

    def tokens(self, seq_len: int) -> tuple[int, int]:
        """(first, end) token positions of this transfer in the whole sequence of ``seq_len``."""
        return self.start * seq_len // self.parts, self.stop * seq_len // self.parts


def sequence_parts(tp: int, sequence_parallel: bool) -> int:
    """Parts of the sequence a stage's ranks hold apart: ``tp`` with sequence parallelism, else 1."""
    return tp if sequence_parallel and tp > 1 else 1


def held_parts(tp: int, sequence_parallel: bool, index: int, parts: int) -> tuple[int, int]:
    """(start, stop) of the ``parts`` equal parts of the sequence rank ``index`` holds."""
    q = sequence_parts(tp, sequence_parallel)
    if q == 1:
        return 0, parts
    return index * parts // q, (index + 1) * parts // q


def handoff(src_tp: int, src_sp: bool, dst_tp: int, dst_sp: bool) -> tuple[Transfer, ...]:
    """The transfers that give every rank of the receiving stage (degree ``dst_tp``, sequence parallel
    ``dst_sp``) its input from the sending stage (``src_tp``, ``src_sp``), in receiver order, then sequence
    order."""
    if src_tp < 1 or dst_tp < 1:
        raise ValueError(f"tensor-parallel degrees must be >= 1, got {src_tp} and {dst_tp}")
    qs, qd = sequence_parts(src_tp, src_sp), sequence_parts(dst_tp, dst_sp)
    n = lcm(qs, qd)
    out = []
    for j in range(dst_tp):
        a, b = held_parts(dst_tp, dst_sp, j, n)
        if qs == 1:
            out.append(Transfer(j % src_tp, j, a, b, n))
            continue
        for i in range(qs):
            lo, hi = held_parts(src_tp, src_sp, i, n)
            if max(a, lo) < min(b, hi):
                out.append(Transfer(i, j, max(a, lo), min(b, hi), n))
    return tuple(out)


def busiest_fraction(transfers: tuple[Transfer, ...]) -> float:
    """The most any one rank sends or receives, as a fraction of the whole activation: what sets the time
    of a hand-off over per-rank links."""
    load: dict[tuple[str, int], float] = {}
    for t in transfers:
        load[("src", t.src)] = load.get(("src", t.src), 0.0) + t.fraction
        load[("dst", t.dst)] = load.get(("dst", t.dst), 0.0) + t.fraction
    return max(load.values(), default=0.0)


def total_fraction(transfers: tuple[Transfer, ...]) -> float:
    """Everything the hand-off moves, as a fraction of the whole activation: what one shared link (a
    node's NIC) carries."""
    return sum(t.fraction for t in transfers)
