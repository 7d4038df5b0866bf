"""Every file ``autotune export`` writes goes through the engine's own configuration code (issue 47).

DeepSpeed (the ``engines`` extra: ``DS_BUILD_OPS=0 pip install -e '.[engines]'``, which ``make install`` does):
each exported JSON is built into ``deepspeed.runtime.config.DeepSpeedConfig`` as ``deepspeed.initialize``
builds it, in one process with DeepSpeed's communication initialised, with the ``mpu`` the notes tell the user
to pass (its data-parallel size the plan's). A representative set of plans: pipelines, AutoTP, ZeRO 1-3,
offload of the optimizer and of everything, bf16 / fp16 / fp32, recomputation. Skipped, saying why, where
DeepSpeed is not installed. torchtitan 0.3 and Megatron-Core's ``megatron/training`` are not checked here:
experiments/RESULTS.md "Exported plans" says why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from autotune import engines
from autotune.loading import load_model
from autotune.specs import ParallelConfig

pytestmark = [pytest.mark.slow]


def _plan(
    pipelines: int, stages: int, tp: int, layers: int, gbs: int, mbs: int = 1, zero: int = 0, **stage
) -> ParallelConfig:
    per = layers // stages
    devices = iter(f"a:{i}" for i in range(pipelines * stages * tp))
    pipes = [
        {
            "num_microbatches": gbs // (mbs * pipelines),
            "stages": [{"devices": [next(devices) for _ in range(tp)], "layers": per, **stage} for _ in range(stages)],
        }
        for _ in range(pipelines)
    ]
    return ParallelConfig.from_dict({"micro_batch_size": mbs, "zero": zero, "pipelines": pipes})


def representative() -> list[tuple[str, ParallelConfig, object]]:
    llama = load_model("llama2-7b", global_batch_size=256)
    llama3 = load_model("llama3-8b", global_batch_size=256)
    return [
        ("dp8", _plan(8, 1, 1, 32, 256, mbs=2), llama),
        ("pp4-dp2-recompute", _plan(2, 4, 1, 32, 256, recompute=True), llama),
        ("pp4-zero1", _plan(2, 4, 1, 32, 256, zero=1), llama3),
        ("tp2-dp4", _plan(4, 1, 2, 32, 256, mbs=4), llama3),
        ("tp2-zero2", _plan(4, 1, 2, 32, 256, zero=2), llama),
        ("zero3-offload-all", _plan(8, 1, 1, 32, 256, zero=3, offload="all"), llama),
        ("zero2-offload-optimizer", _plan(8, 1, 1, 32, 256, zero=2, offload="optimizer"), llama),
        ("fp16-zero1", _plan(4, 1, 1, 32, 256, zero=1), replace(llama, precision="fp16")),
        ("fp32-dp4", _plan(4, 1, 1, 32, 256), replace(llama, precision="fp32")),
    ]


CHECK = r"""
import json, sys
import deepspeed
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
    jobs, expected = [], {}
    for name, config, model in representative():
        path = tmp_path / f"{name}.json"
        path.write_text(engines.export("deepspeed", config, model))
        grid = engines.grid("deepspeed", config)
        jobs.append((name, str(path), grid.dp))
        expected[name] = (grid.global_batch_size, config.zero)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000), RANK="0")
    env.update(WORLD_SIZE="1", LOCAL_RANK="0", DS_BUILD_OPS="0")
    done = subprocess.run(
        [sys.executable, "-c", CHECK, json.dumps(jobs)], env=env, capture_output=True, text=True, timeout=600
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, done.stdout[-2000:] + done.stderr[-3000:]
    got = json.loads(line[len("RESULT ") :])
    rejected = {k: v[1] for k, v in got.items() if v[0] != "ok"}
    assert not rejected, rejected
    assert {k: (v[1], v[2]) for k, v in got.items()} == expected
