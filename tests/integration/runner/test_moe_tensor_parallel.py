"""Tensor parallelism inside MoE blocks (``runner.moe.MoEMLP.set_tensor_parallel``, Megatron-LM's expert tensor
parallelism as the simulator counts it): every expert split across the stage's ranks, the router whole, one
reduction per block. Each plan trains like one process and clips by the same global norm (the router's
gradient summed over the tensor-parallel ranks, each expert shard counted once), beside expert parallelism,
sequence parallelism, a hand-off to a stage of another degree and ZeRO; and a dense sequence-parallel stage
clips by the right norm (its norms' gradients are partial sums per rank, reduced before they count)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from paths import DATA

from runner.optim import TrainSettings
from runner.reference import reference_losses
from runner.train import train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
torch.set_num_threads(1)

RTOL = 1e-5
STEPS = 3
CLIP = TrainSettings(clip_grad_norm=0.5)


def _trains_like_one_process(tmp_path: Path, model: str, plan: dict, settings: TrainSettings = CLIP) -> None:
    norms: list[float] = []
    reference = reference_losses(model, STEPS, settings=settings, grad_norms=norms)
    metrics = tmp_path / "m.jsonl"
    out = train("cpu-4", model, plan, steps=STEPS, settings=settings, metrics_out=metrics, quiet=True, timeout_s=600)
    assert out.returncode == 0, out.error
    got = [json.loads(line) for line in metrics.read_text().splitlines()]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in got]), torch.tensor(reference), rtol=RTOL, atol=0)
    if settings.clip_grad_norm:
        torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in got]), torch.tensor(norms), rtol=RTOL, atol=0)


def _replicas(stage: dict, microbatches: int = 4, **plan) -> dict:
    pipes = [
        {"num_microbatches": microbatches, "stages": [{**stage, "devices": [f"cpu:{2 * p}", f"cpu:{2 * p + 1}"]}]}
        for p in range(2)
    ]
    return {"micro_batch_size": 1, "pipelines": pipes, **plan}


def test_experts_split_two_ways_beside_expert_and_sequence_parallelism(tmp_path):
    plan = _replicas({"layers": 4, "sequence_parallel": True}, expert_parallel=2)
    _trains_like_one_process(tmp_path, "tiny-moe", plan)


def test_an_moe_stage_at_tp2_hands_off_to_one_at_tp1(tmp_path):
    stages = [{"devices": ["cpu:0", "cpu:1"], "layers": 2}, {"devices": ["cpu:2"], "layers": 2}]
    plan = {"micro_batch_size": 1, "pipelines": [{"num_microbatches": 8, "stages": stages}]}
    _trains_like_one_process(tmp_path, "tiny-moe", plan)


def test_experts_split_two_ways_with_zero_2(tmp_path):
    plan = _replicas({"layers": 4}, zero=2)
    _trains_like_one_process(tmp_path, "tiny-moe", plan, TrainSettings())


def test_a_dense_sequence_parallel_stage_clips_by_the_global_norm(tmp_path):
    plan = _replicas({"layers": 2, "sequence_parallel": True}, microbatches=2)
    _trains_like_one_process(tmp_path, str(DATA / "tiny-llama.yaml"), plan)
