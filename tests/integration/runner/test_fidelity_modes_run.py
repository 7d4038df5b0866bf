"""The runner trains the fidelity terms' plans like one process (sequence parallelism, the recompute modes), and ``make gpu-check`` names its GPUs (or says there is no CUDA)."""

from __future__ import annotations

import json

import pytest
from paths import REPO


@pytest.mark.slow
@pytest.mark.distributed
def test_runner_sequence_parallel_and_selective_recompute_train_like_a_single_process(tmp_path) -> None:
    """Two tensor-parallel stages with sequence parallelism (gloo), one selectively and one fully
    recomputing, train the same losses as one process. The tolerance is 10x tighter than
    test_runner_distributed's: this plan is 2.6e-7 from the reference over 6 steps, and leaving the
    norms out of the sequence-parallel plan (their weight gradients then come from each rank's half of
    the sequence only, a deliberate bug, reverted) moved it to 3.5e-6 (experiments/RESULTS.md)."""
    import torch

    from runner.reference import reference_losses
    from runner.train import train

    config = {
        "micro_batch_size": 1,
        "schedule": "1f1b",
        "pipelines": [
            {
                "num_microbatches": 8,
                "stages": [
                    {"devices": ["cpu:0", "cpu:1"], "layers": 2, "recompute": "selective", "sequence_parallel": True},
                    {"devices": ["cpu:2", "cpu:3"], "layers": 2, "recompute": True, "sequence_parallel": True},
                ],
            }
        ],
    }
    steps = 6
    out = train("cpu-4", "tiny", config, steps=steps, metrics_out=tmp_path / "m.jsonl", quiet=True, timeout_s=300)
    assert out.returncode == 0, out.error
    losses = [json.loads(line)["loss"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses("tiny", steps)), rtol=1e-6, atol=0)


@pytest.mark.slow
@pytest.mark.distributed
def test_runner_torchtitan_checkpointing_modes_train_like_a_single_process(tmp_path) -> None:
    """torchtitan's per-op checkpointing on a tensor-parallel stage with sequence parallelism and its
    every-2 checkpointing on the next (tensor-parallel, 3 blocks: the second recomputed) train the losses of one process."""
    import torch

    from runner.reference import reference_losses
    from runner.train import train

    config = {
        "micro_batch_size": 1,
        "schedule": "1f1b",
        "pipelines": [
            {
                "num_microbatches": 8,
                "stages": [
                    {
                        "devices": ["cpu:0", "cpu:1"],
                        "layers": 1,
                        "recompute": "selective-op",
                        "sequence_parallel": True,
                    },
                    {"devices": ["cpu:2", "cpu:3"], "layers": 3, "recompute": "every-2", "sequence_parallel": True},
                ],
            }
        ],
    }
    steps = 6
    out = train("cpu-4", "tiny", config, steps=steps, metrics_out=tmp_path / "m.jsonl", quiet=True, timeout_s=300)
    assert out.returncode == 0, out.error
    losses = [json.loads(line)["loss"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses("tiny", steps)), rtol=1e-6, atol=0)


def test_gpu_check_names_gpus_and_says_so_without_cuda() -> None:
    import subprocess
    import sys

    import torch

    root = REPO
    sys.path.insert(0, str(root / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    assert gpu_check.catalog_name("NVIDIA H200", 140) == "H200"
    assert gpu_check.catalog_name("NVIDIA GH200 480GB", 95) == "GH200"
    assert gpu_check.catalog_name("NVIDIA A100-SXM4-40GB", 39.4) == "A100-40GB"
    assert gpu_check.catalog_name("NVIDIA GeForce RTX 2080 Ti", 10.7) == "RTX-2080-Ti"
    assert gpu_check.catalog_name("NVIDIA GeForce RTX 2080", 7.8) == "RTX-2080"
    assert gpu_check.catalog_name("Some Future GPU", 80) is None
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: `make gpu-check` runs the real check (test_gpu_check_on_cuda)")
    out = subprocess.run(
        [sys.executable, str(root / "scripts" / "gpu_check.py")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "no CUDA device here" in out.stdout


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_check_on_cuda(tmp_path) -> None:
    import subprocess
    import sys

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    root = REPO
    out = subprocess.run(
        [sys.executable, str(root / "scripts" / "gpu_check.py"), "--out", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert len(rows) == 5 and all(r["measured"].get("status") == "ok" for r in rows), rows
