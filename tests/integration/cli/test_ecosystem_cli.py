"""The ecosystem commands as a user runs them: a Hugging Face config as --model, search --engine, export
--to, discover (alone and under torchrun) writing a cluster file simulate accepts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_run import run_cli
from paths import EXAMPLES, REPO

AUTOTUNE = str(Path(sys.executable).parent / "autotune")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


_cli = run_cli


def test_a_hugging_face_config_is_the_model_with_its_parameter_count(capsys):
    code, out, err = _cli(
        capsys,
        "simulate",
        "--cluster",
        "mixed-a100-v100",
        "--model",
        str(EXAMPLES / "hf" / "llama-3-8b"),
        "--global-batch-size",
        "128",
        "--config",
        str(EXAMPLES / "llama-3-8b-config.json"),
        "--json",
    )
    assert code == 0, err
    assert "model llama-3-8b (llama): 8.030B parameters; the config implies 8.030B" in err
    assert "seq_len 4,096 (the default; --seq-len sets it)" in err
    assert json.loads(out)["status"] == "ok"


@pytest.mark.slow
def test_search_with_an_engine_then_export(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    hf = str(EXAMPLES / "hf" / "qwen2.5-7b")
    code, out, err = _cli(
        capsys,
        "search",
        "--cluster",
        "mixed-a100-v100",
        "--model",
        hf,
        "--method",
        "dp",
        "--budget",
        "6",
        "--engine",
        "megatron",
        "--tracking-uri",
        f"sqlite:///{tmp_path}/mlflow.db",
        "--output",
        str(plan),
    )
    assert code == 0, err
    assert "without --engine: " in err  # how much faster the best plan without it is (or that none is)
    code, out, err = _cli(
        capsys, "export", "--to", "megatron", str(plan), "--cluster", "mixed-a100-v100", "--model", hf
    )
    assert code == 0, err
    assert "--tensor-model-parallel-size" in out and "--add-qkv-bias" in out
    written = tmp_path / "plan.json"
    code, out, err = _cli(capsys, "export", "--to", "deepspeed", str(plan), "--output", str(written))
    if code == 0:  # a plan Megatron-LM runs may or may not be one DeepSpeed runs: either way one clear answer
        assert json.loads(written.read_text())["train_batch_size"] == 256
    else:
        assert code == 2 and err.startswith("error: DeepSpeed: ") and err.count("\n") == 1, err


def test_simulate_predicts_a_plan_as_the_named_engine_holds_it(capsys, tmp_path):
    """Llama-3-8B (a 128k vocabulary), two stages of tp 2: both engines split the LM head and the logits over
    the last stage's tp ranks; its loss holds 16 bytes per logit under autotune's runner (the fp32 logits the
    pipeline keeps beside the log-softmax and two gradients) and 10 under Megatron-LM (bf16 logits + 8)
    (``autotune.simulator.engine_terms``)."""
    plan = tmp_path / "plan.json"
    stages = [
        {"devices": ["v100:0", "v100:1"], "layers": 14, "recompute": True},
        {"devices": ["a100:0", "a100:1"], "layers": 18, "recompute": True},
    ]
    plan.write_text(json.dumps({"micro_batch_size": 1, "pipelines": [{"num_microbatches": 128, "stages": stages}]}))
    args = ["--cluster", "mixed-a100-v100", "--model", str(EXAMPLES / "hf" / "llama-3-8b"), "--config", str(plan)]
    args += ["--global-batch-size", "128"]
    peaks = {}
    for engine in (None, "megatron"):
        code, out, err = _cli(capsys, "simulate", *args, "--json", *(["--engine", engine] if engine else []))
        assert code == 0, err
        peaks[engine] = json.loads(out)["peak_memory_GiB"]
    # the last stage holds 6 bytes less per logit of its half under Megatron-LM, the first about the same
    from autotune import load_model

    model = load_model(str(EXAMPLES / "hf" / "llama-3-8b"), 128)
    logits = model.seq_len * model.vocab_size / 2
    assert peaks[None]["a100:0"] - peaks["megatron"]["a100:0"] == pytest.approx(6 * logits / 2**30, rel=0.15)
    assert abs(peaks[None]["v100:0"] - peaks["megatron"]["v100:0"]) < 0.5
    code, out, err = _cli(capsys, "simulate", *args, "--engine", "torchtitan")
    assert code == 2 and "torchtitan does not run this plan: tensor parallelism without sequence" in err, err
    code, out, err = _cli(capsys, "simulate", *args, "--engine", "jax")
    assert code == 2 and "--engine: must be one of torchtitan, megatron, deepspeed" in err and err.count("\n") == 1


def test_export_of_a_plan_the_engine_cannot_run_is_one_line_exit_2(capsys):
    code, out, err = _cli(capsys, "export", "--to", "deepspeed", str(EXAMPLES / "mixed-stage-plan.json"))
    assert code == 2 and out == ""
    assert err.startswith("error: DeepSpeed: ") and "mixed-GPU stage" in err and err.count("\n") == 1, err
    code, out, err = _cli(capsys, "export", "--to", "jax", str(EXAMPLES / "mixed-stage-plan.json"))
    assert code == 2 and "--to: must be one of torchtitan, megatron, deepspeed" in err  # not --engine


def test_export_honours_the_batch_and_checks_the_plan_against_the_model_without_a_cluster(capsys, tmp_path):
    """Issue 46, case 10: ``--global-batch-size`` was dropped for presets and YAML models unless ``--seq-len``
    came too, and ``export --model`` without ``--cluster`` never checked the plan (a 32-layer plan was
    written for Llama-2-13B's 40 layers)."""
    plan = str(EXAMPLES / "llama2-7b-config.json")  # 32 layers, global batch 128
    code, out, err = _cli(
        capsys, "export", "--to", "deepspeed", plan, "--model", "llama2-13b", "--global-batch-size", "128"
    )
    assert code == 2 and "layers sum to 32" in err and "num_layers=40" in err, err
    code, out, err = _cli(capsys, "export", "--to", "deepspeed", plan, "--model", "llama2-7b")  # its batch is 512
    assert code == 2 and "global_batch_size is 512" in err, err
    simple = tmp_path / "plan.json"
    stages = [{"devices": ["a100:0"], "layers": 16}, {"devices": ["a100:1"], "layers": 16}]
    simple.write_text(json.dumps({"micro_batch_size": 1, "pipelines": [{"num_microbatches": 128, "stages": stages}]}))
    code, out, err = _cli(
        capsys, "export", "--to", "deepspeed", str(simple), "--model", "llama2-7b", "--global-batch-size", "128"
    )
    assert code == 0 and json.loads(out)["train_batch_size"] == 128, err


def test_the_readme_layerwise_example_simulates_and_no_engine_exports_it(capsys):
    plan = str(EXAMPLES / "layerwise-plan.json")
    cluster = str(EXAMPLES / "cpu-fast-slow.yaml")
    code, out, err = _cli(capsys, "simulate", "--cluster", cluster, "--model", "tiny", "--config", plan, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["status"] == "ok" and result["expected_error"] > 0
    code, out, err = _cli(capsys, "export", "--to", "torchtitan", plan)
    assert code == 2 and "layer-wise execution" in err and err.count("\n") == 1, err


def _simulate_on(capsys, cluster_file: Path, tmp_path: Path) -> dict:
    """A plan over every device of the discovered cluster (one stage each), simulated."""
    doc = yaml.safe_load(cluster_file.read_text())
    devices = [f"{n['name']}:{i}" for n in doc["nodes"] for i in range(n["count"])]
    plan = {
        "micro_batch_size": 1,
        "schedule": "1f1b",
        "pipelines": [
            {"num_microbatches": 8, "stages": [{"devices": [d], "layers": 4 // len(devices)} for d in devices]}
        ],
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    code, out, err = _cli(
        capsys,
        "simulate",
        "--cluster",
        str(cluster_file),
        "--model",
        "tiny",
        "--config",
        str(tmp_path / "plan.json"),
        "--json",
    )
    assert code == 0, err
    return json.loads(out)


@pytest.mark.slow
def test_discover_on_this_machine_writes_a_cluster_simulate_accepts(capsys, tmp_path):
    out = tmp_path / "cluster.yaml"
    proc = subprocess.run([AUTOTUNE, "discover", "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = yaml.safe_load(out.read_text())
    (node,) = doc["nodes"]
    assert node["gpu"] == "cpu" and node["count"] == (os.cpu_count() or 1)
    assert 0 < node["intra_node"]["bandwidth_GBps"] < 1000 and node["intra_node"]["latency_us"] > 0
    assert node["host"]["memory_GiB"] > 0
    # a node of one or of two cores: the tiny model's 4 layers over its devices
    if node["count"] in (1, 2, 4):
        assert _simulate_on(capsys, out, tmp_path)["status"] == "ok"


def _torchrun_discover(out: Path, agents: list[list[str]]) -> None:
    procs = [
        subprocess.Popen(
            [TORCHRUN, *agent, AUTOTUNE, "discover", "--output", str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            start_new_session=True,
        )
        for agent in agents
    ]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    assert all(p.returncode == 0 for p in procs), outs


@pytest.mark.slow
@pytest.mark.distributed
def test_discover_under_torchrun_two_processes_of_one_machine(capsys, tmp_path):
    out = tmp_path / "cluster.yaml"
    _torchrun_discover(out, [["--standalone", "--nproc-per-node", "2"]])
    doc = yaml.safe_load(out.read_text())
    (node,) = doc["nodes"]
    assert node["count"] == 2 and node["intra_node"]["bandwidth_GBps"] > 0  # measured between the two ranks
    assert _simulate_on(capsys, out, tmp_path)["status"] == "ok"


@pytest.mark.slow
@pytest.mark.distributed
def test_discover_under_torchrun_measures_the_link_between_two_nodes(capsys, tmp_path):
    from servers import free_port

    out = tmp_path / "cluster.yaml"
    rendezvous = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
    ]
    _torchrun_discover(out, [[*rendezvous, "--node-rank", str(n)] for n in (0, 1)])
    doc = yaml.safe_load(out.read_text())
    assert [n["count"] for n in doc["nodes"]] == [1, 1]
    assert len({n["name"] for n in doc["nodes"]}) == 2
    second = doc["nodes"][1]["network"]
    assert 0 < second["bandwidth_GBps"] and second["latency_us"] > 0
    assert doc["network"] == second  # the slowest measured link is the default
    assert _simulate_on(capsys, out, tmp_path)["status"] == "ok"
