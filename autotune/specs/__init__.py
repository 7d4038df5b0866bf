"""Typed, frozen domain values: devices, links, clusters, models, plans, measurements.

Files are converted into these objects once, where they are loaded (``autotune.loading``); everything
else passes the objects. Each value validates itself in ``__post_init__`` and raises ``SpecError``
naming the field and the numbers. ``ParallelConfig.validate(cluster, model)`` checks the rules that
need the cluster and the model (docs/formats.md, "Parallel config").

One module per concept, each importable on its own; ``from autotune.specs import X`` finds them all:

- ``limits``: the bounds of every numeric field and the plan vocabulary (schedules, ZeRO stages, modes);
- ``cluster``: devices, links, host memory, nodes, the cluster;
- ``model``: the decoder (dense or MoE);
- ``plan``: stages, pipelines, the plan and its rules;
- ``mixed_stage`` and ``roundpipe``: the plan parts of Zorse's mixed stages and RoundPipe's pools;
- ``measurement``: what an evaluation returns.
"""

from autotune.specs.cluster import (
    HOST_LINK_LATENCY_US,
    HOST_MEMORY_PER_DEVICE_MEMORY,
    PCIE_EFFICIENCY,
    PCIE_GB_PER_LANE,
    ClusterSpec,
    DeviceSpec,
    HOST_MEMORY_MIN_GiB,
    HostSpec,
    LinkSpec,
    NodeSpec,
    default_host,
    default_host_link,
)
from autotune.specs.limits import (
    ALL_SCHEDULES,
    ATTENTION_KINDS,
    DEFAULT_FP32_RATIO,
    DEFAULT_LIMIT,
    DEFAULT_TF32_RATIO,
    LIMITS,
    MAX_DEVICES,
    MLP_KINDS,
    OFFLOAD_MODES,
    PRECISIONS,
    RECOMPUTE_MODES,
    ROUNDPIPE,
    SCHEDULES,
    ZERO_STAGES,
    limit_of,
    positive,
)
from autotune.specs.measurement import MEASUREMENT_STATUSES, Measurement, TimelineEvent
from autotune.specs.mixed_stage import RankConfig
from autotune.specs.model import ModelSpec
from autotune.specs.plan import ParallelConfig, PipelineConfig, StageConfig, iter_stages
from autotune.specs.roundpipe import RoundPipeStages

__all__ = [
    "ALL_SCHEDULES",
    "ATTENTION_KINDS",
    "DEFAULT_FP32_RATIO",
    "DEFAULT_LIMIT",
    "DEFAULT_TF32_RATIO",
    "HOST_LINK_LATENCY_US",
    "HOST_MEMORY_MIN_GiB",
    "HOST_MEMORY_PER_DEVICE_MEMORY",
    "LIMITS",
    "MAX_DEVICES",
    "MEASUREMENT_STATUSES",
    "MLP_KINDS",
    "OFFLOAD_MODES",
    "PCIE_EFFICIENCY",
    "PCIE_GB_PER_LANE",
    "PRECISIONS",
    "RECOMPUTE_MODES",
    "ROUNDPIPE",
    "SCHEDULES",
    "ZERO_STAGES",
    "ClusterSpec",
    "DeviceSpec",
    "HostSpec",
    "LinkSpec",
    "Measurement",
    "ModelSpec",
    "NodeSpec",
    "ParallelConfig",
    "PipelineConfig",
    "RankConfig",
    "RoundPipeStages",
    "StageConfig",
    "TimelineEvent",
    "default_host",
    "default_host_link",
    "iter_stages",
    "limit_of",
    "positive",
]
