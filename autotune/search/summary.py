"""What a search is summed up by at its end: the top plans, when the best was found, how fast it went,
how many plans did not run, and how it compares with the heterogeneity-blind ``uniform`` baseline.

``speedup_vs_uniform`` is the project's headline: the best plan's tokens/s over the best plan of
``--method uniform`` run with the same budget rule (the same ``--budget`` distinct evaluated plans,
the same seed). With the simulator backend the baseline is computed at the end of the search on the
same evaluator (its evaluations are not the search's and are not logged as children). With
``--backend real`` it would cost real runs, so it is not computed (``None``), unless the search is
itself ``uniform`` (speedup 1 by definition).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.planning.budget import BudgetedEvaluator, Evaluation
from autotune.specs import Measurement

TOP = 5


@dataclass(frozen=True, slots=True)
class SearchSummary:
    evaluations: int  # plans the search holds (a resumed search: before and after the resume)
    new_evaluations: int  # evaluated by this run
    found_at: int  # index (1-based) of the evaluation that found the best plan; 0 if none ran
    oom: int  # evaluated plans out of memory
    failed: int  # evaluated plans that failed or timed out (real runs)
    invalid: int  # proposals that broke a rule of the plan format or the space: free, not evaluated
    wall_time_s: float  # this run
    evaluations_per_s: float  # this run's evaluations / its wall time
    top: tuple[Evaluation, ...]  # best first, at most TOP
    uniform_best_tokens_per_s: float | None = None
    uniform_evaluations: int = 0
    uniform_grid: int = 0  # plans in the uniform grid (the baseline sees min(grid, budget) of them)
    runner_limited: int = 0  # of ``invalid``: plans `autotune train` does not run (``runner.jobs.plan_limits``)
    ended: str = ""  # why the method ended before its budget, where it says

    @property
    def speedup_vs_uniform(self) -> float | None:
        if not self.uniform_best_tokens_per_s or not self.top:
            return None
        return self.top[0].score / self.uniform_best_tokens_per_s

    def metrics(self) -> dict[str, float]:
        """The parent run's summary metrics (MLflow's comparison columns)."""
        out = {
            "found_at": float(self.found_at),
            "oom_plans": float(self.oom),
            "failed_plans": float(self.failed),
            "invalid_proposals": float(self.invalid),
            "runner_limited_proposals": float(self.runner_limited),
            "wall_time_s": self.wall_time_s,
            "evaluations_per_s": self.evaluations_per_s,
        }
        if self.uniform_best_tokens_per_s is not None:
            out["uniform_best_tokens_per_s"] = self.uniform_best_tokens_per_s
        if self.speedup_vs_uniform is not None:
            out["speedup_vs_uniform"] = self.speedup_vs_uniform
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "evaluations": self.evaluations,
            "new_evaluations": self.new_evaluations,
            "found_at": self.found_at,
            "oom": self.oom,
            "failed": self.failed,
            "invalid": self.invalid,
            "runner_limited": self.runner_limited,
            "wall_time_s": self.wall_time_s,
            "evaluations_per_s": self.evaluations_per_s,
            "top": [
                {"index": ev.index, "config": ev.config.to_dict(), "measurement": ev.measurement.to_dict()}
                for ev in self.top
            ],
            "uniform_best_tokens_per_s": self.uniform_best_tokens_per_s,
            "uniform_evaluations": self.uniform_evaluations,
            "uniform_grid": self.uniform_grid,
            **({"ended": self.ended} if self.ended else {}),
            "speedup_vs_uniform": self.speedup_vs_uniform,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SearchSummary:
        from autotune.specs import ParallelConfig

        top = tuple(
            Evaluation(
                int(t["index"]),
                ParallelConfig.from_dict(t["config"], source="summary"),
                Measurement.from_dict(t["measurement"]),
            )
            for t in d.get("top", ())
        )
        return cls(
            evaluations=int(d["evaluations"]),
            new_evaluations=int(d["new_evaluations"]),
            found_at=int(d["found_at"]),
            oom=int(d["oom"]),
            failed=int(d["failed"]),
            invalid=int(d["invalid"]),
            wall_time_s=float(d["wall_time_s"]),
            evaluations_per_s=float(d["evaluations_per_s"]),
            top=top,
            uniform_best_tokens_per_s=d.get("uniform_best_tokens_per_s"),
            uniform_evaluations=int(d.get("uniform_evaluations", 0)),
            uniform_grid=int(d.get("uniform_grid", 0)),
            runner_limited=int(d.get("runner_limited", 0)),
            ended=str(d.get("ended", "")),
        )


def summarize(
    budgeted: BudgetedEvaluator, wall_time_s: float, preloaded: int, uniform: tuple[float, int, int] | None = None
) -> SearchSummary:
    history = budgeted.history
    top = tuple(
        Evaluation(ev.index, ev.config, ev.measurement)
        for ev in sorted((ev for ev in history if ev.measurement.ok), key=lambda ev: -ev.score)[:TOP]
    )
    best = budgeted.best
    new = max(0, len(history) - preloaded)
    ub, un, grid = uniform if uniform is not None else (None, 0, 0)
    return SearchSummary(
        evaluations=len(history),
        new_evaluations=new,
        found_at=best.index if best is not None and best.measurement.ok else 0,
        oom=sum(ev.measurement.oom for ev in history),
        failed=sum(ev.measurement.status in ("failed", "timeout") for ev in history),
        invalid=budgeted.invalid,
        runner_limited=len(budgeted.limited),
        wall_time_s=wall_time_s,
        evaluations_per_s=new / wall_time_s if wall_time_s > 0 else 0.0,
        top=top,
        uniform_best_tokens_per_s=ub,
        uniform_evaluations=un,
        uniform_grid=grid,
        ended=budgeted.ended,
    )


#: the uniform baseline is the best of at most this many plans of the heterogeneity-blind grid, always the same
#: ones (the whole grid when it is smaller): a fixed yardstick, whatever the search's budget and seed
UNIFORM_BASELINE_PLANS = 200


def uniform_baseline(budgeted: BudgetedEvaluator, seed: int = 0) -> tuple[float, int, int]:
    """(best tokens/s, plans evaluated, grid size) of the uniform baseline: the heterogeneity-blind grid
    (``SearchSpace.uniform_plans``), all of it, or a fixed sample of ``UNIFORM_BASELINE_PLANS`` drawn with
    seed 0 (not the search's: the baseline must not move with the search's seed or budget), on the search's
    own evaluator (the simulator), outside its record."""
    import numpy as np

    from autotune.evaluator import CachedEvaluator

    del seed  # the same baseline for every seed
    known = CachedEvaluator(budgeted.inner)
    for ev in budgeted.history:  # plans the search evaluated are known: reuse, do not re-simulate
        known._cache[ev.config] = ev.measurement
    plans = budgeted.space.uniform_plans()
    grid = len(plans)
    chosen = range(grid) if grid <= UNIFORM_BASELINE_PLANS else np.random.default_rng(0).permutation(grid)
    best = 0.0
    for i in list(chosen)[:UNIFORM_BASELINE_PLANS]:
        m = known.evaluate(plans[int(i)])
        if m.ok:
            best = max(best, m.tokens_per_s)
    return best, min(grid, UNIFORM_BASELINE_PLANS), grid
