"""``autotune train --compile``: each transformer block under ``torch.compile`` (``runner.model.compile_blocks``)
trains like one process, with FSDP2's hooks and the recomputation outside the compiled region; plans it does not
compile for are refused in one line before anything starts."""

from __future__ import annotations

import json

import pytest
import torch

from autotune.errors import SpecError
from runner.reference import reference_losses
from runner.train import train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
STEPS = 3


def _replicas(zero: int) -> dict:
    """Two single-stage replicas of the whole model, every block fully recomputed."""
    return {
        "micro_batch_size": 1,
        "zero": zero,
        "pipelines": [
            {"num_microbatches": 4, "stages": [{"devices": [f"cpu:{p}"], "layers": 4, "recompute": True}]}
            for p in range(2)
        ],
    }


def test_compiled_blocks_under_fsdp2_and_recomputation_train_like_one_process(tmp_path, monkeypatch):
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))  # the ranks' compiled kernels land here
    out = train(
        "cpu-2",
        "tiny",
        _replicas(3),
        steps=STEPS,
        metrics_out=tmp_path / "m.jsonl",
        quiet=True,
        timeout_s=900,  # TorchInductor compiles each block on the first step (minutes on a cold cache)
        compile_blocks=True,
    )
    assert out.returncode == 0, out.error
    assert any(cache.rglob("*.py")), "no rank compiled anything"  # --compile reached the ranks
    losses = [json.loads(line)["loss"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses("tiny", STEPS)), rtol=1e-5, atol=0)


def test_compile_is_refused_where_it_does_not_apply(tmp_path):
    moe = {
        "micro_batch_size": 1,
        "pipelines": [{"num_microbatches": 8, "stages": [{"devices": ["cpu:0"], "layers": 4}]}],
    }
    with pytest.raises(SpecError, match="--compile.*not MoE models"):
        train("cpu-2", "tiny-moe", moe, steps=1, compile_blocks=True, metrics_out=tmp_path / "m.jsonl")
    assert not (tmp_path / "m.jsonl").exists()
