"""Simulated vs published: ZeRO memory per device and ZeRO-Offload on one V100.

1. ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
   Models", SC'20, arXiv:1910.02054): model-state memory per device of P_os, P_os+g, P_os+g+p (our
   zero 1, 2, 3) for 7.5B, 128B and 1T parameters at data-parallel degrees 1 to 1024 (their Table 1; the
   running example of their Fig. 1: 7.5B at N_d = 64: 120, 31.4, 16.6, 1.9 GB), against
   ``autotune.simulator.zero.model_state_bytes``. The published numbers are in GB (1e9 bytes), rounded
   as printed in the paper.

2. ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX
   ATC'21, arXiv:2101.06840), single V100-32GB of a DGX-2 (PCIe 3.0 x16 to the host, 1.5 TB of DRAM):
   - throughput: "40 TFlops/GPU on a single NVIDIA V100 GPU for 10B parameter model" (abstract). The
     10B configuration is DeepSpeed's ZeRO-Offload tutorial's (docs/_tutorials/zero-offload.md):
     Megatron GPT-2, 50 layers, hidden 4096, 32 heads, micro-batch 10, activation checkpointing,
     ZeRO stage 2 + offload_optimizer cpu; sequence 1024 and vocabulary 50257 (Megatron GPT-2
     defaults); the paper trains with a global batch of 512 by gradient accumulation, here 510
     (51 micro-batches of 10; 512 is not a multiple of 10). TFLOP/s counted with Megatron's formula
     (recomputation included), as the paper's Megatron-based numbers are;
   - model size: the largest model that trains on one 32 GB V100: 1.4B parameters with PyTorch (no
     offload), 13B with ZeRO-Offload (abstract and Sec. 6.2.1). Simulated: the largest GPT-2-shaped
     model (hidden 2048 without offload, 4096 with, more layers until it no longer fits, micro-batch 1,
     recomputation) that the simulator says fits.

Nothing is fitted here: simulator defaults, no calibration profile.

    .venv/bin/python experiments/fidelity/zero_offload.py
"""

from __future__ import annotations

import argparse

from autotune.loading import cluster_from_dict, model_from_dict
from autotune.simulator import Simulator
from autotune.simulator.flops import megatron_flops_per_iteration
from autotune.simulator.zero import model_state_bytes
from autotune.specs import ParallelConfig, PipelineConfig, StageConfig

# Rajbhandari et al. 2020, Table 1: GB per device (P_os, P_os+g, P_os+g+p) by DP degree, for 7.5B, 128B, 1T
ZERO_TABLE_1 = {
    1: ((120, 120, 120), (2048, 2048, 2048), (16000, 16000, 16000)),
    4: ((52.5, 41.3, 30), (896, 704, 512), (7000, 5500, 4000)),
    16: ((35.6, 21.6, 7.5), (608, 368, 128), (4750, 2875, 1000)),
    64: ((31.4, 16.6, 1.88), (536, 284, 32), (4187, 2218, 250)),
    256: ((30.4, 15.4, 0.47), (518, 263, 8), (4046, 2054, 62.5)),
    1024: ((30.1, 15.1, 0.12), (513, 257, 2), (4011, 2013, 15.6)),
}
SIZES = (7.5e9, 128e9, 1e12)

DGX2_V100 = {
    "name": "dgx2-1xV100",
    "nodes": [
        {
            "name": "dgx2",
            "gpu": "V100-32GB",
            "count": 1,
            "intra_node": {"bandwidth_GBps": 150, "latency_us": 5},
            "host": {"memory_GiB": 1397},
        }
    ],  # DGX-2: 1.5 TB DRAM; host link: the V100's PCIe 3.0 x16 (catalog)
    "network": {"bandwidth_GBps": 12.5},
}


def gpt2(layers: int, hidden: int, heads: int, batch: int, name: str) -> dict:
    return dict(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        ffn_hidden_size=4 * hidden,
        mlp="gelu",
        vocab_size=50257,
        seq_len=1024,
        global_batch_size=batch,
    )


def single_gpu_plan(layers: int, mbs: int, micro_batches: int, offload: str) -> ParallelConfig:
    return ParallelConfig(
        mbs,
        (PipelineConfig(micro_batches, (StageConfig(("dgx2:0",), layers, True, offload),)),),
        zero=2 if offload != "none" else 0,
    )


def relative(published: float, simulated: float) -> str:
    return f"{(simulated - published) / published:+.1%}"


def zero_memory() -> None:
    print("ZeRO (Rajbhandari et al. 2020), Table 1: model-state GB per device, simulated vs published")
    print(f"{'DP':>5s} {'model':>6s} | {'P_os':>16s} {'P_os+g':>16s} {'P_os+g+p':>16s}")
    worst, matched, total = 0.0, 0, 0
    for dp, rows in ZERO_TABLE_1.items():
        for psi, published in zip(SIZES, rows):
            cells = []
            for zero, pub in zip((1, 2, 3), published):
                sim = model_state_bytes(psi, dp, zero) / 1e9
                # the paper prints 3-4 significant digits, rounding some values and truncating others
                # (4187.5 -> 4187, 513.5 -> 513): a match is either at the printed digits
                decimals = len(repr(float(pub)).split(".")[1].rstrip("0"))
                unit = 10.0**-decimals
                ok = abs(sim - pub) <= unit / 2 + 1e-9 or 0 <= sim - pub < unit
                matched += ok
                total += 1
                worst = max(worst, abs(sim - pub) / pub)
                cells.append(f"{sim:8.4g}/{pub:<6g}{'' if ok else ' !'}")
            label = f"{psi / 1e9:g}B" if psi < 1e12 else "1T"
            print(f"{dp:5d} {label:>6s} | " + " ".join(f"{c:>16s}" for c in cells))
    print(
        f"{matched} of {total} cells equal the printed value at its printed digits (rounded or truncated); "
        f"largest relative difference {worst:.2%} (0.1172 printed as 0.12)"
    )
    fig1 = [round(model_state_bytes(7.5e9, 64, z) / 1e9, 1) for z in range(4)]
    print(f"Fig. 1 (7.5B, N_d = 64): simulated {fig1} GB, published [120, 31.4, 16.6, 1.9] GB\n")


def zero_offload() -> None:
    cluster = cluster_from_dict(DGX2_V100, "dgx2")
    print("ZeRO-Offload (Ren et al. 2021), one V100-32GB of a DGX-2, simulated vs published")
    model = model_from_dict(gpt2(50, 4096, 32, 510, "gpt2-10b"), "zero-offload 10B")
    m = Simulator(cluster, model, engine="deepspeed").evaluate(single_gpu_plan(50, 10, 51, "optimizer"))
    print(f"  10B GPT-2 (50 x 4096, {model.num_params / 1e9:.2f}B parameters), micro-batch 10, offload optimizer:")
    if m.ok:
        tflops = megatron_flops_per_iteration(model, recompute=True) / m.iteration_time_s / 1e12
        print(
            f"    {tflops:.1f} TFLOP/s simulated, 40 published ({relative(40, tflops)}); "
            f"device {m.peak_memory_GiB['dgx2:0']:.1f} GiB, host {m.host_memory_GiB['dgx2']:.0f} GiB, "
            f"iteration {m.iteration_time_s:.1f} s"
        )
    else:
        print(f"    does not run in the simulator: {m.error}")
    for mbs in (8, 4, 2):  # the largest micro-batch that fits in the simulator, batch 512
        m = Simulator(cluster, model.with_global_batch_size(512), engine="deepspeed").evaluate(
            single_gpu_plan(50, mbs, 512 // mbs, "optimizer")
        )
        if m.ok:
            tflops = (
                megatron_flops_per_iteration(model.with_global_batch_size(512), recompute=True)
                / m.iteration_time_s
                / 1e12
            )
            print(
                f"    largest micro-batch that fits simulated: {mbs}: {tflops:.1f} TFLOP/s "
                f"({relative(40, tflops)} from the published 40 at micro-batch 10); device "
                f"{m.peak_memory_GiB['dgx2:0']:.1f} GiB, host {m.host_memory_GiB['dgx2']:.0f} GiB"
            )
            break
    # the baseline of the same sentence: PyTorch alone, 1.4B parameters (shape not published: 26 x 2048
    # here, 1.41B in blocks and embedding, 1.51B with the untied LM head), the largest micro-batch that
    # fits, batch 512: isolates the simulator's compute-efficiency error from offload's terms
    small = model_from_dict(gpt2(26, 2048, 16, 512, "gpt2-1.4b"), "1.4B")
    for mbs in (16, 8, 4, 2, 1):
        mm = Simulator(cluster, small, engine="deepspeed").evaluate(single_gpu_plan(26, mbs, 512 // mbs, "none"))
        if mm.ok:
            tf_small = megatron_flops_per_iteration(small, recompute=True) / mm.iteration_time_s / 1e12
            print(
                f"  PyTorch alone, {small.num_params / 1e9:.2f}B (26 x 2048), micro-batch {mbs}, no offload: "
                f"{tf_small:.1f} TFLOP/s simulated, 30 published ({relative(30, tf_small)})"
            )
            if m.ok:
                print(
                    f"  offload's own share: simulated / published is {tflops / 40:.2f} for ZeRO-Offload 10B and "
                    f"{tf_small / 30:.2f} for PyTorch 1.4B (the simulator's V100 matmul rate, not offload, "
                    f"makes most of the gap)"
                )
            break
    base = Simulator(cluster, model, engine="deepspeed").evaluate(single_gpu_plan(50, 10, 51, "none"))
    print(f"    the same plan without offload: {base.status} ({base.error or 'fits'})")
    for offload, hidden, heads, published in (("none", 2048, 16, 1.4), ("optimizer", 4096, 32, 13.0)):
        largest = None
        for layers in range(1, 200):
            model = model_from_dict(gpt2(layers, hidden, heads, 8, "scan"), "scan")
            m = Simulator(cluster, model, engine="deepspeed").evaluate(single_gpu_plan(layers, 1, 8, offload))
            if not m.ok:
                break
            largest = (layers, model.num_params)
        if largest is None:
            print(f"  largest model, offload {offload}: none fits")
            continue
        layers, params = largest
        print(
            f"  largest model that fits, offload {offload:9s}: {params / 1e9:5.2f}B ({layers} x {hidden}) simulated, "
            f"{published:g}B published ({relative(published, params / 1e9)})"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the same tables (the whole run takes about a second)")
    ap.parse_args()
    zero_memory()
    zero_offload()


if __name__ == "__main__":
    main()
