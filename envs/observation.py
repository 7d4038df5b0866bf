"""Pieces of the env's observation that need no env: the plan the observation shows (``observed``), the
memory model's predicted headroom (``predicted_headroom``) and the plan's place in the rest of the space
(``space_features``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from autotune.planning.space import SearchSpace
from autotune.planning.vocabulary import Dimension
from autotune.specs import ParallelConfig, PipelineConfig, StageConfig
from envs.layout import HEADROOM_FEATURES, MAX_CLASSES, SPACE_FEATURES


def observed(config: ParallelConfig | None) -> ParallelConfig | None:
    """The plan the observation describes. A roundpipe plan (``autotune.specs.roundpipe``) is shown as a
    pipeline of its forward stages on its pool's GPUs in turn (the fused stage's blocks with the last),
    recompute on (its backward recomputes), so every feature stays defined; its schedule features are 0."""
    if config is None or not config.is_roundpipe:
        return config
    pipes = []
    for p in config.pipelines:
        rp = p.roundpipe
        layers = list(rp.forward_layers)
        layers[-1] += rp.fused_layers
        pipes.append(
            PipelineConfig(
                p.num_microbatches,
                tuple(StageConfig((rp.devices[k % len(rp.devices)],), n, True) for k, n in enumerate(layers)),
            )
        )
    return _view(config, tuple(pipes))


def _view(config: ParallelConfig, pipes: tuple[PipelineConfig, ...]) -> ParallelConfig:
    """``config`` with ``pipes`` in place of its pipelines, keeping its schedule name (not validated:
    a view for the observation only)."""
    view = object.__new__(ParallelConfig)
    for name in ParallelConfig.__dataclass_fields__:
        object.__setattr__(view, name, getattr(config, name))
    object.__setattr__(view, "pipelines", pipes)
    return view


def predicted_headroom(space: SearchSpace, config: ParallelConfig, simulator: Any) -> np.ndarray:
    """``HEADROOM_FEATURES`` of ``config``: by ``simulator``'s memory model (``memory_estimate``,
    ``memory_use``), per node-class slot (``space.node_classes[:MAX_CLASSES]``) the fullest used
    device's peak over its capacity, then the fullest device and the fullest host; each
    min(use, 1.5) / 1.5. Zeros when the model has no answer (an invalid plan)."""
    out = np.zeros(len(HEADROOM_FEATURES), dtype=np.float32)
    try:
        m = simulator.memory_estimate(config)
    except Exception:  # the observation never raises
        m = None
    if m is None:
        return out
    usable = simulator.costs.usable
    used = {d: gib / usable[d] for d, gib in m.peak_memory_GiB.items() if usable.get(d, 0) > 0}
    node_class = {n: k for k, c in enumerate(space.node_classes[:MAX_CLASSES]) for n in c.node_names}
    for d, use in used.items():
        k = node_class.get(space.cluster.node_of(d).name)
        if k is not None:
            out[k] = max(out[k], min(use, 1.5) / 1.5)
    out[MAX_CLASSES] = min(max(used.values(), default=0.0), 1.5) / 1.5
    host = simulator.memory_use(replace(m, peak_memory_GiB={})) if m.host_memory_GiB else 0.0
    out[MAX_CLASSES + 1] = min(host, 1.5) / 1.5
    return out


def space_features(
    space: SearchSpace, config: ParallelConfig | None, params: Mapping[str, Any], dims: Mapping[str, Dimension]
) -> np.ndarray:
    """``SPACE_FEATURES``: the plan's place in the rest of the space, and the cluster's network."""
    f = np.zeros(len(SPACE_FEATURES), dtype=np.float32)
    if config is None:
        return f

    def idx(name: str) -> float:
        d = dims.get(name)
        v = params.get(name)
        return d.choices.index(v) / max(len(d.choices) - 1, 1) if d is not None and v in d.choices else 0.0

    seq = any(getattr(s, "sequence_parallel", False) for p in config.pipelines for s in p.stages) or bool(
        params.get("seq_parallel", False)
    )
    f[0] = float(config.is_roundpipe)
    f[1] = float(seq)
    f[2] = idx("stage_ranks")
    f[3] = idx("expert_parallel")
    f[4] = float(params.get("trains_experts") == "partition")
    f[5] = idx("sync_every")
    f[6] = float(space.model.num_experts > 0)
    if len(space.cluster.nodes) > 1:
        net = min((n.network for n in space.cluster.nodes), key=lambda link: link.bandwidth_GBps)
        f[7] = math.log10(max(net.bandwidth_GBps, 0.01)) / 3.0
        f[8] = math.log10(max(max(n.network.latency_us for n in space.cluster.nodes), 1.0)) / 5.0
    return f
