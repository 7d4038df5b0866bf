"""Policy files are read without pickle (``autotune.policy.policy_file``): the shipped one makes the same
moves as the Stable-Baselines3 zip it was converted from, and a crafted file never runs its payload."""

from __future__ import annotations

import json
import os
import pickle
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from paths import DATA, REPO

from autotune.errors import SpecError
from autotune.policy import policy_file
from autotune.policy.pretrained import default_policy_path, load_policy

REPO = REPO
REFERENCE = DATA / "policy_reference.json"
#: the first shipped policy (layout v1), converted from a Stable-Baselines3 zip; shipped until session 4
V1_POLICY = DATA / "policy_v1.safetensors"
AUTOTUNE = str(Path(sys.executable).with_name("autotune"))


class _Payload:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_converted_v1_policy_makes_the_moves_of_the_original():
    """tests/data/policy_reference.json was recorded from the original zip (scripts/convert_policy.py);
    the converted file (tests/data/policy_v1.safetensors) must make the same moves. It also keeps a policy
    of the older layout (a prefix of today's, walked with its own moves) in the tests."""
    import torch

    from autotune.loading import load_cluster, load_model
    from autotune.planning.budget import BudgetedEvaluator
    from autotune.planning.space import SearchSpace
    from autotune.policy.pretrained import run_pretrained
    from autotune.policy.scenarios import heldout_scenarios
    from autotune.search.tracking import config_key
    from autotune.simulator import Simulator

    ref = json.loads(REFERENCE.read_text())
    policy = load_policy(V1_POLICY)
    asked = 0
    for walk in ref["walks"]:
        for q in walk["asked"]:
            obs = np.array(q["obs"], dtype=np.float32)
            mask = np.zeros(len(q["probs"]), dtype=bool)
            mask[q["mask"]] = True
            assert int(policy.predict(obs, action_masks=mask, deterministic=True)[0]) == q["action"]
            with torch.no_grad():
                probs = policy.get_distribution(policy.obs_to_tensor(obs)[0], action_masks=mask).distribution.probs[0]
            np.testing.assert_allclose(probs.numpy(), q["probs"], rtol=1e-4, atol=1e-6)
            asked += 1
    assert asked >= 60
    scenarios = {"mixed-h100-a100-32/llama2-13b": (load_cluster("mixed-h100-a100-32"), load_model("llama2-13b", 256))}
    scenarios.update({s.name: (s.cluster, s.model) for s in heldout_scenarios()[:2]})
    # Whole walks too (a few: the moves above cover all of them). A walk's later plans depend on the
    # simulator's numbers (the policy sees them), which change with the cost model since the reference was
    # recorded; so the walk must agree with the reference on every question both asked (same observation
    # and mask), and on its plans up to the first one the recorded walk reached through different numbers.
    known = {(tuple(q["mask"]), tuple(np.round(q["obs"], 5))): q["action"] for w in ref["walks"] for q in w["asked"]}

    class Asking:
        def __init__(self) -> None:
            self.overlap = 0

        def predict(self, obs, action_masks=None, deterministic=True):
            action, state = policy.predict(obs, action_masks=action_masks, deterministic=deterministic)
            key = (tuple(int(i) for i in np.flatnonzero(action_masks)), tuple(np.round(np.asarray(obs, float), 5)))
            if key in known:
                assert int(action) == known[key]
                self.overlap += 1
            return action, state

        def __getattr__(self, name):
            return getattr(policy, name)

    for walk in ref["walks"][::4]:
        cluster, model = scenarios[walk["scenario"]]
        # the walks were recorded before the ZeRO / offload dimensions: replay them in that space
        space = SearchSpace(cluster, model, restrict={"zero": [0], "offload": ["none"]})
        ev = BudgetedEvaluator(Simulator(cluster, model), space, ref["budget"])
        asking = Asking()
        run_pretrained(space, ev, walk["seed"], policy=asking)
        plans = [config_key(e.config) for e in ev.history]
        assert plans[:2] == walk["plans"][:2]  # the start plans do not depend on the simulator
        assert len(plans) == len(walk["plans"])


def test_written_file_round_trips_and_is_safetensors(tmp_path):
    tensors, meta = policy_file.read(default_policy_path())
    path = tmp_path / "copy.safetensors"
    policy_file.write(path, tensors, meta)
    again, meta2 = policy_file.read(path)
    assert meta2 == meta and set(again) == set(tensors)
    assert all(np.array_equal(again[k], tensors[k]) for k in tensors)
    try:
        from safetensors.numpy import load_file
    except ImportError:
        return
    loaded = load_file(str(path))
    assert all(np.array_equal(loaded[k], tensors[k]) for k in tensors)


def test_pickles_and_torch_saves_are_refused_unread(tmp_path):
    import torch

    marker = tmp_path / "payload-ran"
    raw = tmp_path / "policy.safetensors"
    raw.write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(SpecError, match="is a pickle"):
        load_policy(raw)
    saved = tmp_path / "weights.pt"
    torch.save({"x": _Payload(marker)}, saved)  # torch's zip format holds a pickle too
    with pytest.raises(SpecError, match="zip archive"):
        load_policy(saved)
    assert not marker.exists()


def _header_file(path: Path, header: dict, data: bytes = b"") -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


@pytest.mark.parametrize(
    "case,message",
    [
        ("garbage", "header length"),
        ("no-meta", "no 'autotune_policy' entry"),
        ("offsets", "data_offsets must be"),
        ("dtype", "dtype must be one of"),
        ("arch", "net_arch must list 1 to 8 layer widths"),
        ("obs", "trained for 7 observations"),  # a v1 file: no layout named, the weights disagree
        ("layout-size", "layout 'full' has 261 observations and 150 moves; the file says 7 and 150"),
        ("missing", "lacks 'action_net.bias'"),
    ],
)
def test_malformed_policy_files_are_one_clear_line(tmp_path, case, message):
    tensors, meta = policy_file.read(V1_POLICY if case == "obs" else default_policy_path())
    good_meta = {"__metadata__": {policy_file.METADATA_KEY: json.dumps(meta)}}
    path = tmp_path / f"{case}.safetensors"
    if case == "garbage":
        path.write_bytes(b"\xff" * 64)
    elif case == "no-meta":
        _header_file(path, {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
    elif case == "offsets":
        _header_file(path, {**good_meta, "w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}, b"\0" * 4)
    elif case == "dtype":
        _header_file(path, {**good_meta, "w": {"dtype": "O", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
    elif case == "arch":
        policy_file.write(path, tensors, {**meta, "net_arch": [10**9]})
    elif case in ("obs", "layout-size"):
        policy_file.write(path, tensors, {**meta, "obs_dim": 7})
    else:
        policy_file.write(path, {k: v for k, v in tensors.items() if k != "action_net.bias"}, meta)
    with pytest.raises(SpecError, match=message) as info:
        load_policy(path)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400
