"""The simulator's MoE terms against hand counts: expert compute, all-to-all bytes and time, expert memory,
and the SPES synchronisation (its bytes are the trained parameters only, amortised over sync_every_steps)."""

from __future__ import annotations

import pytest

from autotune import load_model
from autotune.loading import cluster_from_dict, load_config
from autotune.simulator import Simulator, moe
from autotune.simulator.memory import GiB

TINY = load_model("tiny-moe")  # h 64, 4 blocks, 4 experts of width 128 (gelu), top-2, seq 64, batch 8


def standalone(n: int = 4, network_GBps: float = 1.0, latency_us: float = 0.0, gpu: str = "A100-80GB"):
    """``n`` single-GPU nodes joined by one network (the SPES setting)."""
    return cluster_from_dict(
        {
            "nodes": [{"name": "n", "gpu": gpu, "count": 1, "repeat": n}],
            "network": {"bandwidth_GBps": network_GBps, "latency_us": latency_us},
        },
        "test",
    )


def plan(n: int = 4, ep: int = 1, sync: int = 1, trains=None, mbs: int = 1, zero: int = 0):
    pipes = []
    for p in range(n):
        pipe = {
            "num_microbatches": TINY.global_batch_size // (n * mbs),
            "stages": [{"devices": [f"n-{p}:0"], "layers": TINY.num_layers}],
        }
        if trains is not None:
            pipe["trains_experts"] = trains[p]
        pipes.append(pipe)
    cfg = {"micro_batch_size": mbs, "expert_parallel": ep, "sync_every_steps": sync, "pipelines": pipes}
    if zero:
        cfg["zero"] = zero
    return load_config(cfg)


SHARED = 2 * TINY.embedding_params + TINY.hidden_size + 4 * (4 * 64 * 64 + 2 * 64 + 64 * 4)  # all but experts
EXPERT = 4 * 2 * 64 * 128  # one expert over the 4 blocks


def test_moe_block_compute_is_top_k_at_capacity() -> None:
    T, h, f, E, k, c = 64, 64, 128, 4, 2, moe.CAPACITY_FACTOR
    for ep in (1, 2, 4):
        mms = moe.moe_mlp_matmuls(TINY, 1, 1, ep)
        router = 2 * T * E * h
        experts = 2 * (c * T * k) * (2 * f * h)  # up + down per token copy, c T k copies per device
        assert sum(m.flops for m in mms) == pytest.approx(router + experts)
        assert mms[1].count == E // ep  # each device computes its own experts


def test_alltoall_bytes_and_time_hand_count() -> None:
    # per device per all-to-all: c T k token copies of 2h bytes, less the 1/ep kept: 1.25 * 64 * 2 * 128 / 2
    assert moe.alltoall_bytes(TINY, 1, 2) == pytest.approx(10240.0)
    assert moe.alltoall_bytes(TINY, 2, 4) == pytest.approx(0.75 * 1.25 * 128 * 2 * 128)
    assert moe.alltoall_bytes(TINY, 1, 1) == 0.0
    # two ep=2 plans that differ only in the network: busy time differs by 4 all-to-alls per block and
    # micro-batch (2 forward, 2 backward) at the two bandwidths
    fast, slow = standalone(4, 10.0), standalone(4, 1.0)
    cfg = plan(ep=2)
    a, b = Simulator(fast, TINY).evaluate(cfg), Simulator(slow, TINY).evaluate(cfg)
    m = cfg.pipelines[0].num_microbatches
    per_a2a = 10240.0 * (1 / 1e9 - 1 / 10e9)
    assert b.stage_busy_s[0] - a.stage_busy_s[0] == pytest.approx(m * TINY.num_layers * 4 * per_a2a, rel=1e-9)


def test_expert_memory_counts_every_expert_held() -> None:
    sim = Simulator(standalone(4), TINY)
    full = sim.evaluate(plan()).allocated_memory_GiB["n-0:0"]
    # expert parallelism 2: a device holds 2 of the 4 experts (16 bytes per parameter each)
    ep2 = sim.evaluate(plan(ep=2)).allocated_memory_GiB["n-0:0"]
    assert (full - ep2) * GiB == pytest.approx(2 * EXPERT * 16, rel=1e-9)
    # SPES: all 4 experts kept, 1 trained: the 3 frozen ones keep their weights only (the runner's: fp32,
    # 4 of the 16 bytes; weights and gradients 4 + 4, Adam's two fp32 moments 8, engine_terms.fp32_state)
    spes = sim.evaluate(plan(sync=4, trains=[[0], [1], [2], [3]])).allocated_memory_GiB["n-0:0"]
    assert (full - spes) * GiB == pytest.approx(3 * EXPERT * (16 - 4), rel=1e-9)
    # ZeRO-1 with expert parallelism 2: dense optimizer state over 4 peers, each expert's over 2
    z1 = sim.evaluate(plan(ep=2, zero=1)).allocated_memory_GiB["n-0:0"]
    dense = SHARED  # every replica holds the whole shared part
    expected = dense * (8 + 8 / 4) + 2 * EXPERT * (8 + 8 / 2)
    assert (ep2 - z1) * GiB == pytest.approx(dense * 16 + 2 * EXPERT * 16 - expected, rel=1e-9)


def test_spes_sync_bytes_are_the_trained_parameters_only() -> None:
    B = moe.SYNC_BYTES_PER_PARAM
    # every replica trains every expert (local SGD): the whole model is ring all-reduced among the 4
    allm = moe.sync_bytes(TINY, plan(sync=4))
    assert allm[0] == pytest.approx(2 * 3 / 4 * (SHARED + 4 * EXPERT) * B)
    # SPES: each replica trains one expert; the shared part is all-reduced, every expert comes from its
    # only trainer (received once by the 3 others), untrained copies never travel
    one = moe.sync_bytes(TINY, plan(sync=4, trains=[[0], [1], [2], [3]]))
    assert one[0] == pytest.approx((2 * 3 / 4 * SHARED + 3 * EXPERT) * B)
    # two trainers per expert: those two all-reduce it (2 (2-1)/2 = 1x), the others receive it
    two = moe.sync_bytes(TINY, plan(sync=4, trains=[[0, 1], [0, 1], [2, 3], [2, 3]]))
    assert two[0] == pytest.approx((2 * 3 / 4 * SHARED + 2 * EXPERT * 1.0 + 2 * EXPERT) * B)


def test_spes_sync_time_amortised_over_sync_every_steps() -> None:
    cluster = standalone(4, network_GBps=0.5, latency_us=100.0)
    sim = Simulator(cluster, TINY)
    trains = [[0], [1], [2], [3]]
    a, b = sim.evaluate(plan(sync=4, trains=trains)), sim.evaluate(plan(sync=8, trains=trains))
    nbytes = (2 * 3 / 4 * SHARED + 3 * EXPERT) * moe.SYNC_BYTES_PER_PARAM
    sync = nbytes / 0.5e9 + 2 * 3 * 100e-6  # one ring over the 4 nodes: its wire bytes + 2 (n-1) latencies
    # the shared part and the experts are two collectives (latency twice)
    assert a.sync_time_s == pytest.approx(sync + 2 * 3 * 100e-6, rel=1e-6)
    assert b.sync_time_s == pytest.approx(a.sync_time_s)
    assert a.iteration_time_s - b.iteration_time_s == pytest.approx(a.sync_time_s * (1 / 4 - 1 / 8), rel=1e-6)
    assert "sync_time_s" in a.to_dict() and "sync_time_s" not in sim.evaluate(plan()).to_dict()
    # synchronising every step costs more per step than every 4 (the all-reduce of 16-bit gradients)
    assert sim.evaluate(plan()).iteration_time_s > a.iteration_time_s


def test_expert_parallel_group_runs_at_its_slowest_replica() -> None:
    cluster = cluster_from_dict(
        {
            "nodes": [
                {"name": "fast", "gpu": "A100-80GB", "count": 1},
                {"name": "slow", "gpu": "V100-32GB", "count": 1},
            ],
            "network": {"bandwidth_GBps": 100.0},
        },
        "mixed",
    )
    sim = Simulator(cluster, TINY)
    stage = {"layers": 4}
    cfg = load_config(
        {
            "micro_batch_size": 1,
            "expert_parallel": 2,
            "pipelines": [
                {"num_microbatches": 4, "stages": [dict(stage, devices=["fast:0"])]},
                {"num_microbatches": 4, "stages": [dict(stage, devices=["slow:0"])]},
            ],
        }
    )
    m = sim.evaluate_detailed(cfg)
    forward = {e.device: e.end_s - e.start_s for e in m.timeline if e.op == "F0"}
    assert forward["fast:0"] == pytest.approx(forward["slow:0"])


def test_mixtral_simulates_and_moe_flops_set_mfu() -> None:
    from autotune.loading import load_cluster

    model = load_model("mixtral-8x7b", global_batch_size=64)
    cluster = load_cluster("mixed-h100-a100-32")
    # 4 replicas (one per node), 8-stage pipelines; expert parallelism 2 pairs the two H100 and the two A100 nodes
    pipes = []
    for node in ("h100-0", "h100-1", "a100-0", "a100-1"):
        pipes.append(
            {
                "num_microbatches": 16,
                "stages": [{"devices": [f"{node}:{i}"], "layers": 4, "recompute": True} for i in range(8)],
            }
        )
    cfg = load_config({"micro_batch_size": 1, "expert_parallel": 2, "pipelines": pipes})
    m = Simulator(cluster, model).evaluate(cfg)
    assert m.status == "oom" or m.ok, m.error
    ep1 = Simulator(cluster, model).evaluate(load_config({"micro_batch_size": 1, "pipelines": pipes}))
    # expert parallelism halves the experts each device holds
    assert max(m.peak_memory_GiB.values()) < max(ep1.peak_memory_GiB.values())


def test_replicas_of_one_node_share_its_network_link_in_a_sync() -> None:
    """Two nodes of two GPUs, expert parallelism 2 inside each: the sync has one ring per position
    (position 0 of both groups, position 1 of both), both leaving the nodes through their one link, so
    they run one after the other: twice one ring's time."""
    cluster = cluster_from_dict(
        {
            "nodes": [
                {"name": "box", "gpu": "A100-80GB", "count": 2, "repeat": 2, "intra_node": {"bandwidth_GBps": 300}}
            ],
            "network": {"bandwidth_GBps": 0.5},
        },
        "pair",
    )
    devices = cluster.device_ids()
    cfg = load_config(
        {
            "micro_batch_size": 1,
            "expert_parallel": 2,
            "sync_every_steps": 4,
            "pipelines": [
                {
                    "num_microbatches": 2,
                    "trains_experts": [0, 2] if p < 2 else [1, 3],
                    "stages": [{"devices": [d], "layers": 4}],
                }
                for p, d in enumerate(devices)
            ],
        }
    )
    m = Simulator(cluster, TINY).evaluate(cfg)
    assert m.ok, m.error
    # each ring: half the shared part all-reduced between 2 (1x), and the one of its 2 held experts the
    # other group trains, received once; in fp32
    ring = (SHARED / 2 + EXPERT) * moe.SYNC_BYTES_PER_PARAM / 0.5e9
    assert m.sync_time_s == pytest.approx(2 * ring, rel=1e-6)


def test_zero_in_spes_mode_shards_only_over_the_replicas_that_step_together() -> None:
    """SPES replicas train on their own between synchronisations, so ZeRO can shard state only over one
    expert-parallel group: with expert_parallel 1 it changes nothing (no free memory from sharding over
    replicas that never reduce together), with 2 the shared part is sharded over the group's 2."""
    sim = Simulator(standalone(4), TINY)
    trains = ([0], [1], [2], [3])
    for zero in (1, 2, 3):
        assert (
            sim.evaluate(plan(sync=4, trains=trains, zero=zero)).peak_memory_GiB
            == sim.evaluate(plan(sync=4, trains=trains)).peak_memory_GiB
        )
    synchronous = sim.evaluate(plan(trains=trains, zero=1)).peak_memory_GiB["n-0:0"]
    assert synchronous < sim.evaluate(plan(trains=trains)).peak_memory_GiB["n-0:0"]  # 4 peers every step
    groups = ([0, 1], [0, 1], [2, 3], [2, 3])
    zero0 = sim.evaluate(plan(ep=2, sync=4, trains=groups)).allocated_memory_GiB["n-0:0"]
    zero1 = sim.evaluate(plan(ep=2, sync=4, trains=groups, zero=1)).allocated_memory_GiB["n-0:0"]
    # ZeRO-1: the shared part's Adam moments (the runner's 8 bytes: its weights are the fp32 master) split
    # over the group's 2 replicas
    assert (zero0 - zero1) * GiB == pytest.approx(SHARED * 8 / 2, rel=1e-6)
    assert moe.zero_peers(plan(ep=2, sync=4, trains=groups), {(0, 0): 4}) == {(0, 0): 2}
