"""Issue 13's inputs and cost-model terms, each on hand-computed cases: precision, attention, dropout,
selective recomputation, sequence parallelism, per-precision peaks, the new catalog GPUs."""

from __future__ import annotations

import json

import pytest
from simulator_cases import FAST, GPT

from autotune import SpecError
from autotune.catalog import GPU_CATALOG
from autotune.loading import cluster_from_dict, model_from_dict
from autotune.simulator import Simulator
from autotune.simulator.memory import GiB, layer_activation_bytes, layer_input_bytes
from autotune.specs import ParallelConfig, PipelineConfig, StageConfig


def _model(**kw):
    return model_from_dict({**GPT, **kw}, "gpt")


def _cluster(count: int = 4, peak: float = 100.0, **gpu):
    return cluster_from_dict(
        {
            "name": "t",
            "nodes": [
                {
                    "name": "n",
                    "count": count,
                    "gpu": {
                        "name": "X",
                        "peak_tflops": peak,
                        "memory_GiB": 1000.0,
                        "memory_bandwidth_GBps": 1000.0,
                        **gpu,
                    },
                    "intra_node": {"bandwidth_GBps": FAST, "latency_us": 0.0},
                }
            ],
            "network": {"bandwidth_GBps": FAST, "latency_us": 0.0},
        },
        "t",
    )


# -- inputs ---------------------------------------------------------------------------------------


def test_model_precision_attention_dropout_are_validated() -> None:
    m = _model()
    assert (m.precision, m.attention, m.dropout, m.bytes_per_element) == ("bf16", "standard", 0.1, 2)
    assert _model(precision="fp32").bytes_per_element == 4
    base = {k: v for k, v in GPT.items() if k not in ("precision", "attention", "dropout")}
    d = model_from_dict(base, "gpt")
    assert (d.precision, d.attention, d.dropout) == ("bf16", "flash", 0.0)  # the defaults
    for field, bad in (("precision", "fp8"), ("attention", "linear"), ("dropout", 1.0), ("dropout", -0.1)):
        with pytest.raises(SpecError, match=field):
            _model(**{field: bad})


def test_stage_recompute_modes_and_sequence_parallel_round_trip() -> None:
    raw = {
        "micro_batch_size": 1,
        "schedule": "1f1b",
        "pipelines": [
            {
                "num_microbatches": 16,
                "stages": [
                    {"devices": ["n:0", "n:1"], "layers": 4, "recompute": "selective", "sequence_parallel": True},
                    {"devices": ["n:2", "n:3"], "layers": 4, "recompute": True},
                ],
            }
        ],
    }
    cfg = ParallelConfig.from_dict(raw)
    s0, s1 = cfg.pipelines[0].stages
    assert s0.selective_recompute and not s0.full_recompute and s0.sequence_parallel
    assert s1.full_recompute and not s1.selective_recompute and not s1.sequence_parallel
    assert ParallelConfig.from_json(cfg.to_json()) == cfg
    assert "sequence_parallel" not in json.dumps(cfg.to_dict()["pipelines"][0]["stages"][1])
    assert " S SP" in cfg.describe() and " R" in cfg.describe()
    for bad in ("full", 1, None):
        with pytest.raises(SpecError, match="recompute"):
            ParallelConfig.from_dict(
                {
                    **raw,
                    "pipelines": [
                        {"num_microbatches": 16, "stages": [{"devices": ["n:0"], "layers": 8, "recompute": bad}]}
                    ],
                }
            )
    with pytest.raises(SpecError, match="sequence_parallel"):
        ParallelConfig.from_dict(
            {
                **raw,
                "pipelines": [
                    {"num_microbatches": 16, "stages": [{"devices": ["n:0"], "layers": 8, "sequence_parallel": "yes"}]}
                ],
            }
        )


def test_catalog_has_the_new_gpus_with_per_precision_peaks() -> None:
    for name in ("GH200", "L40S", "TITAN-RTX", "RTX-2080-Ti", "RTX-2080", "A800-80GB"):
        d = GPU_CATALOG[name]
        assert d.source and d.peak_tflops > d.peak_tflops_tf32 >= d.peak_tflops_fp32 > 0, name
    for d in GPU_CATALOG.values():  # every entry carries both, from its datasheet
        assert d.peak_tflops_tf32 > 0 and d.peak_tflops_fp32 > 0 and d.peak_tflops_tf32 >= d.peak_tflops_fp32
    assert GPU_CATALOG["GH200"].matmul_peak_tflops("fp32") == 494.0
    assert GPU_CATALOG["GH200"].matmul_peak_tflops("bf16") == 989.0
    assert GPU_CATALOG["V100-32GB"].matmul_peak_tflops("fp32") == 15.7  # no TF32 on Volta: the FP32 rate


def test_inline_gpu_peaks_per_precision() -> None:
    given = _cluster(peak_tflops_tf32=40.0, peak_tflops_fp32=10.0).nodes[0].device
    assert (given.peak_tflops_tf32, given.peak_tflops_fp32) == (40.0, 10.0)
    derived = _cluster().nodes[0].device  # not in the catalog, not given: the datasheet ratios
    assert (derived.peak_tflops_tf32, derived.peak_tflops_fp32) == (50.0, 100.0 / 16)
    named = (
        cluster_from_dict(
            {
                "name": "t",
                "nodes": [{"name": "a", "count": 1, "gpu": {"name": "A100-80GB", "memory_GiB": 40}}],
                "network": {"bandwidth_GBps": 1},
            },
            "t",
        )
        .nodes[0]
        .device
    )
    assert named.peak_tflops_tf32 == 156.0 and named.memory_GiB == 40  # the rest from the catalog entry
    with pytest.raises(SpecError, match="peak_tflops_tf32"):
        _cluster(peak_tflops_tf32=-1.0)


@pytest.fixture
def no_host_cost(monkeypatch):
    """Device times only: the host's fixed cost per pass (tested below) would hide them on small layers."""
    import autotune.simulator.cost_model as sim_module
    from autotune.simulator.overheads import NO_HOST_COST

    monkeypatch.setattr(sim_module, "host_cost", lambda gpu, tp: NO_HOST_COST)


def test_fp32_uses_the_tf32_peak_and_4_byte_elements(no_host_cost) -> None:
    cfg = ParallelConfig(1, (PipelineConfig(16, (StageConfig(("n:0",), 8),)),))
    bf16 = Simulator(_cluster(1, peak_tflops_tf32=25.0), _model(attention="flash")).evaluate(cfg)
    fp32 = Simulator(_cluster(1, peak_tflops_tf32=25.0), _model(attention="flash", precision="fp32")).evaluate(cfg)
    # the matmuls run 4x slower (25 vs 100 TFLOP/s), the memory-bound work moves twice the bytes
    assert 2.0 < fp32.iteration_time_s / bf16.iteration_time_s < 4.0
    assert fp32.mfu == pytest.approx(bf16.mfu * 4 * bf16.iteration_time_s / fp32.iteration_time_s)


# -- memory (Korthikanti et al. 2022, Table 2) ----------------------------------------------------


def test_activation_memory_table_2_of_korthikanti() -> None:
    m = _model()
    s, b, h, a = m.seq_len, 2, m.hidden_size, m.num_heads
    for t in (1, 2, 4, 8):
        sbh = s * b * h
        assert layer_activation_bytes(m, b, t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
        assert layer_activation_bytes(m, b, t, selective=True) == pytest.approx(sbh * (10 + 24 / t))
        if t > 1:
            assert layer_activation_bytes(m, b, t, sequence_parallel=True) == pytest.approx(
                sbh / t * (34 + 5 * a * s / h)
            )
            assert layer_activation_bytes(m, b, t, selective=True, sequence_parallel=True) == pytest.approx(
                sbh * 34 / t
            )
        assert layer_input_bytes(m, b) == pytest.approx(2 * sbh)  # full recomputation keeps 2 s b h


def test_activation_memory_in_fp32_without_dropout() -> None:
    m = _model(precision="fp32", dropout=0.0)
    s, b, h, a, t = m.seq_len, 1, m.hidden_size, m.num_heads, 4
    # replicated 4 fp32 tensors of s b h (2 norm inputs, attention and MLP inputs); split: Q, K, V, the
    # projection input (4 x h) and the GeLU input and output (2 x 4h); scores: one fp32 softmax output
    expected = s * b * (4 * 4 * h + 4 * (4 * h + 8 * h) / t) + 4 * a * s * s * b / t
    assert layer_activation_bytes(m, b, t) == pytest.approx(expected)
    assert layer_activation_bytes(_model(precision="fp32", dropout=0.0, attention="flash"), b, t) == pytest.approx(
        expected - 4 * a * s * s * b / t
    )


def test_selective_recompute_and_sequence_parallel_memory_in_the_simulator() -> None:
    m = _model()
    sim = Simulator(_cluster(4), m)
    s, b, h, V, L = m.seq_len, 2, m.hidden_size, m.vocab_size, m.num_layers

    def peak(recompute, sp=False, devices=("n:0", "n:1")) -> float:
        cfg = ParallelConfig(b, (PipelineConfig(8, (StageConfig(devices, L, recompute, sequence_parallel=sp),)),))
        r = sim.evaluate(cfg)
        assert r.ok, r.error
        return r.allocated_memory_GiB[devices[0]] * GiB

    t = 2
    none, sel, full = peak(False), peak("selective"), peak(True)
    keep_all, keep_sel = layer_activation_bytes(m, b, t), layer_activation_bytes(m, b, t, selective=True)
    # one micro-batch in flight: every layer's stored activations, or the selective part plus one layer's
    # attention core rebuilt during the backward, or every layer's input plus one layer's full activations
    assert none - sel == pytest.approx(L * keep_all - (L * keep_sel + keep_all - keep_sel))
    assert none - full == pytest.approx(L * keep_all - (L * 2 * s * b * h + keep_all))
    sp = peak("selective", sp=True)
    assert sel - sp == pytest.approx(
        L * (keep_sel - layer_activation_bytes(m, b, t, True, True))
        + keep_all
        - keep_sel
        - (layer_activation_bytes(m, b, t, sequence_parallel=True) - layer_activation_bytes(m, b, t, True, True))
    )
    # on one device sequence parallelism changes nothing
    assert peak(False, True, ("n:0",)) == peak(False, False, ("n:0",))
    del V


def test_selective_recompute_time_is_the_attention_core(no_host_cost) -> None:
    m = _model()
    cfg = lambda rc: ParallelConfig(1, (PipelineConfig(16, (StageConfig(("n:0",), 8, rc),)),))  # noqa: E731
    sim = Simulator(_cluster(1), m)
    t0, ts, tf = (sim.evaluate(cfg(rc)).iteration_time_s for rc in (False, "selective", True))
    assert t0 < ts < tf
    # with fused attention there is nothing to recompute: selective costs nothing
    flash = Simulator(_cluster(1), _model(attention="flash"))
    assert flash.evaluate(cfg("selective")).iteration_time_s == flash.evaluate(cfg(False)).iteration_time_s


def test_a_measured_backward_ratio_replaces_the_pass_counts_in_its_regime(no_host_cost, monkeypatch) -> None:
    """GH200 in fp32 with unfused attention: a block's backward is the measured ratio times its forward
    (autotune/simulator/backward.py); every other regime keeps the pass counts."""
    import autotune.simulator.cost_model as sim_module
    from autotune.simulator.backward import BACKWARD_RATIOS

    gh200 = cluster_from_dict(
        {
            "name": "t",
            "nodes": [{"name": "n", "count": 1, "gpu": "GH200", "intra_node": {"bandwidth_GBps": FAST}}],
            "network": {"bandwidth_GBps": FAST},
        },
        "t",
    )
    fp32 = _model(precision="fp32", attention="standard")
    lf, lb, lbr, *_ = Simulator(gh200, fp32).costs.unit_costs("n:0", 2)
    assert lb == pytest.approx(BACKWARD_RATIOS[("GH200", "fp32", "standard")].ratio * lf)
    assert lbr == pytest.approx(lb + lf)  # full recomputation: the forward again, then this backward
    others = [
        Simulator(gh200, _model(precision=p, attention=a)).costs.unit_costs("n:0", 2)
        for p, a in (("bf16", "standard"), ("fp32", "flash"))
    ]
    monkeypatch.setattr(sim_module, "backward_ratio", lambda *key: None)
    assert [
        Simulator(gh200, _model(precision=p, attention=a)).costs.unit_costs("n:0", 2)
        for p, a in (("bf16", "standard"), ("fp32", "flash"))
    ] == others
    counted = Simulator(gh200, fp32).costs.unit_costs("n:0", 2)
    assert counted[0] == pytest.approx(lf) and 1.0 < counted[1] / lf < 2.0 < lb / lf


# -- runner ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_runner_selective_recompute_and_standard_attention_train_the_same_model() -> None:
    import torch

    from runner.model import StageChunk, lm_loss

    torch.set_num_threads(1)
    spec = model_from_dict(
        {
            **GPT,
            "num_layers": 2,
            "hidden_size": 64,
            "ffn_hidden_size": 256,
            "num_heads": 4,
            "seq_len": 64,
            "vocab_size": 128,
            "dropout": 0.0,
        },
        "gpt",
    )
    x = torch.randint(0, spec.vocab_size, (2, spec.seq_len))
    y = torch.randint(0, spec.vocab_size, (2, spec.seq_len))

    def grads(attention: str, recompute) -> tuple[float, torch.Tensor]:
        from dataclasses import replace

        chunk = StageChunk(
            replace(spec, attention=attention), range(2), first=True, last=True, seed=0, recompute=recompute
        )
        loss = lm_loss(chunk(x), y)
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in chunk.parameters()])

    ref_loss, ref = grads("flash", False)
    for attention in ("flash", "standard"):
        for recompute in (False, True, "selective"):
            loss, g = grads(attention, recompute)
            assert loss == pytest.approx(ref_loss, rel=1e-6) and torch.allclose(g, ref, atol=1e-6), (
                attention,
                recompute,
            )

    # selective keeps Q, K, V but not the scores: fewer saved bytes than none, more than full
    def saved(attention: str, recompute) -> int:
        from dataclasses import replace

        chunk = StageChunk(
            replace(spec, attention=attention), [0], first=False, last=False, seed=0, recompute=recompute
        )
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.data_ptr()] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            chunk(torch.randn(2, spec.seq_len, spec.hidden_size))
        return sum(seen.values())

    scores = spec.num_heads * spec.seq_len**2 * 2 * 4  # one fp32 softmax output per head and sequence
    assert saved("standard", False) - saved("standard", "selective") >= scores
    assert saved("standard", "selective") > saved("standard", True)


# -- the datasheet cost model: fixed host cost, blocking sends, NCCL-like collectives, device memory --


def test_a_fixed_host_cost_per_layer_adds_layers_times_microbatches_times_cost(monkeypatch) -> None:
    """Device time ~0 (a GPU of 1e9 TFLOP/s with unlimited memory bandwidth): every layer pass waits for
    the host, so the fixed cost adds exactly L x m x (forward + backward cost)."""
    import autotune.simulator.cost_model as sim_module
    from autotune.simulator.overheads import NO_HOST_COST, HostCost

    cost = HostCost(1.5e-3, 1.7e-3, 0.0, 0.0, 0.0, 0.0)
    model = _model(attention="flash", dropout=0.0)
    cluster = cluster_from_dict(
        {
            "name": "t",
            "nodes": [
                {
                    "name": "n",
                    "count": 1,
                    "gpu": {"name": "Z", "peak_tflops": 1e9, "memory_GiB": 1000.0, "memory_bandwidth_GBps": FAST},
                }
            ],
            "network": {"bandwidth_GBps": FAST},
        },
        "t",
    )
    m, L = model.global_batch_size, model.num_layers
    cfg = ParallelConfig(1, (PipelineConfig(m, (StageConfig(("n:0",), L),)),))
    monkeypatch.setattr(sim_module, "host_cost", lambda gpu, tp: NO_HOST_COST)
    without = Simulator(cluster, model).evaluate(cfg).iteration_time_s
    assert without > 0
    monkeypatch.setattr(sim_module, "host_cost", lambda gpu, tp: cost)
    with_cost = Simulator(cluster, model).evaluate(cfg).iteration_time_s
    assert with_cost - without == pytest.approx(L * m * (1.5e-3 + 1.7e-3), rel=1e-6)
    # a compute-bound layer hides the same cost entirely
    slow = cluster_from_dict(
        {
            "name": "t",
            "nodes": [
                {
                    "name": "n",
                    "count": 1,
                    "gpu": {"name": "Z", "peak_tflops": 0.001, "memory_GiB": 1000.0, "memory_bandwidth_GBps": 1.0},
                }
            ],
            "network": {"bandwidth_GBps": FAST},
        },
        "t",
    )
    a = Simulator(slow, model).evaluate(cfg).iteration_time_s
    monkeypatch.setattr(sim_module, "host_cost", lambda gpu, tp: NO_HOST_COST)
    assert Simulator(slow, model).evaluate(cfg).iteration_time_s == a


def test_host_cost_table_by_gpu_class_and_tp() -> None:
    from autotune.simulator.overheads import DEFAULT_HOST_COST, HOST_COSTS, NO_HOST_COST, host_cost

    gh = HOST_COSTS[("GH200", 4)]
    assert host_cost("GH200", 4) is gh and host_cost("GH200", 8) is gh  # nearest measured tp
    assert (gh.layer_forward_s, gh.layer_backward_s) == (1.5e-3, 1.728e-3) and "Sailor" in gh.source
    assert host_cost("A100-80GB", 2) is DEFAULT_HOST_COST and host_cost("cpu", 1) is NO_HOST_COST


def test_a_blocking_send_on_a_slow_link_lengthens_a_two_stage_1f1b_by_hand() -> None:
    """Two stages on two nodes, one layer each, measured layer times f and b (a profile, so no host
    cost), nothing else. 1F1B with 2 micro-batches: stage 0 runs F0 F1 B0 B1, stage 1 F0 B0 F1 B1. When a
    send blocks its sender for its transfer time c, stage 0's forwards take f + c and stage 1's backwards
    b + c, and the iteration is 3f + 3b + 3c (worked out op by op); a send that only delays its receiver
    would give 3f + 3b + 2c."""
    from autotune.profile import CalibrationProfile, DeviceProfile, EdgeTiming, LayerTiming
    from autotune.simulator import collectives

    model = _model(num_layers=2, attention="flash", dropout=0.0, global_batch_size=2)
    f, b = 4e-3, 9e-3
    layer = LayerTiming(
        model.hidden_size,
        model.num_heads,
        model.num_kv_heads,
        model.ffn_hidden_size,
        model.mlp,
        model.seq_len,
        1,
        1,
        forward_s=f,
        backward_s=b,
    )
    edge = EdgeTiming(model.hidden_size, model.vocab_size, model.seq_len, 1, 1, 0.0, 0.0, 0.0, 0.0)
    prof = CalibrationProfile(
        (DeviceProfile("X", (), layers=(layer,), edges=(edge,), optimizer_s_per_param=0.0, memory_bandwidth_GBps=FAST),)
    )
    cluster = cluster_from_dict(
        {
            "name": "t",
            "nodes": [
                {
                    "name": "a",
                    "count": 1,
                    "gpu": {"name": "X", "peak_tflops": 100.0, "memory_GiB": 1000.0, "memory_bandwidth_GBps": 1000.0},
                },
                {
                    "name": "b",
                    "count": 1,
                    "gpu": {"name": "X", "peak_tflops": 100.0, "memory_GiB": 1000.0, "memory_bandwidth_GBps": 1000.0},
                },
            ],
            "network": {"bandwidth_GBps": 1.0, "latency_us": 0.0},
        },
        "t",
    )
    cfg = ParallelConfig(1, (PipelineConfig(2, (StageConfig(("a:0",), 1), StageConfig(("b:0",), 1))),))
    r = Simulator(cluster, model, prof).evaluate(cfg)
    nbytes = 2 * model.seq_len * model.hidden_size  # one bf16 activation of one sequence
    c = (8.4 + 14.0) * 1e-6 + nbytes / (1.0e9 * 0.9)  # NCCL Simple over the network (collectives.py)
    assert c == pytest.approx(collectives.send_s(nbytes, 1.0, 0.0, "network"))
    assert r.iteration_time_s == pytest.approx(3 * f + 3 * b + 3 * c, rel=1e-9)


def test_nccl_like_collectives_per_link_kind() -> None:
    from autotune.simulator.collectives import collective_s, intra_node_kind

    assert intra_node_kind(300, "A100-80GB") == "nvlink" and intra_node_kind(32, "A100-80GB") == "pcie"
    assert intra_node_kind(32, "RTX-4090") == "pcie-no-p2p" and intra_node_kind(32, "cpu") == "host"
    n = 64e6  # a large all-reduce over 4 ranks: Simple protocol, 6 steps
    nv = collective_s("allreduce", n, 4, 300.0, 2.0, "nvlink")
    assert nv == pytest.approx((8.4 + 6 * 3.4) * 1e-6 + 1.5 * n / (300e9 * 0.8))
    # the same bytes over PCIe without peer-to-peer cross it twice (through host memory): half the bus
    p2p = collective_s("allreduce", n, 4, 32.0, 2.0, "pcie")
    nop2p = collective_s("allreduce", n, 4, 32.0, 2.0, "pcie-no-p2p")
    assert nop2p - (8.4 + 6 * 5.7) * 1e-6 == pytest.approx(2 * (p2p - (8.4 + 6 * 5.7) * 1e-6))
    # a small message is latency-bound and takes the LL protocol: 6.6 us + 6 x 0.6 us on NVLink
    assert collective_s("allreduce", 1024, 4, 300.0, 0.0, "nvlink") == pytest.approx(
        (6.6 + 6 * 0.6) * 1e-6 + 1.5 * 1024 / (300e9 * 0.8 * 0.5)
    )
    assert collective_s("allreduce", n, 1, 300.0, 2.0, "nvlink") == 0.0


def test_device_memory_view_adds_context_and_pool_and_sets_oom() -> None:
    from autotune.simulator.device_memory import DEFAULT_DEVICE_MEMORY, device_memory

    model = _model(attention="flash")
    cfg = ParallelConfig(1, (PipelineConfig(16, (StageConfig(("n:0",), 8),)),))
    r = Simulator(_cluster(1), model).evaluate(cfg)
    alloc = r.allocated_memory_GiB["n:0"]
    assert r.peak_memory_GiB["n:0"] == pytest.approx(alloc * 1.05 + 1.0)  # the default class: 1 GiB + 5%
    assert device_memory("X") is DEFAULT_DEVICE_MEMORY and device_memory("GH200").context_GiB == pytest.approx(3.92)
    # a device with exactly the allocated tensors' room is out of memory once the context is counted
    tight = cluster_from_dict(
        {
            "name": "t",
            "nodes": [
                {
                    "name": "n",
                    "count": 1,
                    "gpu": {
                        "name": "X",
                        "peak_tflops": 100.0,
                        "memory_GiB": alloc * 1.01,
                        "memory_bandwidth_GBps": 1000.0,
                    },
                }
            ],
            "network": {"bandwidth_GBps": FAST},
        },
        "t",
    )
    r = Simulator(tight, model).evaluate(cfg)
    assert r.oom and "context" in r.error


def test_a_gpu_profiles_memory_baseline_replaces_the_context_term() -> None:
    """``autotune profile`` on a GPU measures the memory outside the allocator: the device view adds it
    (with the class's pool share) instead of the class's context; the allocated view is unchanged."""
    from autotune.profile import CalibrationProfile, DeviceProfile

    model = _model(attention="flash")
    cfg = ParallelConfig(1, (PipelineConfig(16, (StageConfig(("n:0",), 8),)),))
    plain = Simulator(_cluster(1), model).evaluate(cfg)
    profile = CalibrationProfile((DeviceProfile("X", ((1024.0, 100.0),), memory_baseline_GiB=0.25),))
    r = Simulator(_cluster(1), model, profile).evaluate(cfg)
    alloc = r.allocated_memory_GiB["n:0"]
    assert alloc == pytest.approx(plain.allocated_memory_GiB["n:0"])
    assert r.peak_memory_GiB["n:0"] == pytest.approx(alloc * 1.05 + 0.25)


def test_matmul_roofline_for_thin_attention_matmuls() -> None:
    from autotune.simulator.efficiency import DeviceRates
    from autotune.simulator.flops import Matmul

    dev = _cluster(1, peak=1000.0).nodes[0].device
    rates = DeviceRates(dev, precision="fp32")
    scores = Matmul(2048, 2048, 64, 32)  # Q K^T for 32 heads of 64: writes 32 x 2048^2 fp32 scores
    assert rates.matmul_s(scores) == pytest.approx(4 * scores.elements / (1000e9 * 0.8))  # memory-bound
    big = Matmul(8192, 8192, 8192)
    assert rates.matmul_s(big) == pytest.approx(big.flops / (rates.matmul_tflops(big.size) * 1e12))


# -- runner: sequence parallelism and selective recomputation ----------------------------------


def test_runner_preflight_names_sequence_parallel_it_cannot_run_and_runs_the_rest() -> None:
    from autotune.loading import load_cluster
    from runner.jobs import preflight

    cluster = load_cluster("cpu-4")
    model = {
        "name": "m",
        "num_layers": 4,
        "hidden_size": 64,
        "num_heads": 4,
        "ffn_hidden_size": 256,
        "vocab_size": 128,
        "seq_len": 32,
        "global_batch_size": 4,
    }

    def plan(sp0: bool, sp1: bool) -> ParallelConfig:
        return ParallelConfig.from_dict(
            {
                "micro_batch_size": 1,
                "pipelines": [
                    {
                        "num_microbatches": 4,
                        "stages": [
                            {"devices": ["cpu:0", "cpu:1"], "layers": 2, "sequence_parallel": sp0},
                            {"devices": ["cpu:2", "cpu:3"], "layers": 2, "sequence_parallel": sp1},
                        ],
                    }
                ],
            }
        )

    # a sequence-parallel stage before one without: runner.mixed's hand-offs gather the halves
    assert preflight(cluster, model_from_dict(model, "test"), plan(True, False), schedule_check=False).mixed
    with pytest.raises(SpecError, match=r"seq_len=31 divisible by the tensor-parallel degree 2"):
        preflight(cluster, model_from_dict({**model, "seq_len": 31}, "test"), plan(True, True), schedule_check=False)
    preflight(cluster, model_from_dict(model, "test"), plan(True, True), schedule_check=False)  # runs


# -- make gpu-check ------------------------------------------------------------------------------


def test_megatron_scatters_and_gathers_a_tensor_parallel_hand_off_between_nodes() -> None:
    """Two nodes of 4 GPUs, a stage of tp 4 on each, joined by 1 GB/s (hand-computed with the NCCL-like
    costs of ``collectives``). torch.distributed.pipelining (autotune's runner), Megatron-Core, DeepSpeed and
    torchtitan: each of the 4 ranks sends the whole activation to its peer, 4 copies through the node's NIC.
    Megatron-LM before Megatron-Core (scatter/gather, Narayanan et al. 2021 Sec. 4.1): each rank sends a
    quarter, 1 copy through the NIC, then the receiving stage all-gathers the activation over its NVLink."""
    from autotune.simulator import collectives
    from autotune.simulator.cost_model import CostModel

    model = _model(num_layers=2, attention="flash", dropout=0.0, global_batch_size=2)
    gpu = {"name": "X", "peak_tflops": 100.0, "memory_GiB": 1000.0, "memory_bandwidth_GBps": 1000.0}
    cluster = cluster_from_dict(
        {
            "name": "t",
            "nodes": [
                {"name": n, "count": 4, "gpu": gpu, "intra_node": {"bandwidth_GBps": 100.0, "latency_us": 2.0}}
                for n in ("a", "b")
            ],
            "network": {"bandwidth_GBps": 1.0, "latency_us": 50.0},
        },
        "t",
    )
    src, dst = tuple(f"a:{i}" for i in range(4)), tuple(f"b:{i}" for i in range(4))
    whole = 2 * 2 * model.seq_len * model.hidden_size  # one bf16 activation of a micro-batch of 2
    copies = CostModel(cluster, model, engine="autotune").p2p(src, dst, 2)
    assert copies == pytest.approx(collectives.send_s(4 * whole, 1.0, 50.0, "network"))
    assert CostModel(cluster, model, engine="deepspeed").p2p(src, dst, 2) == copies
    assert CostModel(cluster, model, engine="megatron").p2p(src, dst, 2) == copies  # Megatron-Core: whole tensors
    split = CostModel(cluster, model, engine="megatron-legacy").p2p(src, dst, 2)
    gather = collectives.collective_s("all_gather", whole, 4, 100.0, 2.0, "nvlink")
    assert split == pytest.approx(collectives.send_s(whole, 1.0, 50.0, "network") + gather)
    assert split < copies / 2  # latency is most of the rest at this size
    # with sequence parallelism each rank already holds its part: the same hand-off under every engine
    sp = [CostModel(cluster, model, engine=e).p2p(src, dst, 2, sp=True) for e in ("autotune", "megatron-legacy")]
    assert sp[0] == sp[1] == pytest.approx(collectives.send_s(whole, 1.0, 50.0, "network"))
