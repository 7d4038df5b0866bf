"""``autotune measure`` and ``autotune train`` of a roundpipe plan on this CPU machine: one clear line."""

from __future__ import annotations

import sys

import pytest
from paths import EXAMPLES


def test_measure_and_train_cli_print_one_line_on_cpu(tmp_path):
    import subprocess

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    common = [
        "--cluster",
        str(EXAMPLES / "8x4090.yaml"),
        "--model",
        "llama2-13b",
        "--global-batch-size",
        "64",
        "--config",
        str(EXAMPLES / "roundpipe-8x4090.json"),
    ]
    for command in (["measure"], ["train", "--steps", "2"]):
        proc = subprocess.run(
            [sys.executable, "-m", "autotune.cli", *command, *common],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert proc.returncode == 2, proc.stderr
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "roundpipe library on CUDA" in lines[0] and "no CUDA" in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr
