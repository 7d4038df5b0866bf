"""Plans as torchtitan / Megatron-LM / DeepSpeed configurations: round trips, refusals naming the part,
and a search space kept to the plans an engine runs."""

from __future__ import annotations

import json

import pytest

from autotune import engines
from autotune.engines import megatron, torchtitan
from autotune.loading import load_cluster, load_model
from autotune.planning.space import SearchSpace
from autotune.specs import ParallelConfig


def plan(pipelines, mbs=1, schedule="1f1b", zero=0, virtual_stages=1, **extra) -> ParallelConfig:
    return ParallelConfig.from_dict(
        {
            "micro_batch_size": mbs,
            "schedule": schedule,
            "zero": zero,
            "virtual_stages": virtual_stages,
            "pipelines": pipelines,
            **extra,
        }
    )


def stage(devices, layers, **kw):
    return {"devices": devices, "layers": layers, **kw}


def replace_zero(config: ParallelConfig, zero: int) -> ParallelConfig:
    return ParallelConfig.from_dict({**config.to_dict(), "zero": zero})


# dp 2 x pp 2 x tp 2 of uneven layers 20/12 on the SPEC cluster (a100 stages first, v100 second)
UNEVEN = plan(
    [
        {"num_microbatches": 32, "stages": [stage(["a100:0", "a100:1"], 20), stage(["v100:0", "v100:1"], 12)]},
        {"num_microbatches": 32, "stages": [stage(["a100:2", "a100:3"], 20), stage(["v100:2", "v100:3"], 12)]},
    ],
    mbs=2,
)
EVEN_ZERO1 = plan(
    [{"num_microbatches": 16, "stages": [stage([f"a100:{i}"], 8, recompute=True) for i in range(4)]}]
    + [{"num_microbatches": 16, "stages": [stage([f"v100:{i}"], 8, recompute=True) for i in range(4)]}],
    mbs=4,
    zero=1,
)
INTERLEAVED = plan(
    [{"num_microbatches": 8, "stages": [stage(["a100:0"], 16), stage(["a100:1"], 16)]}],
    mbs=16,
    schedule="interleaved-1f1b",
    virtual_stages=2,
)
FSDP = plan(
    [
        {"num_microbatches": 32, "stages": [stage([d], 32, offload="all")]}
        for d in ("a100:0", "a100:1", "a100:2", "a100:3")
    ],
    mbs=1,
    zero=3,
)
TP_SP = plan(
    [
        {
            "num_microbatches": 64,
            "stages": [stage(["a100:0", "a100:1", "a100:2", "a100:3"], 32, sequence_parallel=True)],
        },
        {
            "num_microbatches": 64,
            "stages": [stage(["v100:0", "v100:1", "v100:2", "v100:3"], 32, sequence_parallel=True)],
        },
    ],
    mbs=1,
    zero=2,
)

# torchtitan's checkpointing modes on every stage (``autotune.specs.recompute``)
FSDP_OP = plan(
    [
        {"num_microbatches": 32, "stages": [stage([d], 32, recompute="selective-op")]}
        for d in ("a100:0", "a100:1", "a100:2", "a100:3")
    ],
    mbs=1,
    zero=3,
)
EVEN_EVERY2 = plan(
    [{"num_microbatches": 16, "stages": [stage([f"a100:{i}"], 8, recompute="every-2") for i in range(4)]}]
    + [{"num_microbatches": 16, "stages": [stage([f"v100:{i}"], 8, recompute="every-2") for i in range(4)]}],
    mbs=4,
    zero=2,  # torchtitan replicates with DDP on a 1-D mesh only: replicas beside a pipeline are FSDP's
)

# torchtitan 0.3 replicates with FSDP2 over a replicate mesh, beside a pipeline too
EVEN_FULL = plan(
    [{"num_microbatches": 16, "stages": [stage([f"a100:{i}"], 8, recompute=True) for i in range(4)]}]
    + [{"num_microbatches": 16, "stages": [stage([f"v100:{i}"], 8, recompute=True) for i in range(4)]}],
    mbs=4,
)

RUNS = {
    "megatron": [UNEVEN, EVEN_ZERO1, INTERLEAVED],
    "torchtitan": [INTERLEAVED, FSDP, TP_SP, FSDP_OP, EVEN_FULL],
    "deepspeed": [EVEN_ZERO1, FSDP],
}


@pytest.fixture(scope="module")
def cluster():
    return load_cluster("mixed-a100-v100")


@pytest.fixture(scope="module")
def model():
    return load_model("llama2-7b", global_batch_size=128)


@pytest.mark.parametrize(("engine", "index"), [(e, i) for e, plans in RUNS.items() for i in range(len(plans))])
def test_export_round_trips(engine, index, cluster, model):
    config = RUNS[engine][index]
    config.validate(cluster, model)
    text = engines.export(engine, config, model)
    assert engines.parse(engine, text) == engines.grid(engine, config)


def test_megatron_writes_the_uneven_split_as_its_pipeline_layout(model):
    text = engines.export("megatron", UNEVEN, model)
    assert "--pipeline-model-parallel-layout 'Et*20|t*12L'" in text
    assert "--tensor-model-parallel-size 2" in text and "--global-batch-size 128" in text
    assert "# a100:0 a100:1 a100:2 a100:3 v100:0 v100:1 v100:2 v100:3" in text  # rank r's device
    assert "--num-query-groups" not in text and "--swiglu" in text  # llama2-7b: no GQA
    assert megatron.parse_layout("Et*3|(tt|)*29,m|L") == (3,) + (2,) * 29 + (0, 0)


def test_megatron_interleaving_lists_chunk_zero_of_every_stage_first():
    assert megatron.layout(engines.grid("megatron", INTERLEAVED)) == "Et*8|t*8|t*8|t*8L"


def test_torchtitan_module_split_and_fsdp(model):
    doc = torchtitan.read_plan(engines.export("torchtitan", INTERLEAVED, model))
    parts = doc["parallelism"]["module_fqns_per_model_part"]
    assert parts[0][:2] == ["tok_embeddings", "layers.0"] and parts[-1][-2:] == ["norm", "lm_head"]
    assert [len([m for m in p if m.startswith("layers.")]) for p in parts] == [8, 8, 8, 8]
    assert doc["parallelism"]["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert doc["training"]["disable_cuda_graphs"] is True  # Trainer.Config refuses CUDA graphs with pp
    fsdp = torchtitan.read_plan(engines.export("torchtitan", FSDP, model))
    assert fsdp["parallelism"]["data_parallel_shard_degree"] == 4
    assert fsdp["parallelism"]["fsdp_reshard_after_forward"] == "always"
    assert fsdp["training"]["enable_cpu_offload"] is True and fsdp["training"]["disable_cuda_graphs"] is False
    assert fsdp["training"]["local_batch_size"] == 1 and fsdp["training"]["global_batch_size"] == 128


def test_torchtitan_writes_its_checkpointing(model):
    assert torchtitan.read_plan(engines.export("torchtitan", FSDP_OP, model))["activation_checkpoint"] == "selective"
    assert torchtitan.read_plan(engines.export("torchtitan", EVEN_FULL, model))["activation_checkpoint"] == "full"
    assert torchtitan.read_plan(engines.export("torchtitan", FSDP, model))["activation_checkpoint"] is None


def test_deepspeed_json(model):
    doc = json.loads(engines.export("deepspeed", EVEN_ZERO1, model))
    assert doc["train_batch_size"] == 128 and doc["gradient_accumulation_steps"] == 16
    assert doc["pipeline"] == {"stages": 4, "activation_checkpoint_interval": 1}
    assert doc["zero_optimization"] == {"stage": 1} and doc["bf16"] == {"enabled": True}


UNEVEN_BATCH = plan(
    [
        {"num_microbatches": 40, "stages": [stage(["a100:0"], 32)]},
        {"num_microbatches": 24, "stages": [stage(["v100:0"], 32)]},
    ],
    mbs=2,
)
PER_STAGE_TP = plan(
    [{"num_microbatches": 64, "stages": [stage(["a100:0"], 20), stage(["v100:0", "v100:1"], 12)]}], mbs=2
)
MIXED_STAGE = plan(
    [
        {
            "num_microbatches": 64,
            "stages": [
                {
                    "layers": 32,
                    "ranks": [
                        {"devices": ["a100:0"], "num_microbatches": 40},
                        {"devices": ["v100:0"], "num_microbatches": 24},
                    ],
                }
            ],
        }
    ],
    mbs=2,
)


@pytest.mark.parametrize(
    ("engine", "config", "part"),
    [
        (
            "megatron",
            UNEVEN_BATCH,
            "replica 1 has 24 micro-batches, replica 0 has 40: Megatron-LM gives every replica the same",
        ),
        ("torchtitan", PER_STAGE_TP, "tensor-parallel degrees 1/2 over its stages: torchtitan has one"),
        ("deepspeed", MIXED_STAGE, "mixed-GPU stage of 2 data-parallel ranks (micro-batch shares 40/24)"),
        ("deepspeed", UNEVEN, "layers split 20/12 over the stages"),
        ("torchtitan", EVEN_ZERO1, "zero 1 (optimizer state sharded alone)"),
        ("torchtitan", UNEVEN, "tensor parallelism without sequence parallelism"),
        ("megatron", FSDP, "offload all (parameters in host memory)"),
        ("deepspeed", INTERLEAVED, "schedule interleaved-1f1b"),
        ("megatron", FSDP_OP, "recompute selective-op (torchtitan's): Megatron-LM recomputes whole layers"),
        (
            "deepspeed",
            replace_zero(EVEN_EVERY2, 0),
            "recompute every-2 (torchtitan's): DeepSpeed checkpoints every layer or none",
        ),
    ],
)
def test_a_plan_the_engine_cannot_run_is_refused_naming_the_part(engine, config, part, model):
    assert part in engines.check(engine, config)
    with pytest.raises(engines.Inexpressible) as refused:
        engines.export(engine, config, model)
    assert part in str(refused.value) and "\n" not in str(refused.value)


def test_unknown_engine_is_one_line():
    from autotune.errors import SpecError

    with pytest.raises(SpecError, match="--engine: must be one of torchtitan, megatron, deepspeed"):
        engines.check("jax", UNEVEN)


@pytest.mark.parametrize("engine", list(engines.ENGINES))
def test_a_space_kept_to_an_engine_accepts_only_plans_it_exports(engine, cluster, model):
    import numpy as np

    space = SearchSpace(cluster, model, engine=engine)
    free = SearchSpace(cluster, model)
    assert "roundpipe" not in {d.name for d in space.dimensions}  # its dimensions are narrowed first
    rng = np.random.default_rng(0)
    refused = 0
    for _ in range(300):  # the whole space's plans: those the engine's space accepts export
        config = free.decode(free.sample(rng)).config
        if config is None or free.check(config) is not None:
            continue
        if space.check(config) is None:
            engines.export(engine, config, model)
        else:
            refused += 1
    assert refused > 0  # the unrestricted space holds plans the engine cannot run
    kept = 0
    for _ in range(300):  # and its own space holds plans it runs
        config = space.decode(space.sample(rng)).config
        if config is not None and space.check(config) is None:
            kept += 1
            engines.export(engine, config, model)
    assert kept > 0


def test_torchtitan_config_is_a_python_module_starting_from_torchtitan_s_own_model_config(model):
    text = engines.export("torchtitan", FSDP, model)
    assert text.startswith("# torchtitan configuration of the autotune plan")
    compile(text, "plan.py", "exec")  # a module torchtitan 0.3 imports (--module / --config autotune_plan)
    assert "def autotune_plan():" in text and torchtitan.parse(text).zero == 3
    # llama2-7b: torchtitan defines no such model; the module says so and starts from Llama 3 8B
    assert 'BASE = "torchtitan.models.llama3.config_registry:llama3_8b"' in text and "replace BASE" in text
    assert any("set it to your model's config function" in n for n in engines.notes("torchtitan", FSDP, model))
    llama3 = load_model("llama3-8b", global_batch_size=128)
    assert "replace BASE" not in engines.export("torchtitan", FSDP, llama3)
    assert not any("BASE" in n for n in engines.notes("torchtitan", FSDP, llama3))


def test_megatron_arguments_carry_what_validate_args_requires_and_the_notes_what_the_user_adds():
    """Issue 47: Megatron-FSDP needs --ckpt-format fsdp_dtensor, the optimizer's CPU offload the
    precision-aware optimizer, Llama 3 its rotary base; fp32 has no --no-bf16; tp > 1 needs
    CUDA_DEVICE_MAX_CONNECTIONS=1, said in the notes and the file's header."""
    sharded = plan([{"num_microbatches": 32, "stages": [stage([f"a100:{i}"], 32)]} for i in range(4)], zero=3)
    text = engines.export("megatron", sharded, load_model("llama3-8b", global_batch_size=128))
    assert "--ckpt-format fsdp_dtensor" in text and "--rotary-base 500000" in text and "--bf16" in text
    offloaded = plan(
        [{"num_microbatches": 32, "stages": [stage([f"a100:{i}"], 32, offload="optimizer")]} for i in range(4)], zero=1
    )
    assert "--use-precision-aware-optimizer" in engines.export("megatron", offloaded)
    fp32 = load_model("llama2-7b", global_batch_size=128)
    from dataclasses import replace

    text = engines.export("megatron", sharded, replace(fp32, precision="fp32"))
    assert "--no-bf16" not in text and "--bf16" not in text and "--fp16" not in text
    notes = engines.notes("megatron", UNEVEN)
    assert any("CUDA_DEVICE_MAX_CONNECTIONS=1" in n for n in notes) and any("--data-path" in n for n in notes)
    assert "# environment: CUDA_DEVICE_MAX_CONNECTIONS=1" in engines.export("megatron", UNEVEN)


def test_deepspeed_notes_say_how_to_split_the_pipeline_and_pass_an_mpu():
    pipeline = plan([{"num_microbatches": 16, "stages": [stage([f"a100:{i}"], 8) for i in range(4)]}])
    notes = " ".join(engines.notes("deepspeed", pipeline))
    assert "partition_method='type:<your block class>'" in notes and "8 blocks" in notes
    tp = plan([{"num_microbatches": 16, "stages": [stage(["a100:0", "a100:1"], 32)]}])
    assert "mpu=" in " ".join(engines.notes("deepspeed", tp))


def test_torchtitan_refuses_what_its_own_code_rejects():
    """Issue 47: torchtitan 0.3 checkpoints every block or per op (per-layer every-N is gone), builds its
    expert mesh from the FSDP one, and takes no fp16; it does replicate beside a pipeline (0.2's DDP did
    not)."""
    assert "torchtitan 0.3 checkpoints every block (full) or per op" in engines.check("torchtitan", EVEN_EVERY2)
    assert engines.check("torchtitan", EVEN_FULL) is None
    from dataclasses import replace

    fp16 = replace(load_model("llama2-7b", global_batch_size=128), precision="fp16")
    assert engines.model_check("torchtitan", fp16) == (
        "precision fp16: torchtitan's mixed_precision_param takes bfloat16 or float32"
    )
    with pytest.raises(engines.Inexpressible, match="fp16"):
        engines.export("torchtitan", FSDP, fp16)
    with pytest.raises(Exception, match="--engine.*fp16"):
        SearchSpace(load_cluster("mixed-a100-v100"), fp16, engine="torchtitan")
