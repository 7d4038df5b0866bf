"""Pipeline schedules, hand-computed: bubbles, a slow stage, interleaving, memory in flight, validity."""

from __future__ import annotations

import pytest

from autotune.simulator.schedule import FORWARD, ScheduleDeadlock, compile_schedule, run_program


def _run(schedule: str, p: int, m: int, v: int, fwd: list[float], bwd: list[float], comm: float = 0.0):
    """Stage s chunk c: forward fwd[s] / v, backward bwd[s] / v; every transfer takes ``comm``."""
    comp = compile_schedule(schedule, p, m, v)
    durs = []
    for s in range(p):
        for _ in range(v):
            durs += [fwd[s] / v, bwd[s] / v]
    comms = [0.0] + [comm] * (2 * p)
    end, free = run_program(comp, durs, comms)
    return comp, end, free


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(4, 8), (4, 16), (8, 64), (3, 2), (1, 5)])
def test_equal_stages_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule: str, p: int, m: int) -> None:
    f, b = 1.0, 2.0
    _, _, free = _run(schedule, p, m, 1, [f] * p, [b] * p)
    makespan = max(free)
    assert makespan == pytest.approx((m + p - 1) * (f + b), rel=1e-12)
    bubble = 1 - p * m * (f + b) / (p * makespan)
    assert bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


def test_slow_stage_dominates_1f1b() -> None:
    # stage 1 is 4x slower: it is busy from the end of stage 0's first forward to its last backward,
    # after which only stage 0's last backward remains.
    p, m = 4, 8
    fwd, bwd = [1.0, 4.0, 1.0, 1.0], [2.0, 8.0, 2.0, 2.0]
    _, _, free = _run("1f1b", p, m, 1, fwd, bwd)
    assert max(free) == pytest.approx(fwd[0] + m * (fwd[1] + bwd[1]) + bwd[0], rel=1e-12)


def test_transfers_by_hand() -> None:
    # p=2, m=2, f=1, b=2, transfer 0.25. Stage 0: F0 F1 B0 B1; stage 1: F0 B0 F1 B1.
    # s0 F0 [0,1] F1 [1,2]; s1 F0 [1.25,2.25] B0 [2.25,4.25] F1 [4.25,5.25] B1 [5.25,7.25];
    # s0 B0 [4.5,6.5] B1 [7.5,9.5]
    _, end, free = _run("1f1b", 2, 2, 1, [1.0, 1.0], [2.0, 2.0], comm=0.25)
    assert free == [9.5, 7.25]
    # more micro-batches: every extra one costs at least f + b more on the busiest stage
    _, _, free8 = _run("1f1b", 4, 8, 1, [1.0] * 4, [2.0] * 4, comm=0.25)
    _, _, free8_no = _run("1f1b", 4, 8, 1, [1.0] * 4, [2.0] * 4)
    assert max(free8) >= max(free8_no) + 2 * 3 * 0.25


@pytest.mark.parametrize("v", [2, 4])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_interleaving_divides_the_bubble_by_v(v: int, m: int) -> None:
    # Narayanan et al. 2021 Sec. 2.2.2: the bubble time of interleaved 1F1B is (p - 1)(f + b) / v
    p, f, b = 4, 1.0, 2.0
    _, _, free = _run("interleaved-1f1b", p, m, v, [f] * p, [b] * p)
    _, _, free_1f1b = _run("1f1b", p, m, 1, [f] * p, [b] * p)
    assert max(free) == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v, rel=1e-12)
    assert max(free) < max(free_1f1b)


def test_micro_batches_in_flight() -> None:
    assert compile_schedule("1f1b", 4, 8, 1).in_flight == (4, 3, 2, 1)  # min(m, p - s)
    assert compile_schedule("1f1b", 4, 2, 1).in_flight == (2, 2, 2, 1)
    assert compile_schedule("gpipe", 4, 8, 1).in_flight == (8, 8, 8, 8)
    # interleaved, in chunks of half a stage: Megatron's warm-up (p - s - 1) * 2 + (v - 1) * p, plus one
    assert compile_schedule("interleaved-1f1b", 4, 8, 2).in_flight == (11, 9, 7, 5)


@pytest.mark.parametrize(
    "schedule,p,m,v",
    [
        ("1f1b", 5, 7, 1),
        ("gpipe", 3, 4, 1),
        ("interleaved-1f1b", 4, 8, 2),
        ("interleaved-1f1b", 2, 6, 3),
        ("1f1b", 6, 3, 1),
    ],
)
def test_schedule_respects_dependencies_and_never_overlaps(schedule: str, p: int, m: int, v: int) -> None:
    fwd = [1.0 + 0.3 * s for s in range(p)]
    bwd = [2.5 - 0.2 * s for s in range(p)]
    comp, end, free = _run(schedule, p, m, v, fwd, bwd, comm=0.1)
    durs = {}
    seen = set()
    last_end = [0.0] * p
    for k, ((prev, dep, ci, _di), s, (kind, c, j)) in enumerate(zip(comp.program, comp.stages, comp.labels)):
        assert prev == 0 or comp.stages[prev - 1] == s
        d = (fwd[s] if kind == FORWARD else bwd[s]) / v
        start = end[k + 1] - d
        assert start >= last_end[s] - 1e-12  # one operation at a time per stage
        if dep:
            assert start >= end[dep] + (0.1 if ci else 0.0) - 1e-12
        last_end[s] = end[k + 1]
        seen.add((kind, s, c, j))
        durs[s] = durs.get(s, 0.0) + d
    assert len(seen) == 2 * p * m * v  # every forward and backward ran once
    for s in range(p):
        assert durs[s] == pytest.approx(m * (fwd[s] + bwd[s]))


def test_interleaving_with_uneven_micro_batches_is_detected() -> None:
    with pytest.raises(ScheduleDeadlock):
        compile_schedule("interleaved-1f1b", 4, 5, 3)


@pytest.mark.parametrize(
    ("schedule", "p", "m", "v", "shares"),
    [
        ("1f1b", 5, 7, 1, None),
        ("gpipe", 3, 4, 1, None),
        ("interleaved-1f1b", 4, 8, 2, None),
        ("1f1b", 3, 6, 1, ((6,), (4, 2), (6,))),  # a mixed stage: two ranks, uneven shares
    ],
)
def test_straight_line_program_computes_the_loops_floats(schedule, p, m, v, shares) -> None:
    """The unrolled program that often-run pipelines switch to (``schedule._straight_line``) gives the very
    floats of ``run_program``'s loop, whatever the durations and transfers (a zero transfer slot included)."""
    import random

    from autotune.simulator.mixed_stages import compile_pipeline
    from autotune.simulator.schedule import _straight_line

    comp = compile_pipeline(schedule, p, m, v, shares)
    rng = random.Random(7)
    run = _straight_line(comp.program)
    for _ in range(5):
        durs = [rng.uniform(0.1, 3.0) for _ in range(1 + max(di for *_, di in comp.program))]
        comms = [0.0] + [
            rng.choice([0.0, rng.uniform(0.0, 0.5)]) for _ in range(max(ci for _, _, ci, _ in comp.program))
        ]
        end = [0.0]
        for prev, dep, ci, di in comp.program:  # the loop's definition
            end.append(max(end[prev], end[dep] + comms[ci]) + durs[di])
        assert run(durs, comms) == end
