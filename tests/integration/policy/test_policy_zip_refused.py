"""A crafted stable-baselines3 zip given as ``--policy`` is refused and its pickled payload never runs."""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from autotune.errors import SpecError
from autotune.policy.policy_file import load_policy_network as load_policy

AUTOTUNE = str(Path(sys.executable).with_name("autotune"))


def _sb3_zip(path: Path, marker: Path) -> Path:
    """A Stable-Baselines3-style save whose ``data`` entry carries a pickled command (cloudpickle-decoded
    by ``MaskablePPO.load``)."""
    blob = base64.b64encode(pickle.dumps(_Payload(marker))).decode()
    data = {"policy_class": {":type:": "<class 'abc.ABCMeta'>", ":serialized:": blob}, "policy_kwargs": {}}
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("data", json.dumps(data))
        z.writestr("_stable_baselines3_version", "2.9.2")
    return path


class _Payload:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_sb3_zip_is_refused_and_its_payload_never_runs(tmp_path):
    marker = tmp_path / "payload-ran"
    evil = _sb3_zip(tmp_path / "evil.zip", marker)
    with pytest.raises(SpecError, match="zip archive"):
        load_policy(evil)
    assert not marker.exists()
    # through the command line, as a user would give it
    r = subprocess.run(
        [
            AUTOTUNE,
            "search",
            "--cluster",
            "mixed-a100-v100",
            "--model",
            "gpt2-xl",
            "--method",
            "rl",
            "--budget",
            "3",
            "--policy",
            str(evil),
            "--tracking-uri",
            f"sqlite:///{tmp_path}/m.db",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert not marker.exists()
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "zip archive" in r.stderr, r.stderr
    assert not (tmp_path / "m.db").exists()  # refused before any work
