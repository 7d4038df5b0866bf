"""The one budget rule: ``budget`` counts distinct evaluated plans; repeats and invalid plans are free.

``BudgetedEvaluator`` is a ``CachedEvaluator`` that every agent (and the env) calls. It checks the
plan against the search space first, then against the evaluator's own ``check(config)`` where it has
one (the real runner's unsupported plan shapes; an invalid plan is answered ``status="invalid"`` without
an evaluation), serves repeats from the cache, refuses a new plan once the budget is spent
(``BudgetExhausted``), keeps the history of evaluations in order and tells listeners (MLflow, the
progress bar) about each new one.

An optional ``screen`` (``--backend real``: ``autotune.search.screen.CalibrationScreen``) is asked
about each new valid plan before the evaluator: when it answers a ``Measurement`` (status
``"pruned"``, the screen's prediction; score 0), that answer is cached and returned instead of an
evaluation. Pruned plans do not spend the budget; they are kept in ``screened``, and after
``max_screened`` of them the search counts as ``exhausted`` so that no agent loops forever.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from autotune.evaluator import CachedEvaluator, Evaluator
from autotune.search.space import SearchSpace
from autotune.specs import Measurement, ParallelConfig

log = logging.getLogger(__name__)


PRUNED = "pruned"  # status of a plan the screen answered without a real run (search-internal, not a measure status)


class BudgetExhausted(RuntimeError):
    """Raised when an agent asks for a new plan after ``budget`` plans were evaluated."""


@dataclass(frozen=True, slots=True)
class Evaluation:
    """One distinct evaluated plan. ``index`` counts from 1 in evaluation order."""

    index: int
    config: ParallelConfig
    measurement: Measurement
    params: Mapping[str, Any] = field(default_factory=dict)  # the encoding that produced it, if any

    @property
    def score(self) -> float:
        return self.measurement.score()


Listener = Callable[[Evaluation], None]
Screen = Callable[[ParallelConfig, "Evaluation | None"], "Measurement | None"]


class BudgetedEvaluator(CachedEvaluator):
    def __init__(self, inner: Evaluator, space: SearchSpace, budget: int,
                 listeners: list[Listener] | None = None, screen: Screen | None = None,
                 max_screened: int | None = None) -> None:
        super().__init__(inner)
        if budget < 1:
            from autotune.errors import SpecError

            raise SpecError("search", "budget", f"must be >= 1, got {budget}")
        self.space = space
        self.budget = budget
        self.listeners = list(listeners or [])
        self.watchers: list[Listener] = []  # hear of every counted evaluation, preloaded ones too
        self.history: list[Evaluation] = []
        self.invalid = 0
        self._best: Evaluation | None = None
        self.screen = screen
        self.max_screened = max_screened if max_screened is not None else 20 * budget
        self.screened: list[Evaluation] = []  # plans the screen pruned, in order (index counts them)
        self.preloaded: set[ParallelConfig] = set()  # plans a killed run of this search evaluated (resume)

    # -- counting ----------------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return len(self.history)

    @property
    def remaining(self) -> int:
        return max(0, self.budget - self.used)

    @property
    def exhausted(self) -> bool:
        return self.used >= self.budget or (self.screen is not None and len(self.screened) >= self.max_screened)

    @property
    def best(self) -> Evaluation | None:
        return self._best

    def would_cost(self, config: ParallelConfig) -> bool:
        """True when evaluating ``config`` would spend one unit of budget."""
        return config not in self

    # -- evaluating --------------------------------------------------------------------------------
    def evaluate(self, config: ParallelConfig, params: Mapping[str, Any] | None = None,
                 commit: Callable[[Measurement], None] | None = None) -> Measurement:
        """``commit(measurement)``, when given, is called once a new plan's measurement is known and
        before any listener hears of it (the Optuna agent writes its study there first)."""
        if config in self:
            return super().evaluate(config)
        reason = self.space.check(config)
        if reason is None and (backend_check := getattr(self.inner, "check", None)) is not None:
            reason = backend_check(config)  # e.g. a plan shape the real runner cannot run
        if reason is not None:
            self.invalid += 1
            return Measurement.failure("invalid", reason)
        if self.exhausted:
            raise BudgetExhausted(f"budget of {self.budget} evaluations is spent" if self.used >= self.budget else
                                  f"{len(self.screened)} plans screened out (limit {self.max_screened})")
        if self.screen is not None:
            pruned = self.screen(config, self._best)
            if pruned is not None:
                self._record(config, pruned, params or {}, commit=commit)
                return pruned
        try:
            measurement = self.inner.evaluate(config)
        except Exception as e:  # an evaluator should not raise; a search must not die of it
            log.warning("evaluator raised on %s: %s", config.describe(), e)
            measurement = Measurement.failure("failed", f"{type(e).__name__}: {e}")
        self._record(config, measurement, params or {}, commit=commit)
        return measurement

    def preload(self, config: ParallelConfig, measurement: Measurement,
                params: Mapping[str, Any] | None = None) -> None:
        """Count an evaluation done earlier (a resumed search) or by another search on the same
        study without telling the listeners (the record has it); the watchers hear of it."""
        if config in self:
            return
        self.preloaded.add(config)
        self._record(config, measurement, params or {}, notify=False)

    def record(self, config: ParallelConfig, measurement: Measurement, params: Mapping[str, Any] | None = None) -> None:
        """Count an evaluation another process made (``--workers``) and tell the listeners."""
        if config not in self:
            self._record(config, measurement, params or {})

    def _record(self, config: ParallelConfig, measurement: Measurement, params: Mapping[str, Any],
                notify: bool = True, commit: Callable[[Measurement], None] | None = None) -> None:
        self._cache[config] = measurement
        if commit is not None:
            commit(measurement)
        if measurement.status == PRUNED:  # screened out: no budget, not in the history or the best
            ev = Evaluation(len(self.screened) + 1, config, measurement, dict(params))
            self.screened.append(ev)
            if notify:
                for listener in self.listeners:
                    listener(ev)
            for watcher in self.watchers:
                watcher(ev)
            return
        ev = Evaluation(len(self.history) + 1, config, measurement, dict(params))
        self.history.append(ev)
        if self._best is None or ev.score > self._best.score:
            self._best = ev
        if notify:
            for listener in self.listeners:
                listener(ev)
        for watcher in self.watchers:
            watcher(ev)

    def best_curve(self) -> list[float]:
        """Best tokens/s after each evaluation (the search-progress curve)."""
        out, best = [], 0.0
        for ev in self.history:
            best = max(best, ev.score)
            out.append(best)
        return out
