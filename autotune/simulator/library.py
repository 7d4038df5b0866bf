"""The library call behind ``autotune simulate``: ``simulate(cluster, model, config)``, with a simulator kept
per (cluster, model, profile) so that a caller looping over plans reuses its caches."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autotune.errors import SpecError
from autotune.loading import load_cluster, load_config, load_model
from autotune.profile import CalibrationProfile
from autotune.simulator.engine_terms import DEFAULT_ENGINE, ENGINE_TERMS
from autotune.simulator.simulator import Simulator
from autotune.specs import ClusterSpec, Measurement, ModelSpec, ParallelConfig

_SIMULATORS: dict[tuple, Simulator] = {}


def _library_simulator(
    cluster: ClusterSpec,
    model: ModelSpec,
    profile: CalibrationProfile | str | Path | None,
    engine: str = DEFAULT_ENGINE,
) -> Simulator:
    """One ``Simulator`` per (cluster, model, profile) for ``simulate``: a caller looping over plans
    gets the simulator's caches instead of a cold simulator per call (a few kept, oldest dropped).
    A profile path is keyed by its modification time and size, so an edited profile is re-read."""

    if profile is None:
        pkey: tuple = ()
    elif isinstance(profile, CalibrationProfile):
        pkey = ("object", id(profile))
    else:
        st = os.stat(profile) if os.path.exists(profile) else None
        pkey = ("path", os.path.abspath(profile), st.st_mtime_ns if st else 0, st.st_size if st else 0)
    key = (cluster, model, pkey, engine)
    sim = _SIMULATORS.get(key)
    if sim is None:
        prof = (
            profile
            if profile is None or isinstance(profile, CalibrationProfile)
            else CalibrationProfile.load(Path(profile))
        )
        sim = Simulator(cluster, model, prof, engine=engine)
        if len(_SIMULATORS) >= 8:
            _SIMULATORS.pop(next(iter(_SIMULATORS)))
        _SIMULATORS[key] = sim
    return sim


def simulate(
    cluster: ClusterSpec | str | Path,
    model: ModelSpec | str | Path,
    config: ParallelConfig | Mapping[str, Any] | str | Path,
    profile: CalibrationProfile | str | Path | None = None,
    global_batch_size: int | None = None,
    timeline: bool = False,
    engine: str = DEFAULT_ENGINE,
) -> Measurement:
    """Simulate one plan (SPEC.md "Library"): the same numbers as ``autotune simulate``.

    ``cluster``, ``model`` and ``config`` are paths, preset names or spec objects; ``profile`` a path or a
    ``CalibrationProfile``. Unlike ``Simulator.evaluate``, bad input raises ``SpecError`` naming the
    file, field and rule. ``engine``: the engine that runs the plan where engines hold different memory
    (``autotune.simulator.engine_terms``): ``"autotune"`` (the runner, default),
    ``"torchtitan"``, ``"megatron"``, ``"deepspeed"``, or ``"megatron-legacy"`` (Megatron-LM before
    Megatron-Core, as its published runs of 2020-2022 ran).
    """
    if engine not in ENGINE_TERMS:
        from autotune.errors import shown

        raise SpecError("engine", "", f"must be one of {', '.join(ENGINE_TERMS)}, got {shown(engine)}")
    cluster_spec = load_cluster(cluster)
    model_spec = load_model(model, global_batch_size)
    cfg = load_config(config)
    cfg.validate(cluster_spec, model_spec, source=str(config) if isinstance(config, (str, Path)) else "config")
    sim = _library_simulator(cluster_spec, model_spec, profile, engine)
    result = sim.evaluate_detailed(cfg) if timeline else sim.evaluate(cfg)
    if result.status == "invalid":
        raise SpecError("", "", result.error)
    return result
