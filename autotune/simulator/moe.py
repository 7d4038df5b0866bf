"""Mixture-of-experts costs: the MoE block's compute, expert-parallel all-to-all, expert memory, and
the data-parallel exchange of MoE / SPES plans (per-step and SPES's periodic synchronisation).

**Compute.** An MoE block is attention plus, in place of the dense MLP, a router (``tokens x h`` by
``h x E``, replicated on a stage's tensor-parallel ranks) and the experts. Each token goes to its top
``k = experts_per_token`` experts; with expert parallelism ``g`` a device holds ``E / g`` experts and
receives the tokens its group sends them. Tokens are not spread evenly over experts: like GShard and
the Switch Transformer we size every expert's work at ``CAPACITY_FACTOR`` times the mean load,
``c * g * T * k / E`` tokens per expert for ``T`` tokens per replica (Fedus et al. 2021 train with
capacity factors 1.0-1.25; dropless implementations such as MegaBlocks do not drop tokens, but their
busiest expert runs about that much over the mean, and the busiest one sets the pace). So each device
computes ``c * T * k`` token-expert products per MoE block, in ``E / g`` matmuls per expert matrix,
split ``tp`` ways like the dense MLP (Megatron's expert tensor parallelism = tp). FLOPs for MFU count
the routed experts without the padding (``ModelSpec.active_params``).

**All-to-all.** Per MoE block and micro-batch, four all-to-alls inside the expert-parallel group:
dispatch and combine forward, their gradients backward (Lepikhin et al. 2020, GShard; full
recomputation runs the forward's two again). Each device sends its ``c * T * k`` token copies of
``e h`` bytes (``e``: the model precision's element size, 2 for bf16) and keeps the ``1 / g`` addressed to itself: ``(g - 1) / g * c T k 2h`` bytes
out. A stage's ``tp`` ranks all send (tokens are replicated on them), so the stage moves ``tp`` times
that over the group's links at the data-parallel ring's bandwidth (``CostModel.dp_bandwidth``: ``tp``
times the intra-node link inside one node, capped by the nodes' network when the group leaves the
node), with ``g - 1`` latencies. The replicas of a group run in lockstep: every stage runs at the
pace of the slowest of the group's corresponding stages.

**Memory.** Every device keeps the shared part and ``E / g`` of the experts (their ``1 / tp`` share),
16 bytes per trained parameter (ZeRO's mixed-precision Adam figure, as for dense weights) and 2 bytes
for an expert it holds but does not train (SPES: a node keeps every expert, gradients and optimizer
state for its own only; the frozen copy is its 16-bit weight). Under ZeRO (``zero``) an expert's
states are sharded over its own data-parallel peers, the replicas at its position in the other
expert-parallel groups (``replicas / g`` of them), the shared part's over all replicas; ZeRO-3's
gathered working set still counts a whole block with all its experts (conservative).
MoE blocks store their router probabilities (fp32 logits and softmax, ``8 E`` bytes per token), the
``c k`` dispatched token copies (input ``2 h`` and output ``2 h``) and the experts' inner activations
(those of the dense MLP, ``k c`` times, at the expert width).

**Data-parallel exchange.** Dense weights are held by every replica, an expert by one replica of each
expert-parallel group (the one at the expert's position). Per step (``sync_every_steps`` 1) the
gradients (16-bit) of every run of layers are ring all-reduced: the shared part among all replicas,
each expert among the groups that train it, and an expert some groups do not train is sent to them
(its new weight, 16-bit). With ``sync_every_steps`` H > 1 (SPES) each group synchronises only inside
itself every step (the shared part's gradients among its replicas), and every H steps the groups
exchange what they trained: the shared part ring all-reduced among the groups (each of a group's g
replicas takes ``1 / g`` of it, in parallel), every expert all-reduced among the groups that train
it and received by the others, in fp32 (``SYNC_BYTES_PER_PARAM``: averaging 16-bit copies would
round the master weights every round). A participant's wire bytes are ``2 (n - 1) / n`` of what it
all-reduces with ``n - 1`` others plus what it receives, over its link's bandwidth, plus ``2 (n - 1)``
latencies; a collective ends for all participants when the slowest finishes, and collectives that
leave a node take its network link one after another (the replicas of one node share it). Untrained copies,
gradients and optimizer state never travel. The sync's makespan, started with every device idle, is
``sync_time_s``; ``iteration_time_s`` adds it divided by H.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

from autotune.simulator.flops import Matmul, layer_matmuls
from autotune.simulator.zero import MIXED_PRECISION_ADAM, StateBytes, offload_state_bytes
from autotune.specs import ModelSpec, ParallelConfig

CAPACITY_FACTOR = 1.25  # expert load over the mean that the busiest expert carries (GShard / Switch)
SYNC_BYTES_PER_PARAM = 4  # SPES exchange in fp32 (master weights)


# --------------------------------------------------------------------------------------------------
# Compute and activations


def moe_mlp_matmuls(model: ModelSpec, micro_batch_size: int, tp: int, ep: int) -> tuple[Matmul, ...]:
    """Forward matmuls of one MoE block's router and experts on one device (``tp`` tensor-parallel,
    ``ep`` expert-parallel), each expert sized at ``CAPACITY_FACTOR`` times its mean load."""
    tokens = micro_batch_size * model.seq_len
    h, f, E, k = model.hidden_size, model.expert_ffn_hidden_size, model.num_experts, model.experts_per_token
    local = E // ep
    rows = max(1, math.ceil(CAPACITY_FACTOR * ep * tokens * k / E))
    up = 2 * f if model.mlp == "swiglu" else f
    routed = (
        Matmul(tokens, E, h),  # router logits
        Matmul(rows, -(-up // tp), h, local),  # expert up (and gate), per local expert
        Matmul(rows, h, -(-f // tp), local),  # expert down
    )
    g = model.shared_expert_ffn_hidden_size  # the shared experts: a dense MLP every token passes
    if not g:
        return routed
    shared_up = 2 * g if model.mlp == "swiglu" else g
    return routed + (Matmul(tokens, -(-shared_up // tp), h), Matmul(tokens, h, -(-g // tp)))


def layer_matmul_s(
    matmul_s: Callable[[Matmul], float], model: ModelSpec, micro_batch_size: int, tp: int, ep: int
) -> float:
    """Forward matmul seconds of one block, averaged over the model's blocks (attention everywhere, the
    dense MLP in dense blocks, router and experts in MoE blocks)."""
    mms = layer_matmuls(model, micro_batch_size, tp)
    attention = sum(matmul_s(m) for m in mms[:4])
    dense_mlp = sum(matmul_s(m) for m in mms[4:])
    f = model.moe_layer_fraction
    moe = sum(matmul_s(m) for m in moe_mlp_matmuls(model, micro_batch_size, tp, ep))
    return attention + (1.0 - f) * dense_mlp + f * moe


def activation_delta_per_token(model: ModelSpec, tp: int) -> float:
    """Bytes per token an MoE model's blocks store beyond the dense formula's MLP term, averaged over
    the blocks: MoE blocks store router probabilities, dispatched copies and expert activations in place
    of the dense MLP's inner activations (see the module docstring)."""
    if not model.is_moe:
        return 0.0
    h, E, k, c = model.hidden_size, model.num_experts, model.experts_per_token, CAPACITY_FACTOR
    per = 6 if model.mlp == "swiglu" else 4
    dense_inner = per * model.ffn_hidden_size / tp
    moe = 8.0 * E + k * c * (2 * h + 2 * h + per * model.expert_ffn_hidden_size / tp)
    moe += per * model.shared_expert_ffn_hidden_size / tp
    return model.moe_layer_fraction * (moe - dense_inner)


# --------------------------------------------------------------------------------------------------
# All-to-all


def alltoall_bytes(model: ModelSpec, micro_batch_size: int, ep: int) -> float:
    """Bytes one device sends in one all-to-all (dispatch or combine) of one MoE block for one
    micro-batch: its ``c T k`` token copies of ``e h`` bytes, less the ``1 / ep`` it keeps."""
    if ep <= 1 or not model.is_moe:
        return 0.0
    tokens = micro_batch_size * model.seq_len
    copies = CAPACITY_FACTOR * tokens * model.experts_per_token
    return (ep - 1) / ep * copies * model.bytes_per_element * model.hidden_size


def alltoall_s(nbytes: float, ep: int, tp: int, bandwidth_GBps: float, latency_us: float) -> float:
    """One all-to-all among ``ep`` stages of ``tp`` devices each sending ``nbytes``, over a stage-level
    bandwidth (``tp`` devices' traffic share it) with ``ep - 1`` latencies."""
    if ep <= 1 or nbytes <= 0:
        return 0.0
    return (ep - 1) * latency_us * 1e-6 + tp * nbytes / (bandwidth_GBps * 1e9)


def alltoalls_per_layer(recomputed_fraction: float) -> tuple[float, float]:
    """(forward, backward) all-to-alls per MoE block and micro-batch: dispatch + combine forward, their
    gradients backward, and the forward's two again for the fraction of blocks fully recomputed (1 under
    full recomputation, 1/N under every-N; selective modes keep the exchanged tokens)."""
    return 2.0, 2.0 + 2.0 * recomputed_fraction


# --------------------------------------------------------------------------------------------------
# Which experts a device holds and trains


def shard(model: ModelSpec, ep: int, position: int) -> range:
    """Experts held by replica ``position`` of an expert-parallel group: the position-th contiguous block."""
    per = model.num_experts // ep
    return range(position * per, (position + 1) * per)


def trained_in(model: ModelSpec, trains: tuple[int, ...] | None, held: range) -> int:
    return len(held) if trains is None else len(set(trains) & set(held))


def position_in_group(config: ParallelConfig, pipeline: int) -> int:
    return pipeline % config.expert_parallel


def zero_peers(config: ParallelConfig, peers: dict[tuple[int, int], int]) -> dict[tuple[int, int], int]:
    """ZeRO's sharding peers per (pipeline, stage): ``peers`` (``zero.peer_degrees``: the replicas), except
    in SPES mode (``sync_every_steps`` > 1), where only the replicas of one expert-parallel group step
    together (the others train on their own until the next synchronisation), so state can be sharded over
    those ``expert_parallel`` replicas only: with ``expert_parallel`` 1 ZeRO has no peers there. An
    expert's peers are then one (``expert_state_delta_bytes``: ``dp / ep``)."""
    if config.sync_every_steps == 1:
        return peers
    return {k: min(n, config.expert_parallel) for k, n in peers.items()}


def stepping_together(config: ParallelConfig, members: list[tuple]) -> list[list[tuple]]:
    """``members`` ((pipeline, ...) tuples of one data-parallel ring) split into the sets that synchronise
    every step: all of them, or in SPES mode each expert-parallel group's (``zero_peers``)."""
    if config.sync_every_steps == 1:
        return [members]
    groups: dict[int, list[tuple]] = {}
    for m in members:
        groups.setdefault(m[0] // config.expert_parallel, []).append(m)
    return list(groups.values())


def expert_state_delta_bytes(
    model: ModelSpec,
    layers: int,
    tp: int,
    ep: int,
    trained: int,
    dp: int,
    zero: int,
    offload: str,
    state: StateBytes = MIXED_PRECISION_ADAM,
) -> tuple[float, float]:
    """(device, host) correction to a stage's model-state bytes, which ``autotune.simulator.zero`` counts as
    if the device held and trained every expert with the dense weights' ``dp`` peers: it holds ``E / ep``
    experts, ``trained`` of them with gradients and optimizer state, ZeRO-sharded over the expert's own
    data-parallel peers (``dp / ep``: one replica per expert-parallel group), the others frozen (their
    16-bit weights, sharded too under zero 3; in host memory with ``offload: all``). Never positive."""
    if not model.is_moe:
        return 0.0, 0.0
    per_expert = layers * model.moe_layer_fraction * model.expert_params / tp
    base_dev, base_host = offload_state_bytes(model.num_experts * per_expert, dp, zero, offload, state)
    peers = max(1, dp // ep)
    dev, host = offload_state_bytes(trained * per_expert, peers, zero, offload, state)
    frozen = (model.num_experts // ep - trained) * per_expert * state.weights / (peers if zero >= 3 else 1)
    if offload == "all":
        host += frozen
    else:
        dev += frozen
    return dev - base_dev, host - base_host


def optimizer_param_delta(model: ModelSpec, layers: int, tp: int, trained: int) -> float:
    """Correction to a stage's optimizer parameter count (the dense formula steps every expert): only the
    ``trained`` experts it holds are stepped. Negative or zero."""
    if not model.is_moe:
        return 0.0
    per_expert = layers * model.moe_layer_fraction * model.expert_params / tp
    return (trained - model.num_experts) * per_expert


# --------------------------------------------------------------------------------------------------
# Data-parallel exchange of MoE / SPES plans


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective over a run of layers: the stages taking part (``(pipeline, stage)``) and each one's
    wire bytes."""

    participants: tuple[tuple[int, int], ...]
    wire_bytes: tuple[float, ...]
    kind: str  # "allreduce" (per step) or "sync" (SPES)


def _segments(model: ModelSpec, config: ParallelConfig, pipelines: tuple[int, ...]):
    """Runs of layers held by the same stage in each of ``pipelines``, last layers first (backward order):
    (first layer, end layer, stage index per pipeline)."""
    L = model.num_layers
    starts = []
    cuts = {0, L}
    for p in pipelines:
        acc, st = 0, []
        for stage in config.pipelines[p].stages:
            st.append(acc)
            cuts.add(acc)
            acc += stage.layers
        starts.append(st)
    cuts_sorted = sorted(cuts)
    out = []
    for x, y in zip(cuts_sorted, cuts_sorted[1:]):
        out.append((x, y, tuple(bisect.bisect_right(st, x) - 1 for st in starts)))
    return list(reversed(out))


def _shared_params(model: ModelSpec, x: int, y: int) -> float:
    return (y - x) * model.shared_params_per_layer + model.end_params(x == 0, y == model.num_layers)


def _expert_params(model: ModelSpec, x: int, y: int) -> float:
    """Parameters of one expert over layers ``[x, y)`` (averaged MoE-block share)."""
    return (y - x) * model.moe_layer_fraction * model.expert_params


def _ring(n: int) -> float:
    return 2.0 * (n - 1) / n if n > 1 else 0.0


def exchange(model: ModelSpec, config: ParallelConfig, scope: str, bytes_per_param: float) -> list[Collective]:
    """The collectives of one exchange, in order. ``scope``: ``"step"`` (the per-step gradient exchange of a
    plan that synchronises every step), ``"local"`` (the per-step exchange inside each expert-parallel
    group of a SPES plan) or ``"sync"`` (a SPES synchronisation among the groups)."""
    groups = config.expert_groups()
    g = config.expert_parallel
    out: list[Collective] = []
    if scope == "local":
        for group in groups:
            if len(group) < 2:
                continue
            for x, y, owners in _segments(model, config, group):
                nbytes = bytes_per_param * _shared_params(model, x, y)
                parts = tuple((p, s) for p, s in zip(group, owners))
                out.append(Collective(parts, tuple(_ring(len(group)) * nbytes for _ in parts), "allreduce"))
        return out
    every = tuple(range(len(config.pipelines)))
    kind = "sync" if scope == "sync" else "allreduce"
    # the shared part: among all replicas per step; among the groups (1/g each, in parallel) in a sync
    rings = [every] if scope == "step" else [tuple(grp[j] for grp in groups) for j in range(g)]
    share = 1.0 if scope == "step" else 1.0 / g
    for ring in rings:
        if len(ring) < 2:
            continue
        for x, y, owners in _segments(model, config, ring):
            nbytes = bytes_per_param * share * _shared_params(model, x, y)
            parts = tuple((p, s) for p, s in zip(ring, owners))
            out.append(Collective(parts, tuple(_ring(len(ring)) * nbytes for _ in parts), kind))
    if not model.is_moe or len(groups) < 2:
        return out
    # the experts: position j of every group holds the same shard
    trains = [config.pipelines[grp[0]].trains_experts for grp in groups]
    for j in range(g):
        holders = tuple(grp[j] for grp in groups)
        experts = shard(model, g, j)
        trainers = {e: [G for G, t in enumerate(trains) if t is None or e in t] for e in experts}
        for x, y, owners in _segments(model, config, holders):
            per_expert = bytes_per_param * _expert_params(model, x, y)
            wire = []
            for G in range(len(holders)):
                w = 0.0
                for e in experts:
                    S = trainers[e]
                    w += _ring(len(S)) * per_expert if G in S else per_expert
                wire.append(w)
            if any(wire):
                out.append(Collective(tuple(zip(holders, owners)), tuple(wire), kind))
    return out


def run_collectives(
    collectives: list[Collective],
    cursor: dict[tuple[int, int], float],
    bandwidth: Callable[[tuple[tuple[int, int], ...]], tuple[float, float]],
    nodes: Callable[[tuple[int, int]], frozenset[str]] | None = None,
) -> list[tuple]:
    """Advance ``cursor`` ((pipeline, stage) -> time) through ``collectives``: each starts when its last
    participant is free and ends for all when the slowest finishes its wire bytes. Wire bytes are a
    stage's (its ``tp`` devices carry them together); ``bandwidth(parts)`` gives the participating
    stages' (GB/s, latency us), as ``CostModel.dp_bandwidth``. ``nodes(participant)``: its nodes; the
    collectives that leave a node share its network link one after another (several replicas of one node
    exchanging with other nodes at once). Returns (participants, start, end) per op."""
    spans = []
    nic: dict[str, float] = {}  # node -> when its network link is free
    for c in collectives:
        n = len(c.participants)
        bw, lat = bandwidth(c.participants)
        t = 2 * (n - 1) * lat * 1e-6 + max(c.wire_bytes) / (bw * 1e9)
        start = max(cursor.get(p, 0.0) for p in c.participants)
        crossing = frozenset().union(*(nodes(p) for p in c.participants)) if nodes is not None else frozenset()
        if len(crossing) > 1:  # leaves the nodes: one node's collectives share its network link, in turn
            start = max([start] + [nic.get(x, 0.0) for x in crossing])
            for x in crossing:
                nic[x] = start + t
        for p in c.participants:
            cursor[p] = start + t
        spans.append((c.participants, start, start + t))
    return spans


def sync_bytes(model: ModelSpec, config: ParallelConfig) -> dict[int, float]:
    """Bytes each replica puts on the wire in one SPES synchronisation (its stages' shares summed)."""
    out: dict[int, float] = {}
    for c in exchange(model, config, "sync", SYNC_BYTES_PER_PARAM):
        for (p, _), w in zip(c.participants, c.wire_bytes):
            out[p] = out.get(p, 0.0) + w
    return out
