"""ZeRO sharding and CPU offload in the simulator's memory model (autotune.simulator.zero)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from paths import EXAMPLES

from autotune import load_cluster, load_config, load_model
from autotune.simulator import Simulator
from autotune.simulator.zero import StateBytes, model_state_bytes, stage_units, state_bytes_for, working_bytes

GiB = 2**30
BOX = EXAMPLES / "8x4090.yaml"


def test_zero_paper_figure_1_example():
    """Rajbhandari et al. 2020, Fig. 1: Psi = 7.5B, N_d = 64, K = 12: 120, 31.4, 16.6, 1.9 GB per device."""
    psi = 7.5e9
    got = [model_state_bytes(psi, 64, z) / 1e9 for z in range(4)]
    assert [round(x, 1) for x in got] == [120.0, 31.4, 16.6, 1.9]


#: bytes per parameter (weights, gradients, optimizer state) as each engine holds a bf16 plan's model states:
#: ZeRO's mixed-precision Adam (16-bit weights and gradients, K = 12: DeepSpeed) and autotune's runner (fp32
#: weights and gradients under autocast, Adam's two fp32 moments: engine_terms.fp32_state)
SPLITS = {"deepspeed": (2, 2, 12), "autotune": (4, 4, 8)}


@pytest.mark.parametrize("engine", sorted(SPLITS))
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_simulated_memory_follows_the_zero_formula_to_the_byte(zero, engine):
    """Four replicas of one llama2-7b stage: the device peak differs from zero 0 by exactly the formula's
    resident states plus the documented working set (gathered units, whole gradients)."""
    cluster, model = load_cluster("mixed-h100-a100-32"), load_model("llama2-7b", 64)
    pipes = [
        {"num_microbatches": 16, "stages": [{"devices": [f"h100-0:{i}"], "layers": 32, "recompute": True}]}
        for i in range(4)
    ]
    sim = Simulator(cluster, model, engine=engine)
    peak = {
        z: sim.evaluate(load_config({"micro_batch_size": 1, "zero": z, "pipelines": pipes})).allocated_memory_GiB[
            "h100-0:0"
        ]
        for z in (0, zero)
    }
    units = stage_units(model, 32, 1, True, True)
    psi = sum(units)
    assert psi == model.num_params
    # the paper's formula, written out: weights w, gradients g, K bytes per parameter, N_d = 4
    w, g, k = SPLITS[engine]
    formula = {0: 16 * psi, 1: (w + g) * psi + k * psi / 4, 2: w * psi + (g + k) * psi / 4, 3: 16 * psi / 4}[zero]
    state = StateBytes(w, g, k)
    assert state_bytes_for(model, engine) == state
    assert model_state_bytes(psi, 4, zero, state) == formula
    expected = (formula + working_bytes(units, zero, "none", 4, state) - 16 * psi) / GiB
    assert peak[zero] - peak[0] == pytest.approx(expected, abs=1e-9)  # bytes: 1e-9 GiB ~ 1 byte
    if zero == 3:  # two blocks' weights (current + prefetched) plus one block's whole gradient
        block = model.params_per_layer
        assert max(units) == block and working_bytes(units, 3, "none", 4, state) == 2 * w * block + g * block


def test_only_bf16_plans_of_the_runner_take_its_fp32_split():
    """fp32 training holds 4 + 4 + 8 under every engine; bf16 under the runner's (fp32 weights and gradients
    under autocast); fp16, which the runner does not train, keeps mixed-precision Adam's 2 + 2 + 12."""
    model = load_model("llama2-7b")
    assert state_bytes_for(model) == StateBytes(4, 4, 8)
    assert state_bytes_for(model, "deepspeed") == state_bytes_for(model, "megatron") == StateBytes(2, 2, 12)
    assert state_bytes_for(replace(model, precision="fp16")) == StateBytes(2, 2, 12)
    assert state_bytes_for(replace(model, precision="fp32"), "deepspeed") == StateBytes(4, 4, 8)
    cluster = load_cluster("mixed-h100-a100-32")
    assert Simulator(cluster, model).costs.grad_bytes == 4
    assert Simulator(cluster, model, engine="megatron").costs.grad_bytes == 2


@pytest.mark.parametrize("engine", sorted(SPLITS))
def test_offload_moves_exactly_the_documented_bytes_to_host_memory(engine):
    cluster, model = load_cluster(BOX), load_model("llama2-13b", 64)
    sim = Simulator(cluster, model, engine=engine)
    psi = model.num_params
    w, g, k = SPLITS[engine]

    def plan(zero, offload, dp=8):
        return load_config(
            {
                "micro_batch_size": 1,
                "zero": zero,
                "pipelines": [
                    {
                        "num_microbatches": 64 // dp,
                        "stages": [{"devices": [f"box:{i}"], "layers": 40, "recompute": True, "offload": offload}],
                    }
                    for i in range(dp)
                ],
            }
        )

    # optimizer: (g + K) Psi / N_d per device with zero >= 1; all: also the weights (w Psi, / N_d with zero 3)
    for zero, offload, per_device in [
        (2, "optimizer", (g + k) * psi / 8),
        (3, "optimizer", (g + k) * psi / 8),
        (1, "all", (g + k) * psi / 8 + w * psi),
        (3, "all", 16 * psi / 8),
    ]:
        m = sim.evaluate(plan(zero, offload))
        assert m.host_memory_GiB["box"] == pytest.approx(8 * per_device / GiB, rel=1e-12), (zero, offload)
        assert m.to_dict()["host_memory_GiB"] == m.host_memory_GiB
    none = sim.evaluate(plan(3, "none"))
    opt = sim.evaluate(plan(3, "optimizer"))
    assert "host_memory_GiB" not in none.to_dict()
    # zero 3 + offload optimizer: the device no longer holds the K Psi / N_d and its g Psi / N_d gradient shard
    assert none.allocated_memory_GiB["box:0"] - opt.allocated_memory_GiB["box:0"] == pytest.approx(
        (g + k) * psi / 8 / GiB
    )


def test_host_memory_is_checked_per_node_and_the_error_names_it(tmp_path):
    small = tmp_path / "small-host.yaml"
    small.write_text(BOX.read_text().replace("memory_GiB: 512", "memory_GiB: 100"))
    cluster, model = load_cluster(small), load_model("llama2-13b", 64)
    cfg = load_config(
        {
            "micro_batch_size": 1,
            "zero": 3,
            "pipelines": [
                {
                    "num_microbatches": 8,
                    "stages": [{"devices": [f"box:{i}"], "layers": 40, "recompute": True, "offload": "optimizer"}],
                }
                for i in range(8)
            ],
        }
    )
    m = Simulator(cluster, model).evaluate(cfg)
    assert m.oom and m.status == "oom"
    assert "host memory of node 'box'" in m.error and "of its 100 GiB" in m.error
    assert m.host_memory_GiB["box"] > 100
    assert Simulator(load_cluster(BOX), model).evaluate(cfg).ok  # 512 GiB holds it


def test_llama2_13b_on_8x4090_fits_only_with_zero_3_or_offload():
    """As DeepSpeed holds it (16-bit weights and gradients); autotune's runner's fp32 weights do not fit the
    host's 512 GiB with zero 1 and offload all (8 x 52 GB of weights)."""
    cluster, model = load_cluster(BOX), load_model("llama2-13b")
    sim = Simulator(cluster, model, engine="deepspeed")

    def plan(zero, offload):
        return load_config(
            {
                "micro_batch_size": 1,
                "zero": zero,
                "pipelines": [
                    {
                        "num_microbatches": 64,
                        "stages": [{"devices": [f"box:{i}"], "layers": 40, "recompute": True, "offload": offload}],
                    }
                    for i in range(8)
                ],
            }
        )

    assert all(sim.evaluate(plan(z, "none")).oom for z in range(4))  # no ZeRO stage alone fits 24 GB
    assert sim.evaluate(plan(3, "optimizer")).ok
    assert sim.evaluate(plan(1, "all")).ok
    assert sim.evaluate(plan(0, "all")).oom  # every replica keeps its own full copy in host memory: 1.5 TiB
    runner = Simulator(cluster, model)
    assert runner.evaluate(plan(3, "optimizer")).ok and runner.evaluate(plan(3, "all")).ok
    held = runner.evaluate(plan(1, "all"))
    assert held.oom and "host memory of node 'box'" in held.error


def test_zero_with_one_replica_changes_nothing():
    cluster, model = load_cluster("mixed-a100-v100"), load_model("gpt2-xl", 64)
    base = {
        "micro_batch_size": 1,
        "pipelines": [
            {
                "num_microbatches": 64,
                "stages": [{"devices": ["a100:0"], "layers": 24}, {"devices": ["a100:1"], "layers": 24}],
            }
        ],
    }
    sim = Simulator(cluster, model)
    ref = sim.evaluate(load_config(base))
    for z in (1, 2, 3):
        m = sim.evaluate(load_config(dict(base, zero=z)))
        assert m.peak_memory_GiB == ref.peak_memory_GiB and m.tokens_per_s == pytest.approx(ref.tokens_per_s)
