"""torchtitan (0.3, what ``pip install torchtitan`` gives): a plan as a config module, the Python file that
``--module`` / ``--config`` name (torchtitan 0.3 no longer reads TOML job files).

The module starts from torchtitan's own config function of the model (``BASE``: torchtitan 0.3 trains the
models it defines; ``base_of`` picks the one of the planned model's shape, or says it has none) and sets
the plan's ``training``, ``parallelism`` and ``activation_checkpoint`` on it (``PLAN``, a literal
``parse`` reads back). The grid (``autotune.engines.grid``) maps to ``data_parallel_replicate_degree``
(ZeRO 0: FSDP2 over a replicate mesh, HSDP with one shard, which torchtitan 0.3 runs beside pp and tp) or
``data_parallel_shard_degree`` (FSDP2: ZeRO 3 with ``fsdp_reshard_after_forward = "always"``, ZeRO 2 with
``"never"``), ``tensor_parallel_degree``, ``pipeline_parallel_degree`` with its schedule (``1F1B``,
``GPipe``, ``Interleaved1F1B``) and micro-batch size, and the per-stage module split
``module_fqns_per_model_part`` (model part ``i`` runs on pipeline rank ``i % pp``: chunk 0 of every stage,
then chunk 1). ``offload: all`` is ``training.enable_cpu_offload``. Recomputation is ``FullAC`` (every
block) or ``SelectiveAC`` (per op). What torchtitan cannot run, ``refusal`` names: ZeRO 1, the optimizer
offloaded alone, Megatron's selective (attention-core) and per-layer (every-N: gone in 0.3) checkpointing,
tensor parallelism without sequence parallelism, expert parallelism without FSDP.
"""

from __future__ import annotations

import ast
import json

from autotune.engines.grid import EngineGrid
from autotune.errors import SpecError
from autotune.specs import ModelSpec

NAME = "torchtitan"
VERSION = "0.3"
RESTRICTIONS = {"zero": [0, 2, 3], "recompute": ["none", "all", "selective-op"]}
_SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved-1f1b": "Interleaved1F1B"}
_AC = {True: "full", "selective-op": "selective", False: None}

#: torchtitan 0.3's config functions by the model's shape (blocks, hidden, heads, kv heads, vocabulary,
#: experts); tests/integration/engines checks each against the model torchtitan builds
BASES: dict[tuple[int, int, int, int, int, int], str] = {
    (32, 4096, 32, 8, 128256, 0): "torchtitan.models.llama3.config_registry:llama3_8b",
    (80, 8192, 64, 8, 128256, 0): "torchtitan.models.llama3.config_registry:llama3_70b",
    (28, 1024, 16, 8, 151936, 0): "torchtitan.models.qwen3.config_registry:qwen3_0_6b",
    (28, 2048, 16, 8, 151936, 0): "torchtitan.models.qwen3.config_registry:qwen3_1_7b",
    (40, 5120, 40, 8, 151936, 0): "torchtitan.models.qwen3.config_registry:qwen3_14b",
    (64, 5120, 64, 8, 151936, 0): "torchtitan.models.qwen3.config_registry:qwen3_32b",
    (48, 2048, 32, 4, 151936, 128): "torchtitan.models.qwen3.config_registry:qwen3_30b_a3b",
}
#: where a model has no torchtitan config function: the family to start from, for the user to replace
FALLBACK = {False: BASES[(32, 4096, 32, 8, 128256, 0)], True: BASES[(48, 2048, 32, 4, 151936, 128)]}


def refusal(grid: EngineGrid) -> str | None:
    if grid.zero == 1:
        return f"zero 1 (optimizer state sharded alone): {NAME} shards with FSDP2 (zero 2 or 3)"
    if grid.offload == "optimizer":
        return f"offload optimizer alone: {NAME} offloads parameters, gradients and optimizer state together"
    if grid.offload == "all" and grid.zero < 2:
        return f"offload all without zero 2 or 3: {NAME}'s CPU offload is FSDP2's"
    if grid.recompute == "selective":
        return f"recompute selective (Megatron's attention core): {NAME}'s selective checkpointing is per op"
    if grid.recompute not in _AC:
        return f"recompute {grid.recompute}: {NAME} {VERSION} checkpoints every block (full) or per op (selective)"
    if grid.tp > 1 and not grid.sequence_parallel:
        return f"tensor parallelism without sequence parallelism: {NAME}'s tensor-parallel plans always use it"
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


def base_of(model: ModelSpec | None) -> tuple[str, bool]:
    """torchtitan's config function for ``model`` (``module:function``) and whether it is the model's own
    (False: the family's, for the user to replace)."""
    if model is None:
        return FALLBACK[False], False
    key = (
        model.num_layers,
        model.hidden_size,
        model.num_heads,
        model.num_kv_heads,
        model.vocab_size,
        model.num_experts if model.is_moe else 0,
    )
    if key in BASES:
        return BASES[key], True
    return FALLBACK[model.is_moe], False


def module_parts(grid: EngineGrid) -> list[list[str]]:
    """``module_fqns_per_model_part``: the module names of each model part (virtual stage)."""
    parts, layer = [], 0
    for n in grid.chunk_layers:
        parts.append([f"layers.{i}" for i in range(layer, layer + n)])
        layer += n
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", "lm_head"]
    return parts


def plan_values(grid: EngineGrid, model: ModelSpec | None) -> dict:
    """The ``PLAN`` literal: the config's fields this plan sets, by section."""
    # local_batch_size: what one data-parallel rank takes per optimizer step when it pipelines (split into
    # micro-batches of pipeline_parallel_microbatch_size); without a pipeline, one micro-batch, the global
    # batch making torchtitan accumulate gradients over num_microbatches of them
    local = grid.micro_batch_size * (grid.num_microbatches if grid.pp > 1 else 1)
    training: dict[str, object] = {"local_batch_size": local, "global_batch_size": grid.global_batch_size}
    if model is not None:
        training["seq_len"] = model.seq_len
        training["mixed_precision_param"] = "bfloat16" if model.precision == "bf16" else "float32"
    training["enable_cpu_offload"] = grid.offload == "all"
    # Trainer.Config refuses CUDA graphs with a pipeline, and with expert parallelism over its default
    # (all-to-all) token dispatcher
    training["disable_cuda_graphs"] = grid.pp > 1 or grid.expert_parallel > 1
    par: dict[str, object] = {
        "data_parallel_replicate_degree": grid.dp if grid.zero == 0 else 1,
        "data_parallel_shard_degree": 1 if grid.zero == 0 else grid.dp,
        "fsdp_reshard_after_forward": {0: "default", 2: "never", 3: "always"}[grid.zero],
        "tensor_parallel_degree": grid.tp,
        "enable_sequence_parallel": grid.tp > 1,
        "pipeline_parallel_degree": grid.pp,
        "expert_parallel_degree": grid.expert_parallel,
    }
    if grid.pp > 1:
        par["pipeline_parallel_schedule"] = _SCHEDULES[grid.schedule]
        par["pipeline_parallel_microbatch_size"] = grid.micro_batch_size
        par["module_fqns_per_model_part"] = module_parts(grid)
    return {
        "layers": sum(grid.chunk_layers),
        "training": training,
        "parallelism": par,
        "activation_checkpoint": _AC[grid.recompute],
    }


_BODY = '''

def autotune_plan():
    """torchtitan's config of BASE's model with the plan's training, parallelism and checkpointing."""
    import dataclasses
    import importlib

    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    module, function = BASE.split(":")
    config = getattr(importlib.import_module(module), function)()
    blocks = len(config.model_spec.model.layers)
    if PLAN["parallelism"]["pipeline_parallel_degree"] > 1 and blocks != PLAN["layers"]:
        raise ValueError(
            f"the plan splits {PLAN['layers']} blocks over its pipeline stages; {BASE}'s model has {blocks}: "
            "set BASE to the config function of the model you planned for"
        )
    config.training = dataclasses.replace(config.training, **PLAN["training"])
    config.parallelism = dataclasses.replace(config.parallelism, **PLAN["parallelism"])
    checkpointing = {"full": FullAC.Config, "selective": SelectiveAC.Config}.get(PLAN["activation_checkpoint"])
    config.activation_checkpoint = checkpointing() if checkpointing else None
    return config
'''


def render(grid: EngineGrid, model: ModelSpec | None, header: list[str]) -> str:
    base, own = base_of(model)
    lines = [f"# {h}" for h in header] + [f"# {note}" for note in notes(grid, model)]
    lines += ['"""A torchtitan 0.3 config module written by ``autotune export`` (``--config autotune_plan``)."""', ""]
    if own:
        lines.append(f"# the model: torchtitan's own config of {model.name if model else ''}")
    else:
        what = f"{model.name} ({model.num_layers} blocks, hidden {model.hidden_size})" if model else "the model"
        lines.append(f"# the model: torchtitan {VERSION} has no config of {what}; replace BASE with yours")
    lines.append(f"BASE = {json.dumps(base)}")
    lines += ["PLAN = {"] + [f"    {line}" for line in _literal_lines(plan_values(grid, model))] + ["}"]
    return "\n".join(lines) + "\n" + _BODY


def _literal(value: object) -> str:
    """A Python literal of a value of ``PLAN`` (strings, numbers, booleans, None, lists of them)."""
    return repr(value) if isinstance(value, bool) or value is None else json.dumps(value)


def _literal_lines(values: dict) -> list[str]:
    """``values`` as the lines of a dict literal's body: sections one key a line, model parts one a line."""
    out = []
    for key, value in values.items():
        if not isinstance(value, dict):
            out.append(f"{json.dumps(key)}: {_literal(value)},")
            continue
        out.append(f"{json.dumps(key)}: {{")
        for k, v in value.items():
            if k == "module_fqns_per_model_part":
                out += [f'    "{k}": ['] + [f"        {json.dumps(part)}," for part in v] + ["    ],"]
            else:
                out.append(f"    {json.dumps(k)}: {_literal(v)},")
        out.append("},")
    return out


def notes(grid: EngineGrid, model: ModelSpec | None) -> list[str]:
    """What the user adds by hand beside this module (in its header, printed by export)."""
    base, own = base_of(model)
    out = [
        "run: PYTHONPATH=<this file's folder> torchrun --nproc-per-node <GPUs per node> -m torchtitan.train "
        "--module <this file's name, no .py> --config autotune_plan (torchtitan 0.3)",
        "add: the tokenizer (hf_assets_path), the dataset, steps and the learning rate, on the command line "
        "(--training.steps ...) or in autotune_plan()",
    ]
    if not own:
        out.append(f"the model: BASE is {base.split(':')[1]}, not your model: set it to your model's config function")
    return out


def read_plan(text: str) -> dict:
    """The ``PLAN`` literal of a module ``render`` wrote (read, never run)."""
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["PLAN"]:
            return ast.literal_eval(node.value)
    raise SpecError("torchtitan config module", "", "no PLAN = {...} literal")


def parse(text: str) -> EngineGrid:
    """The grid of a module ``render`` wrote (its ``PLAN`` literal)."""
    plan = read_plan(text)
    par, training = plan["parallelism"], plan["training"]
    replicate, shard = par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]
    dp, pp = replicate * shard, par["pipeline_parallel_degree"]
    local = training["local_batch_size"]
    if pp > 1:
        mbs = par["pipeline_parallel_microbatch_size"]
        nmb = local // mbs
        chunks = tuple(sum(m.startswith("layers.") for m in part) for part in par["module_fqns_per_model_part"])
    else:
        mbs, chunks = local, (plan["layers"],)
        nmb = max(1, training["global_batch_size"] // (local * dp))
    zero = {"default": 0, "never": 2, "always": 3}[par["fsdp_reshard_after_forward"]]
    schedule = {v: k for k, v in _SCHEDULES.items()}[par.get("pipeline_parallel_schedule", "1F1B")]
    return EngineGrid(
        dp=dp,
        pp=pp,
        tp=par["tensor_parallel_degree"],
        vpp=len(chunks) // pp,
        micro_batch_size=mbs,
        num_microbatches=nmb,
        chunk_layers=chunks,
        schedule=schedule if pp > 1 else "1f1b",
        recompute={v: k for k, v in _AC.items()}[plan["activation_checkpoint"]],
        sequence_parallel=par["enable_sequence_parallel"],
        zero=zero,
        offload="all" if training["enable_cpu_offload"] else "none",
        expert_parallel=par["expert_parallel_degree"],
    )
