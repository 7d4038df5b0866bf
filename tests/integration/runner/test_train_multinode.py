"""``autotune train`` on several machines, as the README shows it: the same command on each with
torchrun's multi-node flags; here two "machines" on loopback sharing one checkpoint directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from paths import REPO

from autotune.errors import SpecError
from runner.train import _node_rank

ROOT = REPO
PLAN = {
    "micro_batch_size": 2,
    "schedule": "1f1b",
    "pipelines": [
        {"num_microbatches": 4, "stages": [{"devices": ["cpu:0"], "layers": 2}, {"devices": ["cpu:1"], "layers": 2}]}
    ],
}


def test_node_rank_is_read_from_torchruns_flags():
    assert _node_rank([]) == 0 and _node_rank(None) == 0
    assert _node_rank(["--nnodes", "2", "--node-rank", "1"]) == 1
    assert _node_rank(["--node_rank=3"]) == 3
    with pytest.raises(SpecError, match="--node-rank"):
        _node_rank(["--node-rank", "one"])


@pytest.mark.slow
@pytest.mark.distributed
def test_two_machines_train_one_plan_and_share_the_checkpoint_directory(tmp_path):
    from servers import free_port

    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "autotune.cli",
                "train",
                "--cluster",
                "cpu-2",
                "--model",
                "tiny",
                "--config",
                "plan.json",
                "--steps",
                "4",
                "--checkpoint-dir",
                "ckpt",
                "--checkpoint-every",
                "2",
                "--metrics-out",
                "m.jsonl",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert "training done after step 4" in outs[0][1] and "final loss" in outs[0][1]
    assert "--node-rank 0 (rank 0) reports" in " ".join(outs[1][1].split())
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000004"
