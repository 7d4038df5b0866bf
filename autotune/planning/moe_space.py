"""The search space's mixture-of-experts dimensions (present only when the model is an MoE model).

``expert_parallel``  experts split across groups of this many consecutive replicas (divisors of
                     ``num_experts``); must divide the decoded replica count. The replicas of a group
                     are made identical: every stage gets the layers its slowest member's speed
                     allows, and the group's micro-batches are split evenly among them.
``trains_experts``   ``all`` (every replica trains every expert) or ``partition`` (SPES: the groups
                     split the experts, each training its own share, sized by its batch share, so
                     every expert learns from about the same number of tokens per step: a group with
                     twice the batch trains twice the experts; with more groups than experts, every
                     group trains one, the next expert going to the one with the least batch so far).
                     With expert parallelism the split is of each shard's slots, the same in every
                     shard, so every replica of a group trains as many of the experts it holds.
                     Subsets change what is trained (an expert learns from its trainers' tokens
                     only), so like the sync period they are searched only when ``max_sync_every``
                     is above 1; with the default the space trains every expert everywhere.
``sync_every``       ``sync_every_steps`` of the plan, from 1 up to ``max_sync_every`` (``search
                     --max-sync-every``, default 1: how stale replicas may grow is the user's
                     convergence choice, as in SPES). Values above 1 need two or more groups.

``apply`` turns the choices into the plan's fields on pipelines the rest of the space decoded.
"""

from __future__ import annotations

from collections.abc import Sequence

from autotune.errors import SpecError
from autotune.specs import ClusterSpec, ModelSpec

EXPERT_MODES = ("all", "partition")
#: sync_every_steps choices (those up to max_sync_every, and max_sync_every itself)
SYNC_CHOICES = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
DIMENSIONS = ("expert_parallel", "trains_experts", "sync_every")


def dimensions(cluster: ClusterSpec, model: ModelSpec, max_sync_every: int) -> list[tuple[str, tuple, bool]]:
    """(name, choices, ordinal) of the MoE dimensions; none for a dense model."""
    if isinstance(max_sync_every, bool) or not isinstance(max_sync_every, int) or max_sync_every < 1:
        raise SpecError("--max-sync-every", "", f"must be an integer >= 1, got {max_sync_every!r}")
    if not model.is_moe:
        return []
    eps = tuple(g for g in range(1, model.num_experts + 1) if model.num_experts % g == 0 and g <= cluster.num_devices)
    syncs = tuple(sorted({h for h in SYNC_CHOICES if h <= max_sync_every} | {max_sync_every}))
    # expert subsets change what is trained too (an expert learns from its trainers' tokens only): like
    # the sync period they are the user's convergence choice, searched only once --max-sync-every allows SPES
    modes = EXPERT_MODES if max_sync_every > 1 else ("all",)
    return [("expert_parallel", eps, True), ("trains_experts", modes, False), ("sync_every", syncs, True)]


def partition(num_experts: int, weights: Sequence[float]) -> list[tuple[int, ...]]:
    """Each group's experts, sized by its weight (its batch share): contiguous blocks of at least one
    expert with as many groups as experts or fewer; one expert each beyond that, balanced greedily."""
    n = len(weights)
    if n <= num_experts:
        total = float(sum(weights)) or 1.0
        raw = [w / total * num_experts for w in weights]  # proportional to the whole, then at least one each
        counts = [max(1, int(r)) for r in raw]
        while sum(counts) > num_experts:
            i = max((i for i in range(n) if counts[i] > 1), key=lambda i: counts[i] - raw[i])
            counts[i] -= 1
        while sum(counts) < num_experts:
            i = max(range(n), key=lambda i: raw[i] - counts[i])
            counts[i] += 1
        out, start = [], 0
        for c in counts:
            out.append(tuple(range(start, start + c)))
            start += c
        return out
    load = [0.0] * num_experts
    out_by_group: list[tuple[int, ...]] = [()] * n
    for g in sorted(range(n), key=lambda i: -weights[i]):
        e = min(range(num_experts), key=lambda j: (load[j], j))
        load[e] += weights[g]
        out_by_group[g] = (e,)
    return out_by_group


def align_groups(
    pipes: list, layer_splits: list[list[int]], ep: int, alpha: float, quantum: int, split_layers
) -> list[list[int]] | str:
    """Layer splits with the replicas of each expert-parallel group made identical: every stage gets the
    layers the slowest of the group's corresponding stages allows (``split_layers(speeds, alpha, q)``,
    the space's); the reason when the group's pipelines differ in depth or do not split."""
    if len(pipes) % ep:
        return f"expert_parallel={ep} does not divide the {len(pipes)} replicas"
    out = list(layer_splits)
    for start in range(0, len(pipes), ep):
        grp = range(start, start + ep)
        if len({len(pipes[r]) for r in grp}) > 1:
            return f"replicas {start}..{start + ep - 1} of an expert-parallel group have different pipeline depths"
        speeds = [min(pipes[r][s].speed_tflops for r in grp) for s in range(len(pipes[start]))]
        split = split_layers(speeds, alpha, quantum)
        if split is None:
            return f"the layers do not split into the stages of expert-parallel group {start // ep}"
        for r in grp:
            out[r] = split
    return out


def group_microbatches(
    total_mb: int, speeds: Sequence[float], ep: int, beta: float, quantum: int, apportion
) -> list[int] | str:
    """Micro-batches per replica: split among the expert-parallel groups by speed^beta (a group runs at its
    slowest replica's pace), then evenly among each group's replicas."""
    groups = [list(range(i, i + ep)) for i in range(0, len(speeds), ep)]
    weights = [(ep * min(speeds[r] for r in grp)) ** beta for grp in groups]
    per_group = apportion(total_mb, weights, minimum=ep * quantum, quantum=ep * quantum)
    if per_group is None:
        return (
            f"{total_mb} micro-batches do not split into {len(groups)} expert-parallel groups of {ep} replicas "
            f"in multiples of {quantum}"
        )
    return [m // ep for m in per_group for _ in range(ep)]


def trained_experts(mode: str, model: ModelSpec, microbatches: Sequence[int], ep: int) -> list[tuple[int, ...] | None]:
    """Per replica: the experts it trains (``None`` = all): with ``partition`` each expert-parallel group
    trains a share sized by its micro-batches (``partition``); ``all`` or a single group: every expert."""
    n_groups = len(microbatches) // ep
    if mode != "partition" or n_groups < 2:
        return [None] * len(microbatches)
    weights = [sum(microbatches[i * ep : (i + 1) * ep]) for i in range(n_groups)]
    per = model.num_experts // ep  # experts each replica of a group holds (its shard)
    if per >= n_groups:  # split the slots of a shard, the same slots in every shard: every replica trains alike
        shares = partition(per, weights)
        groups = [tuple(sorted(j * per + slot for j in range(ep) for slot in share)) for share in shares]
    else:
        groups = partition(model.num_experts, weights)
    return [experts for experts in groups for _ in range(ep)]
