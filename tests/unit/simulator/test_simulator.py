"""The simulator evaluator, hand-computed: compute time, bubbles end to end, memory, replicas, failures."""

from __future__ import annotations

import math

import pytest
from simulator_cases import FAST, GPT

import autotune
from autotune import SpecError, load_cluster, load_model
from autotune.evaluator import Evaluator
from autotune.loading import cluster_from_dict, model_from_dict
from autotune.profile import CalibrationProfile, DeviceProfile, EdgeTiming, LayerTiming
from autotune.simulator import Simulator
from autotune.simulator.efficiency import HALF_SIZE, PEAK_FRACTION, DeviceRates
from autotune.simulator.flops import layer_forward_flops, model_flops_per_token
from autotune.simulator.memory import GiB, layer_activation_bytes, usable_memory_GiB
from autotune.specs import ParallelConfig, PipelineConfig, StageConfig


@pytest.fixture(autouse=True)
def _plain_cost_terms(monkeypatch):
    """These tests compose compute, schedule, alpha-beta communication and the allocator's memory by
    hand; the datasheet terms on top of them (the host's fixed cost per pass, NCCL-like collectives, the
    device's memory view) are checked on their own in tests/unit/simulator/test_fidelity_terms.py, so they are set to
    nothing here."""
    import autotune.simulator.cost_model as sim_module
    import autotune.simulator.data_parallel as iteration_module
    from autotune.simulator import collectives
    from autotune.simulator.device_memory import NO_DEVICE_MEMORY
    from autotune.simulator.overheads import NO_HOST_COST

    monkeypatch.setattr(sim_module, "host_cost", lambda gpu, tp: NO_HOST_COST)
    monkeypatch.setattr(sim_module, "device_memory", lambda gpu: NO_DEVICE_MEMORY)
    monkeypatch.setattr(
        sim_module, "collective_s", lambda op, n, k, bw, lat, kind: collectives.collective_s(op, n, k, bw, lat, "host")
    )
    monkeypatch.setattr(
        iteration_module,
        "collective_s",
        lambda op, n, k, bw, lat, kind: collectives.collective_s(op, n, k, bw, lat, "host"),
    )
    monkeypatch.setattr(sim_module, "send_s", lambda n, bw, lat, kind: collectives.send_s(n, bw, lat, "host"))
    monkeypatch.setattr(Simulator, "_blocking_sends", staticmethod(lambda comp, durs, comms: (durs, comms)))

    def stored_scores_twice_and_four_times(model, b, tp, e):
        """The score tensor's traffic as these tests count it: its stored bytes (softmax output, and with
        dropout the mask and the dropped output) written and read forward, and twice that backward."""
        if model.attention != "standard":
            return 0.0, 0.0
        stored = (e + (model.dropout > 0) * (1 + e)) * model.num_heads / tp * b * model.seq_len**2
        return 2.0 * stored, 4.0 * stored

    monkeypatch.setattr(sim_module, "score_traffic_bytes", stored_scores_twice_and_four_times)


def _cluster(nodes: list[dict], network_GBps: float = FAST, latency_us: float = 0.0):
    return cluster_from_dict(
        {"name": "test", "nodes": nodes, "network": {"bandwidth_GBps": network_GBps, "latency_us": latency_us}}, "test"
    )


def _node(
    name: str, count: int, peak: float = 100.0, memory: float = 1000.0, intra: float = FAST, latency_us: float = 0.0
) -> dict:
    return dict(
        name=name,
        count=count,
        gpu=dict(name=f"X{peak:g}", peak_tflops=peak, memory_GiB=memory, memory_bandwidth_GBps=1000.0),
        intra_node=dict(bandwidth_GBps=intra, latency_us=latency_us),
    )


def _flat_profile(tflops: float, *device_names: str, layers=(), edges=()) -> CalibrationProfile:
    """Every matmul at ``tflops``; memory-bound work and the optimizer take no time."""
    return CalibrationProfile(
        tuple(
            DeviceProfile(
                n, ((1.0, tflops),), memory_bandwidth_GBps=FAST, layers=layers, edges=edges, optimizer_s_per_param=0.0
            )
            for n in device_names
        )
    )


def _config(
    pipelines: list[tuple[int, list[tuple[list[str], int]]]],
    mbs: int = 1,
    schedule: str = "1f1b",
    recompute: bool = False,
    v: int = 1,
) -> ParallelConfig:
    pipes = tuple(PipelineConfig(m, tuple(StageConfig(tuple(d), n, recompute) for d, n in st)) for m, st in pipelines)
    return ParallelConfig(mbs, pipes, schedule=schedule, virtual_stages=v)


def test_simulator_is_an_evaluator() -> None:
    sim = Simulator(load_cluster("mixed-a100-v100"), load_model("tiny"))
    assert isinstance(sim, Evaluator)


# -- compute --------------------------------------------------------------------------------------


def test_default_efficiency_curve() -> None:
    rates = DeviceRates(load_cluster("mixed-a100-v100").device("a100:0"))
    peak = 312.0  # A100 dense BF16 datasheet
    assert rates.matmul_tflops(HALF_SIZE) == pytest.approx(peak * PEAK_FRACTION / 2)
    assert rates.matmul_tflops(4096) == pytest.approx(peak * PEAK_FRACTION * 4096**2 / (4096**2 + HALF_SIZE**2))
    assert rates.matmul_tflops(256) < rates.matmul_tflops(1024) < rates.matmul_tflops(8192) < peak * PEAK_FRACTION


def test_layer_flops_match_narayanan() -> None:
    model = model_from_dict(GPT, "gpt")
    b, s, h = 2, model.seq_len, model.hidden_size
    # Narayanan et al. 2021: 24 B s h^2 + 4 B s^2 h forward FLOPs per GPT layer
    assert layer_forward_flops(model, b) == 24 * b * s * h * h + 4 * b * s * s * h


def test_one_device_time_is_flops_over_sustained_rate() -> None:
    model = model_from_dict(GPT, "gpt")
    cluster = _cluster([_node("n", 1)])
    sim = Simulator(cluster, model, _flat_profile(50.0, "X100"))
    mbs, m = 2, 8
    m_ = sim.evaluate(_config([(m, [(["n:0"], 8)])], mbs=mbs))
    assert m_.ok
    b, s, h, V, L = mbs, model.seq_len, model.hidden_size, model.vocab_size, model.num_layers
    flops = m * 3 * (L * (24 * b * s * h * h + 4 * b * s * s * h) + 2 * b * s * h * V)  # fwd + 2x bwd
    assert m_.iteration_time_s == pytest.approx(flops / 50e12, rel=1e-9)
    assert m_.tokens_per_s == pytest.approx(16 * s / m_.iteration_time_s)
    assert m_.bubble_fraction == pytest.approx(0.0, abs=1e-12)
    # MFU: PaLM's 6N + 12 L h s per token, over the device's datasheet peak
    assert m_.mfu == pytest.approx(model_flops_per_token(model) * 16 * s / m_.iteration_time_s / 100e12)


def test_recompute_adds_one_forward() -> None:
    model = model_from_dict(GPT, "gpt")
    sim = Simulator(_cluster([_node("n", 1)]), model, _flat_profile(50.0, "X100"))
    plain = sim.evaluate(_config([(8, [(["n:0"], 8)])], mbs=2))
    again = sim.evaluate(_config([(8, [(["n:0"], 8)])], mbs=2, recompute=True))
    b, s, h = 2, model.seq_len, model.hidden_size
    extra = 8 * model.num_layers * (24 * b * s * h * h + 4 * b * s * s * h) / 50e12
    assert again.iteration_time_s - plain.iteration_time_s == pytest.approx(extra, rel=1e-9)


def test_tensor_parallel_splits_compute_and_adds_allreduces() -> None:
    model = model_from_dict(GPT, "gpt")
    bw, lat = 100.0, 5.0
    cluster = _cluster([_node("n", 2, intra=bw, latency_us=lat)])
    # Megatron-LM's tensor parallelism: the embedding and the head vocabulary-parallel too
    sim = Simulator(cluster, model, _flat_profile(50.0, "X100"), engine="megatron")
    one = Simulator(_cluster([_node("n", 1)]), model, _flat_profile(50.0, "X100"), engine="megatron")
    t1 = one.evaluate(_config([(8, [(["n:0"], 8)])], mbs=2)).iteration_time_s
    t2 = sim.evaluate(_config([(8, [(["n:0", "n:1"], 8)])], mbs=2)).iteration_time_s
    b, s, h = 2, model.seq_len, model.hidden_size
    ring = 2 * (2 - 1) / 2 * (2 * b * s * h) / (bw * 1e9) + 2 * (2 - 1) * lat * 1e-6  # one all-reduce
    # per micro-batch: 4 per layer (2 fwd, 2 bwd), 1 for the embedding, 1 + 3 small ones for the head
    small = 2 * (2 - 1) / 2 * (4 * b * s) / (bw * 1e9) + 2 * (2 - 1) * lat * 1e-6
    expected = t1 / 2 + 8 * (4 * model.num_layers * ring + 2 * ring + 3 * small)
    assert t2 == pytest.approx(expected, rel=1e-9)
    # autotune's runner splits the embedding and the head as Megatron-LM does where the degree divides the
    # vocabulary; where it does not, it keeps both whole on both ranks: their time is not halved and they
    # need no all-reduce (the blocks as above)
    assert model.vocab_size % 2 == 0
    assert Simulator(cluster, model, _flat_profile(50.0, "X100")).evaluate(
        _config([(8, [(["n:0", "n:1"], 8)])], mbs=2)
    ).iteration_time_s == pytest.approx(t2, rel=1e-12)
    odd = model_from_dict({**GPT, "vocab_size": model.vocab_size + 1}, "gpt")
    costs = Simulator(cluster, odd, _flat_profile(50.0, "X100")).costs
    alone = costs.layer_costs(costs.rate_key["n:0"], 1, 2, cluster.nodes[0].intra_node)
    pair = costs.layer_costs(costs.rate_key["n:0"], 2, 2, cluster.nodes[0].intra_node)
    assert pair[5:9] == pytest.approx(alone[5:9], rel=1e-12)  # embedding and head: forward, backward


# -- pipelines end to end -------------------------------------------------------------------------


def _equal_stage_profile(model, name: str, mbs: int, tp: int = 1) -> CalibrationProfile:
    """Measured layer times 1 ms / 2 ms and free embedding / head: stages with equal layers are equal."""
    layer = LayerTiming(
        model.hidden_size,
        model.num_heads,
        model.num_kv_heads,
        model.ffn_hidden_size,
        model.mlp,
        model.seq_len,
        mbs,
        tp,
        forward_s=1e-3,
        backward_s=2e-3,
    )
    edge = EdgeTiming(model.hidden_size, model.vocab_size, model.seq_len, mbs, tp, 0.0, 0.0, 0.0, 0.0)
    return _flat_profile(50.0, name, layers=(layer,), edges=(edge,))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_homogeneous_pipeline_bubble(schedule: str) -> None:
    model = model_from_dict({**GPT, "global_batch_size": 16}, "gpt")
    sim = Simulator(_cluster([_node("n", 4)]), model, _equal_stage_profile(model, "X100", 1))
    p, m = 4, 16
    r = sim.evaluate(_config([(m, [([f"n:{i}"], 2) for i in range(p)])], schedule=schedule))
    assert r.ok
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)
    assert r.iteration_time_s == pytest.approx((m + p - 1) * 2 * 3e-3, rel=1e-9)
    assert r.stage_busy_s == pytest.approx((m * 2 * 3e-3,) * p)


def test_interleaved_has_a_smaller_bubble_than_1f1b() -> None:
    model = model_from_dict(GPT, "gpt")
    sim = Simulator(_cluster([_node("n", 4)]), model, _equal_stage_profile(model, "X100", 1))
    stages = [([f"n:{i}"], 2) for i in range(4)]
    plain = sim.evaluate(_config([(16, stages)]))
    inter = sim.evaluate(_config([(16, stages)], schedule="interleaved-1f1b", v=2))
    assert inter.ok and plain.ok
    assert inter.bubble_fraction < plain.bubble_fraction
    assert inter.iteration_time_s == pytest.approx((16 + 3 / 2) * 2 * 3e-3, rel=1e-9)
    # ... at the price of more activations in flight on the first stage
    assert inter.peak_memory_GiB["n:0"] > plain.peak_memory_GiB["n:0"]


def test_slow_device_stage_dominates_the_pipeline() -> None:
    model = model_from_dict(GPT, "gpt")
    cluster = _cluster([_node("fast", 3, peak=100.0), _node("slow", 1, peak=25.0)])
    prof = CalibrationProfile(
        (
            DeviceProfile("X100", ((1.0, 80.0),), FAST, optimizer_s_per_param=0.0),
            DeviceProfile("X25", ((1.0, 20.0),), FAST, optimizer_s_per_param=0.0),
        )
    )  # 4x slower
    sim = Simulator(cluster, model, prof)
    m = 16
    r = sim.evaluate(_config([(m, [(["fast:0"], 2), (["slow:0"], 2), (["fast:1"], 2), (["fast:2"], 2)])]))
    busy = r.stage_busy_s
    assert busy[1] == pytest.approx(4 * busy[2], rel=1e-9)
    # the slow stage works from the first stage's first forward to just before its last backward
    f0, b0 = busy[0] / m / 3, 2 * busy[0] / m / 3
    assert r.iteration_time_s == pytest.approx(f0 + busy[1] + b0, rel=1e-6)


def test_slowest_replica_bounds_the_iteration() -> None:
    model = model_from_dict({**GPT, "global_batch_size": 32}, "gpt")
    cluster = _cluster([_node("fast", 4, peak=100.0), _node("slow", 2, peak=50.0)])
    sim = Simulator(cluster, model)
    fast_pipe = (16, [(["fast:0"], 4), (["fast:1"], 4)])
    both_fast = sim.evaluate(_config([fast_pipe, (16, [(["fast:2"], 4), (["fast:3"], 4)])]))
    one_slow = sim.evaluate_detailed(_config([fast_pipe, (16, [(["slow:0"], 4), (["slow:1"], 4)])]))
    assert one_slow.iteration_time_s > 1.5 * both_fast.iteration_time_s
    # the slow replica's last backward ends the pipeline phase; then all-reduce and optimizer follow
    last_slow = max(e.end_s for e in one_slow.timeline if e.device.startswith("slow") and e.op[0] == "B")
    last_fast = max(e.end_s for e in one_slow.timeline if e.device.startswith("fast") and e.op[0] == "B")
    assert last_fast < last_slow < one_slow.iteration_time_s
    ar = [e for e in one_slow.timeline if e.op == "allreduce"]
    assert ar and min(e.start_s for e in ar) >= last_fast
    assert one_slow.iteration_time_s == pytest.approx(max(e.end_s for e in one_slow.timeline))
    # the reported bubble and busy times are the slow replica's
    assert one_slow.stage_busy_s[0] > both_fast.stage_busy_s[0]


def test_data_parallel_allreduce_over_differently_split_replicas() -> None:
    model = model_from_dict({**GPT, "num_layers": 4, "global_batch_size": 4}, "gpt")
    bw, lat = 50.0, 3.0
    cluster = _cluster([_node("n", 4, intra=bw, latency_us=lat)])
    sim = Simulator(cluster, model)
    cfg = _config([(2, [(["n:0"], 2), (["n:1"], 2)]), (2, [(["n:2"], 1), (["n:3"], 3)])])
    r = sim.evaluate_detailed(cfg)
    assert r.ok
    P, E = model.params_per_layer, model.embedding_params
    # 2 ranks; 4 bytes per parameter: the runner all-reduces fp32 gradients under bf16 (engine_terms.fp32_state)
    ring = lambda params: 2 * params / (bw * 1e9) * (2 - 1) / 2 * 4 + 2 * lat * 1e-6  # noqa: E731
    # runs of layers held by the same stages: [0,1) + embedding, [1,2), [2,4) + head
    expected = {
        "n:0": ring(E + P) + ring(P),
        "n:1": ring(2 * P + E + model.hidden_size),
        "n:2": ring(E + P),
        "n:3": ring(P) + ring(2 * P + E + model.hidden_size),
    }
    for dev, t in expected.items():
        got = sum(e.end_s - e.start_s for e in r.timeline if e.op == "allreduce" and e.device == dev)
        assert got == pytest.approx(t, rel=1e-9), dev


# -- memory ---------------------------------------------------------------------------------------


def test_activation_memory_matches_korthikanti() -> None:
    model = model_from_dict(GPT, "gpt")
    s, b, h, a = model.seq_len, 4, model.hidden_size, model.num_heads
    assert layer_activation_bytes(model, b, 1) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    for t in (2, 4, 8):
        assert layer_activation_bytes(model, b, t) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    flash = model_from_dict({**GPT, "attention": "flash"}, "gpt")
    assert layer_activation_bytes(flash, b, 1) == pytest.approx(s * b * h * 34)


def test_peak_memory_of_a_known_model() -> None:
    model = model_from_dict(GPT, "gpt")
    sim = Simulator(_cluster([_node("n", 4)]), model)  # Korthikanti: scores stored
    b, s, h, V, L = 2, model.seq_len, model.hidden_size, model.vocab_size, model.num_layers
    # one device: 16 bytes per parameter (ZeRO paper), one micro-batch in flight
    r = sim.evaluate(_config([(8, [(["n:0"], L)])], mbs=b))
    # the last stage's loss: 16 bytes per logit under autotune's runner (autotune.simulator.memory)
    acts = L * layer_activation_bytes(model, b, 1) + s * b * h + 16 * s * b * V
    assert r.peak_memory_GiB["n:0"] == pytest.approx((16 * model.num_params + acts) / GiB)
    # 1F1B over 4 stages: stage i holds min(m, p - i) micro-batches; recompute keeps each layer's input
    r = sim.evaluate(_config([(8, [([f"n:{i}"], 2) for i in range(4)])], mbs=b, recompute=True))
    for i in range(4):
        params = (
            2 * model.params_per_layer
            + (model.embedding_params if i == 0 else 0)
            + (model.embedding_params + h if i == 3 else 0)
        )
        acts = (4 - i) * 2 * (2 * s * b * h) + layer_activation_bytes(model, b, 1)
        acts += (4 - i) * s * b * h if i == 0 else 0
        acts += 16 * s * b * V if i == 3 else 0
        assert r.peak_memory_GiB[f"n:{i}"] == pytest.approx((16 * params + acts) / GiB), i


def test_llama2_7b_on_one_gpu_is_out_of_memory() -> None:
    cluster = load_cluster("mixed-a100-v100")
    model = load_model("llama2-7b", global_batch_size=8)
    r = Simulator(cluster, model).evaluate(_config([(8, [(["a100:0"], 32)])], recompute=True))
    assert r.oom and r.status == "oom" and r.score() == 0.0 and r.tokens_per_s == 0.0
    assert r.peak_memory_GiB["a100:0"] > 16 * 6.7e9 / GiB  # weights + grads + Adam alone are ~100 GiB
    assert r.peak_memory_GiB["a100:0"] > usable_memory_GiB(80 * 1e9 / GiB)
    assert "a100:0" in r.error


# -- failures and the library call ----------------------------------------------------------------


def test_evaluate_never_raises_for_bad_plans() -> None:
    cluster = load_cluster("mixed-a100-v100")
    sim = Simulator(cluster, load_model("tiny"))
    bad = [
        _config([(8, [(["a100:0"], 3)])]),  # layers do not sum to 4
        _config([(8, [(["a100:0"], 2), (["a100:0"], 2)])]),  # device twice
        _config([(7, [(["a100:0"], 4)])]),  # batch 7 != 8
        _config([(8, [(["gpu:0"], 4)])]),  # unknown device
        _config(
            [(5, [(["a100:0"], 2), (["a100:1"], 2)]), (3, [(["a100:2"], 4)])], schedule="interleaved-1f1b", v=2
        ),  # interleaved needs m % p == 0
    ]
    for cfg in bad:
        r = sim.evaluate(cfg)
        assert r.status == "invalid" and r.score() == 0.0 and r.error and "\n" not in r.error


def test_library_simulate_accepts_names_and_raises_on_bad_input(tmp_path) -> None:
    cfg = {
        "micro_batch_size": 1,
        "pipelines": [
            {
                "num_microbatches": 8,
                "stages": [{"devices": ["a100:0"], "layers": 2}, {"devices": ["v100:0"], "layers": 2}],
            }
        ],
    }
    m = autotune.simulate("mixed-a100-v100", "tiny", cfg)
    assert m.ok and m.tokens_per_s > 0 and set(m.peak_memory_GiB) == {"a100:0", "v100:0"}
    assert not m.timeline
    assert autotune.simulate("mixed-a100-v100", "tiny", cfg, timeline=True).timeline
    with pytest.raises(SpecError, match="global_batch_size is 16"):
        autotune.simulate("mixed-a100-v100", "tiny", cfg, global_batch_size=16)
    with pytest.raises(SpecError, match="no file or preset named 'nope'"):
        autotune.simulate("nope", "tiny", cfg)
    bad_profile = tmp_path / "p.json"
    bad_profile.write_text("{")
    with pytest.raises(SpecError, match="invalid JSON"):
        autotune.simulate("mixed-a100-v100", "tiny", cfg, profile=bad_profile)


def test_h100_replicas_wait_for_a100_replicas() -> None:
    # llama2-7b, 4 pipelines x 4 stages of TP2: 2 on H100 nodes, 2 on A100-40GB nodes
    cluster = load_cluster("mixed-h100-a100-32")
    model = load_model("llama2-7b", global_batch_size=128)
    sim = Simulator(cluster, model)
    pipes = []
    for node in cluster.nodes:
        devs = node.device_ids()
        pipes.append((32, [(devs[2 * s : 2 * s + 2], 8) for s in range(4)]))
    mixed = sim.evaluate(_config(pipes, mbs=1, recompute=True))
    assert mixed.ok and 0.0 < mixed.mfu < 1.0
    assert math.isclose(mixed.tokens_per_s * mixed.iteration_time_s, 128 * 4096)
    h100_only = Simulator(cluster, model.with_global_batch_size(64)).evaluate(_config(pipes[:2], mbs=1, recompute=True))
    a100_only = Simulator(cluster, model.with_global_batch_size(64)).evaluate(_config(pipes[2:], mbs=1, recompute=True))
    assert h100_only.iteration_time_s < a100_only.iteration_time_s
    # the iteration is paced by the A100 replicas (plus a slower all-reduce over the network)
    assert mixed.iteration_time_s >= a100_only.iteration_time_s
    assert mixed.mfu < a100_only.mfu


def test_data_parallel_across_nodes_is_capped_by_the_network() -> None:
    model = model_from_dict({**GPT, "num_layers": 2, "global_batch_size": 4}, "gpt")
    cluster = _cluster([_node("a", 2, intra=300.0), _node("b", 2, intra=300.0)], network_GBps=10.0, latency_us=7.0)
    # two tensor-parallel ranks x 300 GB/s inside the node, but 10 GB/s out of it; 2 ranks in the ring; fp32
    # gradients (the runner's, 4 bytes), 16-bit under an engine that reduces them so (DeepSpeed's default)
    for engine, grad_bytes in (("autotune", 4), ("deepspeed", 2)):
        r = Simulator(cluster, model, engine=engine).evaluate_detailed(
            _config([(2, [(["a:0", "a:1"], 2)]), (2, [(["b:0", "b:1"], 2)])])
        )
        ar = [e for e in r.timeline if e.op == "allreduce" and e.device == "a:0"]
        expected = 2 * (2 - 1) / 2 * grad_bytes * model.num_params / 10e9 + 2 * (2 - 1) * 7e-6
        assert sum(e.end_s - e.start_s for e in ar) == pytest.approx(expected, rel=1e-9), engine


def test_gpipe_keeps_every_micro_batch() -> None:
    model = model_from_dict(GPT, "gpt")
    sim = Simulator(_cluster([_node("n", 2)]), model)  # Korthikanti: scores stored
    stages = [(["n:0"], 4), (["n:1"], 4)]
    gpipe = sim.evaluate(_config([(16, stages)], schedule="gpipe"))
    one_f = sim.evaluate(_config([(16, stages)]))
    per_mb = 4 * layer_activation_bytes(model, 1, 1) / GiB
    assert gpipe.peak_memory_GiB["n:1"] - one_f.peak_memory_GiB["n:1"] == pytest.approx((16 - 1) * per_mb)


def test_timeline_lists_every_operation() -> None:
    model = model_from_dict(GPT, "gpt")
    sim = Simulator(_cluster([_node("n", 4)]), model)  # Korthikanti: scores stored
    cfg = _config([(8, [(["n:0", "n:1"], 4), (["n:2", "n:3"], 4)])], mbs=2)
    r = sim.evaluate_detailed(cfg)
    assert r.ok and not sim.evaluate(cfg).timeline
    for d in ("n:0", "n:1", "n:2", "n:3"):
        ops = [e for e in r.timeline if e.device == d]
        assert sorted(e.op for e in ops if e.op[0] == "F") == sorted(f"F{j}" for j in range(8))
        assert sum(e.op[0] == "B" for e in ops) == 8 and [e.op for e in ops][-1] == "optimizer"
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(ops, ops[1:]))  # one thing at a time
    assert max(e.end_s for e in r.timeline) == pytest.approx(r.iteration_time_s)
