"""The planner's family ``mixed-stages`` (Zorse): stages of several data-parallel ranks of different GPU types.

The composition (``autotune.planning.planner``) builds pipelines whose every stage is one tensor-parallel
group; a stage of several ranks with per-rank micro-batch shares (Zorse's mixed-type stages, the space's
``stage_ranks`` dimension, ``autotune.planning.mixed_space``) is outside it. On Zorse's own example (2 x L4,
an RTX A6000 and a Tesla P40 training Llama 1B) the best plan Optuna found in 200 evaluations was two
one-stage replicas of two ranks each (A6000 + L4, L4 + P40) with ZeRO-3 and layer-wise execution, 1.12x dp's
best; none of dp's families could express it.

``candidates(space, sim, structures, max_simulations)`` takes dp's best composed plans and, from each one's
point of the space (``encoding.nearest``: its tensor-parallel degrees, the classes it uses, its micro-batch
size), decodes every mixed-stage structure of the space: each ``stage_ranks`` choice above 1 (widths and
Zorse's bandwidth cut), ``assign``, ``order`` and pipeline depths 1-4 and the structure's own. Each
distinct structure is timed by the simulator with the structure's own memory state or, when that does not
fit, the first of ZeRO-2, ZeRO-3 and ZeRO-3 with the optimizer or everything in host memory that the
memory model says fits (Zorse shards inside its stages). Micro-batch shares inside a stage are Zorse's
rule on the cost model's per-layer latency, which a ``--profile`` calibrates (``mixed_space.zorse_shares``).
The planner then gives the fastest few the memory-state variants of every other family
(``state_variants``: ZeRO, offload, recomputation, layer-wise execution).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from autotune.planning import encoding
from autotune.planning.candidate import Candidate
from autotune.planning.space import SearchSpace

FAMILY = "mixed-stages"
#: pipeline depths tried besides the structure's own (Zorse's plans are shallow: slow links between stages)
DEPTHS = (1, 2, 3, 4)
#: dp's composed plans whose points the family starts from
BASES = 2
#: the memory states tried, in order, when a structure does not fit with its own (zero, offload)
FRUGAL_STATES = ((2, "none"), (3, "none"), (3, "optimizer"), (3, "all"))
#: the simulator's memory checks and timings of the family at most (``simulations``: fewer on large clusters,
#: where a mixed stage's schedule costs ~0.1 s to simulate at 128 GPUs)
MAX_SIMULATIONS = 160
SIMULATION_DEVICES = 4096
#: the family's fastest plans the planner gives memory-state variants (half the family's simulations)
VARIED = 3
#: points decoded per simulator call allowed, at most (a decode costs ~0.06 s at 1,024 GPUs, and most points
#: there decode to a plan already seen or to none with a stage of several ranks)
DECODES_PER_SIMULATION = 4


def simulations(num_devices: int) -> int:
    """The family's simulator calls on a cluster of ``num_devices`` (160 up to 25 GPUs, 32 at 128, 4 at 1,024)."""
    return min(MAX_SIMULATIONS, SIMULATION_DEVICES // max(num_devices, 1))


def candidates(space: SearchSpace, sim, structures: Sequence[Candidate], max_simulations: int) -> list[Candidate]:
    """The mixed-stage plans decoded around dp's plans ``structures`` (best first), each with the first
    memory state that fits, fastest first. ``sim`` (a ``Simulator``) checks their memory and times them, at
    most ``max_simulations`` calls in all (a mixed stage's schedule is costly to simulate on large clusters:
    ~0.1 s at 128 GPUs). Structures at the base plan's own depth come first. None on a cluster of one node
    class (the space has no ``stage_ranks`` there)."""
    dims = space._dims
    if "stage_ranks" not in dims or not structures:
        return []
    widths = [w for w in dims["stage_ranks"].choices if w != 1]
    states = [(z, o) for z, o in FRUGAL_STATES if z in dims["zero"].choices and o in dims["offload"].choices]
    bases = encoding.base_points(space.context, [c.config for c in structures], BASES)
    out: list[Candidate] = []
    seen: set = set()
    calls = [0, 0]  # simulator calls, decodes
    for point in bases:
        depths = [point["pp"]] + [d for d in DEPTHS if d in dims["pp"].choices and d != point["pp"]]
        for pp, width, assign, order in itertools.product(
            depths, widths, dims["assign"].choices, dims["order"].choices
        ):
            if calls[0] >= max_simulations or calls[1] >= DECODES_PER_SIMULATION * max_simulations:
                return sorted(out, key=lambda c: c.estimate_s)
            params = dict(point, stage_ranks=width, assign=assign, order=order, pp=pp)
            config = _fitting(space, sim, params, states, seen, calls, max_simulations - 1)
            if config is None:
                continue
            m = sim.evaluate(config)
            calls[0] += 1
            if m.ok:
                out.append(Candidate(config, m.iteration_time_s, FAMILY))
    return sorted(out, key=lambda c: c.estimate_s)


def _fitting(space: SearchSpace, sim, params: dict, states: Sequence[tuple[int, str]], seen: set, calls, limit: int):
    """The plan ``params`` decode to with its own memory state, or with the first of ``states`` the memory
    model says fits; None when the point decodes to no new plan with a stage of several ranks, none fits or
    ``calls[0]`` (the memory checks so far, counted there) reaches ``limit``. Adds the plans checked to
    ``seen``; counts its decodes in ``calls[1]``."""
    for zero, offload in ((params["zero"], params["offload"]), *states):
        calls[1] += 1
        config = space.decode(dict(params, zero=zero, offload=offload)).config
        if config is None or config in seen:
            continue
        if not any(s.mixed for p in config.pipelines for s in p.stages):
            return None  # no stage of several ranks (too few groups for the width): the other families' plans
        if calls[0] >= limit:
            return None
        seen.add(config)
        memory = sim.memory_estimate(config)
        calls[0] += 1
        if memory is not None and memory.ok:
            return config
    return None
