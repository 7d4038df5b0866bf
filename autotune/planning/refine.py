"""The planner's steps after its composition (issue 25): the families decoded around its best plans, then
the simulator's correction of the best plans' layer split.

``refine(space, sim, candidates)`` takes the composed plans and their memory-state variants and adds

- the families that decode plans of the shared space around the best of them (``FAMILIES``): Zorse's stages
  of several ranks of different types (``mixed_stages``), SPES's expert subsets, expert parallelism and
  sync period (``moe_plans``) and RoundPipe's settings around its own pick (``roundpipe_plans``), each with
  the memory-state variants of its fastest few (``state_variants``; none for RoundPipe);
- the best ``REBALANCED`` plans of all at their fastest other micro-batch size (``micro_batches``), then the
  best of all with their layer split moved towards the simulated bottleneck (``rebalance``; fewer plans and
  steps on large clusters, where one simulation costs more).
"""

from __future__ import annotations

from autotune.planning import micro_batches, mixed_stages, moe_plans, roundpipe_plans, state_variants
from autotune.planning.candidate import Candidate, distinct
from autotune.planning.rebalance import rebalance
from autotune.planning.space import SearchSpace

FAMILIES = (mixed_stages, moe_plans, roundpipe_plans)
#: the best plans whose layer split the simulator corrects and its steps per plan, at most; the simulations
#: of it all at most ``SIMULATION_DEVICES / GPUs`` (a 1,024-GPU plan takes ~0.5 s to simulate: 2 plans, 2 steps)
REBALANCED = 6
MAX_STEPS = 12
SIMULATION_DEVICES = 6144


def refine(space: SearchSpace, sim, candidates: list[Candidate]) -> list[Candidate]:
    """``candidates`` and the plans the module docstring lists, distinct, best estimate first; ``sim`` (a
    ``Simulator``) checks memory and times every new plan."""
    unique = distinct(candidates)
    n = space.cluster.num_devices
    out = list(unique)
    for family in FAMILIES:
        calls = family.simulations(n)
        found = family.candidates(space, sim, unique, calls)
        if family.VARIED:
            found += state_variants.variants(space, sim, found[: family.VARIED], calls // 2)
        out += found
    total = min(REBALANCED * (MAX_STEPS + 1), SIMULATION_DEVICES // n)
    plans = min(REBALANCED, total // 3)  # each: its own simulation and two steps at least
    if plans:
        for c in distinct(out)[:plans]:
            out += micro_batches.variants(space, sim, c, total // plans)
        out += [rebalance(space, sim, c, total // plans - 1) for c in distinct(out)[:plans]]
    return distinct(out)
