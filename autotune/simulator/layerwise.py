"""Zorse's layer-wise execution (``execution: "layerwise"``, ``autotune.specs.execution``) in the simulator.

Each rank of a stage (a unit, ``mixed_stages``) runs one layer over all of its micro-batches, then the next;
the backward runs the layers in reverse, last micro-batch first. The program (``compile_layerwise``, in
``mixed_stages.PipelineProgram``'s format for ``schedule.run_program``) has per unit, for a stage of ``L``
layers and the unit's ``n`` micro-batches:

- forward: ``n`` operations of its first layer (each waits for its micro-batch from the previous stage's
  owner), one operation for layers ``2 .. L - 1`` over all micro-batches, ``n`` operations of its last layer
  (each sends its micro-batch on as soon as it is done); one layer is ``1 / L`` of the stage's forward of one
  micro-batch (the embedding and LM head counted in with the first and last stage's layers);
- backward: the same, mirrored: the last layer's ``n`` operations wait for their gradients from the next
  stage, the first layer's send theirs back. A stage of one layer has ``n`` operations each way.

So a stage's downstream neighbour starts after ``(L - 1) / L`` of the stage's forward, and every
micro-batch's activations are alive at the end of the forward (``in_flight`` = the unit's share). Each
duration slot carries its ``scales`` entry (the fraction of the per-micro-batch stage pass it is), and the
per-micro-batch runtime overhead of a calibration profile is spread the same way.

Communication (``autotune.simulator.data_parallel.sharded_costs``): a layer's ZeRO all-gather / reduce-scatter
and offload ``all``'s weight traffic happen once per iteration, spread over the unit's micro-batches
(``ChunkComm.spread``). With the stage's ``offload`` the activations go to host memory after each layer's
forward and come back for its backward (``activation_transfer_s``, overlapped with compute as Zorse's copy
stream does), and they count in the host's memory instead of the device's (``stage_memory_GiB``).
"""

from __future__ import annotations

from functools import lru_cache

from autotune.simulator.cost_model import CostModel
from autotune.simulator.mixed_stages import PipelineProgram, transfer_slots
from autotune.simulator.schedule import BACKWARD, FORWARD, ScheduleDeadlock
from autotune.simulator.zero import transfer_s
from autotune.specs import StageConfig
from autotune.specs.mixed_stage import microbatch_owners


@lru_cache(maxsize=512)
def compile_layerwise(m: int, layers: tuple[int, ...], shares: tuple[tuple[int, ...], ...]) -> PipelineProgram:
    """The program of one layer-wise pipeline of ``len(layers)`` stages and ``m`` micro-batches; ``shares[s]``
    the micro-batch share of each rank of stage ``s`` (``(m,)`` for a stage of one rank)."""
    p = len(layers)
    units = tuple((s, k) for s in range(p) for k in range(len(shares[s])))
    owners = [microbatch_owners(k) for k in shares]
    slot, transfers = transfer_slots(p, m, owners)  # numbered as mixed_stages.compile_pipeline numbers them
    # per unit: (kind, micro-batch or -1, the operation it waits for, its receive slot, its send slot, scale,
    # whether it finishes the micro-batch on this stage)
    ops: list[list[tuple[int, int, tuple | None, int, int, float, bool]]] = []
    for s, k in units:
        mine = [j for j in range(m) if owners[s][j] == k]
        n, L = len(mine), max(1, layers[s])
        todo: list[tuple[int, int, tuple | None, int, int, float, bool]] = []
        for kind, order in ((FORWARD, mine), (BACKWARD, mine[::-1])):
            up = s - 1 if kind == FORWARD else s + 1  # where this unit's inputs come from
            down = s + 1 if kind == FORWARD else s - 1
            first_ops, last_ops = [], []
            for j in order:
                dep = (kind, up, j) if 0 <= up < p else None
                recv = slot[(kind, s, owners[up][j], k)] if dep is not None else 0
                send = slot[(kind, down, k, owners[down][j])] if 0 <= down < p else 0
                if L == 1:
                    first_ops.append((kind, j, dep, recv, send, 1.0, True))
                else:
                    first_ops.append((kind, j, dep, recv, 0, 1.0 / L, False))
                    last_ops.append((kind, j, None, 0, send, 1.0 / L, True))
            middle = [(kind, -1, None, 0, 0, (L - 2) * n / L, False)] if L > 2 and n else []
            todo += first_ops + middle + last_ops
        ops.append(todo)
    duration: dict[tuple[int, int, int, float], int] = {}
    emitted: dict[tuple[int, int, int], int] = {}  # (kind, stage, micro-batch) -> the operation that sends it on
    program, unit_of, labels = [], [], []
    last = [0] * len(units)
    ptr = [0] * len(units)
    remaining = sum(len(o) for o in ops)
    while remaining:
        progressed = False
        for u, (s, _) in enumerate(units):
            while ptr[u] < len(ops[u]):
                kind, j, dep, recv, send, scale, emits = ops[u][ptr[u]]
                dep_id = 0
                if dep is not None:
                    dep_id = emitted.get(dep, -1)
                    if dep_id < 0:
                        break
                di = duration.setdefault((u, kind, send, scale), len(duration))
                program.append((last[u], dep_id, recv, di))
                unit_of.append(u)
                labels.append((kind, 0, j))
                last[u] = len(program)
                if emits:
                    emitted[(kind, s, j)] = len(program)
                ptr[u] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen: every stage's inputs come from a stage that has none pending
            raise ScheduleDeadlock(f"layerwise pipeline with layers {layers} and shares {shares} deadlocks")
    index = {u: i for i, u in enumerate(units)}
    sources, sends, scales = [(0, 0)] * len(duration), [0] * len(duration), [1.0] * len(duration)
    for (u, kind, send, scale), i in duration.items():
        sources[i], sends[i], scales[i] = (u, kind), send, scale
    return PipelineProgram(
        p,
        units,
        tuple(program),
        tuple(unit_of),
        tuple(labels),
        tuple(last),
        tuple(len([j for j in range(m) if owners[s][j] == k]) for s, k in units),
        transfers,
        tuple(tuple(index[(s, k)] for k in range(len(shares[s]))) for s in range(p)),
        tuple(sources),
        tuple(sends),
        tuple(scales),
    )


def stage_memory_GiB(
    costs: CostModel,
    devices: tuple[str, ...],
    layers: int,
    recompute: bool | str,
    first: bool,
    last: bool,
    mbs: int,
    in_flight: int,
    v: int,
    dp: int = 1,
    zero: int = 0,
    offload: str = "none",
    sp: bool = False,
) -> tuple[float, float]:
    """``CostModel.stage_memory_GiB`` of a layer-wise unit: all of its ``in_flight`` micro-batches'
    activations on the device, or, with ``offload``, one micro-batch's on the device and the rest in host
    memory (added to the host GiB)."""
    args = (devices, layers, recompute, first, last, mbs)
    tail = (v, dp, zero, offload, sp)
    if offload == "none" or in_flight <= 1:
        return costs.stage_memory_GiB(*args, in_flight, *tail)
    one, host = costs.stage_memory_GiB(*args, 1, *tail)
    all_on_device, _ = costs.stage_memory_GiB(*args, in_flight, *tail)
    return one, host + (all_on_device - one)


def activation_transfer_s(
    costs: CostModel,
    view: StageConfig,
    first: bool,
    last: bool,
    mbs: int,
    v: int,
    dp: int,
    zero: int,
    host: tuple[float, float],
) -> float:
    """Seconds per micro-batch to move a layer-wise stage's activations of one micro-batch over the host
    link (``host``: GB/s, latency us), each way: down after the forward, up for the backward."""
    args = (view.devices, view.layers, view.recompute, first, last, mbs)
    tail = (v, dp, zero, view.offload, view.sequence_parallel)
    one, _ = costs.stage_memory_GiB(*args, 1, *tail)
    two, _ = costs.stage_memory_GiB(*args, 2, *tail)
    return transfer_s(max(0.0, two - one) * 2**30, *host)
