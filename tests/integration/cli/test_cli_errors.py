"""Every validation rule reaches the CLI as one clean line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import run_cli
from paths import REPO
from spec_cases import CLUSTER_RULES, CONFIG_RULES, MODEL_RULES, SPEC_CLUSTER, SPEC_CONFIG, bad_config

MODEL_OK = (
    "num_layers: 4\nhidden_size: 64\nnum_heads: 4\nffn_hidden_size: 256\nvocab_size: 256\nseq_len: 64\n"
    "global_batch_size: 8\n"
)


def _simulate(capsys, *args: str) -> tuple[int, str, str]:
    return run_cli(capsys, "simulate", *args)


def _assert_one_line(code: int, err: str, message: str) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    assert message in err, err


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(SPEC_CLUSTER)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SPEC_CONFIG))
    return {"cluster": cluster, "config": config, "dir": tmp_path}


@pytest.mark.parametrize("changes,message", CONFIG_RULES)
def test_config_rules(capsys, files, changes: dict, message: str) -> None:
    bad = files["dir"] / "bad.json"
    bad.write_text(json.dumps(bad_config(**changes)))
    code, _, err = _simulate(
        capsys,
        "--cluster",
        str(files["cluster"]),
        "--model",
        "llama2-7b",
        "--config",
        str(bad),
        "--global-batch-size",
        "128",
    )
    _assert_one_line(code, err, message)
    assert str(bad) in err


@pytest.mark.parametrize("text,message", CLUSTER_RULES)
def test_cluster_rules(capsys, files, text: str, message: str) -> None:
    bad = files["dir"] / "bad-cluster.yaml"
    bad.write_text(text)
    code, _, err = _simulate(capsys, "--cluster", str(bad), "--model", "llama2-7b", "--config", str(files["config"]))
    _assert_one_line(code, err, message)


@pytest.mark.parametrize("text,message", MODEL_RULES)
def test_model_rules(capsys, files, text: str, message: str) -> None:
    bad = files["dir"] / "bad-model.yaml"
    bad.write_text(text)
    code, _, err = _simulate(
        capsys, "--cluster", str(files["cluster"]), "--model", str(bad), "--config", str(files["config"])
    )
    _assert_one_line(code, err, message)


OTHER = [
    (["--cluster", "nope"], "no file or preset named 'nope'"),
    (["--model", "nope"], "no file or preset named 'nope'"),
    (["--config", "{dir}/missing.json"], "cannot read file"),
    (["--cluster", "{dir}/missing.yaml"], "cannot read file"),
    (["--config", "{dir}/broken.json"], "invalid JSON"),
    (["--config", "{dir}/list.json"], "must be a mapping at the top level"),
    (["--profile", "{dir}/missing-profile.json"], "cannot read file"),
    (["--profile", "{dir}/broken.json"], "invalid JSON"),
    (["--global-batch-size", "0"], "--global-batch-size: must be a positive integer"),
    (["--model", "{dir}/model.yaml"], "layers sum to 32, model 'model' has num_layers=4"),
]


@pytest.mark.parametrize("override,message", OTHER)
def test_files_presets_and_options(capsys, files, override: list[str], message: str) -> None:
    d = files["dir"]
    (d / "broken.json").write_text('{"micro_batch_size": 2,')
    (d / "list.json").write_text("[1, 2]")
    (d / "model.yaml").write_text(MODEL_OK)
    args = {
        "--cluster": str(files["cluster"]),
        "--model": "llama2-7b",
        "--config": str(files["config"]),
        "--global-batch-size": "128",
    }
    args[override[0]] = override[1].format(dir=d)
    flat = [x for kv in args.items() for x in kv]
    code, _, err = _simulate(capsys, *flat)
    _assert_one_line(code, err, message)


def test_spec_example_json(capsys) -> None:
    root = REPO
    code, out, err = _simulate(
        capsys,
        "--cluster",
        str(root / "examples/cluster.yaml"),
        "--model",
        "llama2-7b",
        "--config",
        str(root / "examples/llama2-7b-config.json"),
        "--global-batch-size",
        "128",
        "--json",
    )
    assert code == 0 and not err
    data = json.loads(out)
    assert {"tokens_per_s", "iteration_time_s", "oom", "peak_memory_GiB", "mfu", "bubble_fraction"} <= set(data)
    assert data["oom"] is False and data["tokens_per_s"] > 0
    assert set(data["peak_memory_GiB"]) == {"a100:0", "a100:1", "v100:0", "v100:1", "v100:2", "v100:3"}


def test_human_table(capsys) -> None:
    root = REPO
    code, out, _ = _simulate(
        capsys,
        "--cluster",
        str(root / "examples/cluster.yaml"),
        "--model",
        "llama2-7b",
        "--config",
        str(root / "examples/llama2-7b-config.json"),
        "--global-batch-size",
        "128",
    )
    assert code == 0
    # The SPEC example fits with fused attention (the default), which stores no attention scores.
    assert "out of memory" not in out and "a100:0" in out and "v100:3" in out


def test_real_process_prints_one_line(files) -> None:
    bad = files["dir"] / "bad.json"
    bad.write_text(json.dumps(bad_config(**{"pipelines.0.stages.0.layers": 19})))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune.cli",
            "simulate",
            "--cluster",
            str(files["cluster"]),
            "--model",
            "llama2-7b",
            "--config",
            str(bad),
            "--global-batch-size",
            "128",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "layers sum to 31" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--nnode", "2"], "train: --nnode: is not a torchrun option (did you mean --nnodes?)"),
        (["--nnodes=2", "--nproc-per-node"], "torchrun: --nproc-per-node: needs a value"),
        (["--module"], "train: --module: is not a torchrun option"),
        (["stray"], "train: stray: is not an option of train or torchrun"),
    ],
)
def test_train_refuses_a_torchrun_typo_before_launching(tmp_path, extra, message) -> None:
    """An argument ``train`` passes through to torchrun that torchrun does not know is one line, exit 2, in
    seconds: torchrun's own parser takes ``--nnode 2`` as ``--nnodes 2`` and waited ten minutes for a second
    machine before it printed a traceback."""
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps(
            {
                "micro_batch_size": 1,
                "pipelines": [{"num_microbatches": 8, "stages": [{"devices": ["cpu:0"], "layers": 4}]}],
            }
        )
    )
    cmd = [sys.executable, "-m", "autotune.cli", "train", "--cluster", "cpu-2", "--model", "tiny"]
    cmd += ["--config", str(plan), "--steps", "2", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    _assert_one_line(r.returncode, r.stderr, message)


def test_simulate_says_a_cpu_device_without_a_profile_is_the_catalog_s_nominal_core(capsys, tmp_path) -> None:
    config = tmp_path / "plan.json"
    stages = [{"devices": ["cpu:0"], "layers": 2}, {"devices": ["cpu:1"], "layers": 2}]
    config.write_text(json.dumps({"micro_batch_size": 2, "pipelines": [{"num_microbatches": 4, "stages": stages}]}))
    code, out, _ = _simulate(capsys, "--cluster", "cpu-2", "--model", "tiny", "--config", str(config))
    assert code == 0 and "nominal core" in " ".join(out.split())
    code, out, _ = _simulate(
        capsys,
        "--cluster",
        str(REPO / "examples/cluster.yaml"),
        "--model",
        "llama2-7b",
        "--config",
        str(REPO / "examples/llama2-7b-config.json"),
        "--global-batch-size",
        "128",
    )
    assert code == 0 and "nominal core" not in " ".join(out.split()) and "no --profile" in out
