"""Malformed, hostile and huge files are one short error line (``autotune.documents``), every field has
a documented upper bound (``autotune.specs.LIMITS``), and echoed values are cut short."""

from __future__ import annotations

import json
import re
import sys

import pytest
from cli_run import run_cli
from paths import REPO

from autotune import cli
from autotune.documents import MAX_DEPTH, MAX_FILE_BYTES
from autotune.specs import LIMITS, MAX_DEVICES

ROOT = REPO
MODEL = {
    "name": "m",
    "num_layers": 4,
    "hidden_size": 64,
    "num_heads": 4,
    "ffn_hidden_size": 256,
    "vocab_size": 256,
    "seq_len": 64,
    "global_batch_size": 8,
}
CLUSTER = {
    "name": "c",
    "nodes": [{"name": "cpu", "gpu": "cpu", "count": 2}],
    "network": {"bandwidth_GBps": 1.0, "latency_us": 10},
}
PLAN = {
    "micro_batch_size": 1,
    "schedule": "1f1b",
    "pipelines": [{"num_microbatches": 8, "stages": [{"devices": ["cpu:0"], "layers": 4}]}],
}


def simulate(capsys, tmp_path, cluster=None, model=None, config=None, extra=()) -> tuple[int, str]:
    """``autotune simulate`` on the given documents (dicts are written as JSON, bytes as they are)."""

    def path(name, doc, default):
        p = tmp_path / name
        doc = default if doc is None else doc
        p.write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
        return str(p)

    code, _, err = run_cli(
        capsys,
        "simulate",
        "--cluster",
        path("cluster.json", cluster, CLUSTER),
        "--model",
        path("model.json", model, MODEL),
        "--config",
        path("plan.json", config, PLAN),
        *extra,
    )
    return code, err


def one_line(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert len(err) < 700, err[:200]
    for needle in needles:
        assert needle in err, err


def test_the_plain_files_work(capsys, tmp_path):
    code, err = simulate(capsys, tmp_path)
    assert code == 0, err


# -- bad files ------------------------------------------------------------------------------------------

BOMB = (
    "\n".join(
        [f"l0: &l0 [{', '.join(['lol'] * 9)}]"]
        + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    )
    + "\nname: *l8\n"
)


@pytest.mark.parametrize(
    "kind,content,message",
    [
        ("latin-1 byte in a comment", b"# caf\xe9\nnum_layers: 4\n", "is not UTF-8 text: byte 0xe9 at line 1"),
        ("binary", bytes(range(256)) * 8, "is not UTF-8 text"),
        ("5000-deep YAML", ("a: " + "[" * 5000 + "]" * 5000 + "\n").encode(), "nested too deeply"),
        ("40-deep YAML", ("a: " + "[" * 40 + "]" * 40 + "\n").encode(), f"nested deeper than the limit of {MAX_DEPTH}"),
        ("mixed-type keys", b"name: m\n1: 2\nnum_layers: 4\n", "key 1 must be a string"),
        ("huge integer", ("vocab_size: " + "9" * 400 + "\n").encode(), "vocab_size: integer 9999"),
        ("alias bomb", BOMB.encode(), "holds more than 1,000,000 values"),
    ],
)
def test_bad_yaml_model_files(capsys, tmp_path, kind, content, message):
    assert len(BOMB) < 600  # the campaign's bomb was 515 bytes
    path = tmp_path / "model.yaml"
    path.write_bytes(content)
    argv = sys.argv
    sys.argv = ["autotune", "simulate", "--cluster", "cpu-2", "--model", str(path), "--config", "x.json"]
    try:
        with pytest.raises(SystemExit) as info:
            cli.main()
    finally:
        sys.argv = argv
    one_line(info.value.code, capsys.readouterr().err, message, str(path))


def test_5000_deep_json_plan(capsys, tmp_path):
    code, err = simulate(capsys, tmp_path, config=b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    one_line(code, err, "plan.json: is nested too deeply")


def test_infinite_number_in_json(capsys, tmp_path):
    code, err = simulate(
        capsys, tmp_path, model=json.dumps(MODEL).replace('"vocab_size": 256', '"vocab_size": 1e400').encode()
    )
    one_line(code, err, "model.json: vocab_size: must be a finite number, got inf")


def test_binary_profile(capsys, tmp_path):
    prof = tmp_path / "profile.json"
    prof.write_bytes(bytes(range(128, 256)) * 4)
    code, err = simulate(capsys, tmp_path, extra=("--profile", str(prof)))
    one_line(code, err, "profile.json: is not UTF-8 text")


def test_file_over_the_size_limit(capsys, tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)
    code, err = simulate(capsys, tmp_path, extra=("--profile", str(big)))
    one_line(code, err, f"is larger than the limit of {MAX_FILE_BYTES:,} bytes")


# -- bounds -----------------------------------------------------------------------------------------------


def _set(doc: dict, path: str, value) -> dict:
    doc = json.loads(json.dumps(doc))
    *parents, last = path.split(".")
    target = doc
    for key in parents:
        target = target[int(key)] if key.isdigit() else target[key]
    target[last] = value
    return doc


#: where each limited field sits in the three documents
WHERE = {
    "count": ("cluster", "nodes.0.count"),
    "repeat": ("cluster", "nodes.0.repeat"),
    "latency_us": ("cluster", "network.latency_us"),
    "slowdown": ("cluster", "nodes.0.slowdown"),
    "num_layers": ("model", "num_layers"),
    "hidden_size": ("model", "hidden_size"),
    "num_heads": ("model", "num_heads"),
    "num_kv_heads": ("model", "num_kv_heads"),
    "ffn_hidden_size": ("model", "ffn_hidden_size"),
    "vocab_size": ("model", "vocab_size"),
    "seq_len": ("model", "seq_len"),
    "global_batch_size": ("model", "global_batch_size"),
    "num_experts": ("model", "num_experts"),
    "experts_per_token": ("model", "experts_per_token"),
    "expert_ffn_hidden_size": ("model", "expert_ffn_hidden_size"),
    "moe_layer_every": ("model", "moe_layer_every"),
    "head_dim": ("model", "head_dim"),
    "learned_positions": ("model", "learned_positions"),
    "sliding_window": ("model", "sliding_window"),
    "shared_expert_ffn_hidden_size": ("model", "shared_expert_ffn_hidden_size"),
    "first_dense_layers": ("model", "first_dense_layers"),
    "expert_parallel": ("config", "expert_parallel"),
    "sync_every_steps": ("config", "sync_every_steps"),
    "micro_batch_size": ("config", "micro_batch_size"),
    "num_microbatches": ("config", "pipelines.0.num_microbatches"),
    "virtual_stages": ("config", "virtual_stages"),
    "layers": ("config", "pipelines.0.stages.0.layers"),
}


def test_every_limit_is_placed_here_and_documented():
    assert set(WHERE) == set(LIMITS)
    docs = (ROOT / "docs" / "formats.md").read_text()
    section = docs[docs.index("## Limits") :]
    for name, limit in LIMITS.items():
        assert re.search(rf"`{name}`[^\n]*{int(limit):,}", section), name
    assert f"{MAX_DEVICES:,}" in section


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_each_bound_is_refused_with_its_number(capsys, tmp_path, name):
    limit = int(LIMITS[name])
    kind, path = WHERE[name]
    docs = {"cluster": CLUSTER, "model": MODEL, "config": PLAN}
    docs[kind] = _set(docs[kind], path, limit + 1 if limit < 10**6 else 10**9)
    code, err = simulate(capsys, tmp_path, **docs)
    one_line(code, err, f"{name}: must be <= {limit:,} (the documented limit)")


def test_total_devices_and_global_batch_size_option(capsys, tmp_path):
    cluster = _set(CLUSTER, "nodes.0.count", 1024)
    cluster = _set(cluster, "nodes.0.repeat", 17)
    code, err = simulate(capsys, tmp_path, cluster=cluster)
    one_line(code, err, f"more than {MAX_DEVICES:,} devices")
    code, err = simulate(capsys, tmp_path, extra=("--global-batch-size", str(10**15)))
    one_line(code, err, "--global-batch-size: must be <= 1,048,576")


# -- echoed values ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,path,value",
    [
        ("cluster", "nodes.0.gpu", "x" * 100_000),
        ("model", "num_layers", "7" * 100_000),
        ("model", "mlp", ["a"] * 100_000),
        ("config", "schedule", "y" * 100_000),
        ("cluster", "nodes.0.name", "z" * 100_000),
    ],
)
def test_echoed_values_are_cut_short(capsys, tmp_path, kind, path, value):
    docs = {"cluster": CLUSTER, "model": MODEL, "config": PLAN}
    docs[kind] = _set(docs[kind], path, value)
    code, err = simulate(capsys, tmp_path, **docs)
    one_line(code, err)


def test_a_long_preset_name_is_cut_short(capsys):
    argv = sys.argv
    sys.argv = ["autotune", "simulate", "--cluster", "q" * 50_000, "--model", "tiny", "--config", "x.json"]
    try:
        with pytest.raises(SystemExit) as info:
            cli.main()
    finally:
        sys.argv = argv
    one_line(info.value.code, capsys.readouterr().err, "no file or preset named 'qqq", "characters)")


# -- accepted silently before -----------------------------------------------------------------------------


def test_unknown_key_in_a_pipeline_entry(capsys, tmp_path):
    code, err = simulate(capsys, tmp_path, config=_set(PLAN, "pipelines.0.num_micro_batches", 8))
    one_line(code, err, "pipelines[0].num_micro_batches: unknown field")


def test_interleaved_1f1b_needs_virtual_stages(capsys, tmp_path):
    code, err = simulate(capsys, tmp_path, config=_set(PLAN, "schedule", "interleaved-1f1b"))
    one_line(code, err, "virtual_stages: interleaved-1f1b needs virtual_stages >= 2")


def test_node_name_null(capsys, tmp_path):
    code, err = simulate(capsys, tmp_path, cluster=_set(CLUSTER, "nodes.0.name", None))
    one_line(code, err, "nodes[0].name: must be a non-empty string, got None")
