"""The runner's ZeRO sharding and CPU offload (runner.zero): real gloo runs against single-process
training, exact resume from sharded checkpoints, and the plan shapes it refuses before launch.

Tolerance as in tests/integration/runner/test_runner_distributed.py: the same fp32 math in another summation order
(reduce-scatter + all-gather instead of all-reduce, per-micro-batch accumulation in the shard)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mixed_runs import rewind

from autotune import load_cluster, load_config, load_model
from runner.layout import build_layout, replicas_out_of_step
from runner.reference import reference_losses
from runner.train import train

STEPS = 6
RTOL = 1e-5


def st(device, layers, recompute=False, offload="none"):
    return {
        "devices": [device] if isinstance(device, str) else device,
        "layers": layers,
        "recompute": recompute,
        "offload": offload,
    }


PLANS = {
    # zero 1 on uneven replicas (layers 3+1 / 1+3, 5 + 3 micro-batches), one replica offloading its optimizer
    "zero1-uneven-offload": (
        "cpu-4",
        {
            "micro_batch_size": 1,
            "zero": 1,
            "pipelines": [
                {
                    "num_microbatches": 5,
                    "stages": [st("cpu:0", 3, offload="optimizer"), st("cpu:1", 1, True, "optimizer")],
                },
                {"num_microbatches": 3, "stages": [st("cpu:2", 1), st("cpu:3", 3)]},
            ],
        },
    ),
    # zero 3 on two uneven single-stage replicas (5 + 3 micro-batches); one streams everything from host
    # memory, the other recomputes
    "zero3-all": (
        "cpu-2",
        {
            "micro_batch_size": 1,
            "zero": 3,
            "pipelines": [
                {"num_microbatches": 5, "stages": [st("cpu:0", 4, offload="all")]},
                {"num_microbatches": 3, "stages": [st("cpu:1", 4, True)]},
            ],
        },
    ),
    # zero 2 across two 2-stage replicas, optimizer offloaded
    "zero2-pipelines-offload": (
        "cpu-4",
        {
            "micro_batch_size": 1,
            "zero": 2,
            "pipelines": [
                {
                    "num_microbatches": 4,
                    "stages": [st("cpu:0", 1, offload="optimizer"), st("cpu:1", 3, True, "optimizer")],
                },
                {
                    "num_microbatches": 4,
                    "stages": [st("cpu:2", 1, offload="optimizer"), st("cpu:3", 3, offload="optimizer")],
                },
            ],
        },
    ),
    # zero 2 across replicas that split the layers differently (3+1 / 1+3) and run different micro-batch
    # counts (5 + 3): the per-micro-batch reduce-scatters reach each layer's group in another order on
    # each replica (issued without waiting, runner.zero); one replica recomputes and offloads its optimizer
    "zero2-uneven-replicas": (
        "cpu-4",
        {
            "micro_batch_size": 1,
            "zero": 2,
            "pipelines": [
                {"num_microbatches": 5, "stages": [st("cpu:0", 3), st("cpu:1", 1, True, "optimizer")]},
                {"num_microbatches": 3, "stages": [st("cpu:2", 1), st("cpu:3", 3)]},
            ],
        },
    ),
    # zero 3 over the same uneven replicas: the per-use gathers served point to point (runner.zero), one
    # stage streaming its shard from host memory (offload all), another recomputing
    "zero3-uneven-replicas": (
        "cpu-4",
        {
            "micro_batch_size": 1,
            "zero": 3,
            "pipelines": [
                {"num_microbatches": 5, "stages": [st("cpu:0", 3), st("cpu:1", 1, True, "all")]},
                {"num_microbatches": 3, "stages": [st("cpu:2", 1, offload="optimizer"), st("cpu:3", 3)]},
            ],
        },
    ),
}


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return reference_losses("tiny", STEPS)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("plan", list(PLANS))
def test_sharded_and_offloaded_plans_train_like_a_single_process(plan, reference, tmp_path):
    cluster, config = PLANS[plan]
    out = train(cluster, "tiny", config, steps=STEPS, metrics_out=tmp_path / "m.jsonl", quiet=True, timeout_s=240)
    assert out.returncode == 0, out.error
    losses = _losses(tmp_path / "m.jsonl")
    assert len(losses) == STEPS and losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=RTOL, atol=0)


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_from_a_sharded_checkpoint_is_exact(tmp_path):
    """zero 2 with the optimizer offloaded, two uneven replicas: 6 steps checkpointed at 3, then --resume from step 3
    to 6: the same steps 4-6."""
    config = {
        "micro_batch_size": 1,
        "zero": 2,
        "pipelines": [
            {"num_microbatches": 5, "stages": [st("cpu:0", 4, offload="optimizer")]},
            {"num_microbatches": 3, "stages": [st("cpu:1", 4, offload="optimizer")]},
        ],
    }
    ckpt = tmp_path / "ckpt"
    common = {"checkpoint_dir": ckpt, "quiet": True, "timeout_s": 240}
    whole = train(
        "cpu-2", "tiny", config, steps=STEPS, metrics_out=tmp_path / "whole.jsonl", checkpoint_every=3, **common
    )
    assert whole.returncode == 0, whole.error
    assert any(p.name.endswith(".distcp") for p in (ckpt / "step-00000003").iterdir())
    rewind(ckpt, 3)
    second = train("cpu-2", "tiny", config, steps=STEPS, resume=True, metrics_out=tmp_path / "a.jsonl", **common)
    assert second.returncode == 0, second.error
    assert _losses(tmp_path / "a.jsonl") == _losses(tmp_path / "whole.jsonl")[3:]  # bit for bit


def _layout(cluster, config):
    return build_layout(load_cluster(cluster), load_model("tiny"), load_config(config))


def test_zero_3_runs_over_replicas_out_of_step_and_in_step():
    tp_zero3 = {
        "micro_batch_size": 1,
        "zero": 3,
        "pipelines": [
            {"num_microbatches": 4, "stages": [st(["cpu:0", "cpu:1"], 4)]},
            {"num_microbatches": 4, "stages": [st(["cpu:2", "cpu:3"], 4)]},
        ],
    }
    assert _layout("cpu-4", tp_zero3).sharded  # runs: test_zero_tensor_parallel.py
    uneven_split = {
        "micro_batch_size": 1,
        "zero": 3,
        "pipelines": [
            {"num_microbatches": 4, "stages": [st("cpu:0", 3), st("cpu:1", 1)]},
            {"num_microbatches": 4, "stages": [st("cpu:2", 1), st("cpu:3", 3)]},
        ],
    }
    assert _layout("cpu-4", uneven_split).sharded  # gathers served point to point (zero3-uneven-replicas)
    uneven_counts = {
        "micro_batch_size": 1,
        "zero": 3,
        "pipelines": [
            {"num_microbatches": 5, "stages": [st("cpu:0", 2), st("cpu:1", 2)]},
            {"num_microbatches": 3, "stages": [st("cpu:2", 2), st("cpu:3", 2)]},
        ],
    }
    assert _layout("cpu-4", uneven_counts).sharded
    # zero 1-3 on any split and counts
    assert _layout("cpu-4", dict(uneven_split, zero=1)).sharded
    assert _layout("cpu-4", dict(uneven_split, zero=2)).sharded
    assert _layout("cpu-4", dict(uneven_counts, zero=2)).sharded
    # ... their reduce-scatters issued without waiting there only (in step, each call waits: less memory), and
    # zero 3's gathers served point to point (in step: all-gathers)
    assert replicas_out_of_step(_layout("cpu-4", uneven_split))
    assert replicas_out_of_step(_layout("cpu-4", dict(uneven_split, zero=2)))
    assert replicas_out_of_step(_layout("cpu-4", dict(uneven_counts, zero=2)))
    assert not replicas_out_of_step(_layout("cpu-4", PLANS["zero2-pipelines-offload"][1]))
    assert not replicas_out_of_step(_layout("cpu-2", PLANS["zero3-all"][1]))  # single stages: counts may differ
    assert _layout("cpu-2", PLANS["zero3-all"][1]).sharded
    assert not _layout(
        "cpu-2", {"micro_batch_size": 1, "pipelines": [{"num_microbatches": 8, "stages": [st("cpu:0", 4)]}]}
    ).sharded


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("offload", ["optimizer", "all"])
def test_offload_on_cuda_moves_state_to_pinned_host_memory_and_trains(offload, tmp_path):
    """The same code path on one GPU: host buffers pinned, copies over PCIe. CUDA trains with bf16
    autocast, so the loss is compared to the fp32 single-process reference loosely (it must learn and
    stay within 2%)."""
    gpu = torch.cuda.get_device_name(0)
    cluster = tmp_path / "gpu.yaml"
    cluster.write_text(
        f"nodes: [{{name: g, gpu: {{name: {gpu!r}, peak_tflops: 100, memory_GiB: 16, "
        "memory_bandwidth_GBps: 1000}, count: 1}]\nnetwork: {bandwidth_GBps: 10}\n"
    )
    config = {"micro_batch_size": 2, "pipelines": [{"num_microbatches": 4, "stages": [st("g:0", 4, offload=offload)]}]}
    out = train(str(cluster), "tiny", config, steps=STEPS, metrics_out=tmp_path / "m.jsonl", quiet=True, timeout_s=300)
    assert out.returncode == 0, out.error
    losses = _losses(tmp_path / "m.jsonl")
    assert losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses("tiny", STEPS)), rtol=2e-2, atol=0)
