"""Spec loading and validation: every rule gives one clear error naming file, field and rule."""

from __future__ import annotations

from pathlib import Path

import pytest
from spec_cases import CLUSTER_RULES, CONFIG_RULES, MODEL_RULES, SPEC_CLUSTER, SPEC_CONFIG, bad_config

from autotune import SpecError, load_cluster, load_config, load_model
from autotune.catalog import GPU_CATALOG, MODEL_PRESETS
from autotune.specs import ParallelConfig


@pytest.fixture
def cluster_file(tmp_path: Path) -> Path:
    p = tmp_path / "cluster.yaml"
    p.write_text(SPEC_CLUSTER)
    return p


def test_spec_example_cluster_loads(cluster_file: Path) -> None:
    c = load_cluster(cluster_file)
    assert c.name == "mixed-a100-v100"
    assert c.device_ids() == tuple(f"a100:{i}" for i in range(4)) + tuple(f"v100:{i}" for i in range(4))
    assert c.device("v100:2").memory_GiB == 32
    assert c.link("a100:0", "a100:3").bandwidth_GBps == 300
    assert c.link("a100:0", "v100:0").bandwidth_GBps == 12.5


def test_repeat_names_nodes_with_suffix() -> None:
    c = load_cluster("mixed-h100-a100-32")
    assert [n.name for n in c.nodes] == ["h100-0", "h100-1", "a100-0", "a100-1"]
    assert c.num_devices == 32


def test_catalog_has_spec_gpus_with_sources() -> None:
    for name in [
        "H200",
        "H100-80GB",
        "A100-80GB",
        "A100-40GB",
        "V100-32GB",
        "A10G",
        "L4",
        "T4",
        "RTX-4090",
        "RTX-3090",
        "A6000",
        "cpu",
    ]:
        assert GPU_CATALOG[name].source, name


@pytest.mark.parametrize(
    "preset,billions",
    [("llama2-7b", 6.74), ("llama2-13b", 13.0), ("llama2-70b", 69.0), ("llama3-8b", 8.03), ("gpt2-xl", 1.64)],
)
def test_model_presets_param_counts(preset: str, billions: float) -> None:
    # Published sizes: Llama 2 7B = 6.74B, 13B = 13.0B, 70B = 69.0B; Llama 3 8B = 8.03B; GPT-2 XL 1.5B + untied head
    assert load_model(preset).num_params / 1e9 == pytest.approx(billions, rel=0.01)


def test_spec_example_config_roundtrip(cluster_file: Path) -> None:
    cfg = load_config(SPEC_CONFIG)
    assert ParallelConfig.from_json(cfg.to_json()) == cfg
    cfg.validate(load_cluster(cluster_file), load_model("llama2-7b", global_batch_size=128))


def test_global_batch_override() -> None:
    assert load_model("tiny", global_batch_size=32).global_batch_size == 32
    assert set(MODEL_PRESETS) >= {"tiny", "gpt2-small", "gpt2-xl", "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b"}


@pytest.mark.parametrize("changes,message", CONFIG_RULES)
def test_config_rules(changes: dict, message: str, cluster_file: Path) -> None:
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg = load_config(bad_config(**changes))
        cfg.validate(load_cluster(cluster_file), load_model("llama2-7b", global_batch_size=128))


@pytest.mark.parametrize("text,message", CLUSTER_RULES)
def test_cluster_rules(text: str, message: str, tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(SpecError) as info:
        load_cluster(p)
    assert message in str(info.value)
    assert str(p) in str(info.value)


@pytest.mark.parametrize("text,message", MODEL_RULES)
def test_model_rules(text: str, message: str, tmp_path: Path) -> None:
    p = tmp_path / "m.yaml"
    p.write_text(text)
    with pytest.raises(SpecError, match=message):
        load_model(p)


def test_unknown_presets() -> None:
    with pytest.raises(SpecError, match="no file or preset named 'nope'"):
        load_cluster("nope")
    with pytest.raises(SpecError, match="no file or preset named 'nope'"):
        load_model("nope")


def test_interleaved_needs_microbatches_divisible_by_stages(cluster_file: Path) -> None:
    cfg = bad_config(schedule="interleaved-1f1b", virtual_stages=2)
    cfg["pipelines"][0]["num_microbatches"] = 63
    cfg["micro_batch_size"] = 1
    with pytest.raises(SpecError, match=r"num_microbatches: interleaved-1f1b needs .* 63 % 2 != 0"):
        load_config(cfg).validate(load_cluster(cluster_file), load_model("llama2-7b", global_batch_size=63))
    cfg["pipelines"][0]["num_microbatches"] = 64
    load_config(cfg).validate(load_cluster(cluster_file), load_model("llama2-7b", global_batch_size=64))
