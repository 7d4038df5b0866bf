"""The one evaluator interface: ``evaluate(config) -> Measurement``.

The simulator (``autotune.simulator``) and the real profiled run (``runner``) both implement it;
``CachedEvaluator`` wraps any of them so a repeated plan costs nothing; the env, Optuna and RL
call only this.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

from autotune.specs import ClusterSpec, Measurement, ModelSpec, ParallelConfig

log = logging.getLogger(__name__)


@runtime_checkable
class Evaluator(Protocol):
    """Evaluates plans of one cluster and model. Never raises for a bad plan: returns a Measurement
    whose ``status`` says what went wrong (``invalid``, ``oom``, ``failed``, ``timeout``).

    An evaluator may also offer ``check(config) -> str | None``: why it cannot run a plan at all,
    answered without evaluating (the real runner's unsupported plan shapes); the search then treats
    the plan as invalid and spends no budget on it."""

    cluster: ClusterSpec
    model: ModelSpec

    def evaluate(self, config: ParallelConfig) -> Measurement: ...


class CachedEvaluator:
    """Memoises another evaluator by config (configs are frozen, so hashable)."""

    def __init__(self, inner: Evaluator) -> None:
        self.inner = inner
        self.cluster = inner.cluster
        self.model = inner.model
        self._cache: dict[ParallelConfig, Measurement] = {}
        self.hits = 0

    @property
    def misses(self) -> int:
        return len(self._cache)

    def __contains__(self, config: ParallelConfig) -> bool:
        return config in self._cache

    def evaluate(self, config: ParallelConfig) -> Measurement:
        cached = self._cache.get(config)
        if cached is not None:
            self.hits += 1
            return cached
        result = self.inner.evaluate(config)
        self._cache[config] = result
        return result


#: the evaluators a search can use: the simulator, or short profiled runs on the real devices
BACKENDS = ("sim", "real")


#: ``--backend real``: wall-clock limit of one profiled run (``--run-timeout``); a tiny model on CPU ranks
#: takes 10-60 s here, a GPU run's NCCL start and model build take longer
DEFAULT_RUN_TIMEOUT_S = 300.0


def make_evaluator(
    cluster: ClusterSpec,
    model: ModelSpec,
    backend: str = "sim",
    profile=None,
    run_timeout_s: float = DEFAULT_RUN_TIMEOUT_S,
    engine: str | None = None,
) -> Evaluator:
    """The evaluator of ``backend``: ``sim`` the simulator (with ``profile``, a path or a
    ``CalibrationProfile``; ``engine``: the engine whose plans it predicts, autotune's runner by default),
    ``real`` one short profiled run per plan through the runner, each ended after ``run_timeout_s`` seconds
    (status ``timeout``)."""
    if backend == "sim":
        from pathlib import Path

        from autotune.profile import CalibrationProfile
        from autotune.simulator import Simulator

        if profile is not None and not isinstance(profile, CalibrationProfile):
            profile = CalibrationProfile.load(Path(profile))
        return Simulator(cluster, model, profile=profile, engine=engine)
    if backend == "real":
        from runner import RealEvaluator

        return RealEvaluator(cluster, model, timeout_s=run_timeout_s)
    from autotune.errors import SpecError

    raise SpecError("search", "backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
