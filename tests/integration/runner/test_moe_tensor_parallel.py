"""Tensor parallelism inside MoE blocks (``runner.moe.MoEMLP.set_tensor_parallel``, Megatron-LM's expert tensor
parallelism as the simulator counts it): every expert split across the stage's ranks, the router whole, one
reduction per block. Each plan trains like one process and clips by the same global norm (the router's
gradient summed over the tensor-parallel ranks, each expert shard counted once), beside expert parallelism,
sequence parallelism, a hand-off to a stage of another degree and ZeRO; replicas at tp 2 and tp 1 (their exchange
part by part, ``Layout.exchange_groups``), also with ZeRO and under SPES; and a dense sequence-parallel stage
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


def _tp2_and_tp1(devices0=("cpu:0", "cpu:1"), **plan) -> dict:
    """An MoE replica on ``devices0`` (6 micro-batches) beside one on cpu:2 (2)."""
    pipes = [
        {"num_microbatches": 6, "stages": [{"devices": list(devices0), "layers": 4}]},
        {"num_microbatches": 2, "stages": [{"devices": ["cpu:2"], "layers": 4}]},
    ]
    return {"micro_batch_size": 1, "pipelines": pipes, **plan}


def test_moe_replicas_at_tp2_and_tp1_train_like_one_process_and_clip_alike(tmp_path):
    """Each part of a sharded weight exchanged among its holders, the router and norms among all three ranks
    (weighted 1 / tp: weighing them 1 moves the step-2 loss by 1.2e-4), each part counted once in the norm."""
    trains_like_one_process(tmp_path, "tiny-moe", _tp2_and_tp1(), CLIP)


def test_moe_replicas_at_tp2_and_tp1_with_zero_3(tmp_path):
    trains_like_one_process(tmp_path, "tiny-moe", _tp2_and_tp1(zero=3), TrainSettings())


def test_spes_replicas_at_tp2_and_tp1_with_zero_2_train_like_the_plan_at_tp1(tmp_path):
    """SPES (each replica trains half the experts, weights averaged every 2 steps) is not single-process
    training: the reference is the same plan with the first replica at tp 1 (measured 1.1e-7 apart)."""
    import json

    from runner.train import train

    def losses(plan: dict, name: str) -> list[float]:
        out = train("cpu-4", "tiny-moe", plan, steps=4, metrics_out=tmp_path / name, quiet=True, timeout_s=600)
        assert out.returncode == 0, out.error
        return [json.loads(line)["loss"] for line in (tmp_path / name).read_text().splitlines()]

    spes = {"sync_every_steps": 2}
    parted = _tp2_and_tp1(zero=2, **spes)
    flat = _tp2_and_tp1(("cpu:0",), zero=2, **spes)
    for plan in (parted, flat):
        plan["pipelines"][0]["trains_experts"], plan["pipelines"][1]["trains_experts"] = [0, 1], [2, 3]
    torch.testing.assert_close(
        torch.tensor(losses(parted, "parted.jsonl")), torch.tensor(losses(flat, "flat.jsonl")), rtol=1e-6, atol=0
    )


def test_an_moe_mixed_stage_clips_by_the_global_norm(tmp_path):
    """A stage of two ranks with 5 and 3 of the 8 micro-batches: runner.mixed scales each micro-batch's loss by
    its part of the global batch, so the exchange sums the ranks' gradients unweighted (it weighed them by batch
    share too: the norm 2.0e-5 off, under ZeRO the loss 1.9e-3)."""
    stage0 = {
        "layers": 3,
        "ranks": [{"devices": ["cpu:0"], "num_microbatches": 5}, {"devices": ["cpu:1"], "num_microbatches": 3}],
    }
    plan = {
        "micro_batch_size": 1,
        "schedule": "gpipe",
        "pipelines": [{"num_microbatches": 8, "stages": [stage0, {"devices": ["cpu:2"], "layers": 1}]}],
    }
    trains_like_one_process(tmp_path, "tiny-moe", plan, CLIP)
