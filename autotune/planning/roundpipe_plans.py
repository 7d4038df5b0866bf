"""The planner's family ``roundpipe`` (RoundPipe: consumer GPUs, state in host memory, round-robin dispatch).

Every search method evaluates the plan RoundPipe picks itself (``roundpipe_space.start_params``: its fastest
node class, balance 1.1, 60% memory limit, stage grain, one pass of at least pool + 1 micro-batches). Its
settings are choices, though, and the composition has no RoundPipe plans at all: on ``spes-2b`` over two
8 x A100 nodes, RoundPipe at micro-batch 2 is 3% faster than RoundPipe's own pick (micro-batch 32) and the
best plan there; on 8 x RTX-4090 the full grid of its settings (1,200 plans) gains 0.0-0.7% over its pick.

``candidates(space, sim, structures, max_simulations)`` decodes, from RoundPipe's own plan, every pool,
memory limit, recompute grain and micro-batch size of the space (balance and passes as RoundPipe picks
them), keeps what the memory model says fits and times it with the simulator, at most ``max_simulations``
calls. None where RoundPipe does not apply.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from autotune.planning.candidate import Candidate
from autotune.planning.space import SearchSpace

FAMILY = "roundpipe"
#: the simulator's memory checks and timings at most (``simulations``: fewer on large clusters)
MAX_SIMULATIONS = 120
SIMULATION_DEVICES = 4096
#: RoundPipe plans get no memory-state variants (their state lives in host memory by design)
VARIED = 0


def simulations(num_devices: int) -> int:
    """The family's simulator calls on a cluster of ``num_devices`` (120 up to 34 GPUs, 32 at 128)."""
    return min(MAX_SIMULATIONS, SIMULATION_DEVICES // max(num_devices, 1))


def candidates(space: SearchSpace, sim, structures: Sequence[Candidate], max_simulations: int) -> list[Candidate]:
    """RoundPipe's plans around its own pick (module docstring) that fit, fastest first. ``structures``
    (the planner's other plans) are unused: a RoundPipe plan does not derive from a pipeline plan."""
    del structures
    start = space.roundpipe_start()
    if start is None:
        return []
    dims = space._dims
    out: list[Candidate] = []
    seen: set = set()
    calls = 0
    for pool, memory, grain, mbs in itertools.product(
        dims["rp.pool"].choices, dims["rp.memory"].choices, dims["rp.grain"].choices, dims["mbs"].choices
    ):
        if calls >= max_simulations - 1:
            break
        config = space.decode({**start, "rp.pool": pool, "rp.memory": memory, "rp.grain": grain, "mbs": mbs}).config
        if config is None or config in seen:
            continue
        seen.add(config)
        estimate = sim.memory_estimate(config)
        calls += 1
        if estimate is None or not estimate.ok:
            continue
        m = sim.evaluate(config)
        calls += 1
        if m.ok:
            out.append(Candidate(config, m.iteration_time_s, FAMILY))
    return sorted(out, key=lambda c: c.estimate_s)
