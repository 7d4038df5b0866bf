"""scripts/titan_gpu_check.py, the GPU check that trains one plan with autotune's runner and with torchtitan's
own model and FSDP2 wrapping (issue 44), runs on CPU ranks as its smoke run: a GPU session must not find it
broken. Skipped, saying why, where torchtitan is not in ``.engines/site`` (``make engines``)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]


def test_the_check_beside_torchtitan_trains_the_same_model_on_both_sides(tmp_path):
    if not (ROOT / ".engines" / "site" / "torchtitan").is_dir():
        pytest.skip("torchtitan is not installed in .engines/site (make engines)")
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "titan_gpu_check.py"), "--device", "cpu", "--layers", "1"]
    cmd += ["--seq-len", "32", "--batch", "1", "--steps", "1", "--warmup", "1", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    autotune, titan = rows["autotune"], rows["torchtitan"]
    # the same model on both sides: torchtitan's debug model cut to one block has autotune's parameter count
    assert autotune["parameters"] == titan["parameters"] > 0
    assert autotune["iteration_s"] > 0 and titan["iteration_s"] > 0
    # torchtitan's model trains: a first loss near ln(vocabulary) of a freshly initialised language model
    assert abs(titan["losses"][0] - math.log(2048)) < 2.0, titan["losses"]
    assert "autotune / torchtitan: tokens/s" in done.stdout
