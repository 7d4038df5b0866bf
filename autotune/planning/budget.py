"""The one budget rule: ``budget`` counts distinct evaluated plans; repeats and invalid plans are free.

``BudgetedEvaluator`` is a ``CachedEvaluator`` that every agent (and the env) calls. It checks the
plan against the search space first, then against the evaluator's own ``check(config)`` where it has
one (the real runner's unsupported plan shapes), then against ``limits(config)`` where given (the
runner's limits on the simulator backend, ``runner.jobs.plan_limits``; an invalid plan is answered
``status="invalid"`` without an evaluation), serves repeats from the cache, refuses a new plan once the
budget is spent (``BudgetExhausted``), keeps the history of evaluations in order and tells listeners (MLflow, the
progress bar) about each new one.

An optional ``screen`` (``--backend real``: ``autotune.search.screen.CalibrationScreen``) is asked
about each new valid plan before the evaluator: when it answers a ``Measurement`` (status
``"pruned"``, the screen's prediction; score 0), that answer is cached and returned instead of an
evaluation. Pruned plans do not spend the budget; they are kept in ``screened``, and after
``max_screened`` of them the search counts as ``exhausted`` so that no agent loops forever.

Memory first (every method, both backends): before anything else, a new valid plan goes to the
evaluator's memory model (``memory_check(config)``: ``Simulator.memory_check`` for ``--backend sim``,
the corrected simulator's for ``--backend real``, see ``autotune.search.screen``). A plan the memory
model alone says does not fit is answered ``oom`` (``oom=True``, status ``"pruned"``, the model's
peak memory per device, the reason in ``error``) without spending the budget, like a pruned plan:
kept in ``screened`` and cached, and counted against the same ``max_screened`` cap (default
``20 x budget``, per run of the search), so a search on a cluster where little fits still ends. The
listeners are not told (MLflow gets their number, ``memory_screened``, not a child run each: there
may be 20 per evaluation); the memory model answers a repeat or a resumed search the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from autotune.evaluator import CachedEvaluator, Evaluator
from autotune.planning.space import SearchSpace
from autotune.specs import Measurement, ParallelConfig

log = logging.getLogger(__name__)


PRUNED = "pruned"  # status of a plan the screen answered without a real run (search-internal, not a measure status)
#: plans screened out (memory model or calibration screen) per unit of budget before a search stops
SCREENED_PER_BUDGET = 20
MEMORY_SCREEN_PREFIX = "screened out by the memory model: "


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
    def __init__(
        self,
        inner: Evaluator,
        space: SearchSpace,
        budget: int,
        listeners: list[Listener] | None = None,
        screen: Screen | None = None,
        max_screened: int | None = None,
        memory_first: bool = True,
        memory_model=None,
        limits: Callable[[ParallelConfig], str | None] | None = None,
    ) -> None:
        super().__init__(inner)
        if budget < 1:
            from autotune.errors import SpecError

            raise SpecError("search", "budget", f"must be >= 1, got {budget}")
        self.space = space
        self.limits = limits  # plans beyond them are invalid proposals: why, or None
        self.limited: list[str] = []  # why each plan beyond ``limits`` was refused, in order
        self.budget = budget
        self.listeners = list(listeners or [])
        self.watchers: list[Listener] = []  # hear of every counted evaluation, preloaded ones too
        self.history: list[Evaluation] = []
        self.invalid = 0
        self.ended = ""  # why the method ended before its budget, where it knows (the space exhausted, ...)
        self._best: Evaluation | None = None
        self.screen = screen
        self.max_screened = max_screened if max_screened is not None else SCREENED_PER_BUDGET * budget
        self.screened: list[Evaluation] = []  # plans the screens pruned, in order (index counts them)
        self.preloaded: set[ParallelConfig] = set()  # plans a killed run of this search evaluated (resume)
        #: the memory model asked before every new plan: ``memory_model`` (a ``Simulator``: real runs without
        #: a screen) or the evaluator's own ``memory_check``, if it has one
        self.memory_model = memory_model if memory_model is not None else inner
        self.memory_check = getattr(self.memory_model, "memory_check", None) if memory_first else None

    # -- counting ----------------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return len(self.history)

    @property
    def remaining(self) -> int:
        return max(0, self.budget - self.used)

    @property
    def exhausted(self) -> bool:
        return self.used >= self.budget or len(self.screened) >= self.max_screened

    @property
    def memory_screened(self) -> int:
        """Plans the memory model answered ``oom`` without spending the budget."""
        return sum(ev.measurement.oom for ev in self.screened)

    def memory_use(self, measurement: Measurement) -> float | None:
        """The fullest device's (or host's) use of its usable memory in ``measurement`` (> 1: does not
        fit), from the evaluator's memory model; None when it has none."""
        inner = self.memory_model
        for _ in range(4):
            fn = getattr(inner, "memory_use", None)
            if fn is not None:
                return fn(measurement)
            inner = getattr(inner, "simulator", None) or getattr(inner, "inner", None)
        return None

    @property
    def best(self) -> Evaluation | None:
        return self._best

    def would_cost(self, config: ParallelConfig) -> bool:
        """True when evaluating ``config`` would spend one unit of budget."""
        return config not in self

    def refusal(self, config: ParallelConfig) -> str | None:
        """Why ``config`` would be refused without an evaluation (its space, the backend, the search's
        limits), or None."""
        return self._refusal(config)[0]

    def _refusal(self, config: ParallelConfig) -> tuple[str | None, bool]:
        """(why, whether ``limits`` said it)."""
        reason = self.space.check(config)
        if reason is None and (backend_check := getattr(self.inner, "check", None)) is not None:
            reason = backend_check(config)  # e.g. a plan shape the real runner cannot run
        if reason is None and self.limits is not None:
            reason = self.limits(config)
            return reason, reason is not None
        return reason, False

    # -- evaluating --------------------------------------------------------------------------------
    def evaluate(
        self,
        config: ParallelConfig,
        params: Mapping[str, Any] | None = None,
        commit: Callable[[Measurement], None] | None = None,
    ) -> Measurement:
        """``commit(measurement)``, when given, is called once a new plan's measurement is known and
        before any listener hears of it (the Optuna agent writes its study there first)."""
        if config in self:
            return super().evaluate(config)
        reason, by_limits = self._refusal(config)
        if by_limits:
            self.limited.append(reason)
        if reason is not None:
            self.invalid += 1
            return Measurement.failure("invalid", reason)
        if self.exhausted:
            raise BudgetExhausted(
                f"budget of {self.budget} evaluations is spent"
                if self.used >= self.budget
                else f"{len(self.screened)} plans screened out (limit {self.max_screened})"
            )
        screened = self.screen_memory(config, params)
        if screened is not None:
            return screened
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

    def screen_memory(self, config: ParallelConfig, params: Mapping[str, Any] | None = None) -> Measurement | None:
        """Memory first: the ``oom`` answer (recorded as screened out, no budget) when the memory model
        says a new, valid ``config`` does not fit; None when it fits, was seen before, or there is no
        memory model. ``evaluate`` asks it first; an agent may ask it before claiming a plan."""
        if self.memory_check is None or config in self:
            return None
        try:
            oom = self.memory_check(config)
        except Exception as e:  # the memory model cannot judge it: evaluate it
            log.warning("memory model raised on %s: %s", config.describe(), e)
            return None
        if oom is None:
            return None
        if self.exhausted:
            raise BudgetExhausted(f"{len(self.screened)} plans screened out (limit {self.max_screened})")
        screened = replace(
            oom, oom=True, timeline=(), status=PRUNED, error=MEMORY_SCREEN_PREFIX + (oom.error or "out of memory")
        )
        self._record(config, screened, params or {}, notify=False)
        return screened

    def preload(
        self, config: ParallelConfig, measurement: Measurement, params: Mapping[str, Any] | None = None
    ) -> None:
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

    def _record(
        self,
        config: ParallelConfig,
        measurement: Measurement,
        params: Mapping[str, Any],
        notify: bool = True,
        commit: Callable[[Measurement], None] | None = None,
    ) -> None:
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
