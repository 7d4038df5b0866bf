"""Policy files are read without pickle (``autotune.policy.policy_file``): the shipped chooser's round-trips,
a crafted file never runs its payload, a bad or retired one is one clear line."""

from __future__ import annotations

import json
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from autotune.errors import SpecError
from autotune.policy import policy_file
from autotune.policy.policy_file import load_policy_network as load_policy
from autotune.search.agents.acquire import default_acquisition_path as default_policy_path


class _Payload:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


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
        ("layout-size", "layout 'acquisition' has 580 observations and 64 moves; the file says 7 and 64"),
        ("layout", "trained on env layout 'other', which this autotune does not know"),
        ("version", "policy format version '3'; this autotune reads versions 2"),
        ("retired", "is a policy of the retired local-move walk"),  # rl's walk before the chooser (layout full)
        ("v1", "is a policy of the retired local-move walk"),  # its first files named no layout
        ("missing", "lacks 'value_net.bias'"),
    ],
)
def test_malformed_policy_files_are_one_clear_line(tmp_path, case, message):
    tensors, meta = policy_file.read(default_policy_path())
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
    elif case == "layout-size":
        policy_file.write(path, tensors, {**meta, "obs_dim": 7})
    elif case == "version":
        policy_file.write(path, tensors, {**meta, "version": 3})
    elif case == "layout":
        policy_file.write(path, tensors, {**meta, "layout": "other"})
    elif case == "retired":
        policy_file.write(path, tensors, {**meta, "layout": "full", "obs_dim": 261, "n_actions": 150})
    elif case == "v1":
        policy_file.write(path, tensors, {k: v for k, v in meta.items() if k != "layout"} | {"version": 1})
    else:
        policy_file.write(path, {k: v for k, v in tensors.items() if k != "value_net.bias"}, meta)
    with pytest.raises(SpecError, match=message) as info:
        load_policy(path)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400
