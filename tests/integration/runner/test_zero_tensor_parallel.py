"""ZeRO-3 and offload ``all`` with tensor parallelism (``runner.zero``): a DTensor weight's local shard is the
view into the unit's flat buffer, gathered and freed around each use like a plain weight. Replicas at tp 2 with
ZeRO-3 (with sequence parallelism and offload ``all``; an MoE model beside expert parallelism) train like one
process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from paths import DATA

from runner.reference import reference_losses
from runner.train import train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
torch.set_num_threads(1)

STEPS = 3


def _trains_like_one_process(tmp_path: Path, model: str, plan: dict) -> None:
    metrics = tmp_path / "m.jsonl"
    out = train("cpu-4", model, plan, steps=STEPS, metrics_out=metrics, quiet=True, timeout_s=600)
    assert out.returncode == 0, out.error
    got = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(reference_losses(model, STEPS)), rtol=1e-5, atol=0)


def _replicas(stage: dict, microbatches: int, **plan) -> dict:
    pipes = [
        {"num_microbatches": microbatches, "stages": [{**stage, "devices": [f"cpu:{2 * p}", f"cpu:{2 * p + 1}"]}]}
        for p in range(2)
    ]
    return {"micro_batch_size": 1, "pipelines": pipes, **plan}


def test_zero3_with_sequence_parallel_tp2_and_offload_all(tmp_path):
    plan = _replicas({"layers": 2, "sequence_parallel": True, "offload": "all"}, 2, zero=3)
    _trains_like_one_process(tmp_path, str(DATA / "tiny-llama.yaml"), plan)


def test_zero3_with_tp2_inside_moe_blocks_and_expert_parallelism(tmp_path):
    _trains_like_one_process(tmp_path, "tiny-moe", _replicas({"layers": 4}, 4, zero=3, expert_parallel=2))
