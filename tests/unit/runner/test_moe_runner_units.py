"""The runner's MoE pieces without processes: top-k routing against a per-token loop, expert weights
independent of which experts a rank holds, holder keys and exchange weights of MoE / SPES layouts, and
the plan shapes the runner refuses."""

from __future__ import annotations

import pytest
import torch

from autotune import load_cluster, load_config, load_model
from runner.layout import build_layout
from runner.model import StageChunk, build_full_model

MODEL = load_model("tiny-moe")


def test_top_k_routing_matches_a_per_token_loop() -> None:
    torch.manual_seed(0)
    block = build_full_model(MODEL, seed=0).blocks["1"].mlp
    x = torch.randn(2, 5, MODEL.hidden_size)
    out = block(x)
    want = torch.zeros_like(x)
    for b in range(2):
        for t in range(5):
            logits = block.router(x[b, t])
            top, idx = torch.topk(logits, MODEL.experts_per_token)
            for w, e in zip(torch.softmax(top, -1), idx.tolist()):
                want[b, t] += w * block.experts[str(e)](x[b, t])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_expert_weights_do_not_depend_on_which_experts_a_rank_holds() -> None:
    full = build_full_model(MODEL, seed=3)
    part = StageChunk(MODEL, [2, 3], first=False, last=False, seed=3, experts=(2, 3))
    for name, p in part.named_parameters():
        assert torch.equal(p, dict(full.named_parameters())[name]), name
    assert set(part.blocks["2"].mlp.experts) == {"2", "3"}


def _layout(plan: dict, cluster: str = "cpu-4"):
    return build_layout(load_cluster(cluster), MODEL, load_config(plan))


def _pipes(n: int, trains=None, stages: int = 1) -> list[dict]:
    out = []
    for p in range(n):
        pipe = {"num_microbatches": 8 // n, "stages": [{"devices": [f"cpu:{p}"], "layers": 4}]}
        if trains is not None:
            pipe["trains_experts"] = trains[p]
        out.append(pipe)
    return out


def test_holder_keys_and_exchange_weights() -> None:
    layout = _layout({"micro_batch_size": 1, "expert_parallel": 2, "pipelines": _pipes(4)})
    keys = layout.ranks[1].holds()
    assert "layer0" in keys and "layer0.expert2" in keys and "layer0.expert0" not in keys
    assert layout.expert_parallel_groups() == ((0, 1), (2, 3))
    groups = {g[2][0]: g for g in layout.exchange_groups()}
    holders, trainers, _, w, _ = groups["embed"]
    assert holders == trainers == (0, 1, 2, 3) and w[0] == (0.25, 0.25)
    # expert 0 is held by position 0 of both groups; a holder's gradient covers its group's 4 sequences
    holders, trainers, _, w, _ = groups["layer0.expert0"]
    assert holders == (0, 2) and w[0] == (2 / 8, 4 / 8)
    # SPES: group 0 trains experts 0-1, group 1 experts 2-3
    spes = _layout(
        {
            "micro_batch_size": 1,
            "expert_parallel": 2,
            "sync_every_steps": 4,
            "pipelines": _pipes(4, trains=[[0, 1], [0, 1], [2, 3], [2, 3]]),
        }
    )
    groups = {g[2][0]: g for g in spes.exchange_groups()}
    holders, trainers, _, w, _ = groups["layer0.expert2"]
    assert holders == (1, 3) and trainers == (3,) and w == {3: (2 / 4, 1.0)}
    local = {(g[0], g[2][0]) for g in spes.exchange_groups(local=True)}
    assert ((0, 1), "embed") in local and ((2, 3), "embed") in local
    assert not spes.ranks[1].trains("layer0.expert2") and spes.ranks[3].trains("layer0.expert2")
    # replicas at tp 2 and tp 1: a group per part of the sharded weights (one rank per replica), one for the
    # weights kept whole (every rank, each weighted by 1 / its degree)
    parted = _layout(
        {
            "micro_batch_size": 1,
            "pipelines": [
                {"num_microbatches": 6, "stages": [{"devices": ["cpu:0", "cpu:1"], "layers": 4}]},
                {"num_microbatches": 2, "stages": [{"devices": ["cpu:2"], "layers": 4}]},
            ],
        }
    )
    groups = {(key, g[4]): g for g in parted.exchange_groups() for key in g[2]}
    assert groups[("layer0", (0, 2))][1] == (0, 2) and groups[("layer0", (1, 2))][1] == (1, 2)
    holders, trainers, _, w, _ = groups[("layer0", (-1, 2))]
    assert trainers == (0, 1, 2) and w[0] == (3 / 8, 3 / 8) and w[2] == (1 / 4, 1 / 4)


def test_runner_runs_tp_and_zero_with_moe_and_zero3_with_spes() -> None:
    tp = {
        "micro_batch_size": 1,
        "pipelines": [{"num_microbatches": 8, "stages": [{"devices": ["cpu:0", "cpu:1"], "layers": 4}]}],
    }
    assert _layout(tp).tp_groups() == ((0, 1),)  # tensor parallelism inside MoE blocks runs
    assert _layout({"micro_batch_size": 1, "zero": 1, "pipelines": _pipes(4)}).sharded  # ZeRO with MoE runs
    spes = {
        "micro_batch_size": 1,
        "zero": 3,
        "sync_every_steps": 4,
        "pipelines": _pipes(4, trains=[[0, 1], [2, 3]] * 2),
    }
    assert _layout(spes).sharded  # ZeRO-3 with SPES runs (the exchange gathers the units in turn)


def test_profiled_spes_run_amortises_its_timed_sync() -> None:
    from runner.profile import summarize

    config = load_config(
        {"micro_batch_size": 1, "sync_every_steps": 4, "pipelines": _pipes(2, trains=[[0, 1], [2, 3]])}
    )
    readings = [
        dict(
            rank=r,
            device=f"cpu:{r}",
            pipeline=r,
            stage=0,
            forward_s=0.01,
            backward_s=0.02,
            iteration_time_s=0.1,
            peak_memory_GiB=0.1,
            sync_time_s=0.2 + 0.1 * r,
        )
        for r in range(2)
    ]
    m = summarize(readings, load_cluster("cpu-4"), MODEL, config)
    assert m.sync_time_s == pytest.approx(0.3) and m.iteration_time_s == pytest.approx(0.1 + 0.3 / 4)
