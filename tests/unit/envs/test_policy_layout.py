"""Layout "full" of the RL env (issue 16): the memory-headroom observation, the fixed move list over the
whole space, and policy files of each layout (versioned; old ones load as a prefix, unknown ones are one
line)."""

from __future__ import annotations

import numpy as np
import pytest

from autotune.errors import SpecError
from autotune.loading import cluster_from_dict, load_model
from autotune.planning.space import SearchSpace
from autotune.policy import policy_file
from autotune.simulator import Simulator
from envs.layout import (
    ACTIONS,
    EXTRA_ACTIONS,
    FULL_ACTIONS,
    HEADROOM_FEATURES,
    LAYOUTS,
    MAX_CLASSES,
    MIXED_ACTIONS,
    MOE_ACTIONS,
    SPACE_FEATURES,
    ZERO_ACTIONS,
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


def test_layouts_are_prefixes_and_the_features_are_named():
    names = observation_features()
    v1, zero, full = LAYOUTS["v1"], LAYOUTS["zero"], LAYOUTS["full"]
    assert v1[0] < zero[0] < full[0] == len(names) and v1[1] < zero[1] < full[1] == len(FULL_ACTIONS)
    assert names[zero[0] :] == list(HEADROOM_FEATURES) + list(SPACE_FEATURES)
    assert FULL_ACTIONS[: v1[1]] == ACTIONS and FULL_ACTIONS[: zero[1]] == ACTIONS + ZERO_ACTIONS
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


def test_full_layout_moves_reach_roundpipe_and_back():
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


def _write_policy(path, obs_dim, n_actions, **meta_over):
    """A small random MaskablePPO-shaped policy file of the given sizes."""
    rng = np.random.default_rng(0)
    w = 8
    tensors = {
        "mlp_extractor.policy_net.0.weight": rng.normal(size=(w, obs_dim)),
        "mlp_extractor.policy_net.0.bias": np.zeros(w),
        "mlp_extractor.value_net.0.weight": rng.normal(size=(w, obs_dim)),
        "mlp_extractor.value_net.0.bias": np.zeros(w),
        "action_net.weight": rng.normal(size=(n_actions, w)),
        "action_net.bias": rng.normal(size=n_actions),
        "value_net.weight": rng.normal(size=(1, w)),
        "value_net.bias": np.zeros(1),
    }
    meta = {
        "format": policy_file.FORMAT,
        "version": 1,
        "algorithm": "MaskablePPO",
        "obs_dim": obs_dim,
        "n_actions": n_actions,
        "net_arch": [w],
        "activation": "tanh",
        "hyperparameters": {},
    }
    meta.update(meta_over)
    policy_file.write(path, tensors, meta)
    return tensors


def test_a_full_layout_policy_round_trips_with_its_version_and_layout(tmp_path):
    from sb3_contrib import MaskablePPO

    from autotune.loading import load_cluster

    cluster, model = load_cluster("cpu-2"), load_model("tiny")
    env = ParallelConfigEnv(SearchSpace(cluster, model), Simulator(cluster, model), max_steps=4)
    ppo = MaskablePPO("MlpPolicy", env, n_steps=8, batch_size=8, seed=0, device="cpu", policy_kwargs={"net_arch": [8]})
    path = tmp_path / "full.safetensors"
    policy_file.save(ppo, path)
    tensors, meta = policy_file.read(path)
    assert meta["version"] == policy_file.VERSION == 2 and meta["layout"] == "full"
    assert (meta["obs_dim"], meta["n_actions"]) == LAYOUTS["full"]
    net = policy_file.load_policy_network(path)
    obs, _ = env.reset(seed=0)
    mask = env.action_masks()
    a = int(net.predict(obs, action_masks=mask, deterministic=True)[0])
    assert a == int(ppo.policy.predict(obs, action_masks=mask, deterministic=True)[0]) and mask[a]


def test_an_old_layout_file_loads_and_a_widened_copy_acts_the_same(tmp_path):
    v1 = tmp_path / "v1.safetensors"
    tensors = _write_policy(v1, *LAYOUTS["v1"])  # version 1: no layout entry, told by its sizes
    _, meta = policy_file.read(v1)
    assert meta["version"] == 1
    old = policy_file.load_policy_network(v1)
    wide = policy_file.widen({k: np.asarray(v, np.float32) for k, v in tensors.items()}, *LAYOUTS["full"])
    full = tmp_path / "widened.safetensors"
    policy_file.write(
        full, wide, dict(meta, version=2, layout="full", obs_dim=LAYOUTS["full"][0], n_actions=LAYOUTS["full"][1])
    )
    new = policy_file.load_policy_network(full)
    rng = np.random.default_rng(1)
    for _ in range(20):
        obs = rng.uniform(-1, 1, LAYOUTS["full"][0]).astype(np.float32)
        mask = rng.random(LAYOUTS["full"][1]) < 0.3
        mask[0] = True
        known = mask.copy()
        known[LAYOUTS["v1"][1] :] = False  # the widened policy on the old moves = the old policy
        a_old = int(old.predict(obs[: LAYOUTS["v1"][0]], action_masks=known[: LAYOUTS["v1"][1]], deterministic=True)[0])
        a_new = int(new.predict(obs, action_masks=known, deterministic=True)[0])
        assert a_old == a_new


@pytest.mark.parametrize(
    "over,message",
    [
        ({"version": 3}, "policy format version '3'; this autotune reads versions 1, 2"),
        (
            {"version": 2, "layout": "hyperspace"},
            "trained on env layout 'hyperspace', which this autotune does not know",
        ),
        ({"version": 2}, "trained on env layout 'None'"),
        ({"version": 2, "layout": "zero"}, "layout 'zero' has 246 observations and 96 moves; the file says 242 and 92"),
        ({"version": 1, "dims": 250}, "trained for 250 observations and 92 moves"),
    ],
)
def test_unknown_versions_and_layouts_are_one_clear_line(tmp_path, over, message):
    from autotune.policy.pretrained import load_policy

    path = tmp_path / "p.safetensors"
    over = dict(over)
    obs_dim = over.pop("dims", LAYOUTS["v1"][0])
    _write_policy(path, obs_dim, LAYOUTS["v1"][1], **over)
    with pytest.raises(SpecError) as info:
        load_policy(path)
    text = str(info.value)
    assert message in text and "\n" not in text and len(text) < 400, text
