"""A rank that raises and a rank that hangs both end a profiled run within its timeout, with ``status`` set
and no process left behind (checked by scanning /proc for a tag only these runs' ranks carry)."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import replace

import pytest
from proc_scan import processes_with

from autotune.loading import load_model
from autotune.specs import ParallelConfig
from runner import RealEvaluator, profiled_run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TWO_STAGES = ParallelConfig.from_dict(
    {
        "micro_batch_size": 2,
        "pipelines": [
            {
                "num_microbatches": 4,
                "stages": [{"devices": ["cpu:0"], "layers": 2}, {"devices": ["cpu:1"], "layers": 2}],
            }
        ],
    }
)


@pytest.fixture
def tag(monkeypatch) -> str:
    value = f"autotune-test-{uuid.uuid4().hex}"
    monkeypatch.setenv("AUTOTUNE_TEST_TAG", value)
    return value


def test_raising_rank_fails_fast_and_leaves_nothing(tag, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_FAULT", "raise:rank1")
    t0 = time.monotonic()
    m = profiled_run("cpu-2", "tiny", TWO_STAGES, steps=2, warmup=1, timeout_s=90)
    assert time.monotonic() - t0 < 90
    assert m.status == "failed" and not m.ok and m.score() == 0.0
    assert "rank 1 failed: RuntimeError: injected fault" in m.error
    assert processes_with(tag) == []


def test_hanging_rank_times_out_and_leaves_nothing(tag, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_FAULT", "hang:rank1")
    timeout = 12.0
    t0 = time.monotonic()
    m = RealEvaluator("cpu-2", "tiny", steps=2, warmup=1, timeout_s=timeout).evaluate(TWO_STAGES)
    elapsed = time.monotonic() - t0
    # the status says the launcher's deadline ended it (rank 0's own process-group timeout is 30 s and
    # would make it "failed"); the upper bound only catches a launcher that does not kill promptly,
    # with room for a loaded machine
    assert timeout <= elapsed < timeout + 30
    assert m.status == "timeout" and m.score() == 0.0
    assert "no result after 12 s" in m.error and "killed 2 rank process(es)" in m.error
    assert processes_with(tag) == []


def test_invalid_plan_is_a_measurement_not_an_exception():
    bad = ParallelConfig.from_dict(
        {"micro_batch_size": 2, "pipelines": [{"num_microbatches": 4, "stages": [{"devices": ["cpu:0"], "layers": 3}]}]}
    )
    m = RealEvaluator("cpu-2", "tiny").evaluate(bad)
    assert m.status == "invalid" and "layers sum to 3" in m.error
    # valid, but the runner cannot run it: tensor parallelism with qk_norm
    mixed_tp = ParallelConfig.from_dict(
        {
            "micro_batch_size": 2,
            "pipelines": [{"num_microbatches": 4, "stages": [{"devices": ["cpu:0", "cpu:1"], "layers": 4}]}],
        }
    )
    m = RealEvaluator("cpu-4", replace(load_model("tiny"), qk_norm=True)).evaluate(mixed_tp)
    assert m.status == "failed" and "qk_norm with tensor parallelism is not run by the runner" in m.error


def test_process_scan_sees_a_live_tagged_process(tag):
    import subprocess

    child = subprocess.Popen(["sleep", "30"], env=dict(os.environ))
    try:
        # Until the child has exec'd, /proc may not show its environment yet: give it a moment.
        deadline = time.monotonic() + 5
        while processes_with(tag) != [child.pid] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_with(tag) == [child.pid]
    finally:
        child.kill()
        child.wait()
    assert processes_with(tag) == []
