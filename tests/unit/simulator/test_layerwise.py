"""Zorse's layer-wise execution (``execution: "layerwise"``): the plan field and its rules, the program the
simulator runs (hand-computed), ZeRO traffic once per iteration, activations in host memory with offload."""

from __future__ import annotations

import copy

import pytest

from autotune import SpecError
from autotune.loading import cluster_from_dict, model_from_dict
from autotune.simulator import Simulator
from autotune.simulator.layerwise import compile_layerwise
from autotune.simulator.schedule import run_program
from autotune.simulator.zero import ChunkComm
from autotune.specs import ParallelConfig

MODEL = dict(
    name="m",
    num_layers=8,
    hidden_size=1024,
    num_heads=16,
    ffn_hidden_size=4096,
    vocab_size=32000,
    seq_len=1024,
    global_batch_size=8,
)
ZORSE_STAGE0 = {
    "layers": 6,
    "ranks": [{"devices": ["fast:0"], "num_microbatches": 5}, {"devices": ["slow:0"], "num_microbatches": 3}],
}
LAST = {"layers": 2, "devices": ["fast:1"]}


def _cluster(network_GBps: float = 10.0):
    def node(name, gpu, tflops, gib):
        gpu = dict(name=gpu, peak_tflops=tflops, memory_GiB=gib, memory_bandwidth_GBps=1000)
        return dict(name=name, count=2, gpu=gpu, intra_node=dict(bandwidth_GBps=100, latency_us=5))

    nodes = [node("fast", "F", 100, 80), node("slow", "S", 60, 16)]
    return cluster_from_dict(
        {"name": "t", "nodes": nodes, "network": {"bandwidth_GBps": network_GBps, "latency_us": 20}}, "t"
    )


def _plan(stages, m=8, **top):
    return {"micro_batch_size": 1, **top, "pipelines": [{"num_microbatches": m, "stages": stages}]}


def _layerwise(plan: dict) -> dict:
    out = copy.deepcopy(plan)
    for pipe in out["pipelines"]:
        pipe["execution"] = "layerwise"
    return out


# -- the plan field --------------------------------------------------------------------------------------


def test_the_field_round_trips_describes_and_defaults_to_microbatch():
    plain = ParallelConfig.from_dict(_plan([ZORSE_STAGE0, LAST]))
    assert plain.pipelines[0].execution == "microbatch" and "execution" not in plain.to_dict()["pipelines"][0]
    cfg = ParallelConfig.from_dict(_layerwise(_plan([ZORSE_STAGE0, LAST], schedule="gpipe")))
    assert cfg.pipelines[0].execution == "layerwise"
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.describe().endswith("m=8 layerwise")
    cfg.validate(_cluster(), model_from_dict(MODEL, "m"))


@pytest.mark.parametrize(
    "execution,top,message",
    [
        ("layer", {}, 'pipelines[0].execution: must be "microbatch" or "layerwise", got \'layer\''),
        (
            "layerwise",
            {"schedule": "interleaved-1f1b", "virtual_stages": 2},
            'pipelines[0].execution: "layerwise" runs each stage as one chunk layer by layer: use schedule '
            "1f1b or gpipe, not 'interleaved-1f1b'",
        ),
    ],
)
def test_bad_values_are_one_line_naming_the_field(execution, top, message):
    plan = _plan([{"layers": 4, "devices": ["fast:0"]}, {"layers": 4, "devices": ["fast:1"]}], **top)
    plan["pipelines"][0]["execution"] = execution
    with pytest.raises(SpecError) as e:
        ParallelConfig.from_dict(plan, "plan.json")
    assert str(e.value) == f"plan.json: {message}"


# -- the program, by hand ----------------------------------------------------------------------------------


def test_two_stages_of_two_layers_by_hand():
    """Forward 1 s and backward 2 s per micro-batch and stage (a layer half of that), 2 micro-batches.

    Stage 0 forward: layer 1 for mb 0, 1 at [0, .5], [.5, 1]; layer 2 at [1, 1.5], [1.5, 2] (sends each).
    Stage 1 forward: mb 0 arrives at 1.5 + c: [1.5+c, 2+c], mb 1 at max(2 + c, 2 + c): [2+c, 2.5+c], its
    layer 2 [2.5+c, 3+c], [3+c, 3.5+c]; backward layer 2 mb 1, 0: [3.5+c, 4.5+c], [4.5+c, 5.5+c]; layer 1
    mb 1, 0 (sending each back): [5.5+c, 6.5+c], [6.5+c, 7.5+c]. Stage 0 backward: mb 1 arrives at 6.5 + 2c:
    [6.5+2c, 7.5+2c], mb 0 at 7.5 + 2c: [7.5+2c, 8.5+2c]; layer 1: [.., 9.5+2c], [.., 10.5+2c]."""
    comp = compile_layerwise(2, (2, 2), ((2,), (2,)))
    assert comp.in_flight == (2, 2)  # every micro-batch's activations alive at the end of the forward
    cost = {0: (1.0, 2.0), 1: (1.0, 2.0)}
    durs = [cost[u][kind] * f for (u, kind), f in zip(comp.sources, comp.scales)]
    for c in (0.0, 0.25):
        comms = [0.0] + [c] * len(comp.transfers)
        _, free = run_program(comp, durs, comms)
        assert free == pytest.approx([10.5 + 2 * c, 7.5 + c])


def test_one_stage_is_gradient_accumulation_in_another_order():
    """One stage of 4 layers, 3 micro-batches: the same work as micro-batch execution, no waiting."""
    comp = compile_layerwise(3, (4,), ((3,),))
    durs = [(1.0, 2.0)[kind] * f for (_, kind), f in zip(comp.sources, comp.scales)]
    _, free = run_program(comp, durs, [0.0] * (1 + len(comp.transfers)))
    assert free == pytest.approx([3 * (1.0 + 2.0)])
    # 3 first-layer and 3 last-layer operations each way, one for the middle layers
    assert len(comp.program) == 2 * (3 + 1 + 3)


def test_a_mixed_stage_sends_each_micro_batch_from_its_owner():
    comp = compile_layerwise(8, (6, 2), ((5, 3), (8,)))
    assert comp.units == ((0, 0), (0, 1), (1, 0)) and comp.in_flight == (5, 3, 8)
    # forward hand-offs from both ranks of stage 0 to the one rank of stage 1, gradients back to both
    assert {(k, s, a, b) for k, s, a, b in comp.transfers} >= {(0, 1, 0, 0), (0, 1, 1, 0), (1, 0, 0, 0), (1, 0, 0, 1)}


# -- the simulator ---------------------------------------------------------------------------------------


def test_zero_traffic_is_spread_over_the_micro_batches():
    assert ChunkComm(3.0, 6.0, 9.0).spread(3) == ChunkComm(1.0, 2.0, 3.0)


def test_zero3_gathers_once_per_layer_so_a_communication_bound_plan_gets_faster():
    """Two single-stage replicas, ZeRO-3 over a 0.1 GB/s network, where the gathers and reduce-scatters
    dwarf the compute: micro-batch execution moves every layer's weights and gradients for each of the 4
    micro-batches, layer-wise execution once per iteration: a quarter of the time, plus compute."""
    model = model_from_dict(MODEL, "m")
    sim = Simulator(_cluster(0.1), model)
    plan = {
        "micro_batch_size": 1,
        "schedule": "gpipe",
        "zero": 3,
        "pipelines": [
            {"num_microbatches": 4, "stages": [{"layers": 8, "devices": ["fast:0"]}]},
            {"num_microbatches": 4, "stages": [{"layers": 8, "devices": ["slow:0"]}]},
        ],
    }
    micro = sim.evaluate(ParallelConfig.from_dict(plan))
    layer = sim.evaluate(ParallelConfig.from_dict(_layerwise(plan)))
    assert micro.ok and layer.ok
    assert micro.iteration_time_s / 4 < layer.iteration_time_s < micro.iteration_time_s / 3
    # the same memory: every micro-batch's activations are alive at the end of both forwards (GPipe)
    assert layer.peak_memory_GiB == pytest.approx(micro.peak_memory_GiB)


def test_with_offload_the_activations_wait_in_host_memory():
    """Device: one micro-batch's activations instead of all; host: the rest."""
    model = model_from_dict(MODEL, "m")
    sim = Simulator(_cluster(), model)
    stage = {"layers": 8, "devices": ["fast:0"], "offload": "optimizer"}
    plan = {"micro_batch_size": 1, "schedule": "gpipe", "pipelines": [{"num_microbatches": 8, "stages": [stage]}]}
    micro = sim.evaluate(ParallelConfig.from_dict(plan))
    layer = sim.evaluate(ParallelConfig.from_dict(_layerwise(plan)))
    assert micro.ok and layer.ok
    costs = sim.costs
    args = (("fast:0",), 8, False, True, True, 1)
    all_of_them, _ = costs.stage_memory_GiB(*args, 8, 1, 1, 0, "optimizer")
    one, _ = costs.stage_memory_GiB(*args, 1, 1, 1, 0, "optimizer")
    assert micro.allocated_memory_GiB["fast:0"] == pytest.approx(all_of_them)
    assert layer.allocated_memory_GiB["fast:0"] == pytest.approx(one)
    assert layer.host_memory_GiB["fast"] - micro.host_memory_GiB["fast"] == pytest.approx(all_of_them - one)
    assert layer.expected_error > 0  # every prediction carries its error bar
