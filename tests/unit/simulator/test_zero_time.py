"""Time terms of ZeRO sharding and CPU offload in the simulator (autotune.simulator.zero)."""

from __future__ import annotations

import pytest
from paths import EXAMPLES

from autotune import load_cluster, load_config, load_model
from autotune.simulator import Simulator
from autotune.simulator import zero as zr

BOX = EXAMPLES / "8x4090.yaml"
RING = (10.0, 5.0)


def test_zero_1_and_2_move_what_an_all_reduce_moves_and_zero_3_half_as_much_again():
    psi, n = 1e9, 8
    all_reduce = zr.sync_s(psi, n, 0, RING)
    assert zr.sync_s(psi, n, 1, RING) + zr.gather_s(psi, n, 1, RING) == pytest.approx(all_reduce)
    # zero 2: the reduce-scatter happens per micro-batch (chunk_comm), the all-gather at the step's end
    per_mb = zr.chunk_comm([psi], 2, "none", n, RING, (25.0, 10.0))
    assert per_mb.grads_s + zr.gather_s(psi, n, 2, RING) == pytest.approx(all_reduce)
    # zero 3, one micro-batch: all-gather forward + all-gather backward + reduce-scatter = 1.5 all-reduces
    z3 = zr.chunk_comm([psi], 3, "none", n, RING, (25.0, 10.0))
    assert z3.forward_s + z3.weights_s + z3.grads_s == pytest.approx(1.5 * all_reduce)
    assert zr.sync_s(psi, n, 3, RING) == zr.gather_s(psi, n, 3, RING) == 0.0


def _replicas(zero, offload="none", dp=8, m=1, mbs=1, layers=40, recompute=True):
    return load_config(
        {
            "micro_batch_size": mbs,
            "zero": zero,
            "pipelines": [
                {
                    "num_microbatches": m,
                    "stages": [{"devices": [f"box:{i}"], "layers": layers, "recompute": recompute, "offload": offload}],
                }
                for i in range(dp)
            ],
        }
    )


def test_zero_3_gathers_cost_time_when_the_link_cannot_hide_them(tmp_path):
    """Short sequences (little compute per layer) on a slow ring: zero 3's per-layer all-gathers are
    exposed, so it is slower than zero 2, which is slower than zero 1 with many micro-batches."""
    slow = tmp_path / "slow.yaml"
    slow.write_text(BOX.read_text().replace("intra_node: {bandwidth_GBps: 25", "intra_node: {bandwidth_GBps: 1"))
    cluster = load_cluster(slow)
    model = load_model("llama2-7b").with_global_batch_size(64)
    from dataclasses import replace

    model = replace(model, seq_len=256)
    sim = Simulator(cluster, model, engine="deepspeed")  # 16-bit weights: zero 1 + optimizer offload fits 24 GB
    t = {z: sim.evaluate(_replicas(z, "optimizer", m=8, layers=32)).iteration_time_s for z in (1, 2, 3)}
    assert t[1] < t[2] < t[3]
    # one layer's all-gather of 2 bytes x params over the 1 GB/s ring bounds each layer's forward
    ag = zr.collective_s(2 * model.params_per_layer, 8, 1.0, 10.0)
    assert t[3] > 8 * 2 * 32 * ag  # 8 micro-batches, forward and backward, 32 layers


@pytest.mark.parametrize("engine, weight_bytes, host_bytes", [("deepspeed", 2, 14), ("autotune", 4, 12)])
def test_offload_optimizer_adds_the_host_step_and_the_weight_upload_on_one_gpu(engine, weight_bytes, host_bytes):
    """One RTX 4090 training a small model: offloading the optimizer replaces the device's Adam step by
    the host's (``HOST_ADAM_PARAMS_PER_S``) plus the weights coming up over the host link (16-bit, or the
    runner's fp32); the gradients go down during the backward, hidden behind it."""
    cluster, model = load_cluster(BOX), load_model("gpt2-small", 64)
    sim = Simulator(cluster, model, engine=engine)
    base = {
        "micro_batch_size": 4,
        "pipelines": [{"num_microbatches": 16, "stages": [{"devices": ["box:0"], "layers": 12, "recompute": False}]}],
    }
    off = {
        "micro_batch_size": 4,
        "pipelines": [
            {
                "num_microbatches": 16,
                "stages": [{"devices": ["box:0"], "layers": 12, "recompute": False, "offload": "optimizer"}],
            }
        ],
    }
    a, b = sim.evaluate(load_config(base)), sim.evaluate(load_config(off))
    psi = model.num_params
    device_opt = sim.evaluate_detailed(load_config(base))
    opt_events = [e for e in device_opt.timeline if e.op == "optimizer"]
    device_opt_s = opt_events[0].end_s - opt_events[0].start_s
    host = cluster.nodes[0].host.link
    up = zr.transfer_s(weight_bytes * psi, host.bandwidth_GBps, host.latency_us)
    expected = zr.host_step_s(psi) + up - device_opt_s
    assert b.iteration_time_s - a.iteration_time_s == pytest.approx(expected, rel=1e-6)
    assert b.host_memory_GiB["box"] == pytest.approx(host_bytes * psi / 2**30)


def test_streaming_all_parameters_is_bounded_by_the_host_link(tmp_path):
    narrow = tmp_path / "narrow.yaml"
    narrow.write_text(BOX.read_text().replace("link: {bandwidth_GBps: 25", "link: {bandwidth_GBps: 0.5"))
    model = load_model("llama2-7b", 8)
    fast = Simulator(load_cluster(BOX), model).evaluate(_replicas(1, "all", m=1, layers=32))
    slow = Simulator(load_cluster(narrow), model).evaluate(_replicas(1, "all", m=1, layers=32))
    assert fast.ok and slow.ok
    # every step streams each block's weights (the runner's fp32) up twice (forward, backward) at 0.5 GB/s
    floor = 2 * 32 * 4 * model.params_per_layer / 0.5e9
    assert slow.iteration_time_s > floor > fast.iteration_time_s / 4


def test_a_shared_host_bandwidth_slows_offloading_devices(tmp_path):
    shared = tmp_path / "shared.yaml"
    shared.write_text(BOX.read_text().replace("host: {memory_GiB: 512,", "host: {memory_GiB: 512, bandwidth_GBps: 8,"))
    model = load_model("llama2-7b", 8)
    alone = Simulator(load_cluster(BOX), model).evaluate(_replicas(1, "all", m=1, layers=32))
    together = Simulator(load_cluster(shared), model).evaluate(_replicas(1, "all", m=1, layers=32))
    assert load_cluster(shared).nodes[0].host.shared_bandwidth_GBps(8) == 1.0
    assert together.iteration_time_s > 2 * alone.iteration_time_s
