"""Mixture-of-experts models and MoE / SPES plan fields: counts against published totals, every new rule."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from autotune import SpecError, load_cluster, load_config, load_model
from autotune.loading import model_from_dict
from autotune.simulator.flops import model_flops_per_token
from autotune.specs import ParallelConfig

MOE_YAML = """num_layers: 4
hidden_size: 64
num_heads: 4
ffn_hidden_size: 256
vocab_size: 256
seq_len: 64
global_batch_size: 8
"""


def test_mixtral_matches_published_total_and_active_parameters() -> None:
    # Jiang et al. 2024 (Mixtral of Experts): 46.7B parameters in all, 12.9B used per token
    m = load_model("mixtral-8x7b")
    assert m.num_params / 1e9 == pytest.approx(46.7, rel=0.002)
    assert m.active_params / 1e9 == pytest.approx(12.9, rel=0.002)
    # FLOPs per token see the routed experts only: 6 x (active non-embedding weights) + attention
    assert model_flops_per_token(m) == pytest.approx(
        6 * (m.active_params - m.embedding_params) + 12 * m.num_layers * m.hidden_size * m.seq_len
    )
    assert model_flops_per_token(m) < 0.3 * 6 * m.num_params


def test_spes_2b_is_two_billion_with_half_a_billion_active() -> None:
    m = load_model("spes-2b")
    assert (m.num_experts, m.experts_per_token, m.num_layers, m.hidden_size) == (16, 2, 12, 768)
    assert m.num_params / 1e9 == pytest.approx(2.07, abs=0.01)
    assert m.active_params / 1e9 == pytest.approx(0.49, abs=0.01)


def test_hand_counted_tiny_moe() -> None:
    m = load_model("tiny-moe")  # h 64, 4 layers, 4 experts of width 128 (gelu: 2 matrices), top-2
    h, attention = 64, 4 * 64 * 64 + 2 * 64
    expert = 2 * 64 * 128
    router = 64 * 4
    block = attention + router + 4 * expert
    assert m.params_per_layer == block
    assert m.num_params == 2 * 256 * h + 4 * block + h
    assert m.active_params == 2 * 256 * h + 4 * (attention + router + 2 * expert) + h


def test_moe_layer_every_and_defaults(tmp_path: Path) -> None:
    p = tmp_path / "m.yaml"
    p.write_text(MOE_YAML + "num_experts: 8\nmoe_layer_every: 2\n")
    m = load_model(p)
    assert m.experts_per_token == 2 and m.expert_ffn_hidden_size == 256  # the documented defaults
    assert [m.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert m.num_moe_layers == 2
    dense_block = 4 * 64 * 64 + 2 * 64 + 2 * 64 * 256
    moe_block = 4 * 64 * 64 + 2 * 64 + 64 * 8 + 8 * 2 * 64 * 256
    assert m.num_params == 2 * 256 * 64 + 2 * dense_block + 2 * moe_block + 64
    # a dense model is unchanged and round-trips through the job format (asdict -> model_from_dict)
    dense = load_model("llama2-7b")
    assert not dense.is_moe and dense.active_params == dense.num_params
    assert model_from_dict(asdict(dense), "job") == dense
    assert model_from_dict(asdict(m), "job") == m


MODEL_RULES = [
    ("num_experts: 4\nexperts_per_token: 5\n", "experts_per_token: top-5 routing needs at least that many experts"),
    ("experts_per_token: 2\n", "experts_per_token: applies only to mixture-of-experts models"),
    ("expert_ffn_hidden_size: 128\n", "expert_ffn_hidden_size: applies only to mixture-of-experts models"),
    ("moe_layer_every: 2\n", "moe_layer_every: applies only to mixture-of-experts models"),
    ("num_experts: 4\nmoe_layer_every: 5\n", "moe_layer_every: 5 > num_layers=4"),
    ("num_experts: 4\nmoe_layer_every: 0\n", "moe_layer_every: must be > 0"),
    ("num_experts: -1\n", "num_experts: must be >= 0"),
    ("num_experts: 2.5\n", "num_experts: must be an integer"),
]


@pytest.mark.parametrize("extra,message", MODEL_RULES)
def test_moe_model_rules(extra: str, message: str, tmp_path: Path) -> None:
    p = tmp_path / "m.yaml"
    p.write_text(MOE_YAML + extra)
    with pytest.raises(SpecError) as info:
        load_model(p)
    assert message in str(info.value) and str(p) in str(info.value)


# -- plan fields -----------------------------------------------------------------------------------------


def _plan(ep: int = 1, sync: int = 1, trains=("all",) * 4, mbs=(2, 2, 2, 2), layers=((4,),) * 4) -> dict:
    pipes = []
    for p in range(4):
        pipe = {"num_microbatches": mbs[p], "stages": [{"devices": [f"cpu:{p}"], "layers": n} for n in layers[p]]}
        if trains[p] != "all":
            pipe["trains_experts"] = trains[p]
        pipes.append(pipe)
    out = {"micro_batch_size": 1, "pipelines": pipes}
    if ep != 1:
        out["expert_parallel"] = ep
    if sync != 1:
        out["sync_every_steps"] = sync
    return out


def _validate(plan: dict, model: str = "tiny-moe") -> ParallelConfig:
    cfg = load_config(plan)
    cfg.validate(load_cluster("cpu-4"), load_model(model))
    return cfg


def test_moe_plan_roundtrip_and_dense_json_unchanged() -> None:
    cfg = _validate(_plan(ep=2, sync=4, trains=([0, 1], [0, 1], [2, 3], [2, 3])))
    assert cfg.expert_parallel == 2 and cfg.sync_every_steps == 4
    assert cfg.pipelines[2].trains_experts == (2, 3)
    assert cfg.expert_groups() == ((0, 1), (2, 3))
    assert ParallelConfig.from_json(cfg.to_json()) == cfg
    assert "ep=2 sync=4" in cfg.describe() and "E=2-3" in cfg.describe()
    dense = load_config(_plan())
    assert set(json.loads(dense.to_json())) == {"micro_batch_size", "schedule", "pipelines"}
    assert "trains_experts" not in dense.to_json()


PLAN_RULES = [
    (dict(ep=3), "expert_parallel: 3 must divide num_experts=4"),
    (dict(ep=4, trains=("all",) * 4), None),  # valid: 4 replicas, 4 experts
    (dict(ep=2, mbs=(3, 1, 2, 2)), "pipelines[1].num_microbatches: replicas of one expert-parallel group"),
    (dict(ep=2, layers=((1, 3), (2, 2), (4,), (4,))), "pipelines[1].stages: replicas of one expert-parallel group"),
    (dict(ep=2, trains=([0, 1], [2, 3], "all", "all")), "pipelines[1].trains_experts: replicas of one expert-"),
    (dict(trains=([0], [1], [0], [1])), "expert(s) 2-3 are trained by no replica"),
    (dict(trains=([0, 4], "all", "all", "all")), "pipelines[0].trains_experts: expert index 4 out of range"),
    (dict(trains=([0, 0], "all", "all", "all")), "pipelines[0].trains_experts: lists an expert twice"),
    (dict(trains=("x", "all", "all", "all")), 'pipelines[0].trains_experts: must be "all" or a list'),
    (dict(trains=([-1], "all", "all", "all")), 'pipelines[0].trains_experts: must be "all" or a list of expert'),
    (dict(sync=0), "sync_every_steps: must be > 0"),
    (dict(ep=0), "expert_parallel: must be > 0"),
    (dict(ep=4, sync=2), "sync_every_steps: 2 needs at least two replicas (expert-parallel groups)"),
]


@pytest.mark.parametrize("changes,message", PLAN_RULES)
def test_moe_plan_rules(changes: dict, message: str | None) -> None:
    if message is None:
        _validate(_plan(**changes))
        return
    with pytest.raises(SpecError) as info:
        _validate(_plan(**changes))
    assert message in str(info.value)


def test_expert_parallel_must_divide_the_replicas() -> None:
    plan = {
        "micro_batch_size": 1,
        "expert_parallel": 4,
        "pipelines": [{"num_microbatches": 4, "stages": [{"devices": [f"cpu:{p}"], "layers": 4}]} for p in range(2)],
    }
    with pytest.raises(
        SpecError,
        match=r"expert_parallel: 4 must divide the number of data-parallel replicas "
        r"\(pipelines\), 2",
    ):
        _validate(plan)


def test_moe_plan_fields_need_an_moe_model() -> None:
    with pytest.raises(SpecError, match="expert_parallel: 2 needs a mixture-of-experts model"):
        _validate(_plan(ep=2), model="tiny")
    with pytest.raises(SpecError, match="pipelines\\[0\\].trains_experts: needs a mixture-of-experts model"):
        _validate(_plan(trains=([0], "all", "all", "all")), model="tiny")
    with pytest.raises(SpecError, match="pipelines\\[0\\].bogus: unknown field"):
        load_config(
            {
                "micro_batch_size": 1,
                "pipelines": [{"num_microbatches": 8, "bogus": 1, "stages": [{"devices": ["cpu:0"], "layers": 4}]}],
            }
        )
