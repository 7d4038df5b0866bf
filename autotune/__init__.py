"""autotune: find and run the fastest training plan for an LLM on a heterogeneous GPU cluster.

Library entry points (SPEC.md "Library") are imported lazily so ``import autotune`` stays cheap:
``tune``, ``best_config``, ``simulate``, and the spec types.
"""

from __future__ import annotations

from autotune.errors import SpecError
from autotune.loading import load_cluster, load_config, load_model
from autotune.specs import (
    ClusterSpec,
    DeviceSpec,
    LinkSpec,
    Measurement,
    ModelSpec,
    NodeSpec,
    ParallelConfig,
    PipelineConfig,
    StageConfig,
)

__all__ = [
    "SpecError",
    "load_cluster",
    "load_config",
    "load_model",
    "ClusterSpec",
    "DeviceSpec",
    "LinkSpec",
    "Measurement",
    "ModelSpec",
    "NodeSpec",
    "ParallelConfig",
    "PipelineConfig",
    "StageConfig",
    "tune",
    "best_config",
    "simulate",
    "TuneResult",
]

_LAZY = {
    "simulate": "autotune.simulator",
    "tune": "autotune.search.api",
    "best_config": "autotune.search.api",
    "TuneResult": "autotune.search.result",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")
