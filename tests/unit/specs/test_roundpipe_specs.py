"""RoundPipe plans (``"schedule": "roundpipe"``): loading, round trip, validation messages, describe."""

from __future__ import annotations

import copy
import json

import pytest
from paths import EXAMPLES

from autotune import SpecError, load_cluster, load_config, load_model
from autotune.specs import ParallelConfig

EXAMPLES = EXAMPLES
POOL = [f"box:{i}" for i in range(8)]


def _plan(**pipe):
    base = {
        "num_microbatches": 64,
        "devices": POOL,
        "forward_layers": [3, 4, 4, 4, 4, 4, 4, 4, 4],
        "fused_layers": 5,
        "backward_layers": [2] + [3] * 11,
        "recompute_grain": "stage",
    }
    base.update(pipe)
    return {"micro_batch_size": 1, "schedule": "roundpipe", "pipelines": [base]}


@pytest.fixture(scope="module")
def box():
    return load_cluster(EXAMPLES / "8x4090.yaml"), load_model("llama2-13b", 64)


def test_a_roundpipe_plan_loads_round_trips_and_describes_itself(box):
    cluster, model = box
    cfg = load_config(_plan(memory_limit_GiB=13.4, accumulation_steps=2))
    cfg.validate(cluster, model)
    rp = cfg.pipelines[0].roundpipe
    assert cfg.is_roundpipe and cfg.devices == tuple(POOL) and cfg.pipelines[0].stages == ()
    assert rp.num_stages == 9 + 1 + 12
    assert rp.forward_ranges(40)[0] == (0, 3) and rp.forward_ranges(40)[-1] == (35, 40)
    assert rp.backward_ranges(40)[-2] == (32, 35)
    assert ParallelConfig.from_json(cfg.to_json()) == cfg
    text = cfg.describe()
    assert "roundpipe" in text and "pool box:0-7" in text and "FB 5+head" in text and "acc=2" in text
    defaults = load_config(_plan())
    assert "memory_limit_GiB" not in defaults.to_dict()["pipelines"][0]  # 0 = RoundPipe's 60% default
    assert defaults.pipelines[0].roundpipe.memory_limit_for(24.0) == pytest.approx(14.4)


@pytest.mark.parametrize(
    "change, field, words",
    [
        ({"stages": []}, "pipelines[0].stages", "no stages bound to devices"),
        ({"forward_layers": None}, "pipelines[0].forward_layers", "is required in a roundpipe pipeline"),
        ({"forward_layers": "3,4"}, "pipelines[0].forward_layers", "list of layer counts"),
        ({"forward_layers": [3, 0, 37]}, "pipelines[0].forward_layers[1]", "must be an integer >= 1, got 0"),
        ({"backward_layers": []}, "pipelines[0].backward_layers", "at least one stage"),
        ({"fused_layers": -1}, "pipelines[0].fused_layers", ">= 0 (0: the LM head alone), got -1"),
        ({"recompute_grain": "block"}, "pipelines[0].recompute_grain", "stage, layer, got 'block'"),
        ({"memory_limit_GiB": -2}, "pipelines[0].memory_limit_GiB", "got -2"),
        ({"accumulation_steps": 3}, "pipelines[0].num_microbatches", "accumulation_steps=3"),
        ({"devices": POOL + ["box:0"]}, "pipelines[0].devices", "'box:0' is listed twice"),
        ({"bogus": 1}, "pipelines[0].bogus", "unknown field"),
    ],
)
def test_shape_errors_name_the_field_and_the_numbers(change, field, words):
    plan = _plan()
    for k, v in change.items():
        if v is None:
            del plan["pipelines"][0][k]
        else:
            plan["pipelines"][0][k] = v
    with pytest.raises(SpecError) as e:
        load_config(plan)
    assert e.value.field == field and words in e.value.rule, str(e.value)


def test_rules_that_need_the_cluster_and_the_model(box, tmp_path):
    cluster, model = box
    cases = [
        (
            _plan(forward_layers=[4, 4, 4, 4, 4, 4, 4, 4, 4]),
            "pipelines[0].forward_layers",
            "4 + 4 + 4 + 4 + 4 + 4 + 4 + 4 + 4 + fused_layers 5 = 41 blocks, model 'llama2-13b' has num_layers=40",
        ),
        (_plan(backward_layers=[3] * 11), "pipelines[0].backward_layers", "= 38 blocks"),
        (_plan(devices=["box:0", "box:9"]), "pipelines[0].devices", "unknown device id 'box:9'"),
        (_plan(memory_limit_GiB=30), "pipelines[0].memory_limit_GiB", "30 GiB exceeds the smallest pool GPU's"),
        (_plan(num_microbatches=32), "num_microbatches", "(32) x micro_batch_size 1 = 32 sequences"),
    ]
    for plan, field, words in cases:
        with pytest.raises(SpecError) as e:
            load_config(plan).validate(cluster, model)
        assert e.value.field == field and words in e.value.rule, str(e.value)
    two = tmp_path / "two.yaml"
    two.write_text(
        "nodes: [{name: a, gpu: RTX-4090, count: 4}, {name: b, gpu: RTX-4090, count: 4}]\n"
        "network: {bandwidth_GBps: 12.5}\n"
    )
    with pytest.raises(SpecError, match="spans nodes a, b: give each node its own pipeline"):
        load_config(_plan(devices=["a:0", "a:1", "b:0"])).validate(load_cluster(two), model)


def test_fields_that_belong_to_other_schedules_are_refused():
    with pytest.raises(SpecError, match="does not apply to schedule 'roundpipe'"):
        load_config({**_plan(), "zero": 2})
    pipe = copy.deepcopy(_plan()["pipelines"][0])
    with pytest.raises(SpecError, match='needs "schedule": "roundpipe"'):
        load_config({"micro_batch_size": 1, "schedule": "1f1b", "pipelines": [pipe]})
    with pytest.raises(SpecError, match="must be one of 1f1b, gpipe, interleaved-1f1b, roundpipe"):
        load_config({**_plan(), "schedule": "round-robin"})


def test_notes_say_when_gpus_of_the_pool_stay_idle(box):
    cfg = load_config(_plan(forward_layers=[20], fused_layers=0, backward_layers=[20], num_microbatches=64))
    assert any("3 stages per pass for a pool of 8 GPUs: 5 stay idle" in n for n in cfg.notes())
    few = load_config(_plan(num_microbatches=64, accumulation_steps=16))
    assert any("4 micro-batches per pass fill at most 4 of the 8 GPUs" in n for n in few.notes())
    assert "note:" in few.describe()
    json.dumps(few.to_dict())
