"""A plan a planner proposes, with its estimated iteration time and the family it comes from."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.specs import ParallelConfig


@dataclass(frozen=True, slots=True)
class Candidate:
    """A plan and its composed iteration time (the planner's estimate, not a simulation)."""

    config: ParallelConfig
    estimate_s: float
    family: str


def distinct(candidates: list[Candidate]) -> list[Candidate]:
    """Distinct plans, best estimate first (a plan found twice: its better estimate)."""
    seen, unique = set(), []
    for c in sorted(candidates, key=lambda c: c.estimate_s):
        if c.config not in seen:
            seen.add(c.config)
            unique.append(c)
    return unique
