"""The plan-editing env's layout (issue 16): the memory-headroom observation and the fixed move list over the
whole space."""

from __future__ import annotations

import numpy as np
import pytest

from autotune.loading import cluster_from_dict, load_model
from autotune.planning.space import SearchSpace
from autotune.simulator import Simulator
from envs.layout import (
    ACTIONS,
    EXTRA_ACTIONS,
    FULL_ACTIONS,
    HEADROOM_FEATURES,
    MAX_CLASSES,
    MIXED_ACTIONS,
    MOE_ACTIONS,
    SPACE_FEATURES,
    V1_OBSERVATIONS,
    ZERO_ACTIONS,
    ZERO_FEATURES,
    observation_features,
)
from envs.parallel_config import ParallelConfigEnv


def _two_class_box():
    """One A100-80GB node of 2 and one V100-32GB node of 2, Llama-2-7B, batch 16."""
    nodes = [{"name": "a100", "gpu": "A100-80GB", "count": 2}, {"name": "v100", "gpu": "V100-32GB", "count": 2}]
    cluster = cluster_from_dict({"nodes": nodes, "network": {"bandwidth_GBps": 12.5, "latency_us": 10}}, "box")
    model = load_model("llama2-7b", 16)
    return SearchSpace(cluster, model), Simulator(cluster, model)


def _plan(space, **over):
    params = dict(space.heuristic_params()[0], **over)
    decoded = space.decode(params)
    assert decoded.ok, decoded
    return params, decoded.config


def _headroom(env) -> np.ndarray:
    names = observation_features()
    i = names.index(HEADROOM_FEATURES[0])
    return env._observation()[i : i + len(HEADROOM_FEATURES)]


def test_the_features_are_named_in_their_groups_and_the_moves_cover_the_space():
    names = observation_features()
    zero = V1_OBSERVATIONS + len(ZERO_FEATURES)
    assert names[V1_OBSERVATIONS:zero] == list(ZERO_FEATURES)
    assert names[zero:] == list(HEADROOM_FEATURES) + list(SPACE_FEATURES)
    assert FULL_ACTIONS[: len(ACTIONS) + len(ZERO_ACTIONS)] == ACTIONS + ZERO_ACTIONS
    # the whole space: ZeRO, offload, sequence parallelism, RoundPipe, MoE / SPES, mixed stages
    dims = {a[1] for a in FULL_ACTIONS if a[0] == "dim"}
    assert {
        "zero",
        "offload",
        "seq_parallel",
        "roundpipe",
        "rp.pool",
        "rp.balance",
        "rp.memory",
        "rp.grain",
        "rp.passes",
        "expert_parallel",
        "trains_experts",
        "sync_every",
        "stage_ranks",
    } <= dims
    assert set(EXTRA_ACTIONS) | set(MOE_ACTIONS) | set(MIXED_ACTIONS) <= set(FULL_ACTIONS)


def test_headroom_is_the_memory_models_peak_over_usable_memory_per_class():
    space, sim = _two_class_box()
    env = ParallelConfigEnv(space, sim)
    env.reset(seed=0)
    classes = [c.name for c in space.node_classes]
    assert len(classes) == 2
    params, cfg = _plan(space, pp=2, recompute="all", mbs=1, zero=0, offload="none")
    env.params, env.config = params, cfg
    m = sim.memory_estimate(cfg)
    by_class = [0.0] * MAX_CLASSES
    for d, gib in m.peak_memory_GiB.items():
        node = space.cluster.node_of(d)
        k = next(i for i, c in enumerate(space.node_classes) if node.name in c.node_names)
        # the memory model's device view (allocator peak, pool, CUDA context) over the capacity: > 1 is oom
        by_class[k] = max(by_class[k], gib / node.device.memory_GiB)
    want = [min(u, 1.5) / 1.5 for u in by_class] + [min(max(by_class), 1.5) / 1.5, 0.0]
    got = _headroom(env)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got[:2].min() > 0 and got[2:MAX_CLASSES].max() == 0  # two classes used, two empty slots
    assert got[MAX_CLASSES] == pytest.approx(min(sim.memory_use(m), 1.5) / 1.5, rel=1e-5)
    # a hand case: the same plan with no recomputation and 8x the micro-batch holds more; one that does not
    # fit reads above 2/3 (use > 1); offloading the optimizer moves state to the host (its own feature)
    params2, cfg2 = _plan(space, pp=2, recompute="none", mbs=8, zero=0, offload="none")
    env.params, env.config = params2, cfg2
    fuller = _headroom(env)
    assert fuller[MAX_CLASSES] > got[MAX_CLASSES]
    if sim.memory_check(cfg2) is not None:
        assert fuller[MAX_CLASSES] > 2 / 3
    params3, cfg3 = _plan(space, pp=2, recompute="all", mbs=1, zero=0, offload="optimizer")
    env.params, env.config = params3, cfg3
    offloaded = _headroom(env)
    assert offloaded[MAX_CLASSES + 1] > 0 and offloaded[MAX_CLASSES] < got[MAX_CLASSES]
    assert env.observation_space.contains(env._observation())


def test_the_moves_reach_roundpipe_and_back():
    space, sim = _two_class_box()
    if "roundpipe" not in {d.name for d in space.dimensions}:
        pytest.skip("no RoundPipe dimensions on this cluster")
    env = ParallelConfigEnv(space, sim, max_steps=8)
    env.reset(seed=0)
    on = FULL_ACTIONS.index(("dim", "roundpipe", +1))
    assert env.action_masks()[on]
    env.step(on)
    if env.config.is_roundpipe:  # it ran: the env stands on the roundpipe plan and its features say so
        obs = env._observation()
        assert obs[observation_features().index("roundpipe")] == 1.0
        assert env.action_masks()[FULL_ACTIONS.index(("dim", "roundpipe", -1))]
