"""Mixed data-parallel stages (Zorse): a stage's ``ranks``, their micro-batch shares, parsing, validation.

The plan part of a feature: it takes the stage's values (its ranks, its pipeline's micro-batch count), never
the whole plan; ``autotune.specs.plan`` composes it.

Zorse (Guo et al. 2025, arXiv 2507.10392), Metis and Sailor let one pipeline stage be a data-parallel
group of several GPUs, possibly of different types, each taking its own share of the pipeline's
micro-batches. A stage of a plan may give ``ranks`` in place of ``devices``::

    {"layers": 12, "recompute": true,
     "ranks": [{"devices": ["v100:0"], "num_microbatches": 30},
               {"devices": ["t4:0"], "num_microbatches": 18}]}

- Each rank is a tensor-parallel group (its ``devices``) holding all of the stage's layers and running
  ``num_microbatches`` of the pipeline's micro-batches (forward and backward) through them.
- The shares sum to the pipeline's ``num_microbatches``; each is at least 1 (leave a rank with none out).
- A stage with ``devices`` is one rank holding all of the pipeline's micro-batches (``ranks_of``), so every
  plan valid before means the same.
- Which rank runs which micro-batch: **smooth weighted round-robin by share** (``microbatch_owners``; the
  rule nginx uses for weighted upstreams): micro-batch ``j`` goes to the rank whose running credit is
  highest after every rank gained its share, and that rank pays back the pipeline's total. Shares 5 and 3
  give ``0 1 0 0 1 0 1 0``: each rank's micro-batches are spread evenly over the step. Each stage assigns
  independently, so the activation of micro-batch ``j`` goes from its owner in stage ``s - 1`` to its
  owner in stage ``s`` (and its gradient back): between stages of different width the hand-offs cycle
  through the rank pairs in the order the shares interleave.
- Each rank runs its micro-batches in the order the pipeline schedule gives the stage, skipping the
  others' (``rank_orders``): GPipe, or 1F1B with the stage's warm-up ``w_s`` (``stage_warmups``) the larger
  of ``k_s - 1 + sum_{t > s} k_t`` for ``k_s`` ranks in stage ``s`` (the round trip through wider stages
  behind it) and the fewest forwards that give each rank ``min(share, p - s)`` of its own before its first
  backward (Megatron-LM's in-flight count, per rank), made non-increasing along the pipeline; ``p - s - 1``
  when every stage has one rank, Megatron-LM's. Since ``w_s >= w_{s+1}`` each stage's forward of a
  micro-batch comes before the backward that waits on it downstream, so the stage orders cannot wait on
  each other, and each rank's order is a sub-sequence of its stage's. The stage's time per micro-batch slot is set by its
  ranks' queues, not by its slowest GPU. ``interleaved-1f1b`` with a stage of several ranks is refused.
- The ranks of a stage hold the same layers, so they are data-parallel peers: gradients (or, with
  ``zero``, the ZeRO shards) are synchronised among all ranks holding the same layers, inside stages and
  across replicas; each rank's gradient counts by its share of the global batch.
- Every rank's tensor-parallel degree must divide the heads and the FFN width (as a stage's).

Not combined with: ``schedule: roundpipe``, ``interleaved-1f1b`` (its pipelines have no stages), and MoE plans with
``expert_parallel > 1`` or SPES expert subsets / ``sync_every_steps > 1`` (their replicas exchange per
stage in lockstep; mixed stages there are not modelled): both refused with a message naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autotune.errors import SpecError, shown
from autotune.specs.limits import positive

RANK_FIELDS = ("devices", "num_microbatches")
#: at most this many ranks in one stage (one per device: specs.MAX_DEVICES)
MAX_RANKS = 16_384


@dataclass(frozen=True, slots=True)
class RankConfig:
    """One data-parallel rank of a stage: a tensor-parallel group and its share of the micro-batches."""

    devices: tuple[str, ...]
    num_microbatches: int

    @property
    def tp(self) -> int:
        return len(self.devices)


# --------------------------------------------------------------------------------------------------
# Micro-batch assignment (used by the simulator and the runner alike)


def microbatch_owners(shares: Sequence[int]) -> tuple[int, ...]:
    """Owner rank (index into ``shares``) of each of the ``sum(shares)`` micro-batches: smooth weighted
    round-robin (ties to the lower index). ``(5, 3)`` -> ``(0, 1, 0, 0, 1, 0, 1, 0)``."""
    total = sum(shares)
    credit = [0] * len(shares)
    out = []
    for _ in range(total):
        for k, w in enumerate(shares):
            credit[k] += w
        best = max(range(len(shares)), key=lambda k: (credit[k], -k))
        credit[best] -= total
        out.append(best)
    return tuple(out)


FORWARD, BACKWARD = 0, 1


def stage_warmups(schedule: str, shares: Sequence[Sequence[int]], num_microbatches: int) -> tuple[int, ...]:
    """Forwards each stage runs before its first backward (``w_s``): all of them (GPipe); for 1F1B the
    larger of ``k_s - 1 + sum_{t > s} k_t`` (``k_s`` ranks in stage ``s``: the round trip through wider
    stages behind it) and the fewest that give every rank of the stage ``min(share, p - s)`` of its own
    forwards before its own first backward (Megatron-LM's ``p - s`` in flight, per rank: a slow rank with
    a small share would otherwise hold one micro-batch and wait out each round trip), made non-increasing
    along the pipeline (``w_s >= w_{s+1}``, which keeps the orders free of deadlock). With one rank per
    stage: ``p - s - 1``."""
    m = num_microbatches
    p = len(shares)
    if schedule == "gpipe":
        return tuple(m for _ in shares)
    out = [0] * p
    after = 0  # w of the next stage
    for s in reversed(range(p)):
        need = len(shares[s]) - 1 + sum(len(k) for k in shares[s + 1 :])
        if len(shares[s]) > 1:
            owner = microbatch_owners(shares[s])
            for k, share in enumerate(shares[s]):
                own = [j for j, o in enumerate(owner) if o == k]
                # own[t-1] <= w + own[0]: the rank's t-th forward comes before its first backward
                need = max(need, own[min(share, p - s) - 1] - own[0])
        out[s] = after = min(m, max(need, after))
    return tuple(out)


def stage_order(schedule: str, num_microbatches: int, warmup: int) -> list[tuple[int, int]]:
    """A stage's operations ``(kind, micro-batch)``: ``warmup`` forwards, then one forward and one backward
    in turn, then the remaining backwards (GPipe: every forward, then every backward)."""
    m = num_microbatches
    if schedule == "gpipe":
        return [(FORWARD, j) for j in range(m)] + [(BACKWARD, j) for j in range(m)]
    ops = [(FORWARD, j) for j in range(warmup)]
    for k in range(m - warmup):
        ops += [(FORWARD, warmup + k), (BACKWARD, k)]
    return ops + [(BACKWARD, j) for j in range(m - warmup, m)]


def rank_orders(schedule: str, shares: Sequence[Sequence[int]]) -> list[list[list[tuple[int, int]]]]:
    """``[stage][rank]`` -> that rank's operations ``(kind, micro-batch)`` in the order it runs them: the
    stage's order (``stage_order`` with ``stage_warmups``) restricted to the micro-batches
    ``microbatch_owners`` gives the rank. The simulator and the runner both run these orders."""
    m = sum(shares[0])
    warmups = stage_warmups(schedule, shares, m)
    out = []
    for s, stage_shares in enumerate(shares):
        owner = microbatch_owners(stage_shares)
        per_rank: list[list[tuple[int, int]]] = [[] for _ in stage_shares]
        for kind, j in stage_order(schedule, m, warmups[s]):
            per_rank[owner[j]].append((kind, j))
        out.append(per_rank)
    return out


def shares_of(ranks: Sequence[RankConfig], num_microbatches: int) -> tuple[int, ...]:
    """A stage's micro-batch share per rank (one rank holding all of them for a ``devices`` stage: no ranks)."""
    return tuple(r.num_microbatches for r in ranks) if ranks else (num_microbatches,)


def ranks_of(ranks: tuple[RankConfig, ...], devices: tuple[str, ...], num_microbatches: int) -> tuple[RankConfig, ...]:
    """The backward-compatible view: a stage's ranks, or its ``devices`` as one rank with every micro-batch."""
    return ranks if ranks else (RankConfig(devices, num_microbatches),)


# --------------------------------------------------------------------------------------------------
# Parsing


def ranks_from_dict(raw: Any, source: str, field: str) -> tuple[RankConfig, ...]:
    """A stage's ``ranks`` list -> rank configs (shapes only: values are checked by ``check_ranks``)."""
    if not isinstance(raw, list) or not raw:
        raise SpecError(
            source,
            field,
            f'must be a non-empty list of ranks ({{"devices": [...], "num_microbatches": n}}), got {shown(raw)}',
        )
    if len(raw) > MAX_RANKS:
        raise SpecError(source, field, f"lists {len(raw):,} ranks, at most {MAX_RANKS:,}")
    out = []
    for k, rank in enumerate(raw):
        f = f"{field}[{k}]"
        if not isinstance(rank, Mapping):
            raise SpecError(source, f, "must be an object with devices and num_microbatches")
        extra = sorted(set(rank) - set(RANK_FIELDS), key=str)
        if extra:
            raise SpecError(source, f"{f}.{extra[0]}", f"unknown field (a rank has {', '.join(RANK_FIELDS)})")
        devices = rank.get("devices")
        if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
            raise SpecError(source, f"{f}.devices", "is required and must be a list of device ids")
        if "num_microbatches" not in rank:
            raise SpecError(
                source, f"{f}.num_microbatches", "is required (this rank's share of the pipeline's micro-batches)"
            )
        out.append(RankConfig(tuple(devices), rank["num_microbatches"]))
    return tuple(out)


def ranks_to_dict(ranks: tuple[RankConfig, ...]) -> list[dict[str, Any]]:
    return [{"devices": list(r.devices), "num_microbatches": r.num_microbatches} for r in ranks]


# --------------------------------------------------------------------------------------------------
# Validation


def check_ranks(ranks: Sequence[RankConfig], num_microbatches: int, where: str, field: str) -> None:
    """A stage's ``ranks`` (``field``) without the cluster or the model: every rank lists devices and a share
    >= 1, and the shares sum to the pipeline's ``num_microbatches``."""
    for k, rank in enumerate(ranks):
        if not rank.devices:
            raise SpecError(where, f"{field}[{k}].devices", "must list at least one device")
        positive(where, f"{field}[{k}].num_microbatches", rank.num_microbatches, integer=True)
    total = sum(r.num_microbatches for r in ranks)
    if total != num_microbatches:
        raise SpecError(
            where,
            field,
            f"shares {' + '.join(str(r.num_microbatches) for r in ranks)} = {total} "
            f"micro-batches, the pipeline has num_microbatches={num_microbatches}",
        )


def check_combination(mixed: str, schedule: str, expert_parallel: int, spes_field: str | None, where: str) -> None:
    """A plan with a stage of several ranks (``mixed``: that stage's field) is not combined with
    interleaved-1f1b, MoE expert parallelism or SPES (``spes_field``: the SPES field the plan sets, if any)."""
    if schedule == "interleaved-1f1b":
        raise SpecError(
            where,
            "schedule",
            f"interleaved-1f1b with a stage of several ranks ({mixed}) is not supported: use 1f1b or gpipe",
        )
    if expert_parallel != 1:
        raise SpecError(
            where,
            "expert_parallel",
            f"{expert_parallel} with a stage of several ranks ({mixed}): "
            "expert parallelism over mixed stages is not modelled; use "
            "expert_parallel 1 or one rank per stage",
        )
    if spes_field is not None:
        raise SpecError(
            where,
            spes_field,
            f"SPES (expert subsets / periodic sync) with a stage of several ranks ({mixed}) is not "
            "modelled; use one rank per stage",
        )


def summary(ranks: Sequence[RankConfig], devices: Sequence[str]) -> str:
    """``describe``'s text for a stage's devices: ``v100:0 m30 + t4:0 m18`` for ranks, else the devices."""
    if not ranks:
        return ",".join(devices)
    return " + ".join(f"{','.join(r.devices)} m{r.num_microbatches}" for r in ranks)
