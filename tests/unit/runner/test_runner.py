"""Runner pieces that need no process group: rank layout, model construction and splitting, data, job files."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from autotune import SpecError, load_cluster, load_model
from autotune.loading import cluster_from_dict
from autotune.specs import ModelSpec, ParallelConfig
from runner.data import TokenSource
from runner.jobs import cluster_to_dict, preflight, uses_cuda
from runner.layout import build_layout, splits_differ
from runner.model import StageChunk, build_full_model, lm_loss

torch.set_num_threads(1)


def cfg(pipelines, mbs=1, **kw) -> ParallelConfig:
    return ParallelConfig.from_dict({"micro_batch_size": mbs, "pipelines": pipelines, **kw})


def stage(devices, layers, recompute=False):
    return {"devices": devices, "layers": layers, "recompute": recompute}


TWO_BY_TWO = cfg(
    [
        {"num_microbatches": 5, "stages": [stage(["cpu:0"], 3), stage(["cpu:1"], 1)]},
        {"num_microbatches": 3, "stages": [stage(["cpu:2"], 1), stage(["cpu:3"], 3)]},
    ]
)


def test_ranks_follow_config_device_order_and_batch_shares():
    layout = build_layout(load_cluster("cpu-4"), load_model("tiny"), TWO_BY_TWO)
    assert [r.device_id for r in layout.ranks] == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert [r.chunks[0].layers for r in layout.ranks] == [(0, 1, 2), (3,), (0,), (1, 2, 3)]
    assert [(r.batch_offset, r.batch_size) for r in layout.ranks] == [(0, 5), (0, 5), (5, 3), (5, 3)]
    assert [r.grad_weight for r in layout.ranks] == [5 / 8, 5 / 8, 3 / 8, 3 / 8]
    assert layout.pipeline_groups() == ((0, 1), (2, 3))


def test_grad_groups_are_exactly_the_holders_of_each_weight():
    groups = build_layout(load_cluster("cpu-4"), load_model("tiny"), TWO_BY_TWO).grad_groups()
    # layer 0 + embedding on ranks 0 and 2; layers 1, 2 on 0 and 3; layer 3 + head on 1 and 3
    assert groups == {(0, 2): ("embed", "layer0"), (0, 3): ("layer1", "layer2"), (1, 3): ("layer3", "head")}


def test_interleaved_chunks_are_placed_megatron_style():
    config = cfg(
        [{"num_microbatches": 4, "stages": [stage(["cpu:0"], 2), stage(["cpu:1"], 2)]}],
        mbs=2,
        schedule="interleaved-1f1b",
        virtual_stages=2,
    )
    r0, r1 = build_layout(load_cluster("cpu-2"), load_model("tiny"), config).ranks
    assert [(c.stage_index, c.layers) for c in r0.chunks] == [(0, (0,)), (2, (2,))]
    assert [(c.stage_index, c.layers) for c in r1.chunks] == [(1, (1,)), (3, (3,))]
    assert r0.first and not r0.last and r1.last


def test_unsupported_and_invalid_plans_raise_spec_errors():
    tiny = load_model("tiny")
    with pytest.raises(SpecError, match="layers sum to 3"):
        build_layout(load_cluster("cpu-2"), tiny, cfg([{"num_microbatches": 8, "stages": [stage(["cpu:0"], 3)]}]))
    mixed_tp = cfg([{"num_microbatches": 8, "stages": [stage(["cpu:0", "cpu:1"], 2), stage(["cpu:2"], 2)]}])
    assert build_layout(load_cluster("cpu-4"), tiny, mixed_tp).mixed  # runs on runner.mixed's hand-offs
    interleaved = ParallelConfig.from_dict({**mixed_tp.to_dict(), "schedule": "interleaved-1f1b", "virtual_stages": 2})
    assert build_layout(load_cluster("cpu-4"), tiny, interleaved).mixed  # runner.mixed runs Megatron's order
    # replicas at tp 4 and tp 2 over a vocabulary 4 does not divide: one splits the head, the other not
    nodes = [{"name": "cpu", "gpu": "cpu", "count": 6}]
    six = cluster_from_dict({"name": "six", "nodes": nodes, "network": {"bandwidth_GBps": 5}}, "test")
    split = cfg(
        [
            {"num_microbatches": 4, "stages": [stage([f"cpu:{i}" for i in range(4)], 4)]},
            {"num_microbatches": 4, "stages": [stage(["cpu:4", "cpu:5"], 4)]},
        ]
    )
    with pytest.raises(SpecError, match=r"some of which divide the vocabulary \(258\)"):
        build_layout(six, replace(tiny, vocab_size=258), split)
    assert build_layout(six, tiny, split).resharded()  # 256: both split it, part by part
    tp2 = cfg([{"num_microbatches": 8, "stages": [stage(["cpu:0", "cpu:1"], 4)]}])
    with pytest.raises(SpecError, match="qk_norm with tensor parallelism is not run by the runner"):
        preflight(load_cluster("cpu-2"), replace(tiny, qk_norm=True), tp2)


def test_gpu_plan_without_cuda_is_a_clear_error():
    cluster = load_cluster("mixed-a100-v100")
    config = cfg([{"num_microbatches": 8, "stages": [stage(["a100:0"], 4)]}])
    with pytest.raises(SpecError, match="has GPU devices .A100-80GB. but this machine has no CUDA; use a cpu cluster"):
        uses_cuda(cluster, config, cuda_available=False)
    assert uses_cuda(cluster, config, cuda_available=True)
    assert not uses_cuda(load_cluster("cpu-2"), cfg([{"num_microbatches": 8, "stages": [stage(["cpu:0"], 4)]}]), False)


def test_cluster_round_trips_through_job_dict():
    cluster = load_cluster("cpu-hetero")
    assert cluster_from_dict(cluster_to_dict(cluster), "job") == cluster


@pytest.mark.parametrize("split", [(4,), (1, 3), (2, 2), (1, 1, 1, 1)])
def test_layer_weights_do_not_depend_on_the_split(split):
    spec = load_model("tiny")
    full = dict(build_full_model(spec, seed=3).named_parameters())
    start = 0
    for s, n in enumerate(split):
        chunk = StageChunk(spec, range(start, start + n), first=s == 0, last=s == len(split) - 1, seed=3)
        for name, p in chunk.named_parameters():
            assert torch.equal(p, full[name]), name
        start += n


def test_split_forward_equals_full_forward_swiglu_gqa_recompute():
    spec = ModelSpec(
        "llama-ish",
        num_layers=3,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=48,
        vocab_size=64,
        seq_len=8,
        global_batch_size=2,
        mlp="swiglu",
    )
    x = torch.randint(0, 64, (2, 8))
    full = build_full_model(spec, seed=0)
    a = StageChunk(spec, [0], first=True, last=False, seed=0)
    b = StageChunk(spec, [1, 2], first=False, last=True, seed=0, recompute=True)
    assert b.blocks["1"].mlp.swiglu and b.blocks["1"].attn.k_proj.out_features == 16  # GQA: 2 kv heads x 8
    torch.testing.assert_close(b(a(x)), full(x), rtol=0, atol=0)
    loss = lm_loss(b(a(x)), torch.randint(0, 64, (2, 8)))
    loss.backward()
    assert all(p.grad is not None for p in b.parameters())


def test_model_is_causal():
    spec = load_model("tiny")
    model = build_full_model(spec, 0)
    x = torch.randint(0, spec.vocab_size, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % spec.vocab_size
    torch.testing.assert_close(model(x)[0, :10], model(y)[0, :10])


def test_data_is_deterministic_per_step_and_sliced_per_pipeline(tmp_path):
    spec = load_model("tiny")
    a, b = TokenSource(spec, seed=1), TokenSource(spec, seed=1)
    assert torch.equal(a.global_batch(7), b.global_batch(7))
    assert not torch.equal(a.global_batch(7), a.global_batch(8))
    x, y = a.pipeline_batch(7, 5, 3)
    rows = a.global_batch(7)[5:8]
    assert torch.equal(x, rows[:, :-1]) and torch.equal(y, rows[:, 1:]) and x.shape == (3, spec.seq_len)
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 4)
    batch = TokenSource(spec, 0, text).global_batch(0)
    assert batch.shape == (spec.global_batch_size, spec.seq_len + 1) and int(batch.max()) < 256
    small_vocab = ModelSpec("v", 1, 16, 2, 32, vocab_size=100, seq_len=8, global_batch_size=2)
    with pytest.raises(SpecError, match="vocab_size >= 256"):
        TokenSource(small_vocab, 0, text)


def test_torchrun_command_standalone_or_multi_node(tmp_path):
    from runner.train import torchrun_command

    cmd = torchrun_command(4, tmp_path / "job.json", [])
    assert cmd[1:] == [
        "-m",
        "runner.torchrun",
        "--standalone",
        "--nproc-per-node",
        "4",
        "--log-dir",
        str(tmp_path / "torchrun"),
        "-m",
        "runner.worker",
        str(tmp_path / "job.json"),
    ]
    assert torchrun_command(2, tmp_path / "j", ["--log-dir", "/x"]).count("--log-dir") == 1
    multi = torchrun_command(
        8,
        tmp_path / "j",
        ["--nnodes", "2", "--nproc-per-node", "4", "--rdzv-endpoint=host:29500", "--rdzv-backend", "c10d"],
    )
    assert "--standalone" not in multi and multi.count("--nproc-per-node") == 1
    with pytest.raises(SpecError, match="--nproc-per-node: is required with multi-node flags"):
        torchrun_command(8, tmp_path / "j", ["--nnodes=2"])


def test_summarize_readings_into_a_measurement():
    from runner.profile import summarize

    cluster, tiny = load_cluster("cpu-4"), load_model("tiny")
    r = [  # replica 0: 2 stages, replica 1: 2 stages; replica 1's stage 1 is the slowest stage
        dict(
            rank=0,
            device="cpu:0",
            pipeline=0,
            stage=0,
            forward_s=0.01,
            backward_s=0.02,
            iteration_time_s=0.10,
            peak_memory_GiB=0.5,
            timeline=[("F0", 0.0, 0.01), ("B0", 0.02, 0.04)],
        ),
        dict(
            rank=1,
            device="cpu:1",
            pipeline=0,
            stage=1,
            forward_s=0.01,
            backward_s=0.02,
            iteration_time_s=0.10,
            peak_memory_GiB=0.5,
            timeline=[("F0", 0.01, 0.02)],
        ),
        dict(
            rank=2,
            device="cpu:2",
            pipeline=1,
            stage=0,
            forward_s=0.01,
            backward_s=0.02,
            iteration_time_s=0.12,
            peak_memory_GiB=0.5,
        ),
        dict(
            rank=3,
            device="cpu:3",
            pipeline=1,
            stage=1,
            forward_s=0.03,
            backward_s=0.05,
            iteration_time_s=0.11,
            peak_memory_GiB=9.0,
        ),
    ]
    m = summarize(r, cluster, tiny, TWO_BY_TWO)
    assert m.iteration_time_s == 0.12  # the slowest rank
    assert m.tokens_per_s == pytest.approx(8 * 64 / 0.12)
    assert m.stage_busy_s == pytest.approx((0.03, 0.08))  # replica 1
    assert m.bubble_fraction == pytest.approx(1 - (0.03 * 3 + 0.08) / 0.12 / 4)
    assert m.oom and m.status == "oom" and "cpu:3 used 9.00 GiB, more than its 8.00 GiB" in m.error
    assert [(e.device, e.op) for e in m.timeline] == [("cpu:0", "F0"), ("cpu:1", "F0"), ("cpu:0", "B0")]


def test_real_evaluator_check_names_plans_the_runner_cannot_run_without_launching():
    """The search asks ``check`` before spending a real run: unsupported shapes are answered at once."""
    from autotune.planning.budget import BudgetedEvaluator
    from autotune.planning.space import SearchSpace
    from runner import RealEvaluator

    real = RealEvaluator("cpu-4", replace(load_model("tiny"), qk_norm=True))
    one_microbatch = ParallelConfig.from_dict(
        {
            "micro_batch_size": 8,
            "schedule": "1f1b",
            "pipelines": [
                {
                    "num_microbatches": 1,
                    "stages": [{"devices": ["cpu:0"], "layers": 2}, {"devices": ["cpu:1"], "layers": 2}],
                }
            ],
        }
    )
    mixed_tp = ParallelConfig.from_dict(  # tensor parallelism with qk_norm: not run by the runner
        {
            "micro_batch_size": 2,
            "pipelines": [{"num_microbatches": 4, "stages": [{"devices": ["cpu:0", "cpu:1"], "layers": 4}]}],
        }
    )
    fine = ParallelConfig.from_dict(
        {
            "micro_batch_size": 2,
            "pipelines": [
                {
                    "num_microbatches": 4,
                    "stages": [{"devices": ["cpu:0"], "layers": 2}, {"devices": ["cpu:1"], "layers": 2}],
                }
            ],
        }
    )
    assert "needs at least as many micro-batches as stages: 1 < 2" in real.check(one_microbatch)
    assert "qk_norm with tensor parallelism is not run by the runner" in real.check(mixed_tp)
    assert real.check(fine) is None

    budgeted = BudgetedEvaluator(real, SearchSpace(real.cluster, real.model), budget=2)
    for plan in (one_microbatch, mixed_tp):
        m = budgeted.evaluate(plan)
        assert m.status == "invalid" and m.score() == 0.0
    assert budgeted.used == 0 and budgeted.invalid == 2


def test_chunks_under_bf16_autocast_hand_on_fp32_as_the_pipeline_metadata_says():
    """bf16 on CUDA runs each chunk under autocast; what leaves a chunk (hidden states, the last chunk's
    logits) must be fp32, the dtype ``runner.engine`` declares to torch.distributed.pipelining (the head's
    16-bit logits were refused on an H200: PipeliningShapeError). CPU autocast runs the same code."""
    model = load_model("tiny")
    ids = torch.randint(0, model.vocab_size, (2, model.seq_len), generator=torch.Generator().manual_seed(0))
    first = StageChunk(model, range(2), first=True, last=False, seed=0)
    last = StageChunk(model, range(2, model.num_layers), first=False, last=True, seed=0)
    for chunk in (first, last):
        chunk.autocast_dtype = torch.bfloat16
    hidden = first(ids)
    logits = last(hidden)
    assert hidden.dtype == torch.float32 and logits.dtype == torch.float32
    lm_loss(logits, ids).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in first.parameters() if p.requires_grad)


def test_a_checkpoint_s_settings_record_names_adamw_s_betas_and_eps():
    """Issue 46, case 9: ``train_settings.json`` left out what no option changes, so a reader could not tell
    what the run trained with."""
    import torch

    from runner.optim import TrainSettings, make_optimizer

    record = TrainSettings(lr=3e-3).record()
    group = make_optimizer([torch.nn.Parameter(torch.zeros(2))], TrainSettings(lr=3e-3)).param_groups[0]
    assert record["optimizer"] == "AdamW" and tuple(record["betas"]) == group["betas"] and record["eps"] == group["eps"]
    assert record["lr"] == group["lr"] == 3e-3 and record["weight_decay"] == group["weight_decay"]


def test_fsdp2_runs_zero_1_to_3_over_even_replicas_and_says_why_not_elsewhere():
    from runner.fsdp import fsdp_misfit, loss_scale, stage_groups

    def layout(zero=3, counts=(4, 4), splits=((2, 2), (2, 2)), offload="none", cluster="cpu-4", devices=None):
        pipes = []
        for p, (n, split) in enumerate(zip(counts, splits)):
            stages = [{**stage([f"cpu:{2 * p + s}"], layers), "offload": offload} for s, layers in enumerate(split)]
            pipes.append({"num_microbatches": n, "stages": stages})
        return build_layout(load_cluster(cluster), load_model("tiny"), cfg(pipes, zero=zero))

    even = layout()
    assert fsdp_misfit(even) is None and fsdp_misfit(layout(zero=2)) is None and fsdp_misfit(layout(zero=1)) is None
    assert stage_groups(even) == ((0, 2), (1, 3))  # each stage's ranks, one per pipeline
    assert "offload all with zero 1" in fsdp_misfit(layout(zero=1, offload="all"))
    assert "optimizer-only offload" in fsdp_misfit(layout(offload="optimizer"))
    assert fsdp_misfit(layout(offload="all")) is None  # zero 3: FSDP2's CPUOffloadPolicy
    assert "offload all with zero 2" in fsdp_misfit(layout(zero=2, offload="all"))
    half = cfg(
        [
            {"num_microbatches": 4, "stages": [{**stage([f"cpu:{p}"], 4), "offload": off}]}
            for p, off in enumerate(("all", "none"))
        ],
        zero=3,
    )
    assert "offloading a stage differently" in fsdp_misfit(
        build_layout(load_cluster("cpu-2"), load_model("tiny"), half)
    )
    assert "zero 3 over replicas of other layer splits or micro-batch counts" in fsdp_misfit(layout(counts=(5, 3)))
    assert "zero 2 over replicas of other" in fsdp_misfit(layout(zero=2, counts=(5, 3)))
    assert fsdp_misfit(layout(zero=1, counts=(5, 3))) is None  # one gather and one reduce-scatter per step
    assert "zero 2 over replicas of other" in fsdp_misfit(layout(zero=2, splits=((3, 1), (1, 3))))
    # zero 1: each unit over its layer's holders (key_meshes), one gather and one reduce-scatter per step
    assert fsdp_misfit(layout(zero=1, splits=((3, 1), (1, 3)), counts=(5, 3))) is None
    assert splits_differ(layout(zero=1, splits=((3, 1), (1, 3)))) and not splits_differ(even)
    pipes = [
        {"num_microbatches": n, "stages": [stage([f"cpu:{2 * p + s}"], 2) for s in range(2)]}
        for p, n in enumerate((6, 2))
    ]
    interleaved = cfg(pipes, zero=1, schedule="interleaved-1f1b", virtual_stages=2)
    assert "interleaved, tensor-parallel or MoE" in fsdp_misfit(
        build_layout(load_cluster("cpu-4"), load_model("tiny"), interleaved)
    )
    # zero 1 over 5 + 3 micro-batches: each micro-batch's loss weighted by P * mbs / B, the schedule not dividing
    assert loss_scale(layout(zero=1, counts=(5, 3))) == 2 * 1 / 8 and loss_scale(even) is None
    tp = cfg([{"num_microbatches": 4, "stages": [stage([f"cpu:{2 * p}", f"cpu:{2 * p + 1}"], 4)]} for p in range(2)])
    tp_layout = build_layout(load_cluster("cpu-4"), load_model("tiny"), replace(tp, zero=3))
    assert fsdp_misfit(tp_layout) is None  # over a (dp, tp) mesh
    assert stage_groups(tp_layout) == ((0, 2), (1, 3))  # per tensor-parallel index, one rank per pipeline
    uneven_tp = cfg(
        [
            {"num_microbatches": 4, "stages": [stage(["cpu:0", "cpu:1"], 4)]},
            {"num_microbatches": 4, "stages": [stage(["cpu:2"], 4)]},
        ],
        zero=3,
    )
    assert "tensor-parallel degrees" in fsdp_misfit(build_layout(load_cluster("cpu-4"), load_model("tiny"), uneven_tp))


def test_fsdp2_shards_moe_experts_over_their_holders_and_leaves_spes_and_split_experts_to_runner_zero():
    from runner.fsdp import expert_groups, fsdp_misfit, stage_groups

    moe = load_model("tiny-moe")

    def layout(ep=2, trains=None, sync=1, devices=lambda p: [f"cpu:{p}"], n=4):
        pipes = [
            {"num_microbatches": 8 // n, "stages": [stage(devices(p), 4)]}
            | ({"trains_experts": trains[p]} if trains else {})
            for p in range(n)
        ]
        return build_layout(
            load_cluster("cpu-4"), moe, replace(cfg(pipes, zero=3), expert_parallel=ep, sync_every_steps=sync)
        )

    ep2 = layout()
    assert fsdp_misfit(ep2) is None
    assert stage_groups(ep2) == ((0, 1, 2, 3),)  # the shared weights over every replica
    assert expert_groups(ep2) == ((0, 2), (1, 3))  # each half of the experts over its two holders
    assert fsdp_misfit(layout(ep=1)) is None and expert_groups(layout(ep=1)) == ()  # every replica holds all
    assert fsdp_misfit(layout(ep=1, trains=[[0, 1, 2, 3]] * 4)) is None  # SPES training every expert every step
    assert "SPES" in fsdp_misfit(layout(ep=1, trains=[[p] for p in range(4)], sync=4))
    assert "SPES" in fsdp_misfit(layout(ep=1, trains=[[p] for p in range(4)]))
    split = layout(ep=2, devices=lambda p: [f"cpu:{2 * p}", f"cpu:{2 * p + 1}"], n=2)
    assert "MoE blocks split by tensor parallelism" in fsdp_misfit(split)
