"""ZeRO / offload / host fields (SPEC "Extensions"): loading, defaults, validation messages, describe."""

from __future__ import annotations

import json

import pytest
from paths import EXAMPLES

from autotune import SpecError, load_cluster, load_config, load_model
from autotune.catalog import GPU_CATALOG
from autotune.specs import HOST_MEMORY_MIN_GiB, Measurement, ParallelConfig, default_host, default_host_link

EXAMPLES = EXAMPLES


def _plan(zero=None, offload=None, replicas=2):
    stage = {"devices": ["cpu:0"], "layers": 4}
    pipes = []
    for r in range(replicas):
        st = {"devices": [f"cpu:{r}"], "layers": 4}
        if offload is not None:
            st["offload"] = offload
        pipes.append({"num_microbatches": 8 // replicas, "stages": [st]})
    plan = {"micro_batch_size": 1, "pipelines": pipes}
    if zero is not None:
        plan["zero"] = zero
    del stage
    return plan


def test_host_defaults_come_from_the_gpu_types_pcie_and_the_documented_memory_rule():
    # PCIe 4.0 x16: 16 GT/s x 16 lanes x 128/130 / 8 = 31.5 GB/s payload, at 80%: 25.2 GB/s
    assert default_host_link(GPU_CATALOG["RTX-4090"]).bandwidth_GBps == pytest.approx(25.2, abs=0.02)
    assert default_host_link(GPU_CATALOG["V100-32GB"]).bandwidth_GBps == pytest.approx(12.6, abs=0.02)  # 3.0 x16
    assert default_host_link(GPU_CATALOG["H100-80GB"]).bandwidth_GBps == pytest.approx(50.4, abs=0.02)  # 5.0 x16
    for name, dev in GPU_CATALOG.items():
        assert "host:" in dev.source, name  # the host interface's source is named beside the entry
    node = load_cluster("mixed-a100-v100").nodes[1]  # 4 x V100-32GB
    assert node.host == default_host(node.device, 4)
    assert node.host.memory_GiB == pytest.approx(2 * 4 * node.device.memory_GiB, abs=0.01)
    assert load_cluster("cpu-2").nodes[0].host.memory_GiB == HOST_MEMORY_MIN_GiB


def test_host_from_the_cluster_file_and_its_errors(tmp_path):
    c = load_cluster(EXAMPLES / "8x4090.yaml")
    box = c.nodes[0]
    assert (box.count, box.host.memory_GiB, box.host.link.bandwidth_GBps) == (8, 512, 25)
    partial = tmp_path / "c.yaml"
    partial.write_text("nodes: [{name: n, gpu: T4, count: 2, host: {memory_GiB: 100}}]\nnetwork: {bandwidth_GBps: 1}\n")
    node = load_cluster(partial).nodes[0]
    assert node.host.memory_GiB == 100 and node.host.link == default_host_link(GPU_CATALOG["T4"])
    for text, field, words in [
        ("host: {memory_GiB: -5}", "nodes[0].host.memory_GiB", "must be > 0, got -5"),
        ("host: {memory_GiB: 10, link: {latency_us: 3}}", "nodes[0].host.link.bandwidth_GBps", "is required"),
        ("host: {memroy_GiB: 10}", "nodes[0].host.memroy_GiB", "unknown field"),
        ("host: 12", "nodes[0].host", "must be a mapping"),
        (
            "gpu: {name: X, peak_tflops: 1, memory_GiB: 1, memory_bandwidth_GBps: 1, pcie_gen: 7}",
            "nodes[0].gpu.pcie_gen",
            "must be one of 0, 3, 4, 5",
        ),
    ]:
        gpu = "" if "gpu:" in text else "gpu: T4, "
        partial.write_text(f"nodes: [{{name: n, {gpu}count: 2, {text}}}]\nnetwork: {{bandwidth_GBps: 1}}\n")
        with pytest.raises(SpecError) as e:
            load_cluster(partial)
        assert e.value.field == field and words in e.value.rule, (text, e.value)


def test_zero_and_offload_load_roundtrip_and_old_plans_stay_the_same():
    cfg = load_config(_plan(zero=2, offload="optimizer"))
    assert cfg.zero == 2 and all(s.offload == "optimizer" for p in cfg.pipelines for s in p.stages)
    assert ParallelConfig.from_json(cfg.to_json()) == cfg
    assert cfg.offloads
    old = load_config(_plan())
    assert old.zero == 0 and not old.offloads
    assert "zero" not in old.to_dict() and "offload" not in json.dumps(old.to_dict())  # files written as before


@pytest.mark.parametrize(
    "zero,offload,field,words",
    [
        (4, None, "zero", "must be 0, 1, 2 or 3 (ZeRO stage), got 4"),
        (True, None, "zero", "got True"),
        ("2", None, "zero", "got '2'"),
        (None, "cpu", "pipelines[0].stages[0].offload", "must be one of none, optimizer, all, got 'cpu'"),
    ],
)
def test_bad_zero_or_offload_names_the_field_and_value(zero, offload, field, words):
    with pytest.raises(SpecError) as e:
        load_config(_plan(zero=zero, offload=offload))
    assert e.value.field == field and words in e.value.rule


def test_zero_with_one_replica_is_allowed_and_describe_says_it_does_nothing():
    one = load_config(_plan(zero=3, replicas=1))
    one.validate(load_cluster("cpu-2"), load_model("tiny"))  # not rejected
    assert "zero 3 with one replica does nothing" in one.describe()
    two = load_config(_plan(zero=3, offload="all"))
    assert "zero=3" in two.describe() and "off=all" in two.describe() and "note" not in two.describe()


def test_measurement_carries_host_memory_only_when_set():
    m = Measurement(1.0, 1.0, False, host_memory_GiB={"box": 12.5})
    assert Measurement.from_dict(m.to_dict()).host_memory_GiB == {"box": 12.5}
    assert "host_memory_GiB" not in Measurement(1.0, 1.0, False).to_dict()
