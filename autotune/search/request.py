"""One search as asked for (``SearchRequest``: ``tune``'s arguments, the files loaded) and what keys it: the
resume key of its MLflow parent, the fingerprint of its Optuna study, the variant in its names."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.planning.space import SearchSpace
from autotune.specs import ClusterSpec, ModelSpec


def study_variant(
    backend: str,
    restrict: Mapping[str, Any] | None,
    start: str,
    profile: str | Path | None,
    global_batch_size: int | None,
    engine: str | None = None,
) -> str:
    """The part of a default Optuna study name that keeps different searches of one cluster and model
    apart (another backend, a restricted space, another start, a profile, another global batch size):
    empty for the default search, so its name stays ``<cluster>__<model>__optuna__seed<N>``."""
    narrowed = sorted(
        (dim, tuple(choices) if isinstance(choices, (list, tuple)) else choices)
        for dim, choices in (restrict or {}).items()
    )
    given = (
        ("backend", backend, "sim"),
        ("restrict", narrowed, []),
        ("start", start, "dp"),
        ("profile", None if profile is None else str(profile), None),
        ("global_batch_size", global_batch_size, None),
        ("engine", engine, None),
    )
    parts = [(key, value) for key, value, default in given if value != default]
    if not parts:
        return ""
    import hashlib

    return "__" + hashlib.sha1(repr(parts).encode()).hexdigest()[:8]


@dataclass(frozen=True)
class SearchRequest:
    """One search, as asked for (``tune``'s arguments, the files loaded): what its pieces share."""

    cluster: ClusterSpec
    model: ModelSpec
    method: str
    budget: int
    backend: str
    seed: int
    global_batch_size: int | None
    tracking_uri: str | None
    experiment: str
    storage: str | None
    profile: str | Path | None
    workers: int
    policy: str | Path | None
    study_name: str | None
    restrict: Mapping[str, Any]
    start: str
    max_sync_every: int
    run_timeout_s: float
    fresh: bool
    engine: str | None = None

    def resume_key(self) -> str:
        """The key a re-run of the same search (any method but optuna) finds its MLflow parent by: what the
        answer depends on, by content (the specs themselves, the profile's and the policy's bytes), so an
        edited file under the same name is another search."""
        from autotune.search import tracking

        return tracking.resume_key(
            self.method,
            self.seed,
            self.backend,
            self.cluster,
            self.model,
            sorted(self.restrict.items()),
            self.start,
            tracking.file_digest(self.policy),
            tracking.file_digest(self.profile),
            self.max_sync_every,
            *((self.engine,) if self.engine else ()),
        )

    def fingerprint(self) -> str:
        """What an Optuna study's answers depend on, by content (its name is made of names): the cluster and
        model specs (batch and sequence length included), backend, restriction, start, engine, MoE sync
        bound and the profile's bytes; a study made for another fingerprint is not resumed."""
        from autotune.search import tracking

        return tracking.resume_key(
            self.cluster,
            self.model,
            self.backend,
            sorted(self.restrict.items()),
            self.start,
            self.engine,
            self.max_sync_every,
            tracking.file_digest(self.profile),
        )

    def variant(self) -> str:
        """What sets this search apart from the default one of its method, budget and seed: its start, its
        restriction, its profile, its global batch (empty for the default search); in its run name and in
        ``autotune compare``."""
        parts = [f"engine {self.engine}"] if self.engine else []
        if self.method in ("optuna", "rl") and self.start != "dp":
            parts.append(f"start {self.start}")
        if self.restrict:
            parts.append(" ".join(f"{k}={','.join(map(str, v))}" for k, v in sorted(self.restrict.items())))
        if self.profile is not None:
            parts.append(f"profile {Path(str(self.profile)).name}")
        if self.global_batch_size is not None:
            parts.append(f"gbs {self.global_batch_size}")
        return "; ".join(parts)

    def run_params(self, space: SearchSpace) -> dict[str, Any]:
        """The parent run's MLflow parameters."""
        out = {
            "cluster": self.cluster.name,
            "model": self.model.name,
            "method": self.method,
            "budget": self.budget,
            "seed": self.seed,
            "backend": self.backend,
            "global_batch_size": self.model.global_batch_size,
            "num_devices": self.cluster.num_devices,
            "space_size": space.size,
            "workers": self.workers,
            "start": self.start if self.method in ("optuna", "rl") else "",
            "variant": self.variant()[:500],
        }
        if self.model.is_moe:
            out["max_sync_every"] = self.max_sync_every
        return out
