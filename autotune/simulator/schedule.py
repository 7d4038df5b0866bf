"""Pipeline schedules (GPipe, 1F1B, interleaved 1F1B) simulated per micro-batch.

A schedule fixes, for every stage, the order of its operations: forward ``F`` and backward ``B`` of
each (model chunk, micro-batch). Given that order, the start of an operation is the later of (a) the
end of the previous operation on the same stage and (b) the end of the operation it depends on in a
neighbouring stage plus the point-to-point transfer between them. The order and the dependencies
depend only on (schedule, stages, micro-batches, virtual stages), so they are compiled once
(``compile_schedule``, cached) into a flat program listed in dependency order; simulating a plan is then
one pass over that program with the plan's stage durations (``run_program``). Unequal stage times,
stragglers and bubbles come out of that pass, not out of a formula.

Orders (stage ``s`` of ``p``, ``m`` micro-batches):

- ``gpipe``: all forwards, then all backwards (Huang et al. 2019, GPipe).
- ``1f1b``: ``min(p - s - 1, m)`` warm-up forwards, then alternate one forward / one backward, then the
  remaining backwards (Narayanan et al. 2021, PipeDream-Flush as used by Megatron-LM).
- ``interleaved-1f1b``: each stage holds ``v`` model chunks; forwards visit the chunks in groups of ``p``
  micro-batches, ``(p - s - 1) * 2 + (v - 1) * p`` warm-up forwards, then 1F1B
  (Megatron-LM ``forward_backward_pipelining_with_interleaving``; Narayanan et al. 2021, Sec. 2.2).
  Chunk ``c`` of stage ``s`` is virtual stage ``c * p + s``; the last stage's chunk ``c`` feeds the
  first stage's chunk ``c + 1``.

Duration slots: ``durs[(s * v + c) * 2 + kind]`` with kind 0 = forward, 1 = backward.
Transfer slots: ``comms[0] = 0``; ``comms[1 + s]`` is the activation transfer into stage ``s`` from
the previous virtual stage (from ``s - 1``, or from the last stage for ``s = 0``); ``comms[1 + p + s]``
is the gradient transfer into stage ``s`` from the next one (from ``s + 1``, or from stage 0 for the
last stage).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

FORWARD, BACKWARD = 0, 1


@dataclass(frozen=True, slots=True)
class CompiledSchedule:
    """A schedule's operations in dependency order, ready for ``run_program``.

    ``program[k]`` describes operation ``k + 1`` (ids start at 1; id 0 is a sentinel that ends at time 0)
    as ``(previous, dependency, transfer_slot, duration_slot)``: the id of the previous operation on the
    same stage (0 if none), the id of the operation it waits for on another stage (0 if none), and the
    slots of its transfer and duration. ``stages[k]`` and ``labels[k] = (kind, chunk, microbatch)`` say
    what it is; ``last[s]`` is the id of stage ``s``'s final operation. ``in_flight[s]`` is the most
    model-chunk activations stage ``s`` holds at once (forwards done whose backward has not run).
    """

    num_stages: int
    program: tuple[tuple[int, int, int, int], ...]
    stages: tuple[int, ...]
    labels: tuple[tuple[int, int, int], ...]
    last: tuple[int, ...]
    in_flight: tuple[int, ...]


class ScheduleDeadlock(ValueError):
    """The stage orders wait on each other (cannot happen for the orders above with m % p == 0)."""


def stage_orders(schedule: str, p: int, m: int, v: int) -> list[list[tuple[int, int, int]]]:
    """Each stage's operations ``(kind, chunk, micro-batch)`` in the order it runs them (the runner's
    ``runner.mixed`` runs the interleaved ones as simulated here)."""
    orders = []
    for s in range(p):
        if schedule == "gpipe":
            ops = [(FORWARD, 0, j) for j in range(m)] + [(BACKWARD, 0, j) for j in range(m)]
        else:
            # forward / backward chunk order, micro-batches in groups of p (Megatron's interleaving)
            fwd: list[tuple[int, int]] = []
            bwd: list[tuple[int, int]] = []
            for g0 in range(0, m, p):
                group = range(g0, min(g0 + p, m))
                for c in range(v):
                    fwd.extend((c, j) for j in group)
                    bwd.extend((v - 1 - c, j) for j in group)
            total = m * v
            if v == 1:
                warmup = min(p - s - 1, m)
            else:
                warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
            ops = [(FORWARD, c, j) for c, j in fwd[:warmup]]
            for k in range(total - warmup):
                c, j = fwd[warmup + k]
                ops.append((FORWARD, c, j))
                c, j = bwd[k]
                ops.append((BACKWARD, c, j))
            ops.extend((BACKWARD, c, j) for c, j in bwd[total - warmup :])
        orders.append(ops)
    return orders


@lru_cache(maxsize=256)
def compile_schedule(schedule: str, p: int, m: int, v: int = 1) -> CompiledSchedule:
    """Order the operations of every stage and list them in a dependency-respecting order."""
    orders = stage_orders(schedule, p, m, v)
    op_id: dict[tuple[int, int, int, int], int] = {}
    program: list[tuple[int, int, int, int]] = []
    stages: list[int] = []
    labels: list[tuple[int, int, int]] = []
    last = [0] * p
    ptr = [0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            ops = orders[s]
            while ptr[s] < len(ops):
                kind, c, j = ops[ptr[s]]
                if kind == FORWARD:
                    if s > 0:
                        dep_key, slot = (FORWARD, s - 1, c, j), 1 + s
                    elif c > 0:
                        dep_key, slot = (FORWARD, p - 1, c - 1, j), 1 + s
                    else:
                        dep_key, slot = None, 0
                else:
                    if s < p - 1:
                        dep_key, slot = (BACKWARD, s + 1, c, j), 1 + p + s
                    elif c < v - 1:
                        dep_key, slot = (BACKWARD, 0, c + 1, j), 1 + p + s
                    else:  # the last virtual stage turns around: its own forward, no transfer
                        dep_key, slot = (FORWARD, s, c, j), 0
                if dep_key is None:
                    dep = 0
                else:
                    dep = op_id.get(dep_key, -1)
                    if dep < 0:
                        break
                program.append((last[s], dep, slot, (s * v + c) * 2 + kind))
                stages.append(s)
                labels.append((kind, c, j))
                last[s] = len(program)
                op_id[(kind, s, c, j)] = len(program)
                ptr[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleDeadlock(
                f"{schedule} with {p} stages, {m} micro-batches and {v} virtual stages "
                "deadlocks (use num_microbatches divisible by the number of stages)"
            )
    in_flight = []
    for ops in orders:
        live = peak = 0
        for kind, _, _ in ops:
            live += 1 if kind == FORWARD else -1
            peak = max(peak, live)
        in_flight.append(peak)
    return CompiledSchedule(p, tuple(program), tuple(stages), tuple(labels), tuple(last), tuple(in_flight))


#: a program run this many times is compiled to straight-line Python (``_straight_line``), ~2x faster per run
STRAIGHT_LINE_AFTER_RUNS = 48
_runs: dict[int, list] = {}  # id(program) -> [the program, runs so far, its straight-line function or None]


def run_program(
    compiled: CompiledSchedule, durs: list[float] | tuple[float, ...], comms: list[float] | tuple[float, ...]
) -> tuple[list[float], list[float]]:
    """Simulate one pipeline; return (end time of every operation, sentinel 0 first; finish time of every
    stage). This loop is the simulator's hot path: plain lists and floats only. A program run often is
    compiled once into straight-line code that computes the same floats in the same order."""
    entry = _runs.get(id(compiled))
    if entry is None or entry[0] is not compiled:
        if len(_runs) > 1024:
            _runs.clear()
        entry = _runs[id(compiled)] = [compiled, 0, None]
    if entry[2] is not None:
        end = entry[2](durs, comms)
        return end, [end[k] for k in compiled.last]
    entry[1] += 1
    if entry[1] >= STRAIGHT_LINE_AFTER_RUNS:
        entry[2] = _straight_line(compiled.program)
    end = [0.0]
    append = end.append
    for prev, dep, ci, di in compiled.program:
        t = end[dep] + comms[ci]
        f = end[prev]
        append((f if f > t else t) + durs[di])
    return end, [end[k] for k in compiled.last]


def _straight_line(program: tuple[tuple[int, int, int, int], ...]):
    """``run_program``'s loop unrolled for one program: one local per operation and per duration and transfer
    slot read, no indexing of ``end`` (``comms[0]`` is 0 by definition: ``end[dep] + 0.0`` is ``end[dep]``,
    end times being non-negative)."""
    lines = ["def run(d, c):"]
    lines += [f"    d{i} = d[{i}]" for i in sorted({di for _, _, _, di in program})]
    lines += [f"    c{i} = c[{i}]" for i in sorted({ci for _, _, ci, _ in program if ci})]
    lines.append("    e0 = 0.0")
    for k, (prev, dep, ci, di) in enumerate(program, start=1):
        if dep == 0 and ci == 0:  # max(end[prev], 0 + 0): end[prev] is never negative
            lines.append(f"    e{k} = e{prev} + d{di}")
        else:
            lines.append(f"    t = e{dep} + c{ci}" if ci else f"    t = e{dep}")
            lines.append(f"    e{k} = (e{prev} if e{prev} > t else t) + d{di}")
    lines.append("    return [" + ", ".join(f"e{k}" for k in range(len(program) + 1)) + "]")
    namespace: dict = {}
    exec(compile("\n".join(lines), "<pipeline schedule>", "exec"), namespace)  # noqa: S102 - our own program
    return namespace["run"]


def critical_path(
    compiled, end: list[float], comms: list[float] | tuple[float, ...], unit: int, num_durations: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The chain of operations that ends unit ``unit``'s last operation in ``run_program``'s ``end``: how
    many times each duration slot (``num_durations`` of them) and each transfer slot lies on it, as two
    tuples of counts indexed by slot. Stretching a slot by ``x`` seconds moves that unit's finish by
    ``count * x`` (to first order: until another chain becomes longer). Ties go to the operation's own
    predecessor on the same unit. One backward walk, ``O(length of the chain)``."""
    program = compiled.program
    durations = [0] * num_durations
    transfers = [0] * len(comms)
    k = compiled.last[unit]
    while k:
        prev, dep, ci, di = program[k - 1]
        durations[di] += 1
        if dep and end[dep] + comms[ci] > end[prev]:
            transfers[ci] += 1
            k = dep
        else:
            k = prev
    transfers[0] = 0
    return tuple(durations), tuple(transfers)
