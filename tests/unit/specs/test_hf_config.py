"""A Hugging Face config.json as the model: each family against the preset or its published parameter counts."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from paths import EXAMPLES

from autotune.errors import SpecError
from autotune.loading import load_hf_model, load_model

HF = EXAMPLES / "hf"

# published totals (and active counts for MoE) at the precision their source prints them:
# Llama 2 (Touvron et al. 2023; HF model card 6.74B), Llama 3 8B (model card 8.03B), Mistral 7B (7.24B,
# HF), Qwen2.5 technical report table 1 / model cards (7.61B, 0.49B), Qwen3 model cards (non-embedding:
# 0.44B, 6.95B), Mixtral paper (46.7B / 12.9B), Qwen1.5-MoE-A2.7B card (14.3B / 2.7B), Qwen3-30B-A3B card
# (30.5B), OLMoE paper (6.9B total, 1.3B active; 6.92B on the HF card), DeepSeekMoE paper (16.4B),
# GPT-2 124M (HF count 124,439,808), Pythia paper table 1 (162,322,944).
PUBLISHED = {
    "llama-2-7b": (6.74e9, None),
    "llama-3-8b": (8.03e9, None),
    "mistral-7b": (7.24e9, None),
    "qwen2.5-7b": (7.61e9, None),
    "qwen2.5-0.5b": (0.494e9, None),
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "qwen1.5-moe-a2.7b": (14.3e9, 2.69e9),
    "qwen3-30b-a3b": (30.5e9, None),
    "olmoe-1b-7b": (6.92e9, 1.28e9),
    "deepseek-moe-16b": (16.4e9, None),
    "gpt2": (124_439_808, None),
    "pythia-160m": (162_322_944, None),
}
NON_EMBEDDING = {"qwen3-0.6b": 0.44e9, "qwen3-8b": 6.95e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_family_counts_its_published_parameters(name):
    hf = load_hf_model(HF / name)
    total, active = PUBLISHED[name]
    assert hf.model.num_params == pytest.approx(total, rel=0.005)
    assert hf.implied_params == pytest.approx(total, rel=0.005)
    if active is not None:
        assert hf.model.active_params == pytest.approx(active, rel=0.005)


@pytest.mark.parametrize("name", sorted(NON_EMBEDDING))
def test_qwen3_counts_its_explicit_head_dim(name):
    hf = load_hf_model(HF / name / "config.json")  # the file, not the directory
    m = hf.model
    assert m.head_dim == 128 and m.q_hidden_size == m.num_heads * 128
    embeddings = m.embedding_params * (1 if m.tied_embeddings else 2)
    assert m.num_params - embeddings == pytest.approx(NON_EMBEDDING[name], rel=0.005)
    # the per-head query/key norms are counted: nothing the config implies is left out
    assert m.qk_norm and hf.implied_params == m.num_params and not hf.warnings


@pytest.mark.parametrize(("name", "preset"), [("llama-2-7b", "llama2-7b"), ("llama-3-8b", "llama3-8b")])
def test_a_config_is_the_same_model_as_the_preset(name, preset):
    ours = load_model(preset)
    read = load_model(HF / name, global_batch_size=ours.global_batch_size, seq_len=ours.seq_len)
    assert replace(read, name=preset) == ours


def test_mixtral_config_is_the_preset():
    ours = load_model("mixtral-8x7b")
    read = load_model(HF / "mixtral-8x7b", global_batch_size=512, seq_len=4096)
    assert replace(read, name="mixtral-8x7b") == ours


def test_family_details_land_in_the_model():
    qwen = load_hf_model(HF / "qwen2.5-0.5b").model
    assert qwen.bias == "qkv" and qwen.tied_embeddings and qwen.sliding_window == 0  # use_sliding_window false
    mistral = load_hf_model(HF / "mistral-7b", seq_len=8192).model
    assert mistral.sliding_window == 4096 and mistral.attended_keys() < mistral.seq_len
    deepseek = load_hf_model(HF / "deepseek-moe-16b").model
    assert deepseek.first_dense_layers == 1 and not deepseek.is_moe_layer(0) and deepseek.is_moe_layer(1)
    assert deepseek.num_moe_layers == 27 and deepseek.shared_expert_ffn_hidden_size == 2 * 1408
    gpt2 = load_hf_model(HF / "gpt2").model
    assert (gpt2.bias, gpt2.learned_positions, gpt2.tied_embeddings, gpt2.dropout) == ("all", 1024, True, 0.1)


def test_what_the_file_does_not_say_is_filled_and_said():
    hf = load_hf_model(HF / "llama-3-8b")
    assert (hf.model.seq_len, hf.model.global_batch_size) == (4096, 256)
    assert any("--seq-len" in n for n in hf.notes) and any("--global-batch-size" in n for n in hf.notes)
    given = load_hf_model(HF / "llama-3-8b", seq_len=8192, global_batch_size=64)
    assert (given.model.seq_len, given.model.global_batch_size, given.notes) == (8192, 64, ())
    too_long = load_hf_model(HF / "llama-3-8b", seq_len=16384)
    assert any("exceeds max_position_embeddings" in w for w in too_long.warnings)


def test_an_unmodelled_field_is_one_warning_saying_time_or_memory():
    hf = load_hf_model(HF / "pythia-160m")
    assert len(hf.warnings) == 1 and "use_parallel_residual" in hf.warnings[0] and "time" in hf.warnings[0]


def _config(tmp_path, **fields):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    return path


def test_an_architecture_it_cannot_model_is_refused_naming_it(tmp_path):
    with pytest.raises(SpecError, match="deepseek_v3.*multi-head latent attention"):
        load_model(_config(tmp_path, model_type="deepseek_v3", hidden_size=7168))
    with pytest.raises(SpecError, match=r"'falcon' \(\['FalconForCausalLM'\]\) is not a family autotune reads"):
        load_model(_config(tmp_path, model_type="falcon", architectures=["FalconForCausalLM"]))


def test_a_bad_field_is_one_line_naming_it(tmp_path):
    base = json.loads((HF / "llama-3-8b" / "config.json").read_text())
    with pytest.raises(SpecError, match="num_hidden_layers: must be a non-negative integer"):
        load_model(_config(tmp_path, **{**base, "num_hidden_layers": "32"}))
    del base["hidden_size"]
    with pytest.raises(SpecError, match="hidden_size: is required"):
        load_model(_config(tmp_path, **base))


def test_a_directory_without_config_is_not_a_hugging_face_model(tmp_path):
    assert load_hf_model(tmp_path) is None
    with pytest.raises(SpecError):
        load_model(tmp_path)


def test_a_config_json_in_the_working_directory_is_named_after_its_directory(tmp_path, monkeypatch):
    """A published config has no ``_name_or_path``: ``--model config.json`` run inside its directory was a
    model with an empty name (``h100-a100 / `` in messages)."""
    import json

    from autotune import load_model

    d = tmp_path / "qwen2.5-0.5b"
    d.mkdir()
    data = json.loads((EXAMPLES / "hf" / "qwen2.5-0.5b" / "config.json").read_text())
    data.pop("_name_or_path", None)
    (d / "config.json").write_text(json.dumps(data))
    monkeypatch.chdir(d)
    assert load_model("config.json").name == "qwen2.5-0.5b"


@pytest.mark.parametrize(
    ("base", "change", "field"),
    [
        ("llama-3-8b", {"attention_bias": True}, "attention_bias"),
        ("llama-3-8b", {"mlp_bias": True}, "mlp_bias"),
        ("llama-3-8b", {"hidden_act": "gelu"}, "hidden_act"),
        ("mistral-7b", {"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
        (
            "qwen2.5-7b",
            {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 21},
            "max_window_layers",
        ),
        ("qwen3-30b-a3b", {"mlp_only_layers": [3, 7]}, "mlp_only_layers"),
    ],
)
def test_a_field_that_changes_the_model_and_is_not_modelled_is_refused_naming_it(tmp_path, base, change, field):
    """Issue 46, case 5: these trained (or were counted) as if absent, with at most a line saying "memory:
    negligible"; each is now one line naming the field."""
    data = {**json.loads((HF / base / "config.json").read_text()), **change}
    with pytest.raises(SpecError) as e:
        load_model(_config(tmp_path, **data))
    assert e.value.field == field and "\n" not in str(e.value)


def test_qwen2_moe_counts_its_shared_expert_gate():
    hf = load_hf_model(HF / "qwen1.5-moe-a2.7b")
    assert hf.model.shared_expert_gate and hf.model.num_params == hf.implied_params
