"""A vocabulary-parallel embedding, LM head and loss (``runner.engine.apply_tensor_parallel``): where the
tensor-parallel degree divides the vocabulary each rank holds its rows of the embedding and the head, its part
of the logits, and torch's ``loss_parallel`` cross entropy joins them; a tied head multiplies by the split
embedding. The run trains like one process and clips by the same global norm (each shard's gradient counted
once); where the degree does not divide the vocabulary both stay whole and it trains alike too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from paths import DATA
from tp_runs import trains_like_one_process

from autotune.simulator.engine_terms import head_group
from runner.optim import TrainSettings

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
torch.set_num_threads(1)

SETTINGS = TrainSettings(clip_grad_norm=0.5)  # a norm counted wrong changes the clipped update


def _model(tmp_path: Path, **fields) -> str:
    text = (DATA / "tiny-llama.yaml").read_text()
    for key, value in fields.items():
        text = "\n".join(line for line in text.splitlines() if not line.startswith(f"{key}:")) + f"\n{key}: {value}\n"
    path = tmp_path / "model.yaml"
    path.write_text(text)
    return str(path)


def _one_stage(devices: list[str], microbatches: int = 2) -> dict:
    return {
        "micro_batch_size": 2,
        "schedule": "1f1b",
        "pipelines": [{"num_microbatches": microbatches, "stages": [{"devices": devices, "layers": 2}]}],
    }


def test_a_tied_head_on_a_split_embedding_trains_like_one_process(tmp_path):
    model = _model(tmp_path, tied_embeddings="true")
    assert head_group("autotune", 2, 256) == 2  # the simulator counts the split the runner makes
    trains_like_one_process(tmp_path, model, _one_stage(["cpu:0", "cpu:1"]), SETTINGS)


def test_replicas_splitting_the_vocabulary_two_ways_and_one_way_train_like_one_process(tmp_path):
    """A tp-2 replica beside a tp-1 one: the embedding's and the head's row halves average part by part
    (``runner.reshard``)."""
    plan = {
        "micro_batch_size": 1,
        "schedule": "1f1b",
        "pipelines": [
            {"num_microbatches": 2, "stages": [{"devices": ["cpu:0", "cpu:1"], "layers": 2}]},
            {"num_microbatches": 2, "stages": [{"devices": ["cpu:2"], "layers": 2}]},
        ],
    }
    trains_like_one_process(tmp_path, str(DATA / "tiny-llama.yaml"), plan, SETTINGS)


def test_a_vocabulary_the_degree_does_not_divide_stays_whole_and_trains_like_one_process(tmp_path):
    assert head_group("autotune", 2, 255) == 1
    trains_like_one_process(tmp_path, _model(tmp_path, vocab_size=255), _one_stage(["cpu:0", "cpu:1"]), SETTINGS)
