"""ZeRO-2/3 over even replicas runs on torch's FSDP2 (``runner.fsdp``): every plan family trains like one
process (relative loss difference < 1e-5), resumes bit for bit, and its checkpoint holds each rank's shards
of the model (FSDP2's sharded DTensors through ``get_state_dict``, not ``runner.zero``'s units)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mixed_runs import rewind
from moe_ranks import build_engine, run_ranks
from paths import DATA
from tp_runs import tp2_replicas, trains_like_one_process

from autotune import load_cluster, load_config, load_model
from runner.checkpoint import _reader
from runner.fsdp import fsdp_misfit
from runner.layout import build_layout
from runner.optim import TrainSettings
from runner.reference import reference_losses
from runner.train import train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
STEPS = 6
RTOL = 1e-5


def st(device: str, layers: int, recompute: bool = False, offload: str = "none") -> dict:
    return {"devices": [device], "layers": layers, "recompute": recompute, "offload": offload}


def _pipelines(zero: int, offload: str = "none", counts: tuple[int, int] = (4, 4), **plan) -> dict:
    """Two pipelines of two stages (2 + 2 layers, the second recomputing), ``counts`` micro-batches."""
    pipes = [
        {
            "num_microbatches": counts[p],
            "stages": [st(f"cpu:{2 * p}", 2, offload=offload), st(f"cpu:{2 * p + 1}", 2, True, offload)],
        }
        for p in range(2)
    ]
    return {"micro_batch_size": 1, "zero": zero, "pipelines": pipes, **plan}


PLANS = {
    # two single-stage replicas of the whole model
    "zero3-replicas": (
        "cpu-2",
        {
            "micro_batch_size": 1,
            "zero": 3,
            "pipelines": [{"num_microbatches": 4, "stages": [st(f"cpu:{p}", 4)]} for p in range(2)],
        },
    ),
    "zero2-pipelines": ("cpu-4", _pipelines(2)),
    # the whole gradient accumulated through the step, reduce-scattered after its last backward
    "zero1-pipelines": ("cpu-4", _pipelines(1)),
    # each rank holds two chunks (two FSDP roots), Megatron's interleaved order
    "zero3-interleaved": ("cpu-4", _pipelines(3, schedule="interleaved-1f1b", virtual_stages=2)),
    # everything in host memory: FSDP2's CPUOffloadPolicy (the step on the CPU)
    "zero3-offload-all": ("cpu-4", _pipelines(3, offload="all")),
}


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return reference_losses("tiny", STEPS)


@pytest.mark.parametrize("plan", list(PLANS))
def test_even_zero_plans_train_on_fsdp2_like_a_single_process(plan, reference, tmp_path):
    cluster, config = PLANS[plan]
    assert fsdp_misfit(build_layout(load_cluster(cluster), load_model("tiny"), load_config(config))) is None
    out = train(cluster, "tiny", config, steps=STEPS, metrics_out=tmp_path / "m.jsonl", quiet=True, timeout_s=300)
    assert out.returncode == 0, out.error
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "m.jsonl")), torch.tensor(reference), rtol=RTOL, atol=0)


@pytest.mark.parametrize(("zero", "offload"), [(3, "none"), (3, "all"), (1, "none")])
def test_fsdp2_resumes_bit_exact_from_each_rank_s_shards(zero, offload, tmp_path):
    _trains_and_resumes(_pipelines(zero, offload=offload), tmp_path)


UNEVEN_ZERO1 = {
    "counts": _pipelines(1, counts=(5, 3)),
    # layers 3 + 1 and 1 + 3: each unit over its layer's two holders (key_meshes), at other pipeline positions
    "splits": {
        "micro_batch_size": 1,
        "zero": 1,
        "pipelines": [
            {"num_microbatches": 5, "stages": [st("cpu:0", 3), st("cpu:1", 1, True)]},
            {"num_microbatches": 3, "stages": [st("cpu:2", 1), st("cpu:3", 3)]},
        ],
    },
    # one stage beside two: the head's holders sit at stage 0 and stage 1
    "stages": {
        "micro_batch_size": 1,
        "zero": 1,
        "pipelines": [
            {"num_microbatches": 5, "stages": [st("cpu:0", 4)]},
            {"num_microbatches": 3, "stages": [st("cpu:1", 2), st("cpu:2", 2)]},
        ],
    },
}


@pytest.mark.parametrize("plan", list(UNEVEN_ZERO1))
def test_zero_1_over_uneven_replicas_trains_on_fsdp2_like_one_process(plan, tmp_path):
    """5 and 3 micro-batches (batch shares of 5/8 and 3/8), with the same or other layer splits: FSDP2 gathers
    and reduce-scatters each unit once per step, and each micro-batch's loss is weighted before its backward
    (``runner.fsdp.loss_scale``). Clipping checks the weighting: Adam would hide a constant factor on a shard
    (as it would the schedule's division by each replica's own count after the reduce-scatter), the global
    gradient norm does not. The split plan also resumes exact (the same counts, its units over other meshes:
    the checkpoint of ``key_meshes``); the resume of the first is the even plans' (the weighting is not state)."""
    config = UNEVEN_ZERO1[plan]
    assert fsdp_misfit(build_layout(load_cluster("cpu-4"), load_model("tiny"), load_config(config))) is None
    settings = TrainSettings(clip_grad_norm=0.5)
    norms: list[float] = []
    reference = reference_losses("tiny", STEPS, settings=settings, grad_norms=norms)
    got = _trains_and_resumes(config, tmp_path, resume=plan == "splits", settings=settings)
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in got]), torch.tensor(norms), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in got]), torch.tensor(reference), rtol=RTOL, atol=0)


def _trains_and_resumes(config: dict, tmp_path: Path, resume: bool = True, **kw) -> list[dict]:
    """``config`` on cpu-4 for STEPS steps checkpointed at step 3 (the checkpoint FSDP2's, each rank's shards),
    then, with ``resume``, resumed from step 3 with the identical steps 4-6; the whole run's metrics rows."""
    ckpt = tmp_path / "ckpt"
    common = {"checkpoint_dir": ckpt, "quiet": True, "timeout_s": 300, **kw}
    whole = train("cpu-4", "tiny", config, steps=STEPS, metrics_out=tmp_path / "w.jsonl", checkpoint_every=3, **common)
    assert whole.returncode == 0, whole.error
    stored = _reader(ckpt / "step-00000003").read_metadata().state_dict_metadata
    assert not any(k.startswith("zero") for k in stored)  # not runner.zero's units
    # a block's weight is written as two shards, one by each pipeline's rank holding it; so are Adam's moments
    assert len(stored["model.blocks.0.attn.q_proj.weight"].chunks) == 2
    assert len(stored["optim.blocks.3.mlp.up_proj.weight.exp_avg"].chunks) == 2
    if resume:
        rewind(ckpt, 3)
        again = train("cpu-4", "tiny", config, steps=STEPS, resume=True, metrics_out=tmp_path / "a.jsonl", **common)
        assert again.returncode == 0, again.error
        assert _losses(tmp_path / "a.jsonl") == _losses(tmp_path / "w.jsonl")[3:]
    return [json.loads(line) for line in (tmp_path / "w.jsonl").read_text().splitlines()]


def test_a_tied_head_under_fsdp2_trains_and_clips_like_one_process(tmp_path):
    """The tied embedding stays in each chunk's root unit (gathered for the whole forward); clipping counts
    each shard's gradient once."""
    text = (DATA / "tiny-llama.yaml").read_text()
    model = tmp_path / "tied.yaml"
    model.write_text(
        "\n".join(x for x in text.splitlines() if not x.startswith("tied_embeddings:")) + "\ntied_embeddings: true\n"
    )
    plan = {
        "micro_batch_size": 1,
        "zero": 3,
        "pipelines": [{"num_microbatches": 1, "stages": [st(f"cpu:{p}", 2)]} for p in range(4)],
    }
    trains_like_one_process(tmp_path, str(model), plan, TrainSettings(clip_grad_norm=0.5))


@pytest.mark.parametrize(("zero", "sequence_parallel"), [(3, True), (2, False), (1, True)])
def test_fsdp2_over_tensor_parallel_replicas_trains_and_clips_like_one_process(zero, sequence_parallel, tmp_path):
    """Two tp-2 replicas: FSDP2 shards the DTensor weights over the (dp, tp) mesh's dp dimension, the
    vocabulary-parallel head and loss included; clipping counts a weight the tp ranks keep whole once."""
    plan = tp2_replicas({"layers": 2, "sequence_parallel": sequence_parallel}, 2, zero=zero)
    layout = build_layout(load_cluster("cpu-4"), load_model(str(DATA / "tiny-llama.yaml")), load_config(plan))
    assert fsdp_misfit(layout) is None
    trains_like_one_process(tmp_path, str(DATA / "tiny-llama.yaml"), plan, TrainSettings(clip_grad_norm=0.5))


def _legacy_checkpoint(rank: int, directory: Path) -> dict:
    """Three steps of the even ZeRO-3 plan on ``runner.zero`` (what ran it before FSDP2), checkpointed."""
    from runner import checkpoint
    from runner.optim import TrainSettings

    engine = build_engine(_pipelines(3), rank, "tiny", fsdp=False)
    assert engine.zero is not None and not engine.fsdp
    losses = [engine.step(i, lr=TrainSettings().lr_at(i, STEPS)).loss for i in range(3)]
    checkpoint.save(directory / "ckpt", engine, 3)
    return {"losses": losses}


def test_a_checkpoint_of_runner_zero_resumes_there(reference, tmp_path):
    """A run checkpointed when ``runner.zero`` ran the plan FSDP2 runs now continues on ``runner.zero``: the
    user's run resumes (a sharded checkpoint is one engine's layout)."""
    runs = run_ranks(_legacy_checkpoint, tmp_path)
    assert any(
        k.startswith("zero.") for k in _reader(tmp_path / "ckpt" / "step-00000003").read_metadata().state_dict_metadata
    )
    out = train(
        "cpu-4",
        "tiny",
        _pipelines(3),
        steps=STEPS,
        checkpoint_dir=tmp_path / "ckpt",
        resume=True,
        metrics_out=tmp_path / "a.jsonl",
        quiet=True,
        timeout_s=300,
    )
    assert out.returncode == 0, out.error
    losses = runs[0]["losses"] + _losses(tmp_path / "a.jsonl")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=RTOL, atol=0)


def _collectives(rank: int, directory: Path) -> dict:
    """This rank's all-gathers and reduce-scatters in one training step (after a first), zero 1 to 3."""
    from torch.profiler import profile

    counts = {}
    for zero in (1, 2, 3):
        engine = build_engine(_pipelines(zero), rank, "tiny")
        engine.step(0)
        with profile() as prof:
            engine.step(1)
        names = [e.name for e in prof.events()]
        counts[zero] = (names.count("c10d::_allgather_base_"), names.count("c10d::_reduce_scatter_base_"))
    return counts


def test_fsdp2_units_gather_and_reduce_as_zero_does():
    """Each rank holds three units (two blocks and the embedding, or the norm with the head) and runs four
    micro-batches: zero 1 gathers each unit once per step and reduce-scatters its accumulated gradient once
    (ZeRO-1's all-gather and reduce-scatter); with zero 2 / 3 every unit's gradient is reduce-scattered after
    each backward; zero 2 gathers each unit once per step, zero 3 before each forward and each backward (the recomputing second stage's recomputation reuses
    the backward's gather), what ``autotune.simulator.zero`` counts. The first stage runs two forwards before
    its first backward, and FSDP2's implicit backward prefetch, whose forward order then spans two
    micro-batches, gathers one unit once more per step there (measured: 25 gathers, not 24)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        runs = run_ranks(_collectives, Path(d))
    units, microbatches = 3, 4
    for rank, counts in enumerate(runs):
        assert counts[1] == (units, units)
        assert counts[2] == (units, units * microbatches)
        extra = 1 if rank % 2 == 0 else 0  # ranks 0 and 2: the first stage
        assert counts[3] == (2 * units * microbatches + extra, units * microbatches)
