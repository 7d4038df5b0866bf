"""Mixed data-parallel stages (Zorse, ``ranks``): the plan rules with their messages, and the simulator by hand."""

from __future__ import annotations

import pytest

from autotune import SpecError
from autotune.loading import cluster_from_dict, model_from_dict
from autotune.simulator import Simulator
from autotune.specs import ParallelConfig
from autotune.specs.mixed_stage import microbatch_owners, rank_orders, stage_warmups

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


def _cluster():
    gpu = lambda name, tflops, gib: dict(name=name, peak_tflops=tflops, memory_GiB=gib, memory_bandwidth_GBps=1000)  # noqa: E731
    return cluster_from_dict(
        {
            "name": "t",
            "nodes": [
                dict(name="fast", count=3, gpu=gpu("F", 100, 80), intra_node=dict(bandwidth_GBps=100, latency_us=5)),
                dict(name="slow", count=2, gpu=gpu("S", 60, 16), intra_node=dict(bandwidth_GBps=100, latency_us=5)),
            ],
            "network": {"bandwidth_GBps": 10, "latency_us": 20},
        },
        "t",
    )


def _plan(stages, m=8, **top):
    return {"micro_batch_size": 1, **top, "pipelines": [{"num_microbatches": m, "stages": stages}]}


ZORSE_STAGE0 = {
    "layers": 6,
    "ranks": [{"devices": ["fast:0"], "num_microbatches": 5}, {"devices": ["slow:0"], "num_microbatches": 3}],
}
LAST = {"layers": 2, "devices": ["fast:1"]}


# -- plan rules ----------------------------------------------------------------------------------------


def test_round_trip_describe_and_backward_compatible_view():
    cfg = ParallelConfig.from_dict(_plan([ZORSE_STAGE0, LAST]))
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["pipelines"][0]["stages"][0]["ranks"] == ZORSE_STAGE0["ranks"]
    assert "devices" not in cfg.to_dict()["pipelines"][0]["stages"][0]
    assert cfg.describe() == "mbs=1 1f1b [fast:0 m5 + slow:0 m3 x6 | fast:1 x2] m=8"
    st0, st1 = cfg.pipelines[0].stages
    assert st0.devices == ("fast:0", "slow:0") and st0.mixed and cfg.has_mixed_stages
    # a devices stage is one rank with every micro-batch of its pipeline
    (only,) = cfg.pipelines[0].stage_ranks(1)
    assert only.devices == ("fast:1",) and only.num_microbatches == 8 and not st1.mixed
    cfg.validate(_cluster(), model_from_dict(MODEL, "m"))


@pytest.mark.parametrize(
    "stage0,top,message",
    [
        (
            {"layers": 6, "devices": ["fast:0"], "ranks": ZORSE_STAGE0["ranks"]},
            {},
            "pipelines[0].stages[0].ranks: give devices (one rank) or ranks, not both",
        ),
        ({"layers": 6, "ranks": []}, {}, "pipelines[0].stages[0].ranks: must be a non-empty list of ranks"),
        ({"layers": 6, "ranks": ["fast:0"]}, {}, "pipelines[0].stages[0].ranks[0]: must be an object"),
        (
            {"layers": 6, "ranks": [{"devices": ["fast:0"], "num_microbatches": 8, "tp": 1}]},
            {},
            "pipelines[0].stages[0].ranks[0].tp: unknown field",
        ),
        (
            {"layers": 6, "ranks": [{"num_microbatches": 8}]},
            {},
            "pipelines[0].stages[0].ranks[0].devices: is required and must be a list of device ids",
        ),
        (
            {"layers": 6, "ranks": [{"devices": ["fast:0"]}]},
            {},
            "pipelines[0].stages[0].ranks[0].num_microbatches: is required",
        ),
        (
            {"layers": 6, "ranks": [{"devices": [], "num_microbatches": 8}]},
            {},
            "pipelines[0].stages[0].ranks[0].devices: must list at least one device",
        ),
        (
            {
                "layers": 6,
                "ranks": [
                    {"devices": ["fast:0"], "num_microbatches": 8},
                    {"devices": ["slow:0"], "num_microbatches": 0},
                ],
            },
            {},
            "pipelines[0].stages[0].ranks[1].num_microbatches: must be > 0, got 0",
        ),
        (
            {
                "layers": 6,
                "ranks": [
                    {"devices": ["fast:0"], "num_microbatches": 5},
                    {"devices": ["slow:0"], "num_microbatches": 4},
                ],
            },
            {},
            "pipelines[0].stages[0].ranks: shares 5 + 4 = 9 micro-batches, the pipeline has num_microbatches=8",
        ),
        (
            {
                "layers": 6,
                "ranks": [
                    {"devices": ["fast:0"], "num_microbatches": 2.5},
                    {"devices": ["slow:0"], "num_microbatches": 5.5},
                ],
            },
            {},
            "pipelines[0].stages[0].ranks[0].num_microbatches: must be an integer",
        ),
        (
            ZORSE_STAGE0,
            {"schedule": "interleaved-1f1b", "virtual_stages": 2},
            "schedule: interleaved-1f1b with a stage of several ranks (pipelines[0].stages[0].ranks) is not supported",
        ),
    ],
)
def test_shape_rules_name_field_and_numbers(stage0, top, message):
    with pytest.raises(SpecError) as e:
        ParallelConfig.from_dict(_plan([stage0, LAST], **top))
    assert message in str(e.value)


MOE = dict(MODEL, num_experts=4)


@pytest.mark.parametrize(
    "top,message",
    [
        (
            {"expert_parallel": 2},
            "expert_parallel: 2 with a stage of several ranks (pipelines[0].stages[0].ranks): "
            "expert parallelism over mixed stages is not modelled",
        ),
        (
            {"sync_every_steps": 2},
            "sync_every_steps: SPES (expert subsets / periodic sync) with a stage of several "
            "ranks (pipelines[0].stages[0].ranks) is not modelled",
        ),
    ],
)
def test_moe_exchanges_over_mixed_stages_are_refused(top, message):
    with pytest.raises(SpecError) as e:
        ParallelConfig.from_dict(_plan([ZORSE_STAGE0, LAST], **top))
    assert message in str(e.value)


@pytest.mark.parametrize(
    "ranks,model,message",
    [
        (
            [{"devices": ["fast:0"], "num_microbatches": 5}, {"devices": ["fast:1"], "num_microbatches": 3}],
            MODEL,
            "pipelines[0].stages[1].devices: device 'fast:1' is used more than once",
        ),
        (
            [{"devices": ["fast:0"], "num_microbatches": 5}, {"devices": ["fast:0"], "num_microbatches": 3}],
            MODEL,
            "pipelines[0].stages[0].ranks: device 'fast:0' is used more than once",
        ),
        (
            [{"devices": ["fast:0"], "num_microbatches": 5}, {"devices": ["gone:0"], "num_microbatches": 3}],
            MODEL,
            "pipelines[0].stages[0].ranks: unknown device id 'gone:0'",
        ),
        (
            [{"devices": ["fast:0"], "num_microbatches": 5}, {"devices": ["slow:0", "slow:1"], "num_microbatches": 3}],
            dict(MODEL, num_heads=1, hidden_size=1024),
            "pipelines[0].stages[0].ranks[1].devices: tensor-parallel degree 2 must divide num_heads=1",
        ),
        (
            [{"devices": ["fast:0"], "num_microbatches": 5}, {"devices": ["slow:0", "slow:1"], "num_microbatches": 3}],
            dict(MODEL, ffn_hidden_size=4095),
            "pipelines[0].stages[0].ranks[1].devices: tensor-parallel degree 2 must divide ffn_hidden_size=4095",
        ),
    ],
)
def test_cluster_and_model_rules_name_field_and_numbers(ranks, model, message):
    cfg = ParallelConfig.from_dict(_plan([{"layers": 6, "ranks": ranks}, LAST]))
    with pytest.raises(SpecError) as e:
        cfg.validate(_cluster(), model_from_dict(model, "m"))
    assert message in str(e.value)


def test_round_robin_by_share_and_rank_orders():
    assert microbatch_owners((5, 3)) == (0, 1, 0, 0, 1, 0, 1, 0)
    assert microbatch_owners((1, 1, 2)) == (2, 0, 1, 2)
    assert microbatch_owners((8,)) == (0,) * 8
    # one rank per stage: Megatron-LM's p - s - 1 warm-up forwards
    assert stage_warmups("1f1b", [(8,)] * 4, 8) == (3, 2, 1, 0)
    # a wider stage behind: k_s - 1 + sum of the later widths (1 -> 2 ranks: 2 forwards before the first backward)
    assert stage_warmups("1f1b", [(8,), (4, 4)], 8) == (2, 1)
    # 5/3 then one rank: rank B (micro-batches 1, 4, 6) gets p - s = 2 of its own forwards (F1 F4) before B1:
    # the stage's warm-up is 3 (k_s - 1 + 1 = 2 would give B only F1, and B would wait out each round trip)
    assert stage_warmups("1f1b", [(5, 3), (8,)], 8) == (3, 0)
    # non-increasing along the pipeline (what keeps the orders free of deadlock), at most m
    # (stage 1's owners 0 0 1 0 0 0 1 0: its rank 1 needs F2 F6 before B2, so w_1 = 4, and w_0 >= w_1)
    assert stage_warmups("1f1b", [(8,), (6, 2), (8,)], 8) == (4, 4, 0)
    assert stage_warmups("1f1b", [(2, 1), (3,)], 3) == (2, 0)
    (a, b), (c,) = rank_orders("1f1b", [(5, 3), (8,)])
    assert a == [(0, 0), (0, 2), (0, 3), (1, 0), (0, 5), (1, 2), (1, 3), (0, 7), (1, 5), (1, 7)]
    assert b == [(0, 1), (0, 4), (1, 1), (0, 6), (1, 4), (1, 6)]
    assert c == [(kind, j) for j in range(8) for kind in (0, 1)]


# -- simulator, by hand ------------------------------------------------------------------------------------


def test_two_stage_pipeline_with_a_5_3_mixed_stage_by_hand():
    """Stage 0: ranks A = fast:0 (5 micro-batches) and B = slow:0 (3), stage 1: C = fast:1 (8). Each operation
    ends at max(its rank's previous operation, the end of the operation it waits for) + its duration; the
    durations are the cost model's for each rank's own device (``stage_estimate``), and on GPUs a send blocks
    its sender (NCCL), so each operation also includes the transfer it sends (``p2p_time_s``) to the rank
    that owns the micro-batch next: A's forwards go to C within the node, B's over the network, and C's
    backward of micro-batch j goes back to j's owner."""
    cluster, model = _cluster(), model_from_dict(MODEL, "m")
    sim = Simulator(cluster, model)
    cfg = ParallelConfig.from_dict(_plan([ZORSE_STAGE0, LAST]))
    A = sim.costs.stage_estimate(("fast:0",), 6, False, True, False, 1, 2, dp=2)
    B = sim.costs.stage_estimate(("slow:0",), 6, False, True, False, 1, 2, dp=2)
    C = sim.costs.stage_estimate(("fast:1",), 2, False, False, True, 1, 1)
    assert B.forward_s > A.forward_s  # the slow card is slower
    a = sim.costs.p2p_time_s(("fast:0",), ("fast:1",), 1)  # intra-node
    n = sim.costs.p2p_time_s(("slow:0",), ("fast:1",), 1)  # over the network
    assert n > a > 0
    fA, bA = A.forward_s + a, A.backward_s  # stage 0's backwards send nothing (first stage)
    fB, bB = B.forward_s + n, B.backward_s
    fC, bC_A, bC_B = C.forward_s, C.backward_s + a, C.backward_s + n  # the last stage's forwards send nothing
    # orders (rank_orders, stage 0's warm-up 3): A: F0 F2 F3 B0 F5 B2 B3 F7 B5 B7, B: F1 F4 B1 F6 B4 B6,
    # C: F0 B0 F1 B1 ... F7 B7; owners in stage 0: 0 1 0 0 1 0 1 0 (A B A A B A B A)

    def c_pair(prev_backward: float, upstream_forward: float, backward: float) -> float:
        """End of C's backward of micro-batch j: its forward starts after its previous backward and j's
        forward in stage 0, then its backward (sending to j's owner) follows at once."""
        return max(prev_backward, upstream_forward) + fC + backward

    A_F0 = fA
    B_F1 = fB
    A_F2 = A_F0 + fA
    A_F3 = A_F2 + fA
    B_F4 = B_F1 + fB
    C_B0 = c_pair(0.0, A_F0, bC_A)
    C_B1 = c_pair(C_B0, B_F1, bC_B)
    A_B0 = max(A_F3, C_B0) + bA
    C_B2 = c_pair(C_B1, A_F2, bC_A)
    B_B1 = max(B_F4, C_B1) + bB
    C_B3 = c_pair(C_B2, A_F3, bC_A)
    A_F5 = A_B0 + fA
    B_F6 = B_B1 + fB
    C_B4 = c_pair(C_B3, B_F4, bC_B)
    A_B2 = max(A_F5, C_B2) + bA
    A_B3 = max(A_B2, C_B3) + bA
    C_B5 = c_pair(C_B4, A_F5, bC_A)
    B_B4 = max(B_F6, C_B4) + bB
    A_F7 = A_B3 + fA
    C_B6 = c_pair(C_B5, B_F6, bC_B)
    C_B7 = c_pair(C_B6, A_F7, bC_A)
    A_B5 = max(A_F7, C_B5) + bA
    B_B6 = max(B_B4, C_B6) + bB
    A_B7 = max(A_B5, C_B7) + bA
    # stage 0's two ranks hold the same layers: they all-reduce its gradients (embedding + 6 blocks), then step
    params0 = 6 * model.params_per_layer + model.embedding_params
    sync = sim.costs.allreduce_time_s((("fast:0",), ("slow:0",)), params0)
    start = max(A_B7, B_B6)
    expected = max(start + sync + A.optimizer_s, start + sync + B.optimizer_s, C_B7 + C.optimizer_s)
    m = sim.evaluate_detailed(cfg)
    assert m.ok, m.error
    assert m.iteration_time_s == pytest.approx(expected, rel=1e-12)
    ends = {(e.device, e.op): e.end_s for e in m.timeline}
    assert ends[("slow:0", "B6")] == pytest.approx(B_B6, rel=1e-12)
    assert ends[("fast:0", "B7")] == pytest.approx(A_B7, rel=1e-12)
    assert ends[("fast:1", "B4")] == pytest.approx(C_B4, rel=1e-12)
    # each rank's busy time is its own share at its own speed; the stage shows its busiest rank
    assert m.stage_busy_s[0] == pytest.approx(
        max(5 * (A.forward_s + A.backward_s), 3 * (B.forward_s + B.backward_s)), rel=1e-12
    )
    # memory per rank: each holds the activations of its own in-flight micro-batches (A 3: F0 F2 F3; B 2: F1 F4)
    A3 = sim.costs.stage_estimate(("fast:0",), 6, False, True, False, 1, 3, dp=2)
    assert m.peak_memory_GiB["fast:0"] == pytest.approx(A3.memory_GiB)
    assert m.peak_memory_GiB["slow:0"] == pytest.approx(B.memory_GiB)
    assert A3.memory_GiB > A.memory_GiB


def test_mixed_stage_slot_time_is_set_by_its_queues_not_its_slowest_gpu():
    """A mixed stage's ranks work through their own shares at once; with the same two GPUs as one
    tensor-parallel group, or the slow one alone, every micro-batch waits for the slow card."""
    cluster, model = _cluster(), model_from_dict(dict(MODEL, vocab_size=256), "m")
    sim = Simulator(cluster, model)
    mixed = sim.evaluate(ParallelConfig.from_dict(_plan([ZORSE_STAGE0, LAST])))
    slow_alone = sim.evaluate(ParallelConfig.from_dict(_plan([{"layers": 6, "devices": ["slow:0"]}, LAST])))
    A = sim.costs.stage_estimate(("fast:0",), 6, False, True, False, 1, 2, dp=2)
    B = sim.costs.stage_estimate(("slow:0",), 6, False, True, False, 1, 2, dp=2)
    assert mixed.stage_busy_s[0] == pytest.approx(
        max(5 * (A.forward_s + A.backward_s), 3 * (B.forward_s + B.backward_s))
    )
    assert mixed.stage_busy_s[0] < 0.6 * 8 * (B.forward_s + B.backward_s)
    assert mixed.iteration_time_s < slow_alone.iteration_time_s


def test_hand_off_between_stages_of_different_width_goes_to_each_micro_batch_owner():
    """Stage 0: fast:0 (8); stage 1: ranks fast:1 and slow:0 with 4 each (owners 0 1 0 1 ...): micro-batch 1's
    activation goes over the network to slow:0, micro-batch 0's within the node to fast:1."""
    cluster, model = _cluster(), model_from_dict(MODEL, "m")
    sim = Simulator(cluster, model)
    cfg = ParallelConfig.from_dict(
        _plan(
            [
                {"layers": 6, "devices": ["fast:0"]},
                {
                    "layers": 2,
                    "ranks": [
                        {"devices": ["fast:1"], "num_microbatches": 4},
                        {"devices": ["slow:0"], "num_microbatches": 4},
                    ],
                },
            ]
        )
    )
    m = sim.evaluate_detailed(cfg)
    assert m.ok, m.error
    ev = {(e.device, e.op): e for e in m.timeline}
    assert ("fast:1", "F0") in ev and ("slow:0", "F1") in ev and ("fast:1", "F1") not in ev
    intra = sim.costs.p2p_time_s(("fast:0",), ("fast:1",), 1)
    net = sim.costs.p2p_time_s(("fast:0",), ("slow:0",), 1)
    assert net > intra > 0
    # on GPUs a send blocks its sender (NCCL): stage 0's forward of micro-batch j lasts its compute plus the
    # send to j's owner, and the owner starts when it ends
    f0, f1 = ev[("fast:0", "F0")], ev[("fast:0", "F1")]
    assert (f1.end_s - f1.start_s) - (f0.end_s - f0.start_s) == pytest.approx(net - intra, rel=1e-9)
    assert ev[("fast:1", "F0")].start_s == pytest.approx(f0.end_s, rel=1e-12)
    assert ev[("slow:0", "F1")].start_s == pytest.approx(f1.end_s, rel=1e-12)
    # stage 0's warm-up covers both ranks behind it: 2 forwards before its first backward
    ops = [e.op for e in sorted(m.timeline, key=lambda e: e.start_s) if e.device == "fast:0" and e.op[0] in "FB"]
    assert ops[:4] == ["F0", "F1", "F2", "B0"]


def test_gradient_sync_among_all_ranks_holding_the_layers_inside_stages_and_across_replicas():
    """Replica 0: stage 0 of two ranks (fast:0, slow:0), stage 1 fast:1; replica 1: fast:2 holding every layer.
    The first 6 layers have three holders (one all-reduce among 3), the last 2 two (fast:1 and fast:2)."""
    cluster, model = _cluster(), model_from_dict(dict(MODEL, global_batch_size=12), "m")
    sim = Simulator(cluster, model)
    cfg = ParallelConfig.from_dict(
        {
            "micro_batch_size": 1,
            "pipelines": [
                {"num_microbatches": 8, "stages": [ZORSE_STAGE0, LAST]},
                {"num_microbatches": 4, "stages": [{"layers": 8, "devices": ["fast:2"]}]},
            ],
        }
    )
    m = sim.evaluate_detailed(cfg)
    assert m.ok, m.error
    spans = {}
    for e in m.timeline:
        if e.op == "allreduce":
            spans.setdefault((e.start_s, e.end_s), set()).add(e.device)
    groups = {frozenset(d): t1 - t0 for (t0, t1), d in spans.items()}
    first = 6 * model.params_per_layer + model.embedding_params
    last = 2 * model.params_per_layer + model.embedding_params + model.hidden_size
    three = (("fast:0",), ("slow:0",), ("fast:2",))
    assert groups[frozenset({"fast:0", "slow:0", "fast:2"})] == pytest.approx(sim.costs.allreduce_time_s(three, first))
    assert groups[frozenset({"fast:1", "fast:2"})] == pytest.approx(
        sim.costs.allreduce_time_s((("fast:1",), ("fast:2",)), last)
    )


def test_zero_shards_training_state_across_a_mixed_stage():
    """With ZeRO-2 the two ranks of stage 0 are data-parallel peers: each holds half of the gradients and
    optimizer state, so the 16 GiB card fits a stage it cannot hold alone."""
    cluster = _cluster()
    model = model_from_dict(
        dict(MODEL, num_layers=16, hidden_size=2560, num_heads=20, ffn_hidden_size=10240, global_batch_size=8), "m"
    )
    sim = Simulator(cluster, model)
    mixed = {
        "layers": 12,
        "ranks": [{"devices": ["fast:0"], "num_microbatches": 5}, {"devices": ["slow:0"], "num_microbatches": 3}],
    }
    last = {"layers": 4, "devices": ["fast:1"]}
    plain = sim.evaluate(ParallelConfig.from_dict(_plan([mixed, last])))
    sharded = sim.evaluate(ParallelConfig.from_dict(_plan([mixed, last], zero=2)))
    alone = sim.evaluate(ParallelConfig.from_dict(_plan([{"layers": 12, "devices": ["slow:0"]}, last], zero=2)))
    assert plain.oom and not sharded.oom and alone.oom, (plain.error, sharded.error, alone.error)
    est = sim.costs.stage_estimate(("slow:0",), 12, False, True, False, 1, 2, dp=2, zero=2)
    assert sharded.peak_memory_GiB["slow:0"] == pytest.approx(est.memory_GiB)
    assert est.memory_GiB < sim.costs.stage_estimate(("slow:0",), 12, False, True, False, 1, 2).memory_GiB - 5


def test_one_rank_stage_written_as_ranks_simulates_like_devices():
    cluster, model = _cluster(), model_from_dict(MODEL, "m")
    sim = Simulator(cluster, model)
    ranks = sim.evaluate(
        ParallelConfig.from_dict(
            _plan([{"layers": 6, "ranks": [{"devices": ["fast:0"], "num_microbatches": 8}]}, LAST])
        )
    )
    devices = sim.evaluate(ParallelConfig.from_dict(_plan([{"layers": 6, "devices": ["fast:0"]}, LAST])))
    assert ranks.iteration_time_s == devices.iteration_time_s and ranks.peak_memory_GiB == devices.peak_memory_GiB


def test_cpu_hand_offs_do_not_block_the_sender_and_take_the_owner_pairs_link():
    """On CPU ranks (gloo) a transfer delays only its receiver: micro-batch j starts on its owner in stage 1
    when stage 0's forward of j ended plus the transfer between that pair."""
    cluster = cluster_from_dict(
        {
            "name": "c",
            "nodes": [
                dict(name="a", gpu="cpu", count=1, intra_node=dict(bandwidth_GBps=5, latency_us=20)),
                dict(name="b", gpu="cpu", count=1, intra_node=dict(bandwidth_GBps=5, latency_us=20)),
                dict(name="c", gpu="cpu", count=1, slowdown=2.0, intra_node=dict(bandwidth_GBps=5, latency_us=20)),
            ],
            "network": {"bandwidth_GBps": 1, "latency_us": 50},
        },
        "c",
    )
    model = model_from_dict(
        dict(
            MODEL, hidden_size=256, num_heads=4, ffn_hidden_size=1024, vocab_size=512, seq_len=128, global_batch_size=6
        ),
        "m",
    )
    sim = Simulator(cluster, model)
    cfg = ParallelConfig.from_dict(
        {
            "micro_batch_size": 1,
            "pipelines": [
                {
                    "num_microbatches": 6,
                    "stages": [
                        {"layers": 4, "devices": ["a:0"]},
                        {
                            "layers": 4,
                            "ranks": [
                                {"devices": ["b:0"], "num_microbatches": 4},
                                {"devices": ["c:0"], "num_microbatches": 2},
                            ],
                        },
                    ],
                }
            ],
        }
    )
    m = sim.evaluate_detailed(cfg)
    assert m.ok, m.error
    ev = {(e.device, e.op): e for e in m.timeline}
    owners = [0, 1, 0, 0, 1, 0]  # microbatch_owners((4, 2))
    assert [("c:0", f"F{j}") in ev for j in range(6)] == [bool(k) for k in owners]
    hop = sim.costs.p2p_time_s(("a:0",), ("b:0",), 1)
    assert ev[("b:0", "F0")].start_s == pytest.approx(ev[("a:0", "F0")].end_s + hop, rel=1e-12)
    assert ev[("c:0", "F1")].start_s == pytest.approx(ev[("a:0", "F1")].end_s + hop, rel=1e-12)
    # the slow rank's forward takes twice the fast one's (slowdown 2)
    fast, slow = ev[("b:0", "F0")], ev[("c:0", "F1")]
    assert slow.end_s - slow.start_s == pytest.approx(2 * (fast.end_s - fast.start_s), rel=1e-9)
