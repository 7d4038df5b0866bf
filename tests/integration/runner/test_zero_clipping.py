"""Gradient clipping (``--clip-grad-norm``) under ZeRO sharding and offload (``ShardedState.finish_step``): the
global norm from the master shards' gradients (an element of a sharded unit counted on its one holder, of an
unsharded unit once over its holders, a weight each tensor-parallel rank keeps whole once over the group)
equals the single process's ``torch.nn.utils.clip_grad_norm_`` norm, and the clipped run trains like it
(rtol 1e-5 on losses and norms): tp-2 replicas under ZeRO-3 with sequence parallelism and offload ``all``;
replicas at tp 2 and tp 1 under ZeRO-2 (a unit per part of a resharded weight); two replicas offloading the
optimizer without ZeRO (unsharded units, in host memory)."""

from __future__ import annotations

import pytest
import torch
from paths import DATA
from tp_runs import tp2_replicas, trains_like_one_process

from runner.optim import TrainSettings

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
torch.set_num_threads(1)

LLAMA = str(DATA / "tiny-llama.yaml")
CLIP = TrainSettings(clip_grad_norm=0.5)


def test_zero3_tp2_sequence_parallel_offload_all_clips_like_one_process(tmp_path):
    plan = tp2_replicas({"layers": 2, "sequence_parallel": True, "offload": "all"}, 2, zero=3)
    trains_like_one_process(tmp_path, LLAMA, plan, CLIP)


def test_zero2_over_replicas_at_tp2_and_tp1_clips_like_one_process(tmp_path):
    plan = {
        "micro_batch_size": 1,
        "zero": 2,
        "pipelines": [
            {"num_microbatches": 3, "stages": [{"devices": ["cpu:0", "cpu:1"], "layers": 2}]},
            {"num_microbatches": 1, "stages": [{"devices": ["cpu:2"], "layers": 2}]},
        ],
    }
    trains_like_one_process(tmp_path, LLAMA, plan, CLIP)


def test_unsharded_optimizer_offload_clips_like_one_process(tmp_path):
    stage = {"layers": 2, "offload": "optimizer"}
    plan = {
        "micro_batch_size": 1,
        "pipelines": [{"num_microbatches": 2, "stages": [{**stage, "devices": [f"cpu:{p}"]}]} for p in range(2)],
    }
    trains_like_one_process(tmp_path, LLAMA, plan, CLIP)
