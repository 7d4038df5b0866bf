"""ZeRO-3 and offload ``all`` with tensor parallelism (``runner.zero``): a DTensor weight's local shard is the
view into the unit's flat buffer, gathered and freed around each use like a plain weight. Replicas at tp 2 with
ZeRO-3 (with sequence parallelism and offload ``all``; an MoE model beside expert parallelism; layer-wise, each
layer's shards gathered once per pass, with the vocabulary-parallel loss) train like one process; a layer-wise
pipeline whose tp-2 stage hands off to a tp-1 stage trains like one process and clips by the same norm, and so
does an interleaved-1f1b one."""

from __future__ import annotations

import pytest
import torch
from paths import DATA
from tp_runs import tp2_replicas, trains_like_one_process

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
torch.set_num_threads(1)


def test_zero3_with_sequence_parallel_tp2_and_offload_all(tmp_path):
    plan = tp2_replicas({"layers": 2, "sequence_parallel": True, "offload": "all"}, 2, zero=3)
    trains_like_one_process(tmp_path, str(DATA / "tiny-llama.yaml"), plan)


def test_zero3_with_tp2_inside_moe_blocks_and_expert_parallelism(tmp_path):
    trains_like_one_process(tmp_path, "tiny-moe", tp2_replicas({"layers": 4}, 4, zero=3, expert_parallel=2))


def test_layerwise_zero3_with_sequence_parallel_tp2(tmp_path):
    plan = tp2_replicas({"layers": 2, "sequence_parallel": True}, 2, zero=3)
    for pipe in plan["pipelines"]:
        pipe["execution"] = "layerwise"
    trains_like_one_process(tmp_path, str(DATA / "tiny-llama.yaml"), plan)


def test_layerwise_tp2_stage_hands_off_to_a_tp1_stage(tmp_path):
    from runner.optim import TrainSettings

    stages = [{"devices": ["cpu:0", "cpu:1"], "layers": 1}, {"devices": ["cpu:2"], "layers": 1}]
    plan = {"micro_batch_size": 1, "pipelines": [{"num_microbatches": 4, "execution": "layerwise", "stages": stages}]}
    trains_like_one_process(tmp_path, str(DATA / "tiny-llama.yaml"), plan, TrainSettings(clip_grad_norm=0.5))


def test_interleaved_tp2_stage_hands_off_to_a_tp1_stage(tmp_path):
    """interleaved-1f1b over stages of different tensor-parallel degrees (refused before): runner.mixed runs
    Megatron's interleaved order (``autotune.simulator.schedule.stage_orders``, what the simulator times), the
    last stage's first chunk handing off to the first stage's second chunk; like one process, with clipping."""
    from runner.optim import TrainSettings

    stages = [
        {"devices": ["cpu:0", "cpu:1"], "layers": 2, "sequence_parallel": True},
        {"devices": ["cpu:2"], "layers": 2},
    ]
    plan = {
        "micro_batch_size": 2,
        "schedule": "interleaved-1f1b",
        "virtual_stages": 2,
        "pipelines": [{"num_microbatches": 4, "stages": stages}],
    }
    trains_like_one_process(tmp_path, "tiny", plan, TrainSettings(clip_grad_norm=0.5))
