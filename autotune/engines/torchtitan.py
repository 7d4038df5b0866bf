"""torchtitan (v0.2, the ``JobConfig`` TOML): a plan as the ``[parallelism]``, ``[training]`` and
``[activation_checkpoint]`` sections of a job config.

The grid (``autotune.engines.grid``) maps to ``data_parallel_replicate_degree`` (ZeRO 0) or
``data_parallel_shard_degree`` (FSDP2: ZeRO 3 with ``fsdp_reshard_after_forward = "always"``, ZeRO 2 with
``"never"``), ``tensor_parallel_degree``, ``pipeline_parallel_degree`` with its schedule (``1F1B``,
``GPipe``, ``Interleaved1F1B``) and micro-batch size, and the per-stage module split
``module_fqns_per_model_part`` (model part ``i`` runs on pipeline rank ``i % pp``: chunk 0 of every stage,
then chunk 1). ``offload: all`` is ``training.enable_cpu_offload`` (FSDP2's CPU offload of parameters,
gradients and optimizer state). What torchtitan cannot run, ``refusal`` names: ZeRO 1, the optimizer
offloaded alone, Megatron's selective (attention-core) checkpointing, tensor parallelism without
sequence parallelism (torchtitan's tensor-parallel plans always split the norms along the sequence).
"""

from __future__ import annotations

import json

import tomllib

from autotune.engines.grid import EngineGrid
from autotune.specs import ModelSpec
from autotune.specs.recompute import every_n

NAME = "torchtitan"
RESTRICTIONS = {"zero": [0, 2, 3], "recompute": ["none", "all", "selective-op", "every-2"]}
_SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved-1f1b": "Interleaved1F1B"}


def refusal(grid: EngineGrid) -> str | None:
    if grid.zero == 1:
        return f"zero 1 (optimizer state sharded alone): {NAME} shards with FSDP2 (zero 2 or 3)"
    if grid.offload == "optimizer":
        return f"offload optimizer alone: {NAME} offloads parameters, gradients and optimizer state together"
    if grid.offload == "all" and grid.zero < 2:
        return f"offload all without zero 2 or 3: {NAME}'s CPU offload is FSDP2's"
    if grid.recompute == "selective":
        return (
            f"recompute selective (Megatron's attention core): {NAME}'s selective checkpointing is per op or per layer"
        )
    if grid.tp > 1 and not grid.sequence_parallel:
        return f"tensor parallelism without sequence parallelism: {NAME}'s tensor-parallel plans always use it"
    if grid.zero == 0 and grid.dp > 1 and (grid.pp > 1 or grid.tp > 1):
        return (
            f"zero 0 over {grid.dp} replicas beside pipeline or tensor parallelism: {NAME} replicates with DDP, "
            "which it runs on a 1-D mesh only (DDP has not supported > 1D parallelism); zero 2 or 3 instead"
        )
    if grid.expert_parallel > 1 and grid.zero == 0:
        return (
            f"expert parallelism {grid.expert_parallel} without FSDP: {NAME} builds its expert mesh from the FSDP one"
        )
    return None


def model_refusal(model: ModelSpec) -> str | None:
    """What of the model ``NAME`` cannot train, whatever the plan."""
    if model.precision == "fp16":
        return f"precision fp16: {NAME}'s mixed_precision_param takes bfloat16 or float32"
    return None


def module_parts(grid: EngineGrid) -> list[list[str]]:
    """``module_fqns_per_model_part``: the module names of each model part (virtual stage)."""
    parts, layer = [], 0
    for n in grid.chunk_layers:
        parts.append([f"layers.{i}" for i in range(layer, layer + n)])
        layer += n
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", "output"]
    return parts


def _value(v: object) -> str:
    return json.dumps(v)  # TOML's strings, numbers, booleans and arrays of them read as JSON writes them


def render(grid: EngineGrid, model: ModelSpec | None, header: list[str]) -> str:
    lines = [f"# {h}" for h in header]
    lines += ["", "[model]"]
    if model is not None:
        lines.append(
            f"# set name and flavor to the torchtitan model of {model.name}: {model.num_layers} layers, hidden "
            f"{model.hidden_size}, {model.num_heads} heads ({model.num_kv_heads} kv), ffn {model.ffn_hidden_size}, "
            f"vocab {model.vocab_size}"
        )
    # local_batch_size: what one data-parallel rank takes per optimizer step when it pipelines (split into
    # micro-batches of pipeline_parallel_microbatch_size); without a pipeline, one micro-batch, the global
    # batch making torchtitan accumulate gradients over num_microbatches of them
    local = grid.micro_batch_size * (grid.num_microbatches if grid.pp > 1 else 1)
    training = {"local_batch_size": local, "global_batch_size": grid.global_batch_size}
    if model is not None:
        training["seq_len"] = model.seq_len
        training["mixed_precision_param"] = {"bf16": "bfloat16", "fp16": "float16"}.get(model.precision, "float32")
    training["enable_cpu_offload"] = grid.offload == "all"
    lines += ["", "[training]"] + [f"{k} = {_value(v)}" for k, v in training.items()]
    par: dict[str, object] = {
        "data_parallel_replicate_degree": grid.dp if grid.zero == 0 else 1,
        "data_parallel_shard_degree": 1 if grid.zero == 0 else grid.dp,
    }
    if grid.zero:
        par["fsdp_reshard_after_forward"] = "always" if grid.zero == 3 else "never"
    par["tensor_parallel_degree"] = grid.tp
    par["pipeline_parallel_degree"] = grid.pp
    if grid.pp > 1:
        par["pipeline_parallel_schedule"] = _SCHEDULES[grid.schedule]
        par["pipeline_parallel_microbatch_size"] = grid.micro_batch_size
    par["module_fqns_per_model_part"] = module_parts(grid)
    par["expert_parallel_degree"] = grid.expert_parallel
    lines += ["", "[parallelism]"] + [f"{k} = {_value(v)}" for k, v in par.items()]
    lines += ["", "[activation_checkpoint]"] + activation_checkpoint(grid.recompute)
    return "\n".join(lines) + "\n"


def activation_checkpoint(recompute: bool | str) -> list[str]:
    """The ``[activation_checkpoint]`` lines: ``mode`` none | full | selective, and for selective its
    ``selective_ac_option`` (``op`` per op, or the layer frequency N of every-N)."""
    if recompute is True:
        return ['mode = "full"']
    if recompute == "selective-op":
        return ['mode = "selective"', 'selective_ac_option = "op"']
    n = every_n(recompute)
    if n:
        return ['mode = "selective"', f'selective_ac_option = "{n}"']
    return ['mode = "none"']


def recompute_of(section: dict) -> bool | str:
    """The plan's recompute mode of an ``[activation_checkpoint]`` section (``activation_checkpoint``'s inverse)."""
    mode = section.get("mode", "none")
    if mode == "full":
        return True
    if mode == "selective":
        option = str(section.get("selective_ac_option", "2"))
        return "selective-op" if option == "op" else f"every-{option}"
    return False


def parse(text: str) -> EngineGrid:

    doc = tomllib.loads(text)
    par, training = doc["parallelism"], doc["training"]
    replicate, shard = par.get("data_parallel_replicate_degree", 1), par.get("data_parallel_shard_degree", 1)
    dp, pp = replicate * shard, par.get("pipeline_parallel_degree", 1)
    local = training["local_batch_size"]
    if pp > 1:
        mbs = par.get("pipeline_parallel_microbatch_size", 1)
        nmb = local // mbs
    else:
        mbs = local
        nmb = max(1, training.get("global_batch_size", -1) // (local * dp))
    parts = par.get("module_fqns_per_model_part")
    chunks = tuple(sum(m.startswith("layers.") for m in part) for part in parts) if parts else None
    zero = 0 if shard == 1 else (3 if par.get("fsdp_reshard_after_forward") == "always" else 2)
    schedule = {v: k for k, v in _SCHEDULES.items()}[par.get("pipeline_parallel_schedule", "1F1B")]
    tp = par.get("tensor_parallel_degree", 1)
    return EngineGrid(
        dp=dp,
        pp=pp,
        tp=tp,
        vpp=len(chunks) // pp if chunks else 1,
        micro_batch_size=mbs,
        num_microbatches=nmb,
        chunk_layers=chunks or (),
        schedule=schedule if pp > 1 else "1f1b",
        recompute=recompute_of(doc.get("activation_checkpoint", {})),
        sequence_parallel=tp > 1,
        zero=zero,
        offload="all" if training.get("enable_cpu_offload") else "none",
        expert_parallel=par.get("expert_parallel_degree", 1),
    )
