"""The one contract every evaluator keeps (STYLE.md item 3): the simulator, the cache around it, and the
real profiled run answer ``evaluate(config) -> Measurement`` the same way, and never raise for a plan."""

from __future__ import annotations

import pytest

from autotune import load_cluster, load_config, load_model
from autotune.evaluator import CachedEvaluator, Evaluator
from autotune.simulator import Simulator

TINY_TWO_STAGES = {
    "micro_batch_size": 2,
    "schedule": "1f1b",
    "pipelines": [
        {
            "num_microbatches": 4,
            "stages": [{"devices": ["cpu:0"], "layers": 3}, {"devices": ["cpu:1"], "layers": 1, "recompute": True}],
        }
    ],
}


def _simulator() -> Evaluator:
    return Simulator(load_cluster("cpu-2"), load_model("tiny"))


def _cached() -> Evaluator:
    return CachedEvaluator(_simulator())


def _real() -> Evaluator:
    from runner import RealEvaluator

    return RealEvaluator(load_cluster("cpu-2"), load_model("tiny"), steps=1, warmup=1, timeout_s=120)


EVALUATORS = [
    pytest.param(_simulator, id="simulator"),
    pytest.param(_cached, id="cached-simulator"),
    pytest.param(_real, id="real", marks=[pytest.mark.distributed, pytest.mark.slow]),
]


@pytest.fixture(params=EVALUATORS, scope="module")
def evaluator(request) -> Evaluator:
    return request.param()


class TestEvaluatorContract:
    def test_is_an_evaluator(self, evaluator: Evaluator) -> None:
        assert isinstance(evaluator, Evaluator)
        assert evaluator.cluster.name == "cpu-2" and evaluator.model.name == "tiny"

    def test_valid_plan(self, evaluator: Evaluator) -> None:
        m = evaluator.evaluate(load_config(TINY_TWO_STAGES))
        assert m.status == "ok", m.error
        assert m.ok and not m.oom and m.score() == m.tokens_per_s > 0
        tokens = evaluator.model.global_batch_size * evaluator.model.seq_len
        assert m.tokens_per_s == pytest.approx(tokens / m.iteration_time_s, rel=0.02)
        assert set(m.peak_memory_GiB) == {"cpu:0", "cpu:1"}
        assert all(v >= 0 for v in m.peak_memory_GiB.values())
        assert len(m.stage_busy_s) == 2 and all(t > 0 for t in m.stage_busy_s)
        assert 0.0 <= m.bubble_fraction < 1.0
        for key in (
            "tokens_per_s",
            "iteration_time_s",
            "oom",
            "peak_memory_GiB",
            "mfu",
            "bubble_fraction",
            "status",
            "error",
        ):
            assert key in m.to_dict()

    @pytest.mark.parametrize(
        "change,rule",
        [
            (lambda d: d["pipelines"][0]["stages"][0].update(layers=2), "layers sum to 3"),
            (lambda d: d["pipelines"][0]["stages"][1].update(devices=["cpu:7"]), "unknown device id 'cpu:7'"),
            (lambda d: d["pipelines"][0].update(num_microbatches=3), "global_batch_size is 8"),
        ],
    )
    def test_invalid_plan_is_a_measurement_not_an_exception(self, evaluator: Evaluator, change, rule) -> None:
        import copy

        raw = copy.deepcopy(TINY_TWO_STAGES)
        change(raw)
        m = evaluator.evaluate(load_config(raw))
        assert m.status == "invalid" and rule in m.error
        assert not m.ok and m.score() == 0.0


def test_cache_answers_repeats_without_the_inner_evaluator() -> None:
    inner = _simulator()
    cached = CachedEvaluator(inner)
    cfg = load_config(TINY_TWO_STAGES)
    first = cached.evaluate(cfg)
    again = cached.evaluate(load_config(TINY_TWO_STAGES))  # equal, not identical, config
    assert again is first and cached.hits == 1 and cached.misses == 1
