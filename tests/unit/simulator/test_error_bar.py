"""Every prediction's error bar: its pieces by hand, and how the schedule weighs them."""

from __future__ import annotations

import math

import pytest
from simulator_cases import two_nodes

from autotune import load_model
from autotune.simulator import Simulator
from autotune.simulator import error_bar as eb
from autotune.specs import Measurement, ParallelConfig


def test_network_error_is_validated_above_10_GBps_and_grows_log_linearly_to_1_gbit() -> None:
    assert eb.network_error(25.0)[0] == eb.NETWORK_ERROR_VALIDATED == 0.10
    assert eb.network_error(0.115)[0] == eb.network_error(0.01)[0] == eb.NETWORK_ERROR_SLOW == 0.152
    # the geometric middle of 10 and 0.115 GB/s is halfway: 0.10 + (0.152 - 0.10) / 2
    assert eb.network_error(math.sqrt(10 * 0.115))[0] == pytest.approx(0.126)
    assert "below the validated range" in eb.network_error(1.0)[1]


def test_compute_error_by_family_regime_and_calibration() -> None:
    assert eb.compute_error("A100-80GB", "bf16", False)[0] == eb.DATASHEET_TIME_ERROR[("A100", "16-bit")]
    assert eb.compute_error("A800-80GB", "fp32", False)[0] == eb.DATASHEET_TIME_ERROR[("A100", "fp32")]
    sigma, label = eb.compute_error("L4", "bf16", False)
    assert sigma == eb.UNVALIDATED_TIME_ERROR and "no measured run" in label
    assert eb.compute_error("L4", "bf16", True) == (eb.CALIBRATED_TIME_ERROR, "compute on L4 (profiled)")
    # the unvalidated default is the largest of the validated constants: no class is trusted more unmeasured
    assert eb.UNVALIDATED_TIME_ERROR == max(eb.DATASHEET_TIME_ERROR.values())
    assert eb.compute_error("H200", "bf16", False)[0] >= eb.compute_error("A100-80GB", "bf16", False)[0]


def test_combine_adds_in_quadrature_and_names_the_largest() -> None:
    assert eb.combine([("a", 0.03), ("b", -0.04), ("c", 0.001)]) == (
        pytest.approx(math.sqrt(0.03**2 + 0.04**2 + 0.001**2)),
        ("b", "a"),
    )
    assert eb.combine([("a", 0.02), ("a", 0.01)]) == (pytest.approx(0.03), ("a",))
    assert eb.describe(0.123, ("network at 0.1 GB/s",)) == "±12% (mostly network at 0.1 GB/s)"
    assert eb.describe(0.0, ()) == "not estimated"


PIPELINE = ParallelConfig.from_dict(
    {
        "micro_batch_size": 1,
        "pipelines": [
            {"num_microbatches": 16, "stages": [{"devices": ["a:0"], "layers": 24}, {"devices": ["b:0"], "layers": 24}]}
        ],
    }
)


def test_a_pipeline_over_a_fast_network_is_as_good_as_its_compute() -> None:
    """Over 100 GB/s the sends are small and hidden: the bar is A100's compute error, which the pipeline
    carries nearly whole (both stages are A100s, on the critical path)."""
    model = load_model("gpt2-xl", global_batch_size=16)
    m = Simulator(two_nodes(100.0), model).evaluate(PIPELINE)
    assert m.ok and m.error_terms[0].startswith("compute on A100-80GB")
    sigma = eb.DATASHEET_TIME_ERROR[("A100", "16-bit")]
    assert 0.9 * sigma < m.expected_error < 1.1 * math.hypot(sigma, eb.NETWORK_ERROR_VALIDATED * 0.1)
    assert Measurement.from_dict(m.to_dict()) == m


def test_a_pipeline_over_1_gbit_is_dominated_by_the_network() -> None:
    model = load_model("gpt2-xl", global_batch_size=16)
    slow = Simulator(two_nodes(0.125), model).evaluate(PIPELINE)
    fast = Simulator(two_nodes(100.0), model).evaluate(PIPELINE)
    assert slow.ok and slow.error_terms[0] == "network at 0.125 GB/s, below the validated range"
    assert slow.expected_error > fast.expected_error
    # never more than every term at its full error at once
    assert slow.expected_error <= math.hypot(eb.NETWORK_ERROR_SLOW, eb.DATASHEET_TIME_ERROR[("A100", "16-bit")])


def test_failed_predictions_and_measurements_carry_no_bar() -> None:
    model = load_model("llama2-70b", global_batch_size=16)
    m = Simulator(two_nodes(100.0), model).evaluate(
        ParallelConfig.from_dict(
            {
                "micro_batch_size": 1,
                "pipelines": [{"num_microbatches": 16, "stages": [{"devices": ["a:0"], "layers": 80}]}],
            }
        )
    )
    assert m.oom and m.expected_error == 0.0 and m.error_terms == ()
    assert "expected_error" not in m.to_dict()
