"""Calibration profile files: documented format, round trip, clear one-line errors, interpolation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from autotune import SpecError, load_cluster, load_model
from autotune.profile import CalibrationProfile, DeviceProfile, EdgeTiming, LayerTiming, NodeLinks
from autotune.simulator import Simulator
from autotune.specs import LinkSpec, ParallelConfig, PipelineConfig, StageConfig


def _example() -> CalibrationProfile:
    layer = LayerTiming(64, 4, 4, 256, "gelu", 64, 2, 1, forward_s=1e-3, backward_s=2e-3)
    layer_r = LayerTiming(64, 4, 4, 256, "gelu", 64, 2, 1, forward_s=1e-3, backward_s=2.5e-3, recompute=True)
    edge = EdgeTiming(64, 256, 64, 2, 1, 1e-4, 2e-4, 3e-4, 6e-4)
    cpu = DeviceProfile(
        "cpu",
        ((64.0, 0.02), (256.0, 0.05), (1024.0, 0.08)),
        memory_bandwidth_GBps=12.0,
        layers=(layer, layer_r),
        edges=(edge,),
        optimizer_s_per_param=3e-9,
    )
    return CalibrationProfile(
        (cpu,),
        (NodeLinks("cpu", LinkSpec(4.0, 30.0), LinkSpec(2.0, 50.0)),),
        created="2026-11-29T15:00:00+00:00",
        cluster="cpu-2",
        versions=(("torch", "2.13.0"),),
        step_overhead_s=0.01,
        notes="test",
    )


def test_round_trip(tmp_path: Path) -> None:
    from dataclasses import replace

    base = _example()
    prof = replace(
        base,
        devices=(
            replace(
                base.devices[0],
                contention=((1.0, 1.05), (2.0, 1.2)),
                pipeline_overhead=((2.0, 4e-4), (4.0, 2e-3)),
                data_parallel_overhead=((2.0, 2e-3),),
                tensor_parallel_overhead=((2.0, 8e-3), (4.0, 3e-2)),
            ),
        ),
    )
    path = tmp_path / "profile.json"
    prof.save(path)
    data = json.loads(path.read_text())
    assert data["format_version"] == 1 and data["devices"]["cpu"]["matmul_tflops"][0] == [64.0, 0.02]
    assert data["links"]["cpu"]["network"] == {"bandwidth_GBps": 2.0, "latency_us": 50.0}
    assert CalibrationProfile.load(path) == prof
    assert CalibrationProfile.from_dict(prof.to_dict()) == prof


def test_module_docstring_example_parses() -> None:
    import autotune.profile as module

    doc = module.__doc__
    text = doc[doc.index("    {") : doc.index("\n- ``matmul_tflops``")]
    text = "\n".join(line.split("  #")[0] for line in text.splitlines())  # drop the comments
    prof = CalibrationProfile.from_dict(json.loads(text), "docstring")
    assert prof.device("A100-80GB").matmul_tflops(1024) == 205.0


def test_interpolates_in_log_size_and_clamps() -> None:
    dev = _example().device("cpu")
    assert dev.matmul_tflops(256.0) == 0.05
    assert dev.matmul_tflops(128.0) == pytest.approx(0.02 + 0.5 * (0.05 - 0.02))  # halfway in log2 64..256
    assert dev.matmul_tflops(512.0) == pytest.approx(0.05 + 0.5 * (0.08 - 0.05))
    assert dev.matmul_tflops(1.0) == 0.02 and dev.matmul_tflops(1e6) == 0.08
    single = DeviceProfile("x", ((100.0, 7.0),))
    assert single.matmul_tflops(5.0) == single.matmul_tflops(5000.0) == 7.0


BAD = [
    ("{", "invalid JSON"),
    ("[]", "must be a JSON object"),
    ('{"devices": {}}', "devices: is required"),
    ('{"devices": {"cpu": {}}}', "devices.cpu.matmul_tflops: is required"),
    ('{"devices": {"cpu": {"matmul_tflops": [[1, -2]]}}}', "devices.cpu.matmul_tflops[0][1]: must be > 0"),
    ('{"devices": {"cpu": {"matmul_tflops": [[1, 2], [1, 3]]}}}', "lists the same size twice"),
    ('{"devices": {"cpu": {"matmul_tflops": [3]}}}', "must be a pair [n, tflops]"),
    ('{"devices": {"cpu": {"matmul_tflops": [[1, 2]], "speed": 1}}}', "devices.cpu.speed: unknown field"),
    (
        '{"devices": {"cpu": {"matmul_tflops": [[1, 2]], "pipeline_overhead": [[2, -1]]}}}',
        "devices.cpu.pipeline_overhead[0][1]: must be >= 0",
    ),
    (
        '{"devices": {"cpu": {"matmul_tflops": [[1, 2]], "pipeline_overhead": 3}}}',
        "devices.cpu.pipeline_overhead: must be a list of [ranks, seconds] pairs",
    ),
    ('{"devices": {"cpu": {"matmul_tflops": [[1, 2]], "layers": [{"tp": 1}]}}}', "layers[0].hidden_size: is required"),
    ('{"format_version": 2, "devices": {"cpu": {"matmul_tflops": [[1, 2]]}}}', "format_version: must be 1"),
    (
        '{"devices": {"cpu": {"matmul_tflops": [[1, 2]]}}, "links": {"a": {"network": {"latency_us": 1}}}}',
        "links.a.network: must be a mapping",
    ),
    ('{"devices": {"cpu": {"matmul_tflops": [[1, 2]]}}, "colour": 1}', "colour: unknown field"),
    (
        '{"devices": {"cpu": {"matmul_tflops": [[1, 2]], "matmul_roofline": "yes"}}}',
        "devices.cpu.matmul_roofline: must be true or false",
    ),
]


@pytest.mark.parametrize("text,message", BAD)
def test_bad_files_raise_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        CalibrationProfile.load(path)
    assert message in str(info.value) and str(path) in str(info.value) and "\n" not in str(info.value)


def test_missing_file() -> None:
    with pytest.raises(SpecError, match="cannot read file"):
        CalibrationProfile.load("/nonexistent/profile.json")


def test_simulator_uses_profile_measurements() -> None:
    cluster = load_cluster("cpu-2")
    model = load_model("tiny")  # 4 layers, h 64, 4 heads, f 256, gelu, V 256, s 64, global batch 8
    prof = _example()
    cfg = ParallelConfig(2, (PipelineConfig(4, (StageConfig(("cpu:0",), 4),)),))
    m = Simulator(cluster, model, prof).evaluate(cfg)
    params = model.num_params
    # measured: 4 micro-batches x (4 layers x (1 + 2) ms + embedding 0.3 ms + head 0.9 ms); Adam; overhead
    expected = 4 * (4 * 3e-3 + 3e-4 + 9e-4) + 3e-9 * params + 0.01
    assert m.iteration_time_s == pytest.approx(expected, rel=1e-9)
    # recomputing stages use the measured recompute backward
    cfg_r = ParallelConfig(2, (PipelineConfig(4, (StageConfig(("cpu:0",), 4, True),)),))
    m_r = Simulator(cluster, model, prof).evaluate(cfg_r)
    assert m_r.iteration_time_s - m.iteration_time_s == pytest.approx(4 * 4 * 0.5e-3, rel=1e-9)
    # measured links replace the cluster file's: stage 1 starts one profiled transfer after stage 0
    cfg2 = ParallelConfig(2, (PipelineConfig(4, (StageConfig(("cpu:0",), 2), StageConfig(("cpu:1",), 2))),))
    tl = Simulator(cluster, model, prof).evaluate_detailed(cfg2).timeline
    f0 = {e.device: e for e in tl if e.op == "F0"}
    # intra_node 4 GB/s, 30 us; mbs 2 x s x h fp32 elements (the CPU runner computes in fp32)
    transfer = 30e-6 + 4 * 2 * model.seq_len * model.hidden_size / 4e9
    assert f0["cpu:1"].start_s - f0["cpu:0"].end_s == pytest.approx(transfer, rel=1e-9)
    default = Simulator(cluster, model).evaluate_detailed(cfg2).timeline
    d0 = {e.device: e for e in default if e.op == "F0"}
    assert not math.isclose(d0["cpu:1"].start_s - d0["cpu:0"].end_s, transfer)
