"""ZeRO-3 and offload ``all`` with tensor parallelism (``runner.zero``): a DTensor weight's local shard is the
view into the unit's flat buffer, gathered and freed around each use like a plain weight. Replicas at tp 2 with
ZeRO-3 (with sequence parallelism and offload ``all``; an MoE model beside expert parallelism) train like one
process."""

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
