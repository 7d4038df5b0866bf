"""The three agents without a model: random sampling, the uniform baseline grid, exhaustive search."""

from __future__ import annotations

import logging

import numpy as np

from autotune.planning.budget import BudgetedEvaluator
from autotune.planning.space import EXHAUSTIVE_LIMIT, SearchSpace

log = logging.getLogger(__name__)


def run_random(space: SearchSpace, evaluator: BudgetedEvaluator, seed: int = 0, max_tries_per_eval: int = 200) -> None:
    """Uniform samples of the encoding; invalid and repeated plans are redrawn and plans the memory
    model screens out are free (they cost nothing). Memory first: while no evaluated plan runs, the
    last evaluation the search can still make (the budget's last, or the last before the screened-out
    cap) goes to the space's most memory-frugal plan (``autotune.planning.memory_first``), so random
    search returns a plan that fits wherever that plan does.

    A resumed search replays the same draws: a plan its killed run evaluated (``evaluator.preloaded``)
    is answered from the record, free, and is not a miss, so the search goes on exactly where it stopped."""
    from autotune.planning.memory_first import fallback_due, frugal_start

    rng = np.random.default_rng(seed)
    fallback_done = False

    def fallback() -> None:
        nonlocal fallback_done
        fallback_done = True
        frugal = frugal_start(space, evaluator)
        decoded = space.decode(frugal) if frugal is not None else None
        if decoded is not None and decoded.ok and evaluator.would_cost(decoded.config):
            evaluator.evaluate(decoded.config, frugal)

    if _covers_the_space(space, evaluator):
        plans = space.enumerate()
        for i in rng.permutation(len(plans)):  # every valid plan, in a seeded random order: random can do no more
            params, config = plans[int(i)]
            if evaluator.exhausted:
                return
            if evaluator.would_cost(config):
                evaluator.evaluate(config, params)
        evaluator.ended = (
            f"the space is exhausted: every one of its {len(plans):,} valid plans ({space.size:,} combinations) "
            "was evaluated or screened out by the memory model"
        )
        log.info("random: %s", evaluator.ended)
        return
    misses = 0
    replay = set(evaluator.preloaded)
    while not evaluator.exhausted and misses < max_tries_per_eval:
        if not fallback_done and fallback_due(evaluator):
            fallback()
            continue
        params = space.sample(rng)
        decoded = space.decode(params)
        if not decoded.ok or not evaluator.would_cost(decoded.config):
            if decoded.ok and decoded.config in replay:
                replay.discard(decoded.config)
                misses = 0
            else:
                misses += 1
                evaluator.invalid += not decoded.ok  # a proposal that breaks a rule (summary count)
            continue
        misses = 0
        evaluator.evaluate(decoded.config, params)
    if not evaluator.exhausted:
        if not fallback_done and not (evaluator.best is not None and evaluator.best.measurement.ok):
            fallback()
        evaluator.ended = f"no new valid plan in {max_tries_per_eval} draws in a row: the reachable space is exhausted"
        log.info("random: %s; stopping at %d evaluations", evaluator.ended, evaluator.used)


def _covers_the_space(space: SearchSpace, evaluator: BudgetedEvaluator) -> bool:
    """Whether the budget left can evaluate every valid plan of the space (an enumerable one): sampling would
    then spend ever longer finding the last unseen plans, and cannot end before it has."""
    return space.size <= EXHAUSTIVE_LIMIT and evaluator.remaining >= space.size


def run_uniform(space: SearchSpace, evaluator: BudgetedEvaluator, seed: int = 0) -> None:
    """The heterogeneity-blind grid (``SearchSpace.uniform_plans``), in a seeded random order when the
    budget does not cover it all."""
    plans = space.uniform_plans()
    order = (
        np.random.default_rng(seed).permutation(len(plans)) if len(plans) > evaluator.remaining else range(len(plans))
    )
    for i in order:
        if evaluator.exhausted:
            log.info("uniform: budget spent after %d of %d grid plans", evaluator.used, len(plans))
            break
        evaluator.evaluate(plans[int(i)], {"uniform_index": int(i)})
    if not evaluator.exhausted:
        evaluator.ended = f"every one of the uniform grid's {len(plans)} plans was evaluated"


def run_exhaustive(
    space: SearchSpace, evaluator: BudgetedEvaluator, seed: int = 0, limit: int = EXHAUSTIVE_LIMIT
) -> None:
    """Every distinct valid plan of the space (refuses spaces above ``limit`` raw combinations)."""
    del seed
    plans = space.enumerate(limit)
    if len(plans) > evaluator.remaining:
        log.warning(
            "exhaustive: the space has %d distinct plans, the budget covers %d; the rest is not evaluated",
            len(plans),
            evaluator.remaining,
        )
    for params, config in plans:
        if evaluator.exhausted:
            break
        evaluator.evaluate(config, params)
    if not evaluator.exhausted:
        evaluator.ended = f"every one of the space's {len(plans)} valid plans was evaluated"
