"""The runner on plans with mixed data-parallel stages (Zorse; runner.mixed): placement and refusals (fast),
and real gloo runs (slow): loss equal to single-process training over 6 steps, bit-exact resume, also with
ZeRO-1 / 2 sharding over the mixed stages' ranks.

Tolerance as in test_runner_distributed: the same fp32 math as the single-process reference up to the
order of sums (measured <= 2e-7 relative); rtol 1e-5 is far below what a weighting bug moves (giving the
two ranks of the 5/3 stage equal weight changes the step-2 loss by ~1e-3 relative).
"""

from __future__ import annotations

import pytest
from mixed_runs import RTOL, STEPS, cluster_yaml, rank, run, trains_like_one_process_and_resumes

from autotune.loading import cluster_from_dict, load_model
from autotune.specs import ParallelConfig
from runner.layout import build_layout

# the plan: stage 0 = two ranks of different speed with shares 5/3, stage 1 = one rank
PLAN_5_3 = {
    "micro_batch_size": 1,
    "schedule": "1f1b",
    "pipelines": [
        {
            "num_microbatches": 8,
            "stages": [
                {"layers": 3, "ranks": [rank("fast:0", 5), rank("slow:0", 3)]},
                {"devices": ["fast:1"], "layers": 1},
            ],
        }
    ],
}
# one rank widening to a mixed stage of two (1 -> 2 hand-offs), plus a second replica of plain stages
PLAN_REPLICA = {
    "micro_batch_size": 1,
    "schedule": "gpipe",
    "pipelines": [
        {
            "num_microbatches": 5,
            "stages": [
                {"devices": ["fast:0"], "layers": 1},
                {"layers": 3, "recompute": True, "ranks": [rank("fast:1", 3), rank("slow:0", 2)]},
            ],
        },
        {"num_microbatches": 3, "stages": [{"devices": ["slow:1"], "layers": 2}, {"devices": ["fast:2"], "layers": 2}]},
    ],
}


def layout_of(config: dict, fast: int, slow: int):
    cluster = cluster_from_dict(
        {
            "name": "t",
            "nodes": [
                {"name": "fast", "gpu": "cpu", "count": fast},
                {"name": "slow", "gpu": "cpu", "count": slow, "slowdown": 2},
            ],
            "network": {"bandwidth_GBps": 5},
        },
        "test",
    )
    return build_layout(cluster, load_model("tiny"), ParallelConfig.from_dict(config))


def test_layout_places_each_rank_of_a_mixed_stage_with_its_share():
    layout = layout_of(PLAN_5_3, 2, 1)
    assert layout.mixed
    assert [(r.device_id, r.stage, r.stage_rank, r.share) for r in layout.ranks] == [
        ("fast:0", 0, 0, 5),
        ("slow:0", 0, 1, 3),
        ("fast:1", 1, 0, 8),
    ]
    # the two ranks of stage 0 hold the same layers: one gradient group; no tensor-parallel groups
    groups = layout.grad_groups()
    assert groups[(0, 1)] == ("embed", "layer0", "layer1", "layer2")
    assert groups[(2,)] == ("layer3", "head")
    assert layout.tp_groups() == ()
    # across replicas too: layer 0 lives on fast:0 (pipeline 0) and slow:1 (pipeline 1)
    layout = layout_of(PLAN_REPLICA, 3, 2)
    by_device = {r.device_id: r.rank for r in layout.ranks}
    holders = {k: g for g, keys in layout.grad_groups().items() for k in keys}
    assert holders["layer2"] == tuple(sorted((by_device["fast:1"], by_device["slow:0"], by_device["fast:2"])))
    assert holders["layer0"] == tuple(sorted((by_device["fast:0"], by_device["slow:1"])))


def test_mixed_stage_plans_with_zero_offload_tp_and_layerwise_execution_all_build():
    """ZeRO-3 runs (gathers served point to point, runner.zero), also with ranks at different degrees
    (runner.sharded_state's parts), and with those ranks layer-wise (refused until ae8b77f; run in
    test_reshard.py's layer-wise ZeRO-3 over tp-2 and tp-1 replicas)."""
    assert layout_of({**PLAN_REPLICA, "zero": 3}, 3, 2).sharded
    offload = {
        **PLAN_5_3,
        "pipelines": [
            {
                **PLAN_5_3["pipelines"][0],
                "stages": [
                    {**PLAN_5_3["pipelines"][0]["stages"][0], "offload": "optimizer"},
                    PLAN_5_3["pipelines"][0]["stages"][1],
                ],
            }
        ],
    }
    assert layout_of(offload, 2, 1).sharded  # offload runs (test_offload_in_a_mixed_stage_...)
    tp = {
        "micro_batch_size": 2,
        "pipelines": [
            {
                "num_microbatches": 4,
                "stages": [
                    {
                        "layers": 4,
                        "ranks": [{"devices": ["fast:0", "fast:1"], "num_microbatches": 3}, rank("slow:0", 1)],
                    }
                ],
            }
        ],
    }
    assert layout_of(tp, 2, 1).mixed  # ranks at tp 2 and tp 1 run (tests/integration/runner/test_per_stage_tp.py)
    assert layout_of({**tp, "zero": 3}, 2, 1).sharded  # and with ZeRO (test_zero_3_over_ranks_at_tp_2_and_1...)
    layerwise = {**tp, "pipelines": [{**tp["pipelines"][0], "execution": "layerwise"}]}
    assert layout_of(layerwise, 2, 1).mixed  # runs (measured 6.5e-8 from one process; not a test: suite time)
    assert layout_of({**layerwise, "zero": 1}, 2, 1).sharded


def test_zero_1_and_2_shard_a_mixed_stage_among_its_ranks_and_the_replicas():
    """The ranks of a mixed stage (and the other replicas' holders) are the ZeRO peers of its layers."""
    layout = layout_of({**PLAN_5_3, "zero": 2}, 2, 1)
    assert layout.sharded and layout.mixed
    holders = {key: h for key, _, h in layout.key_holders()}
    assert holders["layer0"] == (0, 1) and holders["head"] == (2,)
    layout = layout_of({**PLAN_REPLICA, "zero": 1}, 3, 2)
    by_device = {r.device_id: r.rank for r in layout.ranks}
    holders = {key: h for key, _, h in layout.key_holders()}
    assert holders["layer2"] == tuple(sorted((by_device["fast:1"], by_device["slow:0"], by_device["fast:2"])))


# --------------------------------------------------------------------------------------------------
# real runs (gloo)


@pytest.fixture(scope="module")
def reference() -> list[float]:
    from runner.reference import reference_losses

    return reference_losses("tiny", STEPS)


@pytest.mark.slow
@pytest.mark.distributed
def test_5_3_mixed_stage_trains_like_a_single_process_and_resumes_bit_exact(reference, tmp_path):
    # stop after 3 steps (checkpoint at the end), resume to 6: the identical curve
    losses = trains_like_one_process_and_resumes(PLAN_5_3, cluster_yaml(tmp_path, 2, 1), tmp_path, reference)
    assert len(losses) == STEPS and losses[-1] < losses[0]


@pytest.mark.slow
@pytest.mark.distributed
def test_mixed_stage_beside_a_second_replica_trains_like_a_single_process(reference, tmp_path):
    import torch

    losses = run(PLAN_REPLICA, cluster_yaml(tmp_path, 3, 2), tmp_path)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=RTOL, atol=0)


@pytest.mark.slow
@pytest.mark.distributed
def test_zero_2_over_a_mixed_stage_trains_like_a_single_process_and_resumes_bit_exact(reference, tmp_path):
    """ZeRO-2 across the 5/3 stage's two ranks (asynchronous per-micro-batch reduce-scatters, the 3-share rank
    padding two): single-process loss; stop + sharded checkpoint + resume gives the identical curve."""
    trains_like_one_process_and_resumes({**PLAN_5_3, "zero": 2}, cluster_yaml(tmp_path, 2, 1), tmp_path, reference)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_over_a_mixed_stage_beside_a_second_replica_trains_like_a_single_process(reference, tmp_path, zero):
    import torch

    losses = run({**PLAN_REPLICA, "zero": zero}, cluster_yaml(tmp_path, 3, 2), tmp_path)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=RTOL, atol=0)


def _offloaded(plan: dict, modes: dict[tuple[int, int], str]) -> dict:
    """``plan`` with stage ``(p, s)``'s offload set to ``modes[(p, s)]``."""
    pipes = []
    for p, pipe in enumerate(plan["pipelines"]):
        stages = [{**st, "offload": modes.get((p, s), "none")} for s, st in enumerate(pipe["stages"])]
        pipes.append({**pipe, "stages": stages})
    return {**plan, "pipelines": pipes}


@pytest.mark.slow
@pytest.mark.distributed
def test_offload_in_a_mixed_stage_trains_like_a_single_process_and_resumes_bit_exact(reference, tmp_path):
    """The 5/3 stage's parameters streamed from host memory (offload all) under ZeRO-2: single-process loss,
    exact resume."""
    plan = _offloaded({**PLAN_5_3, "zero": 2}, {(0, 0): "all", (0, 1): "optimizer"})
    trains_like_one_process_and_resumes(plan, cluster_yaml(tmp_path, 2, 1), tmp_path, reference)


@pytest.mark.slow
@pytest.mark.distributed
def test_zero_3_over_a_mixed_stage_trains_like_a_single_process_and_resumes_bit_exact(reference, tmp_path):
    """ZeRO-3 across the 5/3 stage's two ranks (Zorse's ZeRO-sharded mixed stage under 1F1B, not layer-wise):
    each rank's per-use gathers are answered by sends its peer posted at the step's start, the 5-share rank
    taking 10 per layer, the 3-share rank 6; both stream their shards from host memory (offload all).
    Single-process loss, exact resume."""
    plan = _offloaded({**PLAN_5_3, "zero": 3}, {(0, 0): "all"})
    trains_like_one_process_and_resumes(plan, cluster_yaml(tmp_path, 2, 1), tmp_path, reference)


@pytest.mark.slow
@pytest.mark.distributed
def test_zero_3_over_ranks_at_tp_2_and_1_in_a_mixed_stage_trains_like_a_single_process(reference, tmp_path):
    """A stage of a tp-2 rank (3 micro-batches) and a tp-1 rank (1): each part of a sharded weight a ZeRO-3
    unit of its own (the tp-1 rank holds both), gathers served point to point."""
    import torch

    plan = {
        "micro_batch_size": 2,
        "zero": 3,
        "pipelines": [
            {
                "num_microbatches": 4,
                "stages": [
                    {
                        "layers": 4,
                        "ranks": [{"devices": ["fast:0", "fast:1"], "num_microbatches": 3}, rank("slow:0", 1)],
                    }
                ],
            }
        ],
    }
    losses = run(plan, cluster_yaml(tmp_path, 2, 1), tmp_path)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=RTOL, atol=0)


@pytest.mark.slow
@pytest.mark.distributed
def test_offload_in_a_mixed_stage_beside_a_second_replica_trains_like_a_single_process(reference, tmp_path):
    import torch

    plan = _offloaded({**PLAN_REPLICA, "zero": 1}, {(0, 1): "optimizer", (1, 0): "all"})
    losses = run(plan, cluster_yaml(tmp_path, 3, 2), tmp_path)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=RTOL, atol=0)
