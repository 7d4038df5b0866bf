"""``autotune/ParallelConfig-v0``'s fixed layout: the observation's features and the move list.

The features and moves were appended in groups over time (the first list, then ZeRO's, then the rest); the
groups stay in that order. ``envs.parallel_config`` documents what each feature and move means.
"""

from __future__ import annotations

from autotune.planning import mixed_space, roundpipe_space
from autotune.planning.space import SearchSpace
from autotune.specs import SCHEDULES

MAX_STAGES = 16
MAX_REPLICAS = 8
MAX_CLASSES = 4
FAIL_PENALTY = -0.5
INVALID_PENALTY = -0.1
STRUCT_DIMS = ("pp", "assign", "order", "layer_split", "batch_split", "recompute")

STAGE_FEATURES = (
    "present",
    "layers_share",
    "time_share",
    "time_vs_bottleneck",
    "memory_used",
    "relative_speed",
    "tp_log2",
    "recompute",
    "link_to_next_log_bw",
    "device_memory",
)
REPLICA_FEATURES = ("present", "microbatch_share", "relative_speed", "load_vs_max", "stages")
CLASS_FEATURES = ("present", "used", "tp_log2", "relative_speed", "device_memory")
GLOBAL_FEATURES = (
    "mbs_index",
    "sched_1f1b",
    "sched_gpipe",
    "sched_interleaved",
    "pp",
    "dp_log2",
    "idle_fraction",
    "bubble_fraction",
    "mfu",
    "last_failed",
    "gain_vs_start",
    "gain_vs_best",
    "steps_left",
    "max_memory_used",
    "layer_split",
    "batch_split",
    "assign_mixed",
    "order_slow_first",
    "recompute_none",
    "recompute_all",
    "head_extra",
    "interleaved_ok",
)
#: appended after the first features (ZeRO sharding and CPU offload)
ZERO_FEATURES = ("zero", "offload_optimizer", "offload_all", "host_memory_used")
#: appended after those (issue 16): the memory model's predicted headroom of the
#: current plan (``Simulator.memory_estimate``: no schedule simulation, so it is defined for a plan whatever
#: the backend measured), per node-class slot the fullest used device's predicted peak (the device view:
#: allocator peak, pool, CUDA context) over its capacity, then the fullest device of the plan and the
#: fullest host (offloaded state over host memory); each min(use, 1.5) / 1.5, so 2/3 is "exactly full"
HEADROOM_FEATURES = tuple(f"class{c}.predicted_memory" for c in range(MAX_CLASSES)) + (
    "predicted_memory_worst",
    "predicted_host_worst",
)
#: and the rest of the space the plan sits in: a roundpipe plan, sequence parallelism,
#: mixed-stage width (``stage_ranks`` index), MoE choices (expert parallel index, expert subsets, sync
#: period index; 0 for a dense model), an MoE model, the cluster's slowest inter-node link (log10 of its
#: bandwidth in GB/s over 3, log10 of its latency in us over 5; 0 on one node)
SPACE_FEATURES = (
    "roundpipe",
    "seq_parallel",
    "stage_ranks",
    "expert_parallel",
    "trains_experts_partition",
    "sync_every",
    "moe_model",
    "network_log_bw",
    "network_log_latency",
)


def _build_actions() -> list[tuple]:
    acts: list[tuple] = [("noop",)]
    for k in range(MAX_STAGES - 1):
        acts += [("layer", k, +1), ("layer", k, -1)]
    acts += [("recompute", k) for k in range(MAX_STAGES)]
    for r in range(MAX_REPLICAS):
        acts += [("batch", r, -1), ("batch", r, +1)]
    acts += [("mbs", +1), ("mbs", -1)]
    acts += [("schedule", s) for s in SCHEDULES]
    for d in STRUCT_DIMS:
        acts += [("dim", d, +1), ("dim", d, -1)]
    for c in range(MAX_CLASSES):
        acts += [("tp", c, +1), ("tp", c, -1), ("use", c)]
    return acts


ACTIONS: tuple[tuple, ...] = tuple(_build_actions())
#: moves appended after ``ACTIONS`` when the space is an MoE model's (its MoE dimensions, one step each way);
#: a dense model's env has none of them
MOE_ACTIONS: tuple[tuple, ...] = tuple(
    ("dim", d, step) for d in ("expert_parallel", "trains_experts", "sync_every") for step in (+1, -1)
)


#: moves appended after ``ACTIONS`` when the space has the ZeRO / offload dimensions (every space built
#: by ``SearchSpace``), before any MoE moves
ZERO_ACTIONS: tuple[tuple, ...] = tuple(("dim", d, step) for d in ("zero", "offload") for step in (+1, -1))
V1_OBSERVATIONS = (
    MAX_STAGES * len(STAGE_FEATURES)
    + MAX_REPLICAS * len(REPLICA_FEATURES)
    + MAX_CLASSES * len(CLASS_FEATURES)
    + len(GLOBAL_FEATURES)
)
#: moves appended last when the space has mixed-stage dimensions (Zorse: ``autotune.planning.mixed_space``)
MIXED_ACTIONS: tuple[tuple, ...] = tuple(("dim", d, step) for d in mixed_space.DIMENSIONS for step in (+1, -1)) + tuple(
    ("share", k, step) for k in range(MAX_STAGES) for step in (+1, -1)
)
#: sequence parallelism and RoundPipe's dimensions (``autotune.planning.roundpipe_space``: the switch, pool,
#: balance, memory limit, recompute grain, passes), one step each way (re-decode)
EXTRA_ACTIONS: tuple[tuple, ...] = tuple(
    ("dim", d, step) for d in ("seq_parallel",) + roundpipe_space.DIMENSION_NAMES for step in (+1, -1)
)
#: the env's default move list, the same on every cluster and model: a move whose dimension the space lacks
#: is masked
FULL_ACTIONS: tuple[tuple, ...] = ACTIONS + ZERO_ACTIONS + EXTRA_ACTIONS + MOE_ACTIONS + MIXED_ACTIONS
FULL_OBSERVATIONS = V1_OBSERVATIONS + len(ZERO_FEATURES) + len(HEADROOM_FEATURES) + len(SPACE_FEATURES)


def actions_for(space: SearchSpace, mixed: bool = False) -> tuple[tuple, ...]:
    """The env's move list for ``space``: ``ACTIONS``, plus ``ZERO_ACTIONS`` and ``MOE_ACTIONS`` for the
    dimensions it has, plus with ``mixed`` ``MIXED_ACTIONS`` when it has mixed-stage dimensions and the
    ``EXTRA_ACTIONS`` (sequence parallelism, RoundPipe) of the dimensions it has (the from-scratch RL
    search turns them on)."""
    names = {d.name for d in space.dimensions}
    extra = tuple(a for a in EXTRA_ACTIONS if a[1] in names) if mixed else ()
    mixed = MIXED_ACTIONS if mixed and "stage_ranks" in names else ()
    return (
        ACTIONS
        + tuple(a for a in ZERO_ACTIONS if a[1] in names)
        + tuple(a for a in MOE_ACTIONS if a[1] in names)
        + mixed
        + extra
    )


def action_name(a: int, actions: tuple[tuple, ...] = ACTIONS) -> str:
    act = actions[a]
    return " ".join(str(x) for x in act)


def observation_features() -> list[str]:
    """Every feature of the observation, in order."""
    names = [f"stage{i}.{f}" for i in range(MAX_STAGES) for f in STAGE_FEATURES]
    names += [f"replica{r}.{f}" for r in range(MAX_REPLICAS) for f in REPLICA_FEATURES]
    names += [f"class{c}.{f}" for c in range(MAX_CLASSES) for f in CLASS_FEATURES]
    return names + list(GLOBAL_FEATURES) + list(ZERO_FEATURES) + list(HEADROOM_FEATURES) + list(SPACE_FEATURES)
