"""The runner computes what ``transformers`` computes for each family it loads: logits of one checkpoint
equal (fp32, CPU) for the whole model as one stage, as two pipeline stages, and on two replicas of
uneven batch shares."""

from __future__ import annotations

import pytest
import torch
from hf_models import FAMILIES, tiny_model

from autotune.loading import load_hf_model
from runner.hf_checkpoint import load_weights
from runner.model import StageChunk

pytestmark = pytest.mark.slow
TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {f: tiny_model(f, tmp_path_factory.mktemp(f)) for f in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_runner_logits_equal_transformers(family, checkpoints):
    from transformers import AutoModelForCausalLM

    path = checkpoints[family]
    spec = load_hf_model(path, seq_len=32, global_batch_size=4).model
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(0, spec.vocab_size, (4, spec.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        one = StageChunk(spec, range(spec.num_layers), first=True, last=True, seed=0)
        load_weights([one], path)
        assert _rel(one.eval()(ids), expected) < TOL
        if spec.tied_embeddings:
            return  # the runner keeps a tied head on the embedding's stage (one-stage plans only)
        # two stages of uneven depth: 1 block, then 3 blocks and the head
        first = StageChunk(spec, range(1), first=True, last=False, seed=0)
        second = StageChunk(spec, range(1, spec.num_layers), first=False, last=True, seed=0)
        load_weights([first, second], path)
        assert _rel(second.eval()(first.eval()(ids)), expected) < TOL
        # two replicas with uneven batch shares (3 and 1 sequences): each row as in the whole batch
        rows = torch.cat([one(ids[:3]), one(ids[3:])])
        assert _rel(rows, expected) < TOL


def test_a_shape_that_does_not_match_is_refused_naming_the_tensor(checkpoints):
    from dataclasses import replace

    from autotune.errors import SpecError

    spec = load_hf_model(checkpoints["llama"], seq_len=32, global_batch_size=4).model
    wider = replace(spec, ffn_hidden_size=256)
    with pytest.raises(
        SpecError,
        match=r"model.layers.0.mlp.up_proj.weight: has shape \(128, 64\) in the checkpoint, the plan.s model needs \(256, 64\)",
    ):
        load_weights([StageChunk(wider, range(1), first=True, last=False, seed=0)], checkpoints["llama"])


def test_a_checkpoint_that_does_not_fit_the_model_is_refused_before_launch(checkpoints):
    """Issue 46, case 8: a tensor of another shape (or a missing one) ended with exit 1 and ~46 lines of
    torchrun traceback; now ``train`` refuses it in one line before any process starts (the CLI: exit 2)."""
    from dataclasses import replace

    from autotune.errors import SpecError
    from runner.hf_checkpoint import check_weights
    from runner.train import train

    spec = load_hf_model(checkpoints["llama"], seq_len=32, global_batch_size=4).model
    check_weights(spec, checkpoints["llama"])  # the checkpoint's own model passes
    plan = {
        "micro_batch_size": 1,
        "pipelines": [{"num_microbatches": 4, "stages": [{"devices": ["cpu:0"], "layers": 4}]}],
    }
    for wrong, tensor in ((replace(spec, ffn_hidden_size=256), "up_proj"), (replace(spec, vocab_size=300), "embed")):
        with pytest.raises(SpecError, match=tensor) as e:
            train("cpu-2", wrong, plan, steps=1, init_from=checkpoints["llama"], quiet=True, timeout_s=60)
        assert "\n" not in str(e.value)
