"""Every file ``autotune export`` writes goes through the engine's own configuration code (issue 47).

The engines (``make engines``, which ``make test`` runs): DeepSpeed 0.19 in the venv (the ``engines`` extra);
torchtitan 0.3.0 and Megatron-Core 0.19.2's ``megatron/training`` in ``.engines/site`` beside it
(requirements-engines.txt says how and why). Each check runs in a subprocess, one per engine, over the files
of a representative set of plans: data parallel, pipelines (even, uneven, interleaved, with recomputation),
tensor parallelism with and without sequence parallelism, ZeRO 1-3, offload of the optimizer and of
everything, bf16 / fp16 / fp32, MoE with expert parallelism, a sliding window, and one plan for every
Hugging Face config in examples/hf. A plan the engine cannot hold is refused by ``engines.check`` in one line
(not written); every file that is written must be accepted. Skipped, saying why, where an engine is missing.

- DeepSpeed: ``deepspeed.runtime.config.DeepSpeedConfig`` as ``deepspeed.initialize`` builds it, with
  DeepSpeed's communication initialised and the ``mpu`` the notes tell the user to pass.
- Megatron-Core: ``parse_args`` + ``validate_args`` of ``megatron/training`` (megatron_check.py).
- torchtitan 0.3: ``ConfigManager`` over the config module, ``ParallelDims`` and its meshes on a fake process
  group of the plan's world size, the trainer's batch check, the model built on the meta device and split
  by torchtitan's own pipeline code (torchtitan_check.py); and the shapes of the models the modules start
  from (``BASES``) as torchtitan builds them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from autotune import engines
from autotune.loading import load_model
from autotune.specs import ModelSpec, ParallelConfig

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
SITE = ROOT / ".engines" / "site"
HERE = Path(__file__).resolve().parent


def _plan(
    pipelines: int,
    stages: int,
    tp: int,
    layers: int,
    gbs: int,
    mbs: int = 1,
    zero: int = 0,
    split: tuple[int, ...] | None = None,
    top: dict | None = None,
    **stage,
) -> ParallelConfig:
    split = split or (layers // stages,) * stages
    devices = iter(f"a:{i}" for i in range(pipelines * stages * tp))
    pipes = [
        {
            "num_microbatches": gbs // (mbs * pipelines),
            "stages": [{"devices": [next(devices) for _ in range(tp)], "layers": n, **stage} for n in split],
        }
        for _ in range(pipelines)
    ]
    return ParallelConfig.from_dict({"micro_batch_size": mbs, "zero": zero, "pipelines": pipes, **(top or {})})


def _hf_plans() -> list[tuple[str, ParallelConfig, ModelSpec]]:
    """One plan per shipped Hugging Face config: 8 replicas with ZeRO 2 (MoE: 2-way expert parallelism)."""
    out = []
    for path in sorted((ROOT / "examples" / "hf").iterdir()):
        model = load_model(path, global_batch_size=64)
        top = {"expert_parallel": 2} if model.is_moe else None
        out.append((f"hf-{path.name}", _plan(8, 1, 1, model.num_layers, 64, zero=2, top=top), model))
    return out


def representative() -> list[tuple[str, ParallelConfig, ModelSpec]]:
    llama = load_model("llama2-7b", global_batch_size=256)
    llama3 = load_model("llama3-8b", global_batch_size=256)
    mixtral = load_model(ROOT / "examples" / "hf" / "mixtral-8x7b", global_batch_size=256)
    mistral = load_model(ROOT / "examples" / "hf" / "mistral-7b", global_batch_size=256)
    interleaved = {"schedule": "interleaved-1f1b", "virtual_stages": 2}
    return [
        ("dp8", _plan(8, 1, 1, 32, 256, mbs=2), llama),
        ("pp4-dp2-recompute", _plan(2, 4, 1, 32, 256, recompute=True), llama),
        ("pp4-zero1", _plan(2, 4, 1, 32, 256, zero=1), llama3),
        ("pp4-uneven", _plan(2, 4, 1, 32, 256, split=(6, 10, 8, 8)), llama3),
        ("pp4-interleaved", _plan(2, 4, 1, 32, 256, top=interleaved), llama3),
        ("tp2-dp4", _plan(4, 1, 2, 32, 256, mbs=4), llama3),
        ("tp2-sp-pp2", _plan(2, 2, 2, 32, 256, sequence_parallel=True), llama3),
        ("tp2-sp-zero3", _plan(4, 1, 2, 32, 256, zero=3, sequence_parallel=True), llama3),
        ("tp2-zero2", _plan(4, 1, 2, 32, 256, zero=2), llama),
        ("zero3", _plan(8, 1, 1, 32, 256, zero=3), llama3),
        ("zero3-offload-all", _plan(8, 1, 1, 32, 256, zero=3, offload="all"), llama),
        ("zero2-offload-optimizer", _plan(8, 1, 1, 32, 256, zero=2, offload="optimizer"), llama),
        ("fp16-zero1", _plan(4, 1, 1, 32, 256, zero=1), replace(llama, precision="fp16")),
        ("fp32-dp4", _plan(4, 1, 1, 32, 256), replace(llama, precision="fp32")),
        ("moe-ep4-zero1", _plan(8, 1, 1, 32, 256, zero=1, top={"expert_parallel": 4}), mixtral),
        ("moe-ep4-zero3", _plan(8, 1, 1, 32, 256, zero=3, top={"expert_parallel": 4}), mixtral),
        ("moe-ep2-pp2", _plan(4, 2, 1, 32, 256, zero=1, top={"expert_parallel": 2}), mixtral),
        ("sliding-window", _plan(8, 1, 1, 32, 256, zero=1), mistral),
    ] + _hf_plans()


#: what ``search --engine`` returns is checked too: (cluster, model, global batch, method, budget)
#: (models torchtitan defines: a pipeline module of another model waits for the user's BASE, tested below)
SEARCHES = [
    ("mixed-a100-v100", "llama3-8b", 256, "dp", 10),
    ("mixed-h100-a100-32", ROOT / "examples" / "hf" / "qwen3-30b-a3b", 512, "dp", 10),
    ("mixed-consumer-16", "qwen3-32b", 128, "optuna", 30),
]


def _searched(engine: str) -> list[tuple[str, ParallelConfig, ModelSpec]]:
    from autotune.search.api import tune

    out = []
    for cluster, name, gbs, method, budget in SEARCHES:
        model = load_model(name, global_batch_size=gbs)
        result = tune(cluster, model, method=method, budget=budget, engine=engine, track=False, seed=0)
        if result.best_measurement.ok:
            out.append((f"search-{cluster}-{model.name}", result.best_config, model))
    return out


def _written(engine: str, tmp_path: Path, suffix: str) -> tuple[list, dict, dict]:
    """The files ``export`` writes for the representative set and for what ``search --engine`` returns
    (path per plan name), the grids, and the plans the engine refuses in one line (name: reason)."""
    jobs, grids, refused = [], {}, {}
    searched = _searched(engine)
    assert len(searched) >= 2, f"search --engine {engine} found too few plans to check"
    for name, config, model in representative() + searched:
        reason = engines.check(engine, config) or engines.model_check(engine, model)
        if reason:
            refused[name] = reason
            continue
        path = tmp_path / f"{name.replace('-', '_').replace('.', '_')}{suffix}"  # torchtitan: a module name
        path.write_text(engines.export(engine, config, model))
        jobs.append((name, str(path)))
        grids[name] = engines.grid(engine, config)
    return jobs, grids, refused


def _run(script: list[str], env: dict, timeout: int = 900) -> dict:
    done = subprocess.run(script, env=env, capture_output=True, text=True, timeout=timeout)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(line[len("RESULT ") :])


CHECK = r"""
import json, sys
import deepspeed
import deepspeed.comm.torch
# not DeepSpeed's shared-memory all-reduce for CPU ranks (a C++ op it compiles on first use: 2-3 minutes on a fresh
# machine); the config code under test does not use it
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
deepspeed.init_distributed(dist_backend="gloo")
from deepspeed.runtime.config import DeepSpeedConfig

class MPU:  # what the notes tell the user to pass: process groups whose data-parallel size is the plan's
    def __init__(self, dp): self.dp = dp
    def get_data_parallel_world_size(self): return self.dp
    def get_data_parallel_rank(self): return 0
    def get_model_parallel_world_size(self): return 1
    def get_model_parallel_rank(self): return 0

out = {}
for name, path, dp in json.loads(sys.argv[1]):
    try:
        c = DeepSpeedConfig(json.load(open(path)), mpu=MPU(dp))
        out[name] = ["ok", c.train_batch_size, c.zero_optimization_stage]
    except Exception as e:
        out[name] = ["rejected", f"{type(e).__name__}: {e}"]
print("RESULT " + json.dumps(out))
"""


def test_every_deepspeed_file_is_accepted_by_deepspeed_s_own_config(tmp_path):
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        pytest.skip("DeepSpeed is not installed (DS_BUILD_OPS=0 pip install -e '.[engines]')")
    jobs, grids, refused = _written("deepspeed", tmp_path, ".json")
    assert len(jobs) >= 20, refused
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000), RANK="0")
    env.update(WORLD_SIZE="1", LOCAL_RANK="0", DS_BUILD_OPS="0")
    got = _run([sys.executable, "-c", CHECK, json.dumps([(n, p, grids[n].dp) for n, p in jobs])], env)
    rejected = {k: v[1] for k, v in got.items() if v[0] != "ok"}
    assert not rejected, rejected
    assert {k: (v[1], v[2]) for k, v in got.items()} == {
        n: (grids[n].global_batch_size, grids[n].zero) for n, _ in jobs
    }


def _site_or_skip(module: str) -> dict:
    if not (SITE / module).is_dir():
        pytest.skip(f"{module} is not installed in {SITE} (make engines)")
    return dict(os.environ, PYTHONPATH=str(SITE))


def test_every_megatron_file_is_accepted_by_megatron_s_own_parse_and_validate_args(tmp_path):
    env = _site_or_skip("megatron")
    jobs, grids, refused = _written("megatron", tmp_path, ".args")
    assert len(jobs) >= 20, refused
    got = _run([sys.executable, str(HERE / "megatron_check.py"), json.dumps(jobs), "9"], env)
    rejected = {k: v[1] for k, v in got.items() if v[0] != "ok"}
    assert not rejected, rejected
    # Megatron reads the plan's degrees back: data, tensor, pipeline, virtual pipeline, expert parallel
    assert {k: v[1:] for k, v in got.items()} == {
        n: [g.dp, g.tp, g.pp, g.vpp, g.expert_parallel] for n, g in grids.items()
    }


def test_every_torchtitan_module_is_accepted_by_torchtitan_0_3_s_own_config_code(tmp_path):
    env = _site_or_skip("torchtitan")
    jobs, grids, refused = _written("torchtitan", tmp_path, ".py")
    assert len(jobs) >= 20, refused
    got = _run([sys.executable, str(HERE / "torchtitan_check.py"), json.dumps(jobs)], env)
    rejected = {k: v[1] for k, v in got.items() if v[0] != "ok"}
    assert not rejected, rejected
    # torchtitan reads the plan back: batch, tensor, pipeline degrees, model chunks per pipeline rank,
    # expert degree, gradient accumulation steps (one with a pipeline: its micro-batches are the local batch)
    assert {k: v[1:] for k, v in got.items()} == {
        n: [g.dp, g.tp, g.pp, g.vpp, g.expert_parallel, g.num_microbatches if g.pp == 1 else 1]
        for n, g in grids.items()
    }


def test_a_pipeline_module_for_a_model_torchtitan_lacks_says_to_set_its_base(tmp_path):
    """gpt2 (48 blocks) has no torchtitan config: its module starts from Llama 3 8B (32 blocks), which a
    pipeline split of 48 blocks cannot run; loading it says what to change instead of splitting wrongly."""
    env = _site_or_skip("torchtitan")
    gpt2 = load_model(ROOT / "examples" / "hf" / "gpt2", global_batch_size=64)
    path = tmp_path / "gpt2_pp2.py"
    path.write_text(engines.export("torchtitan", _plan(2, 2, 1, 48, 64, zero=2), gpt2))
    assert "replace BASE with yours" in path.read_text()
    got = _run([sys.executable, str(HERE / "torchtitan_check.py"), json.dumps([("gpt2", str(path))])], env)
    assert got["gpt2"][0] == "rejected" and "set BASE to the config function of the model" in got["gpt2"][1]


def test_the_models_torchtitan_modules_start_from_have_the_shapes_autotune_matched():
    from autotune.engines.torchtitan import BASES

    env = _site_or_skip("torchtitan")
    got = _run([sys.executable, str(HERE / "torchtitan_check.py"), "bases", json.dumps(list(BASES.values()))], env)
    assert got == {base: list(shape) for shape, base in BASES.items()}
