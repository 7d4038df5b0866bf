"""Fine-tuning a Hugging Face checkpoint with ``autotune train``: ``--init-from`` a tiny Llama built locally,
``--data`` tokenized with its tokenizer, the optimizer settings, under pipeline and data-parallel plans:
the same losses as one process, an exact resume after a SIGTERM, and a ``--save-hf`` directory that
``transformers`` loads with the runner's logits."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hf_models import CORPUS, tiny_model

from autotune.loading import load_hf_model
from runner.optim import TrainSettings
from runner.reference import reference_losses
from runner.train import train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
torch.set_num_threads(1)

STEPS = 6
RTOL = 1e-5  # the equivalence tests' tolerance (tests/integration/runner/test_runner_distributed.py)
SETTINGS = TrainSettings(lr=3e-3, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1, clip_grad_norm=0.5)
OPTIONS = ["--lr", "3e-3", "--warmup-steps", "2", "--lr-schedule", "cosine", "--min-lr-ratio", "0.1"]
OPTIONS += ["--clip-grad-norm", "0.5"]
TWO_STAGES = {
    "micro_batch_size": 2,
    "schedule": "1f1b",
    "pipelines": [
        {
            "num_microbatches": 4,
            "stages": [{"devices": ["cpu:0"], "layers": 1}, {"devices": ["cpu:1"], "layers": 3}],
        }
    ],
}
# two pipelines of two stages, uneven layers and an uneven 5 + 3 batch split
TWO_BY_TWO = {
    "micro_batch_size": 1,
    "schedule": "1f1b",
    "pipelines": [
        {"num_microbatches": 5, "stages": [{"devices": ["cpu:0"], "layers": 3}, {"devices": ["cpu:1"], "layers": 1}]},
        {"num_microbatches": 3, "stages": [{"devices": ["cpu:2"], "layers": 1}, {"devices": ["cpu:3"], "layers": 3}]},
    ],
}

# one stage on a tensor-parallel pair: clipping counts sharded and replicated weights once each
TENSOR_PARALLEL = {
    "micro_batch_size": 2,
    "schedule": "1f1b",
    "pipelines": [{"num_microbatches": 4, "stages": [{"devices": ["cpu:0", "cpu:1"], "layers": 4}]}],
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    directory = tmp_path_factory.mktemp("finetune")
    corpus = directory / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in CORPUS * 4))
    return tiny_model("llama", directory / "tiny"), corpus


def _model(path: Path):
    return load_hf_model(path, seq_len=32, global_batch_size=8).model


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    ("cluster", "plan", "steps"),
    [("cpu-2", TWO_STAGES, STEPS), ("cpu-4", TWO_BY_TWO, STEPS), ("cpu-2", TENSOR_PARALLEL, 3)],
    ids=["2-stages", "2x2", "tp2"],  # DTensor on gloo is slow on CPU: 3 steps
)
def test_finetuning_trains_like_a_single_process(cluster, plan, steps, tiny, tmp_path):
    checkpoint, corpus = tiny
    model = _model(checkpoint)
    norms: list[float] = []
    reference = reference_losses(model, steps, settings=SETTINGS, init_from=checkpoint, data=corpus, grad_norms=norms)
    metrics = tmp_path / "m.jsonl"
    outcome = train(
        cluster,
        model,
        plan,
        steps=steps,
        metrics_out=metrics,
        data=corpus,
        init_from=checkpoint,
        settings=SETTINGS,
        quiet=True,
        timeout_s=600,
    )
    assert outcome.returncode == 0, outcome.error
    torch.testing.assert_close(torch.tensor(_losses(metrics)), torch.tensor(reference), rtol=RTOL, atol=0)
    # the global gradient norm the plan clipped with is the single process's (each tensor counted once)
    measured = [json.loads(line)["grad_norm"] for line in metrics.read_text().splitlines()]
    torch.testing.assert_close(torch.tensor(measured), torch.tensor(norms), rtol=RTOL, atol=0)
    assert min(norms) > SETTINGS.clip_grad_norm  # clipping was active on every step
    assert reference[-1] < reference[0]  # the schedule and the data train the checkpoint further


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from autotune.cli import main; main()", *args]


def test_stop_resume_and_save_a_checkpoint_transformers_loads(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from runner import checkpoint as ckpt_files
    from runner.model import StageChunk

    checkpoint, corpus = tiny
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(TWO_STAGES))
    common = ["--config", str(plan), "--init-from", str(checkpoint), "--global-batch-size", "8", "--seq-len", "32"]
    common += ["--data", str(corpus), "--steps", str(STEPS), *OPTIONS]
    # the uninterrupted run
    whole = tmp_path / "whole.jsonl"
    done = subprocess.run(
        _cli("train", "--cluster", "cpu-2", *common, "--metrics-out", str(whole)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    # the same run 10x slower, stopped by SIGTERM after its first step, then resumed on the normal cluster
    slow = tmp_path / "slow.yaml"
    slow.write_text("nodes: [{name: cpu, gpu: cpu, count: 2, slowdown: 10}]\nnetwork: {bandwidth_GBps: 5}\n")
    ckpt, stopped, out = tmp_path / "ckpt", tmp_path / "stopped.jsonl", tmp_path / "hf-out"
    run = _cli("train", *common, "--checkpoint-dir", str(ckpt), "--metrics-out", str(stopped), "--save-hf", str(out))
    run += ["--checkpoint-every", "2"]
    proc = subprocess.Popen(
        [*run[:4], "--cluster", str(slow), *run[4:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 300
    while not (stopped.exists() and stopped.read_text().count("\n") >= 1) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 143, output
    assert (out / "model.safetensors").is_file()  # a clean stop writes the step it stopped at too
    resumed = subprocess.run(
        [*run[:4], "--cluster", "cpu-2", *run[4:], "--resume"], capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr
    assert _losses(stopped) == _losses(whole)  # same data, same state, same schedule: the identical curve
    assert f"Hugging Face checkpoint written to {out}" in resumed.stderr
    # transformers loads it; its logits are the runner's (the last checkpoint's weights in the runner's model)
    model = _model(checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    runner = StageChunk(model, range(model.num_layers), first=True, last=True, seed=0)
    runner.load_state_dict(ckpt_files.full_weights(ckpt_files.latest(ckpt), model))
    ids = torch.randint(0, model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = runner.eval()(ids)
        torch.testing.assert_close(hf(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    assert (out / "tokenizer.json").is_file() and json.loads((out / "config.json").read_text())["model_type"] == "llama"
    # each earlier checkpoint as its own Hugging Face directory (the stopped step's included)
    earlier = sorted(p.name for p in out.glob("checkpoint-*"))
    assert "checkpoint-2" in earlier and f"checkpoint-{STEPS}" not in earlier
    assert AutoModelForCausalLM.from_pretrained(str(out / "checkpoint-2")) is not None


def test_save_hf_from_a_zero3_plan_writes_the_weights_of_the_plan_without_it(tiny, tmp_path):
    """``--save-hf`` from ZeRO-3 (refused before: a sharded checkpoint held flat shards only): its checkpoints
    carry the full weights beside the shards, gathered for the save, and the Hugging Face directory holds what
    the same plan trains without ZeRO (rtol 1e-5, atol 1e-6), which ``transformers`` loads; so does an even
    ZeRO-3 plan on FSDP2, whose sharded weights DCP reassembles, and ZeRO-1 over the uneven replicas on FSDP2
    (each layer sharded over its own holders: ``runner.fsdp.key_meshes``)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    checkpoint, corpus = tiny
    model = _model(checkpoint)
    saved = {}
    even = {  # FSDP2 runs this one (runner.fsdp): its checkpoints hold the model's sharded DTensors
        "micro_batch_size": 1,
        "zero": 3,
        "pipelines": [
            {"num_microbatches": 4, "stages": [{"devices": [f"cpu:{2 * p + s}"], "layers": 2} for s in range(2)]}
            for p in range(2)
        ],
    }
    plans = (
        ("zero3", {**TWO_BY_TWO, "zero": 3}),
        ("fsdp2", even),
        ("fsdp2-uneven", {**TWO_BY_TWO, "zero": 1}),
        ("plain", TWO_BY_TWO),
    )
    for name, plan in plans:
        out = tmp_path / name
        outcome = train(
            "cpu-4", model, plan, steps=3, data=corpus, init_from=checkpoint, settings=SETTINGS, save_hf=out,
            quiet=True, timeout_s=600,
        )  # fmt: skip
        assert outcome.returncode == 0, outcome.error
        saved[name] = load_file(out / "model.safetensors")
    for sharded in ("zero3", "fsdp2", "fsdp2-uneven"):
        assert saved[sharded].keys() == saved["plain"].keys()
        for key, value in saved["plain"].items():
            # atol 1e-6 on weights of ~2e-2: Adam's step turns a near-zero gradient's rounding into ~4e-7
            torch.testing.assert_close(saved[sharded][key], value, rtol=1e-5, atol=1e-6)
        assert AutoModelForCausalLM.from_pretrained(str(tmp_path / sharded)) is not None


def test_a_checkpoint_without_a_tokenizer_is_refused_before_launch_when_data_is_given(tiny, tmp_path):
    """Issue 46, case 5: ``--init-from`` a directory without ``tokenizer.json`` trained on the raw bytes of a
    JSONL file, JSON syntax included; now one line naming the file, before any process starts."""
    import shutil

    from autotune.errors import SpecError

    checkpoint, corpus = tiny
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in checkpoint.iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, bare / f.name)
    with pytest.raises(SpecError, match="no tokenizer.json to tokenize --data"):
        train("cpu-2", _model(bare), TWO_STAGES, steps=1, init_from=bare, data=corpus, quiet=True, timeout_s=60)
