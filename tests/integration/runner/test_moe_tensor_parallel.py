"""Tensor parallelism inside MoE blocks (``runner.moe.MoEMLP.set_tensor_parallel``, Megatron-LM's expert tensor
parallelism as the simulator counts it): every expert split across the stage's ranks, the router whole, one
reduction per block. Each plan trains like one process and clips by the same global norm (the router's
gradient summed over the tensor-parallel ranks, each expert shard counted once), beside expert parallelism,
sequence parallelism, a hand-off to a stage of another degree and ZeRO; and a dense sequence-parallel stage
clips by the right norm (its norms' gradients are partial sums per rank, reduced before they count)."""

from __future__ import annotations

import pytest
import torch
from paths import DATA
from tp_runs import tp2_replicas, trains_like_one_process

from runner.optim import TrainSettings

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
torch.set_num_threads(1)

CLIP = TrainSettings(clip_grad_norm=0.5)


def test_experts_split_two_ways_beside_expert_and_sequence_parallelism(tmp_path):
    plan = tp2_replicas({"layers": 4, "sequence_parallel": True}, 4, expert_parallel=2)
    trains_like_one_process(tmp_path, "tiny-moe", plan, CLIP)


def test_an_moe_stage_at_tp2_hands_off_to_one_at_tp1(tmp_path):
    stages = [{"devices": ["cpu:0", "cpu:1"], "layers": 2}, {"devices": ["cpu:2"], "layers": 2}]
    plan = {"micro_batch_size": 1, "pipelines": [{"num_microbatches": 8, "stages": stages}]}
    trains_like_one_process(tmp_path, "tiny-moe", plan, CLIP)


def test_experts_split_two_ways_with_zero_2(tmp_path):
    plan = tp2_replicas({"layers": 4}, 4, zero=2)
    trains_like_one_process(tmp_path, "tiny-moe", plan, TrainSettings())


def test_a_dense_sequence_parallel_stage_clips_by_the_global_norm(tmp_path):
    plan = tp2_replicas({"layers": 2, "sequence_parallel": True}, 2)
    trains_like_one_process(tmp_path, str(DATA / "tiny-llama.yaml"), plan, CLIP)
