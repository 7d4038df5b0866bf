"""The loss's memory at the last stage, by the engine that runs the plan (``autotune.simulator.memory``)."""

from __future__ import annotations

import importlib.util

import pytest
from paths import REPO

from autotune.errors import SpecError
from autotune.loading import model_from_dict
from autotune.simulator import simulate
from autotune.simulator.engine_terms import head_group, loss_bytes_per_logit
from autotune.simulator.memory import stage_activation_bytes, stage_params

MODEL = dict(
    name="m",
    num_layers=4,
    hidden_size=256,
    num_heads=4,
    ffn_hidden_size=1024,
    vocab_size=32000,
    seq_len=512,
    global_batch_size=8,
)


@pytest.mark.parametrize(
    ("precision", "engine", "per_logit"),
    [
        ("bf16", "autotune", 16),  # fp32 stage output kept by the pipeline + log-softmax + two gradients
        ("fp32", "autotune", 16),
        ("bf16", "torchtitan", 12),  # log-softmax output + two gradients; the logits deleted
        ("bf16", "megatron", 10),  # e + 8
        ("fp32", "megatron", 12),
    ],
)
def test_the_last_stage_holds_the_engine_s_loss_bytes_per_logit(precision: str, engine: str, per_logit: int) -> None:
    model = model_from_dict({**MODEL, "precision": precision}, "test")
    b, tp = 2, 2
    args = (model, b, tp, 4, False, 1, 1, False)
    last = stage_activation_bytes(*args, True, engine=engine)
    not_last = stage_activation_bytes(*args, False, engine=engine)
    assert last - not_last == pytest.approx(per_logit * 512 * b * 32000 / head_group(engine, tp, 32000))


def test_an_unknown_engine_is_named() -> None:
    with pytest.raises(ValueError, match="engine must be one of"):
        loss_bytes_per_logit("jax", 2)
    with pytest.raises(SpecError, match="must be one of autotune, torchtitan"):
        simulate("mixed-a100-v100", "gpt2-xl", {"micro_batch_size": 1, "pipelines": []}, engine="jax")


@pytest.mark.slow
def test_the_runner_s_loss_holds_what_the_simulator_says() -> None:
    """Measured on CPU through ``runner.model.lm_loss`` (``experiments/fidelity/loss_peak.py``): the peak
    resident growth per logit of the runner's way (stage output kept) and torchtitan's (deleted)."""
    spec = importlib.util.spec_from_file_location("loss_peak", REPO / "experiments/fidelity/loss_peak.py")
    loss_peak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loss_peak)
    assert loss_peak.measure(1024, 16384, keep=True) == pytest.approx(loss_bytes_per_logit("autotune", 2), rel=0.1)
    assert loss_peak.measure(1024, 16384, keep=False) == pytest.approx(loss_bytes_per_logit("torchtitan", 2), rel=0.1)


def test_autotune_s_runner_splits_the_head_where_the_degree_divides_the_vocabulary() -> None:
    """The runner splits the embedding and the head across tensor parallelism where the degree divides the
    vocabulary (``runner.engine``, as Megatron-LM always does after padding it): a tp-2 last stage holds
    half the head's states and half the logits' loss; with an odd vocabulary the whole of each."""
    model = model_from_dict({**MODEL, "precision": "bf16"}, "test")
    odd = model_from_dict({**MODEL, "precision": "bf16", "vocab_size": 32001}, "test")
    b, s, V, h = 2, 512, 32000, 256
    runner = stage_activation_bytes(model, b, 2, 4, False, 1, 1, False, True, engine="autotune")
    blocks = stage_activation_bytes(model, b, 2, 4, False, 1, 1, False, False, engine="autotune")
    assert runner - blocks == pytest.approx(16 * s * b * V / 2)
    whole = stage_activation_bytes(odd, b, 2, 4, False, 1, 1, False, True, engine="autotune")
    assert whole - stage_activation_bytes(odd, b, 2, 4, False, 1, 1, False, False, engine="autotune") == (
        pytest.approx(16 * s * b * (V + 1))
    )
    meg = stage_activation_bytes(model, b, 2, 4, False, 1, 1, False, True, engine="megatron")
    assert meg - blocks == pytest.approx(10 * s * b * V / 2)
    head = model.end_params(False, True)
    assert head_group("autotune", 2, V) == 2 and head_group("autotune", 2, V + 1) == 1
    assert head_group("megatron", 2, V + 1) == 2  # Megatron-LM pads the vocabulary
    assert stage_params(model, 4, 2, False, True, head_group("autotune", 2, V + 1)) == pytest.approx(
        4 * model.params_per_layer / 2 + head
    )
    assert stage_params(model, 4, 2, False, True, head_group("autotune", 2, V)) == pytest.approx(
        (4 * model.params_per_layer + head) / 2
    )
    assert head == pytest.approx(V * h + 2 * h, rel=0.01)  # the head and the final norm
