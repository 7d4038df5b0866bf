"""Calibration: micro-benchmarks, the profile `autotune profile` writes, and its use by the simulator;
interpolation at unprofiled sizes; device types that cannot be profiled; online correction."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace

import pytest
from paths import REPO

from autotune.calibration import bench, profiler
from autotune.calibration.online import Corrections, OnlineCalibrator, apply_corrections, default_profile
from autotune.loading import load_cluster, load_config, load_model
from autotune.profile import CalibrationProfile, DeviceProfile, LayerTiming
from autotune.simulator import Simulator

ROOT = REPO
AUTOTUNE = [sys.executable, "-m", "autotune.cli"]

MIXED_CLUSTER = """
name: mixed-cpu-a100
nodes:
  - {name: cpu, gpu: cpu, count: 2, intra_node: {bandwidth_GBps: 5, latency_us: 20}}
  - {name: a100, gpu: A100-80GB, count: 2, intra_node: {bandwidth_GBps: 300, latency_us: 2}}
network: {bandwidth_GBps: 5, latency_us: 20}
"""


def plan(mbs, *pipelines):
    return load_config(
        {
            "micro_batch_size": mbs,
            "schedule": "1f1b",
            "pipelines": [
                {"num_microbatches": m, "stages": [{"devices": [d], "layers": n, "recompute": r} for d, n, r in stages]}
                for m, stages in pipelines
            ],
        }
    )


# --------------------------------------------------------------------------------------------------
# micro-benchmarks


def test_fit_alpha_beta_recovers_latency_and_bandwidth():
    lat_us, bw = 50.0, 4.0
    samples = [(n, lat_us * 1e-6 + n / (bw * 1e9)) for n in (4, 16_384, 262_144, 2**20, 4 * 2**20)]
    got_lat, got_bw = bench.fit_alpha_beta(samples)
    assert got_lat == pytest.approx(lat_us, rel=1e-3)
    assert got_bw == pytest.approx(bw, rel=1e-3)


def test_layer_benchmark_times_and_activation_bytes():
    model = load_model("tiny")
    shape = bench.LayerShape.of(model)
    plain = bench.bench_layer(shape, 2, 1, repeats=2)
    recompute = bench.bench_layer(shape, 2, 1, recompute=True, repeats=2)
    assert plain.forward_s > 0 and plain.backward_s > 0
    # checkpointing keeps exactly the block's fp32 input; without it much more is kept
    assert recompute.activation_bytes == 2 * model.seq_len * model.hidden_size * 4
    assert plain.activation_bytes > 4 * recompute.activation_bytes
    # tensor parallelism halves the heads and MLP columns a rank holds
    half = bench.bench_layer(shape, 2, 2, repeats=2)
    assert half.activation_bytes < plain.activation_bytes


def test_matmul_curve_indexes_by_cube_root_and_averages_duplicates():
    # 128 x 32 x 64 has the same cube root (64) as 64^3: all three land on n = 64
    pts = [
        bench.MatmulPoint(64, 64, 64, 1e-3),
        bench.MatmulPoint(64, 64, 64, 2e-3),
        bench.MatmulPoint(128, 32, 64, 1e-3),
        bench.MatmulPoint(128, 128, 128, 1e-3),
    ]
    curve = profiler.matmul_curve(pts)
    assert [n for n, _ in curve] == [64.0, 128.0]
    assert curve[0][1] == pytest.approx(sum(p.tflops for p in pts[:3]) / 3)


# --------------------------------------------------------------------------------------------------
# the profile `autotune profile` writes, and its use by the simulator


def test_plan_skips_gpu_types_without_cuda():
    plan = profiler.plan_profile(load_cluster("mixed-a100-v100"), load_model("tiny"))
    assert [(d.name, d.runnable) for d in plan.devices] == [("A100-80GB", False), ("V100-32GB", False)]
    assert all("no CUDA device here" in d.skip_reason for d in plan.devices)
    cpu = profiler.plan_profile(load_cluster("cpu-4"), load_model("small"))
    (dev,) = cpu.devices
    assert dev.runnable and dev.micro_batch_sizes == (1, 2, 4, 8) and dev.tp_degrees == (1, 2, 4)


# --------------------------------------------------------------------------------------------------
# interpolation at sizes the profile does not hold


def _profile_with_layers(model, mbs_list, forward_s_per_seq=0.01):
    layers = tuple(
        LayerTiming(
            model.hidden_size,
            model.num_heads,
            model.num_kv_heads,
            model.ffn_hidden_size,
            model.mlp,
            model.seq_len,
            b,
            1,
            forward_s_per_seq * b,
            2 * forward_s_per_seq * b,
            activation_bytes=1e6 * b,
        )
        for b in mbs_list
    )
    # a matmul curve consistent with those layer times: the FLOP model then agrees with the table
    flops = bench.LayerShape.of(model).layer_flops(1, 1)
    tflops = flops / forward_s_per_seq / 1e12
    return CalibrationProfile((DeviceProfile("cpu", ((16.0, tflops), (4096.0, tflops)), 1e6, layers),))


def test_matmul_rate_is_interpolated_between_profiled_sizes():
    dev = DeviceProfile("cpu", ((64.0, 0.02), (256.0, 0.1)))
    mid = dev.matmul_tflops(128.0)
    assert 0.02 < mid < 0.1
    assert mid == pytest.approx(0.06)  # linear in log n: 128 is halfway between 64 and 256
    assert dev.matmul_tflops(8.0) == 0.02 and dev.matmul_tflops(1e5) == 0.1  # clamped outside


def test_simulator_predicts_unprofiled_micro_batch_between_profiled_ones():
    model = load_model("small")
    cluster = load_cluster("cpu-4")
    sim = Simulator(cluster, model, _profile_with_layers(model, (1, 2, 8)))

    def busy(mbs):
        m = sim.evaluate(plan(mbs, (16 // mbs, [("cpu:0", 8, False)])))
        assert m.ok, m.error
        return m.stage_busy_s[0]

    b2, b4, b8 = busy(2), busy(4), busy(8)  # mbs 4 is not in the profile: FLOP model on the measured curve
    assert math.isfinite(b4) and b2 < b4 * 1.5 and b4 < b8 * 1.5
    assert min(b2, b8) * 0.5 < b4 < max(b2, b8) * 2.0


def test_contention_curve_interpolates_and_extrapolates():
    dev = DeviceProfile("cpu", ((16.0, 0.1),), contention=((1.0, 1.0), (2.0, 1.1), (4.0, 2.1)))
    assert dev.contention_stretch(1) == 1.0
    assert dev.contention_stretch(3) == pytest.approx(1.6)
    assert dev.contention_stretch(8) == pytest.approx(4.2)  # processor sharing past the end


def test_pipeline_overhead_curve_is_zero_at_one_rank_interpolated_and_linear_past_the_end():
    dev = DeviceProfile("cpu", ((16.0, 0.1),), pipeline_overhead=((2.0, 0.001), (4.0, 0.003)))
    assert dev.pipeline_overhead_s(1) == 0.0
    assert dev.pipeline_overhead_s(1.5) == pytest.approx(0.0005)
    assert dev.pipeline_overhead_s(3) == pytest.approx(0.002)
    assert dev.pipeline_overhead_s(8) == pytest.approx(0.006)
    assert DeviceProfile("cpu", ((16.0, 0.1),)).pipeline_overhead_s(4) == 0.0
    dp = DeviceProfile("cpu", ((16.0, 0.1),), data_parallel_overhead=((2.0, 0.002), (4.0, 0.01)))
    assert (dp.data_parallel_overhead_s(1), dp.data_parallel_overhead_s(3)) == (0.0, pytest.approx(0.006))


def test_simulator_adds_pipeline_overhead_to_every_slot_of_multi_stage_pipelines_only():
    model = load_model("tiny")
    cluster = load_cluster("cpu-4")
    base = _profile_with_layers(model, (1, 2))
    cpu = base.devices[0]
    extra = 0.004
    with_hops = replace(base, devices=(replace(cpu, pipeline_overhead=((2.0, extra / 2), (4.0, extra))),))
    m = 8
    four = plan(1, (m, [("cpu:0", 1, False), ("cpu:1", 1, False), ("cpu:2", 1, False), ("cpu:3", 1, False)]))
    a, b = Simulator(cluster, model, base).evaluate(four), Simulator(cluster, model, with_hops).evaluate(four)
    # balanced 1F1B: the critical path holds m + p - 1 forward+backward slots of the stage, each longer by
    # the overhead at 4 ranks (communication is a few microseconds here)
    assert b.iteration_time_s - a.iteration_time_s == pytest.approx((m + 4 - 1) * extra, rel=0.05)
    assert b.stage_busy_s == a.stage_busy_s  # it is not compute
    one = plan(2, (4, [("cpu:0", 4, False)]))  # no pipeline, no hand-offs
    assert (
        Simulator(cluster, model, with_hops).evaluate(one).iteration_time_s
        == Simulator(cluster, model, base).evaluate(one).iteration_time_s
    )
    replicas = plan(2, (2, [("cpu:0", 4, False)]), (2, [("cpu:1", 4, False)]))
    assert (
        Simulator(cluster, model, with_hops).evaluate(replicas).iteration_time_s
        == Simulator(cluster, model, base).evaluate(replicas).iteration_time_s
    )


def test_simulator_adds_data_parallel_overhead_once_per_step_to_plans_with_replicas():
    model = load_model("tiny")
    cluster = load_cluster("cpu-4")
    base = _profile_with_layers(model, (1, 2))
    with_dp = replace(base, devices=(replace(base.devices[0], data_parallel_overhead=((2.0, 0.003), (4.0, 0.009))),))
    two = plan(2, (2, [("cpu:0", 4, False)]), (2, [("cpu:1", 4, False)]))
    four = plan(1, (4, [("cpu:0", 2, False), ("cpu:1", 2, False)]), (4, [("cpu:2", 2, False), ("cpu:3", 2, False)]))
    for config, extra in ((two, 0.003), (four, 0.009)):  # at the plan's number of ranks
        a, b = Simulator(cluster, model, base).evaluate(config), Simulator(cluster, model, with_dp).evaluate(config)
        assert b.iteration_time_s - a.iteration_time_s == pytest.approx(extra, rel=1e-6)
    one_pipeline = plan(1, (8, [("cpu:0", 2, False), ("cpu:1", 2, False)]))  # no replicas: no gradient all-reduce
    assert (
        Simulator(cluster, model, with_dp).evaluate(one_pipeline).iteration_time_s
        == Simulator(cluster, model, base).evaluate(one_pipeline).iteration_time_s
    )


def test_simulator_adds_tensor_parallel_overhead_per_layer_and_micro_batch():
    model = load_model("tiny")
    cluster = load_cluster("cpu-4")
    base = _profile_with_layers(model, (1, 2))
    with_tp = replace(base, devices=(replace(base.devices[0], tensor_parallel_overhead=((2.0, 0.004), (4.0, 0.02))),))
    m = 4
    tp2 = load_config(
        {
            "micro_batch_size": 2,
            "pipelines": [
                {"num_microbatches": m, "stages": [{"devices": ["cpu:0", "cpu:1"], "layers": model.num_layers}]}
            ],
        }
    )
    a, b = Simulator(cluster, model, base).evaluate(tp2), Simulator(cluster, model, with_tp).evaluate(tp2)
    # one stage: every micro-batch's forward and backward pass every layer once
    assert b.iteration_time_s - a.iteration_time_s == pytest.approx(m * model.num_layers * 0.004, rel=1e-6)
    one = plan(2, (4, [("cpu:0", 4, False)]))  # tp 1: untouched
    assert (
        Simulator(cluster, model, with_tp).evaluate(one).iteration_time_s
        == Simulator(cluster, model, base).evaluate(one).iteration_time_s
    )


def test_simulator_uses_contention_and_memory_terms():
    model = load_model("tiny")
    cluster = load_cluster("cpu-4")
    base = _profile_with_layers(model, (1,))
    four = plan(1, (8, [("cpu:0", 1, False), ("cpu:1", 1, False), ("cpu:2", 1, False), ("cpu:3", 1, False)]))
    cpu = base.devices[0]
    stretched = replace(base, devices=(replace(cpu, contention=((1.0, 1.0), (4.0, 2.0)), memory_baseline_GiB=0.5),))
    a, b = Simulator(cluster, model, base).evaluate(four), Simulator(cluster, model, stretched).evaluate(four)
    # 4 ranks at stretch 2 do 2 ranks' worth of work per second: the iteration is at least all ranks'
    # compute over 2 (work-conserving processor sharing), here more than the pipeline alone needs
    work = 8 * sum(a.stage_busy_s) / 8  # stage_busy_s is per step already: m * (F + B) per stage
    assert work * 2 / 4 > a.iteration_time_s
    assert b.iteration_time_s == pytest.approx(work * 2 / 4, rel=0.02)
    assert b.peak_memory_GiB["cpu:0"] == pytest.approx(a.peak_memory_GiB["cpu:0"] + 0.5)
    one = plan(2, (4, [("cpu:0", 4, False)]))  # a single rank does not contend
    assert (
        Simulator(cluster, model, stretched).evaluate(one).stage_busy_s
        == Simulator(cluster, model, base).evaluate(one).stage_busy_s
    )


# --------------------------------------------------------------------------------------------------
# online correction


def _err(sim, truth, configs):
    return sum(
        abs(sim.evaluate(c).iteration_time_s - truth.evaluate(c).iteration_time_s) / truth.evaluate(c).iteration_time_s
        for c in configs
    ) / len(configs)


def test_online_calibration_recovers_a_deliberately_wrong_profile():
    """The true profile plays the measurement; the calibrator starts from a wrong one (compute 40% too
    fast, contention 70% too weak, links 2x off, memory baseline 50 MiB short) and must close the gap on
    plans it was not fitted on."""
    cluster, model = load_cluster("cpu-4"), load_model("small")
    base = _profile_with_layers(model, (1, 2, 4))
    true_profile = replace(
        base,
        devices=(replace(base.devices[0], contention=((1.0, 1.0), (2.0, 1.1), (4.0, 2.0)), memory_baseline_GiB=0.1),),
    )
    truth = Simulator(cluster, model, true_profile)
    wrong = apply_corrections(
        true_profile,
        cluster,
        Corrections(
            compute=(("cpu", 0.6),),
            link=(("intra:cpu", 2.0), ("network", 2.0)),
            contention=(("cpu", 0.3),),
            memory_GiB=(("cpu", -0.05),),
        ),
    )
    fit_on = [
        plan(2, (8, [("cpu:0", 8, False)])),
        plan(2, (8, [("cpu:0", 2, False), ("cpu:1", 2, False), ("cpu:2", 2, False), ("cpu:3", 2, False)])),
    ]
    held_out = [
        plan(4, (4, [("cpu:0", 4, False), ("cpu:1", 4, True)])),
        plan(2, (4, [("cpu:0", 4, False), ("cpu:1", 4, False)]), (4, [("cpu:2", 4, False), ("cpu:3", 4, False)])),
        plan(1, (16, [("cpu:0", 5, False), ("cpu:1", 3, False)])),
    ]
    start = Simulator(cluster, model, wrong)
    cal = OnlineCalibrator(start)
    for c in fit_on:
        cal.update(c, truth.evaluate(c))
    before, after = _err(start, truth, held_out), _err(cal.corrected_simulator(), truth, held_out)
    assert before > 0.3
    # the ridge prior (robustness to noisy real runs) leaves a few percent of bias with two runs
    assert after < 0.08 and after < before / 5
    corr = cal.corrections
    assert dict(corr.compute)["cpu"] == pytest.approx(1 / 0.6, rel=0.1)
    assert dict(corr.memory_GiB)["cpu"] == pytest.approx(0.05, abs=1e-6)
    c = held_out[1]
    assert cal.corrected_simulator().evaluate(c).peak_memory_GiB["cpu:0"] == pytest.approx(
        truth.evaluate(c).peak_memory_GiB["cpu:0"], rel=1e-6
    )
    # the corrected profile is an ordinary profile: it survives a save and load
    assert CalibrationProfile.from_dict(json.loads(json.dumps(cal.profile.to_dict()))) == cal.profile


def test_online_calibration_ignores_failed_runs_and_works_without_a_profile():
    from autotune.specs import Measurement

    cluster, model = load_cluster("cpu-2"), load_model("tiny")
    sim = Simulator(cluster, model)
    cal = OnlineCalibrator(sim)
    assert cal.profile == default_profile(cluster, model.precision)
    # the datasheet-equivalent profile predicts what the profile-less simulator predicts
    c = plan(2, (4, [("cpu:0", 4, False)]))
    assert cal.corrected_simulator().evaluate(c).iteration_time_s == pytest.approx(
        sim.evaluate(c).iteration_time_s, rel=0.02
    )
    cal.update(c, Measurement.failure("timeout", "no result"))
    assert not cal.observations
    slow = sim.evaluate(c)
    cal.update(
        c,
        replace(slow, iteration_time_s=3 * slow.iteration_time_s, stage_busy_s=tuple(3 * b for b in slow.stage_busy_s)),
    )
    assert cal.corrected_simulator().evaluate(c).iteration_time_s == pytest.approx(3 * slow.iteration_time_s, rel=0.05)


def test_calibrating_evaluator_returns_real_results_and_corrects_its_simulator():
    cluster, model = load_cluster("cpu-4"), load_model("small")
    true_profile = _profile_with_layers(model, (1, 2))
    truth = Simulator(cluster, model, true_profile)  # stands in for the real runs in this unit test
    wrong = Simulator(cluster, model, apply_corrections(true_profile, cluster, Corrections(compute=(("cpu", 2.0),))))
    from autotune.calibration.online import CalibratingEvaluator

    ev = CalibratingEvaluator(truth, wrong)
    c1, c2 = plan(2, (8, [("cpu:0", 8, False)])), plan(1, (16, [("cpu:0", 4, False), ("cpu:1", 4, False)]))
    assert ev.simulator is wrong
    assert ev.evaluate(c1) == truth.evaluate(c1)
    assert ev.simulator.evaluate(c2).iteration_time_s == pytest.approx(truth.evaluate(c2).iteration_time_s, rel=0.05)
    assert abs(wrong.evaluate(c2).iteration_time_s / truth.evaluate(c2).iteration_time_s - 1) > 0.5


def test_negative_memory_offset_still_gives_a_saveable_profile(tmp_path) -> None:
    """An offset that would push the memory baseline below zero is cut at zero, so the corrected profile
    stays valid and can be written as the search's calibrated_profile.json."""
    from autotune.calibration.online import Corrections, apply_corrections, default_profile
    from autotune.loading import load_cluster
    from autotune.profile import CalibrationProfile

    cluster = load_cluster("cpu-2")
    corrected = apply_corrections(default_profile(cluster), cluster, Corrections(memory_GiB=(("cpu", -3.0),)))
    assert corrected.device("cpu").memory_baseline_GiB == 0.0
    path = tmp_path / "calibrated.json"
    corrected.save(path)
    assert CalibrationProfile.load(path).device("cpu").memory_baseline_GiB == 0.0


def _noisy(m, k):
    return replace(
        m,
        iteration_time_s=m.iteration_time_s * k,
        stage_busy_s=tuple(b * k for b in m.stage_busy_s),
        peak_memory_GiB={d: g * (2 - k) for d, g in m.peak_memory_GiB.items()},
    )


SIX_PLANS = [
    plan(2, (8, [("cpu:0", 8, False)])),
    plan(2, (8, [("cpu:0", 2, False), ("cpu:1", 2, False), ("cpu:2", 2, False), ("cpu:3", 2, False)])),
    plan(4, (4, [("cpu:0", 4, False), ("cpu:1", 4, True)])),
    plan(2, (4, [("cpu:0", 4, False), ("cpu:1", 4, False)]), (4, [("cpu:2", 4, False), ("cpu:3", 4, False)])),
    plan(1, (16, [("cpu:0", 5, False), ("cpu:1", 3, False)])),
    plan(1, (16, [("cpu:0", 3, False), ("cpu:1", 3, False), ("cpu:2", 2, False)])),
]


@pytest.mark.slow
def test_online_calibration_keeps_a_right_profile_when_runs_only_add_noise():
    """Runs scattered +-8-12% around a profile that is right: a fit would chase the noise; the held-out
    check must keep the profile as it is."""
    cluster, model = load_cluster("cpu-4"), load_model("small")
    profile = replace(
        _profile_with_layers(model, (1, 2, 4)),
        devices=(
            replace(
                _profile_with_layers(model, (1, 2, 4)).devices[0],
                contention=((1.0, 1.0), (2.0, 1.1), (4.0, 2.0)),
                memory_baseline_GiB=0.1,
            ),
        ),
    )
    truth = Simulator(cluster, model, profile)
    cal = OnlineCalibrator(Simulator(cluster, model, profile))
    for c, k in zip(SIX_PLANS, (1.1, 1.1, 0.9, 0.9, 1.1, 0.9)):
        cal.update(c, _noisy(truth.evaluate(c), k))
    assert cal.corrections == Corrections()
    assert cal.profile.devices == profile.devices


def test_online_calibration_held_out_check_keeps_a_real_correction():
    """The same check lets a real error through: a profile 40% too fast is corrected from six runs."""
    cluster, model = load_cluster("cpu-4"), load_model("small")
    true_profile = _profile_with_layers(model, (1, 2, 4))
    truth = Simulator(cluster, model, true_profile)
    wrong = apply_corrections(true_profile, cluster, Corrections(compute=(("cpu", 0.6),)))
    cal = OnlineCalibrator(Simulator(cluster, model, wrong))
    for c, k in zip(SIX_PLANS, (1.03, 0.98, 1.02, 0.97, 1.01, 1.0)):
        cal.update(c, _noisy(truth.evaluate(c), k))
    assert dict(cal.corrections.compute)["cpu"] == pytest.approx(1 / 0.6, rel=0.1)


def test_a_run_out_of_memory_teaches_the_memory_model():
    """The cluster file says 32 GiB V100s, the devices hold 15% less (issue 45): a plan the file says fits
    runs out of memory for real; from then on the corrected simulator (the memory check every later plan
    goes through before a real run) says it does not fit, while a plan that truly fits still fits."""
    from autotune.calibration.online import CalibratingEvaluator
    from autotune.loading import cluster_from_dict

    node = {"name": "v", "gpu": "V100-32GB", "count": 2, "intra_node": {"bandwidth_GBps": 16, "latency_us": 5}}
    spec = {"name": "v100x2", "nodes": [node], "network": {"bandwidth_GBps": 12.5, "latency_us": 10}}
    smaller = {"name": "V100-32GB", "peak_tflops": 125, "memory_GiB": 32 * 0.85, "memory_bandwidth_GBps": 900}
    model = load_model("gpt2-xl")
    file = Simulator(cluster_from_dict(spec, "file"), model)
    truth = Simulator(cluster_from_dict({**spec, "nodes": [{**node, "gpu": smaller}]}, "truth"), model)

    def two_stages(mbs: int, first: int, recompute) -> object:
        stages = [{"devices": ["v:0"], "layers": first}, {"devices": ["v:1"], "layers": 48 - first}]
        n = model.global_batch_size // mbs
        return load_config(
            {
                "micro_batch_size": mbs,
                "pipelines": [{"num_microbatches": n, "stages": [s | {"recompute": recompute} for s in stages]}],
            }
        )

    tight, roomy = two_stages(8, 20, "every-2"), two_stages(4, 24, False)
    assert file.evaluate(tight).ok and truth.evaluate(tight).oom and truth.evaluate(roomy).ok
    ev = CalibratingEvaluator(truth, file)
    assert ev.evaluate(tight).oom
    assert ev.simulator.memory_check(tight) is not None  # never run again: answered oom without a run
    assert ev.simulator.evaluate(roomy).ok
    offset = dict(ev.calibrator.corrections.memory_GiB)["V100-32GB"]
    assert 0 < offset < 32 * 0.15  # as much as the run shows (the device over its memory), not more


def test_one_link_factor_per_link_class_tells_a_pcie_node_from_a_slow_network():
    """The A100 node's GPUs are joined by PCIe (1/20 of the NVLink the file says), the network is as written
    (issue 45): the runs' fit puts the error on that node type's intra-node links, not on the network, and says
    which terms the runs identified (cross-validation off: one run identifies the PCIe class here)."""
    from autotune.calibration.online import link_classes
    from autotune.simulator.perturbation import ClusterErrors, perturb

    cluster, model = load_cluster("mixed-a100-v100"), load_model("gpt2-small", 64)
    truth = Simulator(perturb(cluster, ClusterErrors(intra_node_bandwidth={"a100": 0.05})), model)

    def cfg(*stages):
        pipe = {"num_microbatches": 8, "stages": [{"devices": d, "layers": n} for d, n in stages]}
        return load_config({"micro_batch_size": 8, "pipelines": [pipe]})

    runs = [cfg((["a100:0"], 12)), cfg((["a100:0", "a100:1"], 12)), cfg((["a100:2"], 6), (["v100:0"], 6))]
    assert [sorted(link_classes(cluster, c)) for c in runs] == [[], ["intra:A100-80GB"], ["network"]]
    cal = OnlineCalibrator(Simulator(cluster, model), min_validation_runs=99)
    for c in runs:
        cal.update(c, truth.evaluate(c))
    link = dict(cal.corrections.link)
    assert link["intra:A100-80GB"] > 10 and link["network"] == pytest.approx(1.0, abs=0.02)
    assert "intra:V100-32GB" not in link  # no run used the V100 node's links: not identified
    assert "link:network" in cal.corrections.identified
    tp = cfg((["a100:2", "a100:3"], 12))  # a plan the fit never saw, on the same links
    real = truth.evaluate(tp).iteration_time_s
    corrected = abs(cal.corrected_simulator().evaluate(tp).iteration_time_s / real - 1)
    nominal = abs(Simulator(cluster, model).evaluate(tp).iteration_time_s / real - 1)
    assert corrected < 0.2 and corrected < nominal / 3  # 15% against 58% (the ridge prior keeps it short of 20x)


def test_the_fit_has_one_residual_per_run_and_measured_stage_wherever_the_slowest_replica_moves():
    """The measured busy times are the slowest replica's stages; where replicas have different stage counts,
    which one is slowest moves with the factors the fit tries, and so did the number of residuals (scipy:
    'could not broadcast input array'): a real run of a closed-loop search was recorded as failed, and every
    later run with it (h100-l4-32's PCIe draw, issue 45)."""
    from autotune.calibration.online import CalibratingEvaluator, _Observation, run_residuals
    from autotune.simulator.perturbation import ClusterErrors, perturb

    cluster, model = load_cluster("mixed-a100-v100"), load_model("gpt2-small")
    nominal = Simulator(cluster, model)
    # a replica of one stage on a V100 beside one of two stages on A100s; for real the A100s are 8x slower,
    # so the two-stage replica is the slowest measured, where the nominal simulator's slowest has one stage
    truth = Simulator(perturb(cluster, ClusterErrors(compute_time={"A100-80GB": 8.0})), model)
    c = plan(8, (32, [("v100:0", 12, False)]), (32, [("a100:0", 6, False), ("a100:1", 6, False)]))
    assert len(truth.evaluate(c).stage_busy_s) == 2 and len(nominal.evaluate(c).stage_busy_s) == 1
    obs = [_Observation(c, truth.evaluate(c))]
    assert len(run_residuals(nominal, obs)) == len(run_residuals(truth, obs)) == 3
    assert run_residuals(truth, obs) == pytest.approx([0.0, 0.0, 0.0], abs=1e-9)
    # the closed loop keeps both runs and fits through the flip
    ev = CalibratingEvaluator(truth, nominal)
    alone = plan(8, (64, [("a100:0", 12, False)]))
    for run in (c, alone):
        assert ev.evaluate(run) == truth.evaluate(run)
    assert len(ev.calibrator.observations) == 2
    assert ev.simulator.evaluate(alone).iteration_time_s == pytest.approx(
        truth.evaluate(alone).iteration_time_s, rel=0.1
    )


def test_a_run_the_fit_cannot_take_is_kept_and_leaves_the_correction_as_it_was(caplog):
    """The closed loop's evaluator returns the measurement whatever the refit does: a time the fit cannot
    take (not finite) is ignored like a failed run, and a refit that raises keeps the correction it had."""
    from autotune.calibration.online import CalibratingEvaluator

    cluster, model = load_cluster("cpu-2"), load_model("tiny")
    sim = Simulator(cluster, model)
    ev = CalibratingEvaluator(sim, sim)
    c = plan(2, (4, [("cpu:0", 4, False)]))
    broken = replace(sim.evaluate(c), iteration_time_s=math.inf)
    ev.observe(c, broken)
    assert not ev.calibrator.observations and ev.simulator is sim
    ev.calibrator.observations.append("not an observation")  # a state no refit can take: it raises
    ev.observe(c, sim.evaluate(c))
    assert ev.calibrator.observations == ["not an observation"] and ev.simulator is sim  # the new run rolled back
    assert "could not refit with the run" in caplog.text


@pytest.mark.slow
def test_the_closed_loop_starts_from_the_datasheet_simulator_and_a_run_it_predicts_moves_nothing(tmp_path):
    """Without a profile the corrections scale ``default_profile``, which must predict what the datasheet
    simulator predicts, memory roofline of the matmuls included (issue 45: it dropped the roofline, so it was
    6-14% fast on llama2-7b, and a run with no error moved H100's compute factor to 1.14-1.28)."""
    from autotune.planning.planner import plan_candidates
    from autotune.planning.space import SearchSpace
    from autotune.profile import CalibrationProfile

    cluster, model = load_cluster("mixed-h100-a100-32"), load_model("llama2-7b")
    nominal = Simulator(cluster, model)
    plans = [c.config for c in plan_candidates(SearchSpace(cluster, model), None, limit=3)]
    cal = OnlineCalibrator(nominal)
    for c in plans:
        assert cal.corrected_simulator().evaluate(c).iteration_time_s == pytest.approx(
            nominal.evaluate(c).iteration_time_s, rel=1e-3
        )
    cal.fit([(c, nominal.evaluate(c)) for c in plans])
    factors = [v for _, v in cal.corrections.compute + cal.corrections.link]
    assert factors and all(v == pytest.approx(1.0, abs=0.01) for v in factors), cal.corrections
    # the roofline flag survives the file the search writes (calibrated_profile.json)
    path = tmp_path / "calibrated_profile.json"
    cal.profile.save(path)
    again = Simulator(cluster, model, CalibrationProfile.load(path))
    assert again.evaluate(plans[0]).iteration_time_s == pytest.approx(
        nominal.evaluate(plans[0]).iteration_time_s, rel=1e-3
    )
