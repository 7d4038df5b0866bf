"""Roundpipe plans on the runner (``runner.roundpipe_run``): the execute plan built from the autotune plan,
the checks before launch (CPU: one clear line; CUDA without the extra; pools the runner cannot run), the
real backend answering such plans invalid, and (``gpu``, skipped without CUDA) a real run."""

from __future__ import annotations

import json
import sys

import pytest
from paths import EXAMPLES, REPO

from autotune import SpecError, load_cluster, load_config, load_model
from autotune.specs.roundpipe import RoundPipeStages
from runner.roundpipe_run import (
    EXTRA_HINT,
    RoundPipeLaunch,
    check_execute_ranges,
    execute_ranges,
    preflight,
    refuse_checkpoints,
)

ROOT = REPO
POOL = tuple(f"box:{i}" for i in range(8))


@pytest.fixture(scope="module")
def box():
    return load_cluster(EXAMPLES / "8x4090.yaml"), load_model("llama2-13b", 64)


@pytest.fixture(scope="module")
def example():
    return load_config(EXAMPLES / "roundpipe-8x4090.json")


def test_execute_plan_of_a_hand_made_partition():
    # 10 blocks: forward [2 (with the embedding), 3, 2], fused 3 blocks + head, backward [4, 3]
    rp = RoundPipeStages(POOL[:2], (2, 3, 2), (4, 3), fused_layers=3)
    fwd, bwd = execute_ranges(rp, 10)
    # RoundPipe layers: 0 embedding, 1..10 blocks 0..9, 11 head
    assert fwd == [(0, 3), (3, 6), (6, 8)]
    assert bwd == [(8, 12), (5, 8), (0, 5)]  # fused first, then the backward stages from the last layers down
    check_execute_ranges(fwd, bwd, 10)


def test_execute_plan_of_the_embedding_and_the_head_alone():
    rp = RoundPipeStages(POOL, (0, 5), (0, 2, 3), fused_layers=0)
    fwd, bwd = execute_ranges(rp, 5)
    assert fwd == [(0, 1), (1, 6)]
    assert bwd == [(6, 7), (3, 6), (1, 3), (0, 1)]
    check_execute_ranges(fwd, bwd, 5)


def test_execute_plan_check_refuses_what_roundpipe_refuses():
    with pytest.raises(ValueError, match="after"):
        check_execute_ranges([(0, 3), (4, 6)], [(6, 12), (0, 6)], 10)
    with pytest.raises(ValueError, match="Empty"):
        check_execute_ranges([(0, 3), (3, 3)], [(3, 12), (0, 3)], 10)
    with pytest.raises(ValueError, match="mismatch"):
        check_execute_ranges([(0, 3)], [(4, 12), (0, 4)], 10)


def test_example_plan_is_roundpipes_own_choice_and_maps_to_a_valid_execute_plan(box, example):
    cluster, model = box
    example.validate(cluster, model)
    fwd, bwd = execute_ranges(example.pipelines[0].roundpipe, model.num_layers)
    check_execute_ranges(fwd, bwd, model.num_layers)
    assert len(fwd) + len(bwd) == example.pipelines[0].roundpipe.num_stages
    from autotune.planning.space import SearchSpace

    space = SearchSpace(cluster, model)
    assert space.decode(space.roundpipe_start()).config == example  # the plan RoundPipe would pick


def test_cpu_machine_refuses_before_launch_naming_cuda_and_the_extra(box, example):
    cluster, model = box
    with pytest.raises(SpecError) as e:
        preflight(cluster, model, example, cuda_available=False, library=False)
    text = str(e.value)
    assert e.value.source == "runner" and "no CUDA" in text and EXTRA_HINT in text and "\n" not in text
    with pytest.raises(SpecError, match="no CUDA") as e:
        preflight(cluster, model, example, cuda_available=False, library=True)
    assert EXTRA_HINT not in str(e.value)


def test_cuda_machine_without_the_extra_or_enough_gpus(box, example):
    cluster, model = box
    with pytest.raises(SpecError, match=r"need the roundpipe library: pip install -e '\.\[roundpipe\]'"):
        preflight(cluster, model, example, cuda_available=True, library=False)
    with pytest.raises(SpecError, match=r"box:4, box:5, box:6, box:7 \(cuda:7\), this machine has 4 GPU"):
        preflight(cluster, model, example, cuda_available=True, library=True, gpu_count=4)
    launch = preflight(cluster, model, example, cuda_available=True, library=True, gpu_count=8)
    assert launch.world_size == 1 and launch.gpu_indices == tuple(range(8))


def test_pools_the_runner_does_not_run(box):
    cluster, model = box
    two = json.loads((EXAMPLES / "roundpipe-8x4090.json").read_text())
    half = dict(two["pipelines"][0], num_microbatches=8)
    two["pipelines"] = [dict(half, devices=list(POOL[:4])), dict(half, devices=list(POOL[4:]))]
    with pytest.raises(SpecError, match="2 data-parallel pools"):
        preflight(cluster, model, load_config(two), cuda_available=True, library=True, gpu_count=8)
    cpu = load_cluster("cpu-2")
    tiny = load_model("tiny")
    plan = load_config(
        {
            "micro_batch_size": 1,
            "schedule": "roundpipe",
            "pipelines": [
                {
                    "num_microbatches": 8,
                    "devices": ["cpu:0", "cpu:1"],
                    "forward_layers": [1, 1],
                    "fused_layers": 2,
                    "backward_layers": [1, 1],
                }
            ],
        }
    )
    with pytest.raises(SpecError, match="CUDA GPUs; this pool has cpu devices"):
        preflight(cpu, tiny, plan, cuda_available=True, library=True, gpu_count=8)


def test_invalid_plans_stay_invalid_not_runner_errors(box, example):
    cluster, model = box
    raw = json.loads((EXAMPLES / "roundpipe-8x4090.json").read_text())
    raw["pipelines"][0]["forward_layers"][1] += 1
    with pytest.raises(SpecError) as e:
        preflight(cluster, model, load_config(raw), cuda_available=True, library=True, gpu_count=8)
    assert e.value.source != "runner" and "num_layers=40" in str(e.value)


def test_checkpoints_refused_for_roundpipe_training():
    refuse_checkpoints(None, False)
    with pytest.raises(SpecError, match="checkpoints of roundpipe plans are not implemented"):
        refuse_checkpoints("ckpt", False)
    with pytest.raises(SpecError, match="--resume"):
        refuse_checkpoints("ckpt", True)


def test_worker_sees_the_pool_through_cuda_visible_devices():
    launch = RoundPipeLaunch(pool=("box:2", "box:3"), gpu_indices=(2, 3))
    assert launch.cuda_visible_devices(None) == "2,3"
    assert launch.cuda_visible_devices("4,5,6,7") == "6,7"  # box:k is this process's cuda:k


def test_real_backend_answers_roundpipe_plans_invalid_on_this_machine(box, example):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the plan may run")
    from autotune.planning.budget import BudgetedEvaluator
    from autotune.planning.space import SearchSpace
    from runner import RealEvaluator, profiled_run

    cluster, model = box
    real = RealEvaluator(cluster, model)
    assert "no CUDA" in real.check(example)
    budgeted = BudgetedEvaluator(real, SearchSpace(cluster, model), budget=5)
    m = budgeted.evaluate(example)
    assert m.status == "invalid" and "roundpipe library on CUDA" in m.error and budgeted.used == 0
    m = profiled_run(cluster, model, example)  # measure's path: never launched, never raises
    assert m.status == "failed" and "no CUDA" in m.error


@pytest.mark.gpu
def test_gpu_roundpipe_plan_measures_and_trains(tmp_path):
    """On CUDA with the extra: a tiny roundpipe plan over this machine's GPUs measures, its first loss is the
    single-process reference's, and training lowers the loss (scripts/roundpipe_gpu_check.py runs more)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from runner.roundpipe_run import library_installed

    if not library_installed():
        pytest.skip(f"needs the roundpipe extra ({EXTRA_HINT})")
    sys.path.insert(0, str(ROOT / "scripts"))
    import roundpipe_gpu_check as check

    result = check.tiny_checks(tmp_path)
    assert result["measure"]["status"] == "ok", result
    assert abs(result["first_loss"] - result["reference_first_loss"]) < 2e-2 * result["reference_first_loss"], result
    assert result["train_losses"][-1] < result["train_losses"][0], result
