"""The validity of any plan within a search: ``--restrict`` (``autotune.planning.validity.restriction``)."""

from __future__ import annotations


def test_a_plan_outside_the_restriction_is_refused_with_the_dimension_named() -> None:
    from autotune.planning.validity import restriction
    from autotune.specs import ParallelConfig

    plan = ParallelConfig.from_dict(
        {
            "micro_batch_size": 2,
            "pipelines": [
                {
                    "num_microbatches": 4,
                    "stages": [
                        {"devices": ["a:0"], "layers": 2, "recompute": True},
                        {"devices": ["a:1"], "layers": 2, "offload": "optimizer"},
                    ],
                }
            ],
        }
    )
    assert restriction({}, plan) is None
    assert restriction({"pp": [2], "mbs": [2, 4], "schedule": ["1f1b"]}, plan) is None
    assert restriction({"pp": [4]}, plan) == "--restrict pp=4: the plan has pp 2"
    assert restriction({"recompute": ["all"]}, plan) == "--restrict recompute=all: the plan has recompute all,none"
    assert restriction({"recompute": ["low-memory"]}, plan) is None  # a mix of on and off is low-memory's
    assert restriction({"offload": ["optimizer"]}, plan) == (
        "--restrict offload=optimizer: the plan has offload none,optimizer"
    )
    assert restriction({"zero": [3]}, plan) == "--restrict zero=3: the plan has zero 0"
