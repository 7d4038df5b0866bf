"""The bad-input cases of the file formats, shared by the specs' unit tests and the CLI's error tests:
each an input and the rule its one-line error must name."""

from __future__ import annotations

import json

SPEC_CLUSTER = """
name: mixed-a100-v100
nodes:
  - name: a100
    gpu: A100-80GB
    count: 4
    intra_node: {bandwidth_GBps: 300, latency_us: 2}
  - name: v100
    gpu: {name: V100-32GB, peak_tflops: 125, memory_GiB: 32, memory_bandwidth_GBps: 900}
    count: 4
    intra_node: {bandwidth_GBps: 16, latency_us: 5}
network: {bandwidth_GBps: 12.5, latency_us: 10}
"""


SPEC_CONFIG = {
    "micro_batch_size": 2,
    "schedule": "1f1b",
    "pipelines": [
        {
            "num_microbatches": 64,
            "stages": [
                {"devices": ["a100:0", "a100:1"], "layers": 20, "recompute": False},
                {"devices": ["v100:0", "v100:1", "v100:2", "v100:3"], "layers": 12, "recompute": True},
            ],
        }
    ],
}


def bad_config(**changes) -> dict:
    cfg = json.loads(json.dumps(SPEC_CONFIG))
    for path, value in changes.items():
        target = cfg
        keys = path.split(".")
        for k in keys[:-1]:
            target = target[int(k)] if k.isdigit() else target[k]
        last = keys[-1]
        target[int(last) if last.isdigit() else last] = value
    return cfg


CONFIG_RULES = [
    (dict(**{"pipelines.0.stages.0.layers": 19}), "layers sum to 31"),
    (dict(**{"pipelines.0.stages.1.devices": ["a100:0", "v100:1"]}), "used more than once"),
    (dict(**{"pipelines.0.stages.1.devices": ["v100:9"]}), "unknown device id 'v100:9'"),
    (dict(**{"pipelines.0.num_microbatches": 63}), "global_batch_size is 128"),
    (dict(schedule="zigzag"), "schedule: must be one of"),
    (dict(micro_batch_size=0), "micro_batch_size: must be > 0"),
    (dict(**{"pipelines.0.stages.1.devices": ["v100:0", "v100:1", "v100:2"]}), "tensor-parallel degree 3"),
    (dict(virtual_stages=2), "virtual_stages: only applies to interleaved-1f1b"),
    (dict(**{"pipelines.0.stages.0.speed": 3}), "speed: unknown field"),
]


CLUSTER_RULES = [
    ("nodes: []\nnetwork: {bandwidth_GBps: 1}", "nodes: is required and must be a non-empty list"),
    ("nodes:\n  - {name: a, gpu: B200, count: 1}\nnetwork: {bandwidth_GBps: 1}", "nodes[0].gpu: unknown GPU 'B200'"),
    ("nodes:\n  - {name: a, gpu: T4, count: 0}\nnetwork: {bandwidth_GBps: 1}", "nodes[0].count: must be > 0"),
    ("nodes:\n  - {name: a, gpu: T4, count: 1}\nnetwork: {bandwidth_GBps: -3}", "network.bandwidth_GBps: must be > 0"),
    ("nodes:\n  - {name: a, gpu: T4, count: 1}", "network: is required"),
    ("nodes:\n  - {name: a, gpu: T4, count: 1, slowdown: 2}\nnetwork: {bandwidth_GBps: 1}", "CPU emulation only"),
    (
        "nodes:\n  - {name: a, gpu: T4, count: 1}\n  - {name: a, gpu: T4, count: 1}\nnetwork: {bandwidth_GBps: 1}",
        "used twice",
    ),
    ("nodes: [ {name: a", "invalid YAML"),
    ("- 1\n- 2", "must be a mapping at the top level"),
    (
        "nodes:\n  - {name: a, gpu: T4, count: 1, colour: red}\nnetwork: {bandwidth_GBps: 1}",
        "nodes[0].colour: unknown field",
    ),
]


MODEL_RULES = [
    (
        "num_layers: 2\nhidden_size: 65\nnum_heads: 4\nffn_hidden_size: 8\nvocab_size: 8\nseq_len: 8\nglobal_batch_size: 1",
        "hidden_size: must be divisible by num_heads",
    ),
    (
        "num_layers: 2\nhidden_size: 64\nnum_heads: 4\nffn_hidden_size: 8\nvocab_size: 8\nseq_len: 8",
        "global_batch_size: is required",
    ),
    (
        "num_layers: 2\nhidden_size: 64\nnum_heads: 4\nffn_hidden_size: 8\nvocab_size: 8\nseq_len: 8\nglobal_batch_size: 1\nmlp: relu",
        "mlp: must be one of",
    ),
    (
        "num_layers: 2\nhidden_size: 64\nnum_heads: 4\nnum_kv_heads: 3\nffn_hidden_size: 8\nvocab_size: 8\nseq_len: 8\nglobal_batch_size: 1",
        "num_kv_heads: must divide num_heads",
    ),
    (
        "num_layers: 2.5\nhidden_size: 64\nnum_heads: 4\nffn_hidden_size: 8\nvocab_size: 8\nseq_len: 8\nglobal_batch_size: 1",
        "num_layers: must be an integer",
    ),
]
