"""FSDP plans as torchtitan publishes them (pytorch/torchtitan docs/performance.md and its H100 benchmark):
what ran in production must not be predicted out of memory, what ran out of memory must be."""

from __future__ import annotations

from autotune.catalog import GPU_CATALOG
from autotune.loading import cluster_from_dict, model_from_dict
from autotune.simulator import Simulator
from autotune.simulator.device_memory import device_memory
from autotune.specs import ParallelConfig

LLAMA3_8B = dict(
    num_layers=32,
    hidden_size=4096,
    num_heads=32,
    num_kv_heads=8,
    ffn_hidden_size=14336,
    vocab_size=128256,
    seq_len=8192,
)
LLAMA2_70B = dict(
    num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, ffn_hidden_size=28672, vocab_size=32000, seq_len=4096
)


def gpu(name: str, memory_GiB: float) -> dict:
    d = GPU_CATALOG[name]
    fields = ("peak_tflops", "peak_tflops_tf32", "peak_tflops_fp32", "memory_bandwidth_GBps", "pcie_gen")
    return {**{k: getattr(d, k) for k in fields}, "name": name, "memory_GiB": memory_GiB, "source": "test"}


def evaluate(device: dict, gpus: int, shape: dict, mbs: int, recompute):
    cluster = cluster_from_dict(
        {
            "name": "fsdp",
            "nodes": [
                {
                    "name": "n",
                    "gpu": device,
                    "count": 8,
                    "repeat": gpus // 8,
                    "intra_node": {"bandwidth_GBps": 300, "latency_us": 3},
                    "network": {"bandwidth_GBps": 200, "latency_us": 10},
                }
            ],
            "network": {"bandwidth_GBps": 200, "latency_us": 10},
        },
        "test",
    )
    model = model_from_dict(
        {"name": "m", **shape, "mlp": "swiglu", "global_batch_size": gpus * mbs, "precision": "bf16"}, "test"
    )
    plan = ParallelConfig.from_dict(
        {
            "micro_batch_size": mbs,
            "zero": 3,
            "pipelines": [
                {
                    "num_microbatches": 1,
                    "stages": [{"devices": [d], "layers": shape["num_layers"], "recompute": recompute}],
                }
                for d in cluster.device_ids()
            ],
        }
    )
    return Simulator(cluster, model, engine="torchtitan").evaluate(plan)  # torchtitan's loss (del pred)


def test_a_production_run_fits_a_device_with_10_percent_over_its_memory_reading() -> None:
    """torchtitan, Llama 3.1 8B, 8 H100, FSDP2, local batch 2, selective (op) checkpointing: 82.4 GiB
    reserved (the allocator's pool). A device of 1.1 x 82.4 GiB plus the CUDA context must fit it."""
    reading = 82.4
    m = evaluate(
        gpu("H100-80GB", 1.1 * reading + device_memory("H100-80GB").context_GiB), 8, LLAMA3_8B, 2, "selective-op"
    )
    assert m.ok, m.error


def test_the_published_out_of_memory_run_is_out_of_memory_and_its_neighbours_fit() -> None:
    """torchtitan, Llama 2 70B on 64 A100-80GB, FSDP2: local batch 1 with selective op checkpointing and
    local batch 2 with full checkpointing ran; local batch 2 with selective op ran out of memory."""
    a100 = gpu("A100-80GB", GPU_CATALOG["A100-80GB"].memory_GiB)
    assert evaluate(a100, 64, LLAMA2_70B, 1, "selective-op").ok
    assert evaluate(a100, 64, LLAMA2_70B, 2, True).ok
    assert evaluate(a100, 64, LLAMA2_70B, 2, "selective-op").oom
