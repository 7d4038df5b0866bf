"""Built-in GPU catalog, model presets and cluster presets.

Each GPU number is the vendor datasheet value: ``peak_tflops`` is dense (no sparsity) 16-bit tensor
throughput, ``peak_tflops_tf32`` dense TF32 tensor throughput (the FP32 rate on GPUs without TF32:
Volta, Turing), ``peak_tflops_fp32`` plain FP32, ``memory_GiB`` the datasheet capacity converted from GB
(1e9 bytes) to GiB, ``memory_bandwidth_GBps`` the datasheet memory bandwidth, ``pcie_gen`` /
``pcie_lanes`` the host interface (the default ``host.link`` of a node:
``autotune.specs.default_host_link``). The ``source`` field names the sheet.
"""

from __future__ import annotations

from autotune.specs import DeviceSpec

_GB_TO_GiB = 1e9 / 2**30


def _gb(gigabytes: float) -> float:
    return round(gigabytes * _GB_TO_GiB, 2)


GPU_CATALOG: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        # NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity -> 989 dense; TF32 989 sparse
        # -> 494 dense; FP32 67; 141 GB HBM3e; 4.8 TB/s
        DeviceSpec(
            "H200",
            peak_tflops=989.0,
            memory_GiB=_gb(141),
            memory_bandwidth_GBps=4800.0,
            peak_tflops_tf32=494.0,
            peak_tflops_fp32=67.0,
            source="NVIDIA H200 datasheet (SXM), dense BF16 / TF32, FP32; host: PCIe Gen5 x16 (datasheet: 128 GB/s)",
            pcie_gen=5,
        ),
        # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity -> 989 dense; TF32 989 sparse
        # -> 494 dense; FP32 67; 80 GB HBM3; 3.35 TB/s
        DeviceSpec(
            "H100-80GB",
            peak_tflops=989.0,
            memory_GiB=_gb(80),
            memory_bandwidth_GBps=3350.0,
            peak_tflops_tf32=494.0,
            peak_tflops_fp32=67.0,
            source="NVIDIA H100 datasheet (SXM5), dense BF16 / TF32, FP32; host: PCIe Gen5 x16 (datasheet: 128 GB/s)",
            pcie_gen=5,
        ),
        # NVIDIA GH200 Grace Hopper Superchip datasheet (H100 GPU with 96 GB HBM3, 4 TB/s): BF16 1,979 / TF32 989
        # TFLOPS with sparsity -> 989 / 494 dense; FP32 67
        DeviceSpec(
            "GH200",
            peak_tflops=989.0,
            memory_GiB=_gb(96),
            memory_bandwidth_GBps=4000.0,
            peak_tflops_tf32=494.0,
            peak_tflops_fp32=67.0,
            source="NVIDIA GH200 Grace Hopper Superchip datasheet (96 GB HBM3), dense BF16 / TF32, FP32; host: NVLink-C2C to Grace (900 GB/s; give host.link explicitly, the PCIe default is Gen5 x16)",
            pcie_gen=5,
        ),
        # NVIDIA A100 datasheet (SXM4 80GB): BF16 312 TFLOPS dense; TF32 156 dense; FP32 19.5; 80 GB HBM2e; 2,039 GB/s
        DeviceSpec(
            "A100-80GB",
            peak_tflops=312.0,
            memory_GiB=_gb(80),
            memory_bandwidth_GBps=2039.0,
            peak_tflops_tf32=156.0,
            peak_tflops_fp32=19.5,
            source="NVIDIA A100 datasheet (SXM4 80GB), dense BF16 / TF32, FP32; host: PCIe Gen4 x16 (datasheet: 64 GB/s)",
            pcie_gen=4,
        ),
        # NVIDIA A100 datasheet (SXM4 40GB): BF16 312 TFLOPS dense; TF32 156; FP32 19.5; 40 GB HBM2; 1,555 GB/s
        DeviceSpec(
            "A100-40GB",
            peak_tflops=312.0,
            memory_GiB=_gb(40),
            memory_bandwidth_GBps=1555.0,
            peak_tflops_tf32=156.0,
            peak_tflops_fp32=19.5,
            source="NVIDIA A100 datasheet (SXM4 40GB), dense BF16 / TF32, FP32; host: PCIe Gen4 x16 (datasheet: 64 GB/s)",
            pcie_gen=4,
        ),
        # NVIDIA A800 datasheet (SXM4 80GB; the A100 with NVLink limited to 400 GB/s): BF16 312 TFLOPS dense;
        # TF32 156; FP32 19.5; 80 GB HBM2e; 2,039 GB/s
        DeviceSpec(
            "A800-80GB",
            peak_tflops=312.0,
            memory_GiB=_gb(80),
            memory_bandwidth_GBps=2039.0,
            peak_tflops_tf32=156.0,
            peak_tflops_fp32=19.5,
            source="NVIDIA A800 datasheet (SXM4 80GB), dense BF16 / TF32, FP32; host: PCIe Gen4 x16 (datasheet: 64 GB/s)",
            pcie_gen=4,
        ),
        # NVIDIA V100 datasheet (SXM2 32GB): 125 TFLOPS tensor (FP16); no TF32; FP32 15.7; 32 GB HBM2; 900 GB/s
        DeviceSpec(
            "V100-32GB",
            peak_tflops=125.0,
            memory_GiB=_gb(32),
            memory_bandwidth_GBps=900.0,
            peak_tflops_tf32=15.7,
            peak_tflops_fp32=15.7,
            source="NVIDIA V100 datasheet (SXM2), FP16 tensor; FP32 (no TF32); host: PCIe Gen3 x16 (datasheet: 32 GB/s)",
            pcie_gen=3,
        ),
        # NVIDIA A10G (AWS EC2 G5 documentation): ~70 TFLOPS FP16 tensor dense; 24 GB GDDR6; 600 GB/s. FP32 31.2
        # from the NVIDIA A10 datasheet (same GA102 chip); TF32 35: half the 16-bit rate (the GA10x ratio)
        DeviceSpec(
            "A10G",
            peak_tflops=70.0,
            memory_GiB=_gb(24),
            memory_bandwidth_GBps=600.0,
            peak_tflops_tf32=35.0,
            peak_tflops_fp32=31.2,
            source="AWS EC2 G5 / NVIDIA A10G, FP16 tensor dense; A10 datasheet FP32; host: PCIe Gen4 x16 (NVIDIA A10 datasheet: 64 GB/s)",
            pcie_gen=4,
        ),
        # NVIDIA L4 datasheet: BF16 242 TFLOPS with sparsity -> 121 dense; TF32 120 sparse -> 60 dense; FP32 30.3;
        # 24 GB GDDR6; 300 GB/s
        DeviceSpec(
            "L4",
            peak_tflops=121.0,
            memory_GiB=_gb(24),
            memory_bandwidth_GBps=300.0,
            peak_tflops_tf32=60.0,
            peak_tflops_fp32=30.3,
            source="NVIDIA L4 datasheet, dense BF16 / TF32, FP32; host: PCIe Gen4 x16 (datasheet: 64 GB/s)",
            pcie_gen=4,
        ),
        # NVIDIA L40S datasheet: BF16 733 TFLOPS with sparsity -> 362 dense; TF32 366 sparse -> 183 dense; FP32 91.6;
        # 48 GB GDDR6; 864 GB/s
        DeviceSpec(
            "L40S",
            peak_tflops=362.0,
            memory_GiB=_gb(48),
            memory_bandwidth_GBps=864.0,
            peak_tflops_tf32=183.0,
            peak_tflops_fp32=91.6,
            source="NVIDIA L40S datasheet, dense BF16 / TF32, FP32; host: PCIe Gen4 x16 (datasheet: 64 GB/s)",
            pcie_gen=4,
        ),
        # NVIDIA T4 datasheet: 65 TFLOPS mixed precision (FP16/FP32); no TF32; FP32 8.1; 16 GB GDDR6; 320 GB/s
        DeviceSpec(
            "T4",
            peak_tflops=65.0,
            memory_GiB=_gb(16),
            memory_bandwidth_GBps=320.0,
            peak_tflops_tf32=8.1,
            peak_tflops_fp32=8.1,
            source="NVIDIA T4 datasheet, FP16 mixed precision; FP32 (no TF32); host: PCIe Gen3 x16 (datasheet: 32 GB/s)",
            pcie_gen=3,
        ),
        # NVIDIA Ada GPU architecture whitepaper (RTX 4090): FP16 tensor, FP32 accumulate 165.2 dense; TF32 82.6 dense;
        # FP32 82.6; 24 GB GDDR6X; 1,008 GB/s
        DeviceSpec(
            "RTX-4090",
            peak_tflops=165.2,
            memory_GiB=_gb(24),
            memory_bandwidth_GBps=1008.0,
            peak_tflops_tf32=82.6,
            peak_tflops_fp32=82.6,
            source="NVIDIA Ada whitepaper (RTX 4090), FP16 tensor FP32-accumulate dense; TF32, FP32; host: PCIe Gen4 x16 (GeForce RTX 4090 specifications)",
            pcie_gen=4,
        ),
        # NVIDIA Ampere GA102 whitepaper (RTX 3090): FP16 tensor 71 TFLOPS dense (FP16 accumulate); TF32 35.6 dense;
        # FP32 35.6; 24 GB GDDR6X; 936 GB/s
        DeviceSpec(
            "RTX-3090",
            peak_tflops=71.0,
            memory_GiB=_gb(24),
            memory_bandwidth_GBps=936.0,
            peak_tflops_tf32=35.6,
            peak_tflops_fp32=35.6,
            source="NVIDIA GA102 whitepaper (RTX 3090), FP16 tensor dense; TF32, FP32; host: PCIe Gen4 x16 (GeForce RTX 3090 specifications)",
            pcie_gen=4,
        ),
        # NVIDIA RTX A6000 datasheet: 309.7 TFLOPS tensor with sparsity -> 154.8 dense; FP32 38.7; 48 GB GDDR6;
        # 768 GB/s. TF32 77.4 dense: half the FP16 rate (GA102 whitepaper ratio for the professional cards)
        DeviceSpec(
            "A6000",
            peak_tflops=154.8,
            memory_GiB=_gb(48),
            memory_bandwidth_GBps=768.0,
            peak_tflops_tf32=77.4,
            peak_tflops_fp32=38.7,
            source="NVIDIA RTX A6000 datasheet, dense FP16 tensor, FP32; TF32 from the GA102 ratio; host: PCIe Gen4 x16 (datasheet: 64 GB/s)",
            pcie_gen=4,
        ),
        # NVIDIA Turing architecture whitepaper (Titan RTX): 130.5 TFLOPS FP16 tensor with FP32 accumulate (full rate
        # on Titan); no TF32, no BF16; FP32 16.3; 24 GB GDDR6; 672 GB/s
        DeviceSpec(
            "TITAN-RTX",
            peak_tflops=130.5,
            memory_GiB=_gb(24),
            memory_bandwidth_GBps=672.0,
            peak_tflops_tf32=16.3,
            peak_tflops_fp32=16.3,
            source="NVIDIA Turing whitepaper (TITAN RTX), FP16 tensor FP32-accumulate; FP32 (no TF32); host: PCIe Gen3 x16",
            pcie_gen=3,
        ),
        # NVIDIA Turing architecture whitepaper, Appendix A (GeForce RTX 2080 Ti reference board): FP16 tensor with FP32
        # accumulate 53.8 TFLOPS (107.6 with FP16 accumulate; training GEMMs accumulate in FP32); no TF32, no BF16;
        # FP32 13.4; 11 GB GDDR6; 616 GB/s
        DeviceSpec(
            "RTX-2080-Ti",
            peak_tflops=53.8,
            memory_GiB=_gb(11),
            memory_bandwidth_GBps=616.0,
            peak_tflops_tf32=13.4,
            peak_tflops_fp32=13.4,
            source="NVIDIA Turing whitepaper (RTX 2080 Ti reference), FP16 tensor FP32-accumulate; FP32; host: PCIe Gen3 x16",
            pcie_gen=3,
        ),
        # NVIDIA Turing architecture whitepaper, Appendix A (GeForce RTX 2080 reference board): FP16 tensor with FP32
        # accumulate 40.3 TFLOPS (80.5 with FP16 accumulate); no TF32, no BF16; FP32 10.1; 8 GB GDDR6; 448 GB/s
        DeviceSpec(
            "RTX-2080",
            peak_tflops=40.3,
            memory_GiB=_gb(8),
            memory_bandwidth_GBps=448.0,
            peak_tflops_tf32=10.1,
            peak_tflops_fp32=10.1,
            source="NVIDIA Turing whitepaper (RTX 2080 reference), FP16 tensor FP32-accumulate; FP32; host: PCIe Gen3 x16",
            pcie_gen=3,
        ),
        # One core of this kind of host, used by the CPU runner: AVX2 2 FMA units x 8 fp32 lanes x 2 flop x ~3 GHz
        # = ~0.096 TFLOPS fp32 nominal (every precision: the CPU runner computes in fp32); memory is what a rank may
        # use here. Calibrate with `autotune profile`.
        DeviceSpec(
            "cpu",
            peak_tflops=0.096,
            memory_GiB=8.0,
            memory_bandwidth_GBps=20.0,
            peak_tflops_tf32=0.096,
            peak_tflops_fp32=0.096,
            source="nominal one x86-64 AVX2 core (fp32); replace with `autotune profile`; host: no PCIe, its own memory",
            pcie_gen=0,
        ),
    )
}

# Model presets. Shapes from the papers / model cards named beside each.
MODEL_PRESETS: dict[str, dict] = {
    # Small enough to train on a CPU in seconds (tests, runner equivalence).
    "tiny": dict(
        num_layers=4,
        hidden_size=64,
        num_heads=4,
        ffn_hidden_size=256,
        mlp="gelu",
        vocab_size=256,
        seq_len=64,
        global_batch_size=8,
    ),
    # A little bigger than tiny, for the calibration fidelity experiment on CPU ranks.
    "small": dict(
        num_layers=8,
        hidden_size=256,
        num_heads=8,
        ffn_hidden_size=1024,
        mlp="gelu",
        vocab_size=256,
        seq_len=128,
        global_batch_size=16,
    ),
    # Radford et al. 2019 (GPT-2) table 2: 117M / 1.5B
    "gpt2-small": dict(
        num_layers=12,
        hidden_size=768,
        num_heads=12,
        ffn_hidden_size=3072,
        mlp="gelu",
        vocab_size=50257,
        seq_len=1024,
        global_batch_size=512,
    ),
    "gpt2-xl": dict(
        num_layers=48,
        hidden_size=1600,
        num_heads=25,
        ffn_hidden_size=6400,
        mlp="gelu",
        vocab_size=50257,
        seq_len=1024,
        global_batch_size=512,
    ),
    # Touvron et al. 2023 (Llama 2) table 1 and the released configs
    "llama2-7b": dict(
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        ffn_hidden_size=11008,
        mlp="swiglu",
        vocab_size=32000,
        seq_len=4096,
        global_batch_size=512,
        rms_norm_eps=1e-5,
    ),
    "llama2-13b": dict(
        num_layers=40,
        hidden_size=5120,
        num_heads=40,
        ffn_hidden_size=13824,
        mlp="swiglu",
        vocab_size=32000,
        seq_len=4096,
        global_batch_size=512,
        rms_norm_eps=1e-5,
    ),
    "llama2-70b": dict(
        num_layers=80,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=8,
        ffn_hidden_size=28672,
        mlp="swiglu",
        vocab_size=32000,
        seq_len=4096,
        global_batch_size=1024,
        rms_norm_eps=1e-5,
    ),
    # Meta Llama 3 8B model card / config.json
    "llama3-8b": dict(
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        ffn_hidden_size=14336,
        mlp="swiglu",
        vocab_size=128256,
        seq_len=8192,
        global_batch_size=512,
        rms_norm_eps=1e-5,
        rope_theta=500_000.0,
    ),
    # Qwen/Qwen3-1.7B config.json: hidden 2048, 28 layers, 16 heads, 8 kv heads, intermediate 6144, vocab 151936
    # (RoundPipe's published 8 x RTX-4090 runs; tied embeddings are not modelled: one more 311M-parameter
    # matrix is counted)
    "qwen3-1.7b": dict(
        num_layers=28,
        hidden_size=2048,
        num_heads=16,
        num_kv_heads=8,
        ffn_hidden_size=6144,
        mlp="swiglu",
        vocab_size=151936,
        seq_len=4096,
        global_batch_size=64,
    ),
    # Qwen/Qwen3-32B config.json: hidden 5120, 64 layers, 64 heads, 8 kv heads, intermediate 25600, vocab 151936
    "qwen3-32b": dict(
        num_layers=64,
        hidden_size=5120,
        num_heads=64,
        num_kv_heads=8,
        ffn_hidden_size=25600,
        mlp="swiglu",
        vocab_size=151936,
        seq_len=4096,
        global_batch_size=64,
    ),
    # -- mixture of experts --------------------------------------------------------------------------
    # A tiny MoE for the CPU runner (tests, equivalence): 4 experts of width 128, top-2, in every block.
    "tiny-moe": dict(
        num_layers=4,
        hidden_size=64,
        num_heads=4,
        ffn_hidden_size=256,
        mlp="gelu",
        vocab_size=256,
        seq_len=64,
        global_batch_size=8,
        num_experts=4,
        experts_per_token=2,
        expert_ffn_hidden_size=128,
    ),
    # Jiang et al. 2024, "Mixtral of Experts", Table 1: dim 4096, 32 layers, 32 heads, 8 kv heads,
    # hidden_dim 14336, vocab 32000, 8 experts, top-2 (published: 46.7B total, 12.9B active parameters).
    # Not from the paper: seq_len 4096 (its context is 32768; we train at 4096 like the Llama presets) and
    # global_batch_size 512 (not published).
    "mixtral-8x7b": dict(
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        ffn_hidden_size=14336,
        mlp="swiglu",
        vocab_size=32000,
        seq_len=4096,
        global_batch_size=512,
        num_experts=8,
        experts_per_token=2,
        expert_ffn_hidden_size=14336,
        rms_norm_eps=1e-5,
        rope_theta=1_000_000.0,
    ),
    # SPES-2B (Zhang et al. 2026, arXiv 2602.11543, "Pretraining A Large Language Model using Distributed
    # GPUs"; github.com/zjr2000/SPES): an OLMoE-architecture MoE trained on 16 standalone 48 GB L40S GPUs.
    # The 2B model's own config is not in the material we could reach (paper body, repository configs,
    # model card); the repository publishes its 1B sibling (configs/spes_experiments/spes_moe_1b_*:
    # d_model 768, 12 heads, 12 layers, SwiGLU, 16 experts, top-2, mlp_hidden_size 4096 i.e. 2048 per
    # expert after OLMo's SwiGLU halving, vocab 151665 (Qwen2.5 tokenizer), untied embeddings, sequence
    # length 2048, global_train_batch_size 1024). Our choice: that shape with experts twice as wide
    # (4096), which gives 2.07B parameters ("2B"; 0.49B active) and matches the memory the paper's
    # reviewers quote (about 55 GB per GPU centrally, about 35 GB under SPES: the 20 GB difference is
    # the optimizer state of the 15/16 experts a node does not train). global_batch_size 1024: the 1B
    # config's value.
    "spes-2b": dict(
        num_layers=12,
        hidden_size=768,
        num_heads=12,
        ffn_hidden_size=4096,
        mlp="swiglu",
        vocab_size=151665,
        seq_len=2048,
        global_batch_size=1024,
        num_experts=16,
        experts_per_token=2,
        expert_ffn_hidden_size=4096,
    ),
}

# Cluster presets, in the cluster-file format of SPEC.md.
CLUSTER_PRESETS: dict[str, dict] = {
    # The SPEC.md example: 4 A100 on NVLink beside 4 V100 on PCIe, joined by 100 Gbit/s Ethernet.
    "mixed-a100-v100": dict(
        nodes=[
            dict(name="a100", gpu="A100-80GB", count=4, intra_node=dict(bandwidth_GBps=300, latency_us=2)),
            dict(name="v100", gpu="V100-32GB", count=4, intra_node=dict(bandwidth_GBps=16, latency_us=5)),
        ],
        network=dict(bandwidth_GBps=12.5, latency_us=10),
    ),
    # Two H100 nodes and two A100 nodes, 8 GPUs each, 200 Gbit/s between nodes.
    "mixed-h100-a100-32": dict(
        nodes=[
            dict(name="h100", gpu="H100-80GB", count=8, repeat=2, intra_node=dict(bandwidth_GBps=450, latency_us=2)),
            dict(name="a100", gpu="A100-40GB", count=8, repeat=2, intra_node=dict(bandwidth_GBps=300, latency_us=2)),
        ],
        network=dict(bandwidth_GBps=25, latency_us=10),
    ),
    # Consumer cards on PCIe beside a datacenter node, 10 Gbit/s Ethernet.
    "mixed-consumer-16": dict(
        nodes=[
            dict(name="a100", gpu="A100-80GB", count=8, intra_node=dict(bandwidth_GBps=300, latency_us=2)),
            dict(name="rtx", gpu="RTX-4090", count=4, repeat=2, intra_node=dict(bandwidth_GBps=16, latency_us=5)),
        ],
        network=dict(bandwidth_GBps=1.25, latency_us=30),
    ),
    # This machine: two CPU ranks, one of them emulated 2x slower (runner testing).
    "cpu-2": dict(
        nodes=[dict(name="cpu", gpu="cpu", count=2, intra_node=dict(bandwidth_GBps=5, latency_us=20))],
        network=dict(bandwidth_GBps=5, latency_us=20),
    ),
    "cpu-4": dict(
        nodes=[dict(name="cpu", gpu="cpu", count=4, intra_node=dict(bandwidth_GBps=5, latency_us=20))],
        network=dict(bandwidth_GBps=5, latency_us=20),
    ),
    "cpu-hetero": dict(
        nodes=[
            dict(name="fast", gpu="cpu", count=2, intra_node=dict(bandwidth_GBps=5, latency_us=20)),
            dict(name="slow", gpu="cpu", count=2, slowdown=2.0, intra_node=dict(bandwidth_GBps=5, latency_us=20)),
        ],
        network=dict(bandwidth_GBps=5, latency_us=20),
    ),
}
