"""Pipelines whose stages have several data-parallel ranks (Zorse; plan rules in ``autotune.specs.mixed_stage``).

A pipeline is simulated as a set of *units*, one per (stage, rank), in stage order and rank order within a
stage; a stage given by ``devices`` is one unit. ``compile_pipeline`` lists every unit's operations in a
dependency-respecting order for ``schedule.run_program``, with the same program format as
``schedule.compile_schedule``:

- unit ``u`` runs forward / backward of its micro-batches in the order ``mixed_stage.rank_orders`` gives
  (the runner runs the same orders), so each rank has its own queue: a stage of ranks A (5 micro-batches)
  and B (3) is busy ``max(5 t_A, 3 t_B)``, not ``8 max(t_A, t_B)``;
- the forward of micro-batch ``j`` on stage ``s`` waits for its forward on stage ``s - 1`` on whichever rank
  owns ``j`` there (``mixed_stage.microbatch_owners``: round-robin by share), plus the transfer between that
  pair of ranks; the backward likewise from stage ``s + 1``.

Slots (``run_program``'s ``durs`` and ``comms``): transfer ``0`` none, then one slot per (kind, receiving
stage, sending rank, receiving rank) in ``transfers``; duration slot ``i`` is operation kind
``sources[i] = (u, 2 c + kind)`` of unit ``u`` sending over transfer slot ``sends[i]`` (0: it sends
nothing), so a sender whose sends block it (NCCL) can absorb each send into the operation that makes it
even when its micro-batches go to different ranks. With one rank per stage the units are the stages
and the slots are exactly ``compile_schedule``'s (duration ``(s * v + c) * 2 + kind``, transfer ``1 + s``
forward into ``s``, ``1 + p + s`` backward into ``s``): that program is used as it is, so plans without
mixed stages simulate exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from autotune.simulator.schedule import BACKWARD, FORWARD, CompiledSchedule, ScheduleDeadlock, compile_schedule
from autotune.specs import PipelineConfig, StageConfig
from autotune.specs.mixed_stage import microbatch_owners, rank_orders


@dataclass(frozen=True, slots=True)
class PipelineProgram:
    """A pipeline's operations in dependency order (``program`` as ``CompiledSchedule.program``).

    ``units[u] = (stage, rank)``; ``unit_of[k]`` the unit of operation ``k + 1``, ``labels[k] = (kind, chunk,
    micro-batch)``; ``last[u]`` the id of unit ``u``'s final operation, ``in_flight[u]`` the most chunk
    activations it holds at once; ``transfers[i]`` the (kind, receiving stage, sending rank, receiving rank)
    of transfer slot ``i + 1``; ``stage_units[s]`` the units of stage ``s``.
    """

    num_stages: int
    units: tuple[tuple[int, int], ...]
    program: tuple[tuple[int, int, int, int], ...]
    unit_of: tuple[int, ...]
    labels: tuple[tuple[int, int, int], ...]
    last: tuple[int, ...]
    in_flight: tuple[int, ...]
    transfers: tuple[tuple[int, int, int, int], ...]
    stage_units: tuple[tuple[int, ...], ...]
    sources: tuple[tuple[int, int], ...]
    sends: tuple[int, ...]
    #: per duration slot, the fraction of the unit's per-micro-batch pass it is (empty: 1 each; layer-wise
    #: execution, ``autotune.simulator.layerwise``)
    scales: tuple[float, ...] = ()

    # ``schedule.run_program`` reads these two names
    @property
    def stages(self) -> tuple[int, ...]:
        return self.unit_of


def _from_compiled(comp: CompiledSchedule, v: int) -> PipelineProgram:
    p = comp.num_stages
    transfers = tuple((FORWARD, s, 0, 0) for s in range(p)) + tuple((BACKWARD, s, 0, 0) for s in range(p))
    sources, sends = [], []
    for s in range(p):
        for c in range(v):  # forward to the next (virtual) stage, backward to the previous one
            sources += [(s, 2 * c), (s, 2 * c + 1)]
            sends.append(1 + s + 1 if s < p - 1 else 1 if c < v - 1 else 0)
            sends.append(1 + p + s - 1 if s > 0 else 1 + 2 * p - 1 if c > 0 else 0)
    return PipelineProgram(
        p,
        tuple((s, 0) for s in range(p)),
        comp.program,
        comp.stages,
        comp.labels,
        comp.last,
        comp.in_flight,
        transfers,
        tuple((s,) for s in range(p)),
        tuple(sources),
        tuple(sends),
    )


def transfer_slots(
    p: int, m: int, owners: list[tuple[int, ...]]
) -> tuple[dict[tuple[int, int, int, int], int], tuple[tuple[int, int, int, int], ...]]:
    """The transfer slots of a pipeline of ``p`` stages and ``m`` micro-batches whose micro-batch ``j`` is
    owned by rank ``owners[s][j]`` of stage ``s``: (transfer -> its slot, 1-based; the transfers in slot
    order). ``compile_schedule``'s slots first (rank 0 to rank 0), then every other pair that occurs."""
    slot: dict[tuple[int, int, int, int], int] = {}
    for s in range(p):
        slot[(FORWARD, s, 0, 0)] = 1 + s
        slot[(BACKWARD, s, 0, 0)] = 1 + p + s
    for s in range(1, p):
        for j in range(m):
            slot.setdefault((FORWARD, s, owners[s - 1][j], owners[s][j]), 1 + len(slot))
    for s in range(p - 1):
        for j in range(m):
            slot.setdefault((BACKWARD, s, owners[s + 1][j], owners[s][j]), 1 + len(slot))
    return slot, tuple(sorted(slot, key=slot.__getitem__))


@lru_cache(maxsize=512)
def compile_pipeline(
    schedule: str, p: int, m: int, v: int = 1, shares: tuple[tuple[int, ...], ...] | None = None
) -> PipelineProgram:
    """The program of one pipeline of ``p`` stages and ``m`` micro-batches; ``shares[s]`` the micro-batch
    share of each rank of stage ``s`` (None or one rank everywhere: ``compile_schedule``'s program)."""
    if shares is None or all(len(k) == 1 for k in shares):
        return _from_compiled(compile_schedule(schedule, p, m, v), v)
    if v != 1 or schedule not in ("1f1b", "gpipe"):
        raise ScheduleDeadlock(f"{schedule} with virtual stages {v} is not defined for stages of several ranks")
    units = tuple((s, k) for s in range(p) for k in range(len(shares[s])))
    index = {u: i for i, u in enumerate(units)}
    owners = [microbatch_owners(k) for k in shares]
    orders = rank_orders(schedule, shares)
    slot, transfers = transfer_slots(p, m, owners)
    duration: dict[tuple[int, int, int], int] = {}  # (unit, kind, send slot) -> duration slot
    op_id: dict[tuple[int, int, int], int] = {}
    program: list[tuple[int, int, int, int]] = []
    unit_of: list[int] = []
    labels: list[tuple[int, int, int]] = []
    last = [0] * len(units)
    ptr = [0] * len(units)
    remaining = sum(len(o) for stage in orders for o in stage)
    while remaining:
        progressed = False
        for u, (s, k) in enumerate(units):
            ops = orders[s][k]
            while ptr[u] < len(ops):
                kind, j = ops[ptr[u]]
                if kind == FORWARD:
                    dep_key = (FORWARD, s - 1, j) if s > 0 else None
                    pair = (FORWARD, s, owners[s - 1][j], k) if s > 0 else None
                elif s < p - 1:
                    dep_key, pair = (BACKWARD, s + 1, j), (BACKWARD, s, owners[s + 1][j], k)
                else:  # the last stage turns around: its own forward, no transfer
                    dep_key, pair = (FORWARD, s, j), None
                dep = 0
                if dep_key is not None:
                    dep = op_id.get(dep_key, -1)
                    if dep < 0:
                        break
                ci = 0 if pair is None else slot[pair]
                if kind == FORWARD:
                    send = slot[(FORWARD, s + 1, k, owners[s + 1][j])] if s < p - 1 else 0
                else:
                    send = slot[(BACKWARD, s - 1, k, owners[s - 1][j])] if s > 0 else 0
                di = duration.setdefault((u, kind, send), len(duration))
                program.append((last[u], dep, ci, di))
                unit_of.append(u)
                labels.append((kind, 0, j))
                last[u] = len(program)
                op_id[(kind, s, j)] = len(program)
                ptr[u] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for rank_orders' orders (their warm-ups fall along the pipeline)
            raise ScheduleDeadlock(f"{schedule} with shares {shares} deadlocks")
    in_flight = []
    for s, k in units:
        live = peak = 0
        for kind, _ in orders[s][k]:
            live += 1 if kind == FORWARD else -1
            peak = max(peak, live)
        in_flight.append(peak)
    stage_units = tuple(tuple(index[(s, k)] for k in range(len(shares[s]))) for s in range(p))
    sources = [(0, 0)] * len(duration)
    sends = [0] * len(duration)
    for (u, kind, send), i in duration.items():
        sources[i], sends[i] = (u, kind), send
    return PipelineProgram(
        p,
        units,
        tuple(program),
        tuple(unit_of),
        tuple(labels),
        tuple(last),
        tuple(in_flight),
        transfers,
        stage_units,
        tuple(sources),
        tuple(sends),
    )  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Unit:
    """One rank of a stage as the simulator sees it: ``view`` is the rank as a one-rank stage (its devices,
    the stage's layers, recompute, offload, sequence parallelism), ``share`` the micro-batches it runs."""

    stage: int
    rank: int
    view: StageConfig
    share: int


def pipeline_units(pipe: PipelineConfig) -> tuple[Unit, ...]:
    """A pipeline's units in ``compile_pipeline``'s order (stage by stage, ranks in order)."""
    out = []
    for s, st in enumerate(pipe.stages):
        if not st.ranks:
            out.append(Unit(s, 0, st, pipe.num_microbatches))
            continue
        for k, rank in enumerate(st.ranks):
            out.append(Unit(s, k, replace(st, devices=rank.devices, ranks=()), rank.num_microbatches))
    return tuple(out)


def shares_key(pipe: PipelineConfig) -> tuple[tuple[int, ...], ...] | None:
    """``compile_pipeline``'s ``shares`` for a pipeline: None when no stage has several ranks."""
    if not any(st.mixed for st in pipe.stages):
        return None
    return tuple(st.shares(pipe.num_microbatches) for st in pipe.stages)


def transfer_seconds(costs, pipe: PipelineConfig, comp: PipelineProgram, mbs: int, v: int) -> tuple[tuple, tuple]:
    """Seconds of each transfer slot of a pipeline's program (slot 0: none; ``costs``: the simulator's
    ``CostModel``, its ``p2p``) and whether each crosses nodes (the error bar's network part)."""
    p, stages, node = len(pipe.stages), pipe.stages, costs.node
    comms = [0.0] * (1 + len(comp.transfers))
    across = [False] * (1 + len(comp.transfers))
    for i, (kind, s, k_src, k_dst) in enumerate(comp.transfers, start=1):
        if kind == FORWARD and (s > 0 or v > 1):  # activations from the previous (virtual) stage
            other = s - 1
        elif kind != FORWARD and (s < p - 1 or v > 1):  # gradients from the next one
            other = (s + 1) % p
        else:
            continue
        # a rank's devices (``StageConfig.ranks_of`` without building them: a stage of one rank is its devices)
        src = stages[other].ranks[k_src].devices if stages[other].ranks else stages[other].devices
        dst = stages[s].ranks[k_dst].devices if stages[s].ranks else stages[s].devices
        comms[i] = costs.p2p(src, dst, mbs, stages[other].sequence_parallel, stages[s].sequence_parallel)
        across[i] = node[src[0]].name != node[dst[0]].name
    return tuple(comms), tuple(across)
