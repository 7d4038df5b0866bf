"""Search agents. Each is ``run_<method>(space, evaluator, seed, **options)`` and stops when the
``BudgetedEvaluator`` has spent its budget (or, for the finite ones, when the space is done)."""

from __future__ import annotations

from autotune.search.agents.simple import run_exhaustive, run_random, run_uniform

METHODS = ("rl", "optuna", "random", "uniform", "exhaustive", "dp")

__all__ = ["METHODS", "run_exhaustive", "run_random", "run_uniform"]
