"""No search returns a plan `autotune train` refuses: on a small cluster of each plan family, the best plan of
dp, optuna and rl at small budgets passes the runner's pre-flight (CUDA, the GPUs and the RoundPipe library
assumed present: these are GPU clusters). Before the runner's limits bounded the search, the memory-tight
family's best plans (offload ``all`` with tensor parallelism) and the MoE family's (ZeRO-3 or tensor
parallelism inside MoE blocks) were refused; then the memory-tight family's searches left out ZeRO / offload
over replicas at different tensor-parallel degrees, which the runner now runs too (none left out)."""

from __future__ import annotations

import pytest
import torch

from autotune.catalog import GPU_CATALOG, MODEL_PRESETS
from autotune.errors import SpecError
from autotune.loading import load_cluster, load_model
from autotune.search.api import tune
from autotune.specs import ClusterSpec, LinkSpec, ModelSpec, NodeSpec
from runner.jobs import plan_limits

pytestmark = pytest.mark.slow
torch.set_num_threads(1)

NET = LinkSpec(3.125, 20.0)


def _nodes(prefix: str, gpu: str, count: int) -> list[NodeSpec]:
    return [NodeSpec(f"{prefix}-0", GPU_CATALOG[gpu], count, LinkSpec(16.0, 5.0), NET)]


def _preset(name: str, gbs: int) -> ModelSpec:
    return ModelSpec(
        name=name, global_batch_size=gbs, **{k: v for k, v in MODEL_PRESETS[name].items() if k != "global_batch_size"}
    )


FAMILIES = {
    # pipelines over two GPU types (per-stage tp, uneven replicas)
    "pipelines": (
        ClusterSpec("a100-a10g", tuple(_nodes("a100", "A100-40GB", 4) + _nodes("a10g", "A10G", 4))),
        "llama2-7b",
    ),
    # memory-tight consumer cards: ZeRO and offload
    "tight": (ClusterSpec("3090-t4", tuple(_nodes("rtx", "RTX-3090", 4) + _nodes("t4", "T4", 4))), "llama2-7b"),
    # Zorse's kind of machine: mixed-GPU stages
    "mixed-stages": (
        ClusterSpec(
            "zorse", tuple(_nodes("l4", "L4", 2) + _nodes("a6000", "A6000", 1) + _nodes("v100", "V100-32GB", 1))
        ),
        "gpt2-xl",
    ),
    # RoundPipe on consumer GPUs, SPES over the internet
    "roundpipe": (load_cluster("examples/8x4090.yaml"), "llama3-8b"),
    "spes": (load_cluster("examples/spes-16-internet.yaml"), "spes-2b"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_best_plan_of_every_method_passes_the_runners_preflight(family, tmp_path):
    cluster, model_name = FAMILIES[family]
    model = load_model(model_name) if model_name == "spes-2b" else _preset(model_name, 64)
    refusal = plan_limits(cluster, model)
    assert refusal is not None
    for method in ("dp", "optuna", "rl"):
        storage = str(tmp_path / "optuna.journal") if method == "optuna" else None
        result = tune(cluster, model, method=method, budget=5, track=False, storage=storage)
        assert result.best_measurement.ok, (method, result.best_measurement.error)
        assert refusal(result.best_config) is None, (method, refusal(result.best_config))
        if family == "tight":  # its best plans (ZeRO / offload over replicas at tp 2 and 1) run since issue 44
            assert result.summary is not None and result.summary.runner_limited == 0


def test_mixtral_s_only_fitting_plans_run_and_a_search_the_runner_cannot_run_says_so():
    """Mixtral-8x7B on 8 A100 + 8 V100 fits only with ZeRO-3 or tensor parallelism inside its MoE blocks, both of
    which the runner runs (issue 44): the best plan passes ``autotune train``'s pre-flight, and so does the best
    of a search restricted to ZeRO-3 with SPES's sparse sync (refused until the exchange gathered the sharded
    units in turn). A search restricted to what the runner does not run (a tied LM head on the last of two
    stages) says so in one line and names --engine instead of returning such a plan."""
    from dataclasses import replace

    from runner.jobs import preflight_refusal

    cluster, model = load_cluster("mixed-a100-v100"), load_model("mixtral-8x7b")
    found = tune(cluster, model, method="dp", budget=5, track=False)
    assert found.best_measurement.ok and preflight_refusal(cluster, model, found.best_config) is None
    spes = load_model("spes-2b")
    restrict = {"zero": [3], "sync_every": [10]}
    sparse = tune(
        cluster, spes, method="optuna", budget=5, track=False, storage="memory", restrict=restrict, max_sync_every=10
    )
    assert sparse.best_measurement.ok and sparse.best_config.zero == 3 and sparse.best_config.spes
    assert preflight_refusal(cluster, spes, sparse.best_config) is None
    assert sparse.summary is not None and sparse.summary.runner_limited == 0
    tied = replace(load_model("llama2-7b"), tied_embeddings=True)
    with pytest.raises(SpecError, match=r"`autotune train` does not run them \(--engine torchtitan"):
        tune(cluster, tied, method="optuna", budget=5, track=False, storage="memory", restrict={"pp": [2]})
    # the runner's limits bound only the default search: torchtitan runs it with ZeRO-3 (FSDP)
    plan = tune(cluster, model, method="dp", budget=5, track=False, engine="torchtitan")
    assert plan.best_measurement.ok and plan.best_config.zero == 3


def test_issue_26s_fleet_gets_a_plan_the_runner_runs_not_one_of_zero_tokens_per_s():
    """Issue 26's fleet, 2 x 8 A100-40GB + 8 RTX-4090, with Mixtral-8x7B: rl's walk once ended on RoundPipe plans
    the simulator answers ``invalid`` and returned one as its best at 0 tokens/s; then (runner without ZeRO or tp
    in MoE blocks) every method said no plan fits. Now its best plan fits and ``train``'s pre-flight accepts it
    (issue 44)."""
    from runner.jobs import preflight_refusal

    net = LinkSpec(3.125, 10.0)
    nodes = [NodeSpec(f"a100-{k}", GPU_CATALOG["A100-40GB"], 8, LinkSpec(300.0, 2.0), net) for k in range(2)]
    cluster = ClusterSpec(
        "a100x16-4090x8", tuple(nodes + [NodeSpec("rtx-0", GPU_CATALOG["RTX-4090"], 8, LinkSpec(16.0, 5.0), net)])
    )
    model = _preset("mixtral-8x7b", 256)
    found = tune(cluster, model, method="rl", budget=20, track=False)
    assert found.best_measurement.ok and found.best_measurement.tokens_per_s > 0
    assert preflight_refusal(cluster, model, found.best_config) is None
