"""The planner's family ``moe`` (SPES): expert parallelism, expert subsets and the sync period of an MoE model.

The composition (``autotune.planning.planner``) builds dense pipelines: every replica trains every expert and
synchronises every step, which is the slowest plan SPES's setting has (16 L40S joined by 1 Gbit/s training
``spes-2b`` with ``--max-sync-every 100``: dp's best 46k tokens/s, Optuna's 438k, the exhaustive optimum 467k:
sixteen one-GPU replicas, each training its own experts and syncing every 100 steps). Plain data parallelism
does not even fit there; a subset of the experts per replica (``trains_experts: partition``) does.

``candidates(space, sim, structures, max_simulations)`` decodes, around dp's best plans' points of the space
(``encoding.base_points``, each also with every tensor-parallel degree at its smallest), every combination of
the MoE dimensions (``autotune.planning.moe_space``: ``expert_parallel``, ``trains_experts``), the sync period
at the user's bound (``sync_every``: the largest the space allows, ``--max-sync-every``; the plan with fewer
syncs is never slower), ZeRO 0 (the runner shards no MoE plan's state) and the base's stage, pipeline depths
1, 2, 4 and the base's own, every micro-batch size and recomputation none, all or the base's; keeps what the memory model says fits and times it with the simulator.
The planner gives the fastest few the memory-state variants of every other family (``state_variants``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from autotune.planning import encoding
from autotune.planning.candidate import Candidate
from autotune.planning.space import SearchSpace

FAMILY = "moe"
#: pipeline depths tried besides the base's own
DEPTHS = (1, 2, 4)
#: dp's plans whose points the family starts from
BASES = 2
#: the simulator's memory checks and timings at most (``simulations``: fewer on large clusters)
MAX_SIMULATIONS = 1500
SIMULATION_DEVICES = 24000
#: the family's fastest plans the planner gives memory-state variants
VARIED = 3


def simulations(num_devices: int) -> int:
    """The family's simulator calls on a cluster of ``num_devices`` (1,500 up to 16 GPUs, ~1 ms each there; 187 at 128)."""
    return min(MAX_SIMULATIONS, SIMULATION_DEVICES // max(num_devices, 1))


def candidates(space: SearchSpace, sim, structures: Sequence[Candidate], max_simulations: int) -> list[Candidate]:
    """The MoE plans decoded around dp's plans ``structures`` (best first) that fit, fastest first; at most
    ``max_simulations`` calls of ``sim`` (a ``Simulator``: ``memory_estimate``, ``evaluate``). None for a
    dense model (the space has no MoE dimensions)."""
    dims = space._dims
    if "expert_parallel" not in dims or not structures:
        return []
    sync = max(dims["sync_every"].choices)
    bases = []
    for point in encoding.base_points(space.context, [c.config for c in structures], BASES):
        smallest = {k: min(dims[k].choices) for k in point if k.startswith("tp.")}
        bases += [point] + ([dict(point, **smallest)] if any(point[k] != v for k, v in smallest.items()) else [])
    out: list[Candidate] = []
    seen: set = set()
    calls = 0
    for point in bases:
        depths = [point["pp"]] + [d for d in DEPTHS if d in dims["pp"].choices and d != point["pp"]]
        recomputes = list(
            dict.fromkeys([point["recompute"], *(r for r in ("none", "all") if r in dims["recompute"].choices)])
        )
        zeros = list(dict.fromkeys([0, point["zero"]]))  # the runner shards no MoE state (runner.jobs)
        for trains, ep, pp, mbs, recompute, zero in itertools.product(
            reversed(dims["trains_experts"].choices),  # subsets first: the memory they free decides the fit
            dims["expert_parallel"].choices,
            depths,
            dims["mbs"].choices,
            recomputes,
            zeros,
        ):
            if calls >= max_simulations - 1:
                return sorted(out, key=lambda c: c.estimate_s)
            params = dict(point, trains_experts=trains, zero=zero, expert_parallel=ep, pp=pp, mbs=mbs)
            params["recompute"] = recompute
            config = space.decode(dict(params, sync_every=sync)).config
            if config is None or config in seen:
                continue
            seen.add(config)
            memory = sim.memory_estimate(config)
            calls += 1
            if memory is None or not memory.ok:
                continue
            m = sim.evaluate(config)
            calls += 1
            if m.ok:
                out.append(Candidate(config, m.iteration_time_s, FAMILY))
    return sorted(out, key=lambda c: c.estimate_s)
