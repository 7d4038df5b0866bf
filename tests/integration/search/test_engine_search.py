"""``--engine``: every method's best plan at small budgets is one the engine's exporter accepts, predicted as
that engine holds it (``autotune.simulator.engine_terms``)."""

from __future__ import annotations

import pytest

from autotune import engines, load_cluster, load_model
from autotune.search.api import tune
from autotune.simulator import Simulator

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("engine", list(engines.ENGINES))
@pytest.mark.parametrize("method", ["dp", "optuna", "rl"])
def test_the_best_plan_of_an_engine_search_exports(engine, method, tmp_path):
    result = tune(
        "mixed-a100-v100",
        "llama2-7b",
        method=method,
        budget=8,
        global_batch_size=64,
        track=False,
        storage=f"{tmp_path}/optuna.journal" if method == "optuna" else None,
        engine=engine,
    )
    assert result.best_measurement.ok, result.best_measurement.error
    assert engines.check(engine, result.best_config) is None
    engines.export(engine, result.best_config)
    cluster, model = load_cluster("mixed-a100-v100"), load_model("llama2-7b", 64)
    as_engine = Simulator(cluster, model, engine=engine).evaluate(result.best_config)
    assert result.best_measurement.peak_memory_GiB == pytest.approx(as_engine.peak_memory_GiB)
    assert result.best_measurement.iteration_time_s == pytest.approx(as_engine.iteration_time_s)
