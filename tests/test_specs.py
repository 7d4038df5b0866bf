"""Spec loading and validation: every rule gives one clear error naming file, field and rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune import SpecError, load_cluster, load_config, load_model
from autotune.catalog import GPU_CATALOG, MODEL_PRESETS
from autotune.specs import ParallelConfig

SPEC_CLUSTER = """
name: mixed-a100-v100
nodes:
  - name: a100
    gpu: A100-80GB
    count: 4
    intra_node: {bandwidth_GBps: 300, latency_us: 2}
  - name: v100
    gpu: {name: V100-32GB, peak_tflops: 125, memory_GiB: 32, memory_bandwidth_GBps: 900}
    count: 4
    intra_node: {bandwidth_GBps: 16, latency_us: 5}
network: {bandwidth_GBps: 12.5, latency_us: 10}
"""

SPEC_CONFIG = {
    "micro_batch_size": 2,
    "schedule": "1f1b",
    "pipelines": [
        {
            "num_microbatches": 64,
            "stages": [
                {"devices": ["a100:0", "a100:1"], "layers": 20, "recompute": False},
                {"devices": ["v100:0", "v100:1", "v100:2", "v100:3"], "layers": 12, "recompute": True},
            ],
        }
    ],
}


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


def _bad_config(**changes) -> dict:
    cfg = json.loads(json.dumps(SPEC_CONFIG))
    for path, value in changes.items():
        target = cfg
        keys = path.split(".")
        for k in keys[:-1]:
            target = target[int(k)] if k.isdigit() else target[k]
        last = keys[-1]
        target[int(last) if last.isdigit() else last] = value
    return cfg


CONFIG_RULES = [
    (dict(**{"pipelines.0.stages.0.layers": 19}), "layers sum to 31"),
    (dict(**{"pipelines.0.stages.1.devices": ["a100:0", "v100:1"]}), "used more than once"),
    (dict(**{"pipelines.0.stages.1.devices": ["v100:9"]}), "unknown device id 'v100:9'"),
    (dict(**{"pipelines.0.num_microbatches": 63}), "global_batch_size is 128"),
    (dict(schedule="zigzag"), "schedule: must be one of"),
    (dict(micro_batch_size=0), "micro_batch_size: must be > 0"),
    (dict(**{"pipelines.0.stages.1.devices": ["v100:0", "v100:1", "v100:2"]}), "tensor-parallel degree 3"),
    (dict(virtual_stages=2), "virtual_stages: only applies to interleaved-1f1b"),
    (dict(**{"pipelines.0.stages.0.speed": 3}), "speed: unknown field"),
]


@pytest.mark.parametrize("changes,message", CONFIG_RULES)
def test_config_rules(changes: dict, message: str, cluster_file: Path) -> None:
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg = load_config(_bad_config(**changes))
        cfg.validate(load_cluster(cluster_file), load_model("llama2-7b", global_batch_size=128))


CLUSTER_RULES = [
    ("nodes: []\nnetwork: {bandwidth_GBps: 1}", "nodes: is required and must be a non-empty list"),
    ("nodes:\n  - {name: a, gpu: B200, count: 1}\nnetwork: {bandwidth_GBps: 1}", "nodes[0].gpu: unknown GPU 'B200'"),
    ("nodes:\n  - {name: a, gpu: T4, count: 0}\nnetwork: {bandwidth_GBps: 1}", "nodes[0].count: must be > 0"),
    ("nodes:\n  - {name: a, gpu: T4, count: 1}\nnetwork: {bandwidth_GBps: -3}", "network.bandwidth_GBps: must be > 0"),
    ("nodes:\n  - {name: a, gpu: T4, count: 1}", "network: is required"),
    ("nodes:\n  - {name: a, gpu: T4, count: 1, slowdown: 2}\nnetwork: {bandwidth_GBps: 1}", "CPU emulation only"),
    (
        "nodes:\n  - {name: a, gpu: T4, count: 1}\n  - {name: a, gpu: T4, count: 1}\nnetwork: {bandwidth_GBps: 1}",
        "used twice",
    ),
    ("nodes: [ {name: a", "invalid YAML"),
    ("- 1\n- 2", "must be a mapping at the top level"),
    (
        "nodes:\n  - {name: a, gpu: T4, count: 1, colour: red}\nnetwork: {bandwidth_GBps: 1}",
        "nodes[0].colour: unknown field",
    ),
]


@pytest.mark.parametrize("text,message", CLUSTER_RULES)
def test_cluster_rules(text: str, message: str, tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(SpecError) as info:
        load_cluster(p)
    assert message in str(info.value)
    assert str(p) in str(info.value)


MODEL_RULES = [
    (
        "num_layers: 2\nhidden_size: 65\nnum_heads: 4\nffn_hidden_size: 8\nvocab_size: 8\nseq_len: 8\nglobal_batch_size: 1",
        "hidden_size: must be divisible by num_heads",
    ),
    (
        "num_layers: 2\nhidden_size: 64\nnum_heads: 4\nffn_hidden_size: 8\nvocab_size: 8\nseq_len: 8",
        "global_batch_size: is required",
    ),
    (
        "num_layers: 2\nhidden_size: 64\nnum_heads: 4\nffn_hidden_size: 8\nvocab_size: 8\nseq_len: 8\nglobal_batch_size: 1\nmlp: relu",
        "mlp: must be one of",
    ),
    (
        "num_layers: 2\nhidden_size: 64\nnum_heads: 4\nnum_kv_heads: 3\nffn_hidden_size: 8\nvocab_size: 8\nseq_len: 8\nglobal_batch_size: 1",
        "num_kv_heads: must divide num_heads",
    ),
    (
        "num_layers: 2.5\nhidden_size: 64\nnum_heads: 4\nffn_hidden_size: 8\nvocab_size: 8\nseq_len: 8\nglobal_batch_size: 1",
        "num_layers: must be an integer",
    ),
]


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
    cfg = _bad_config(schedule="interleaved-1f1b", virtual_stages=2)
    cfg["pipelines"][0]["num_microbatches"] = 63
    cfg["micro_batch_size"] = 1
    with pytest.raises(SpecError, match=r"num_microbatches: interleaved-1f1b needs .* 63 % 2 != 0"):
        load_config(cfg).validate(load_cluster(cluster_file), load_model("llama2-7b", global_batch_size=63))
    cfg["pipelines"][0]["num_microbatches"] = 64
    load_config(cfg).validate(load_cluster(cluster_file), load_model("llama2-7b", global_batch_size=64))
