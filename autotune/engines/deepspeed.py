"""DeepSpeed (0.19, checked with 0.19.8; AutoTP tensor parallelism needs 0.16.4+): a plan as a DeepSpeed config JSON.

The grid (``autotune.engines.grid``) maps to ``train_micro_batch_size_per_gpu``,
``gradient_accumulation_steps`` (the micro-batches per replica and step) and ``train_batch_size``;
``zero_optimization.stage`` with ``offload_optimizer`` / ``offload_param`` on the CPU; a pipeline to the
``pipeline`` section (``stages``, ``activation_checkpoint_interval``: 1 with full recomputation), the
split being ``PipelineModule(num_stages=..., partition_method="type:<block class>")`` in the user's code
(``notes`` says so: ``"uniform"`` counts the embedding, norm and head as layers and splits the blocks
unevenly); tensor parallelism to ``tensor_parallel.autotp_size`` (AutoTP training, with an ``mpu`` the
user passes: ``notes``). What DeepSpeed cannot run, ``refusal`` names: an uneven layer split (its
``PipelineModule`` partitions uniformly or by parameter count, not by a given list), GPipe and
interleaved schedules, ZeRO 2 / 3 with a pipeline, AutoTP with a pipeline or with ZeRO 3, selective
checkpointing, sequence parallelism, expert parallelism (set in the model's DeepSpeed-MoE layers).
"""

from __future__ import annotations

import json

from autotune.engines.grid import EngineGrid
from autotune.specs import ModelSpec

NAME = "DeepSpeed"
RESTRICTIONS = {
    "schedule": ["1f1b"],
    "layer_split": [0.0],
    "seq_parallel": [False],
    "expert_parallel": [1],
    "recompute": ["none", "all", "low-memory"],
}


def refusal(grid: EngineGrid) -> str | None:
    if grid.pp > 1 and not grid.even_layers:
        split = "/".join(map(str, grid.stage_layers))
        return f"layers split {split} over the stages: {NAME}'s PipelineModule gives every stage the same number"
    if grid.pp > 1 and grid.schedule != "1f1b":
        return f"schedule {grid.schedule}: {NAME}'s pipeline engine runs its own 1F1B schedule only"
    if grid.pp > 1 and grid.zero >= 2:
        return f"zero {grid.zero} with {grid.pp} pipeline stages: {NAME}'s pipeline engine takes zero 0 or 1"
    if grid.tp > 1 and (grid.pp > 1 or grid.zero == 3):
        return f"tensor parallelism with {'a pipeline' if grid.pp > 1 else 'zero 3'}: {NAME}'s AutoTP training does not run it"
    if grid.offload == "optimizer" and grid.zero == 0:
        return f"offload optimizer without zero: {NAME} offloads the optimizer state ZeRO shards"
    if grid.offload == "all" and grid.zero < 3:
        return f"offload all with zero {grid.zero}: {NAME} offloads parameters under zero 3 only"
    if grid.recompute == "selective":
        return f"recompute selective (Megatron's attention core): {NAME} checkpoints whole layers"
    if grid.recompute not in (False, True):
        return f"recompute {grid.recompute} (torchtitan's): {NAME} checkpoints every layer or none"
    if grid.sequence_parallel:
        return f"sequence parallelism (Megatron's): {NAME}'s Ulysses is a different scheme"
    if grid.expert_parallel > 1:
        return f"expert parallelism: {NAME} sets it in the model's MoE layers (ep_size), not in its config"
    return None


def render(grid: EngineGrid, model: ModelSpec | None, header: list[str]) -> str:
    doc: dict[str, object] = {
        "train_batch_size": grid.global_batch_size,
        "train_micro_batch_size_per_gpu": grid.micro_batch_size,
        "gradient_accumulation_steps": grid.num_microbatches,
    }
    precision = model.precision if model is not None else "bf16"
    if precision in ("bf16", "fp16"):
        doc[precision] = {"enabled": True}
    zero: dict[str, object] = {"stage": grid.zero}
    if grid.offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if grid.offload == "all":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    doc["zero_optimization"] = zero
    if grid.tp > 1:
        doc["tensor_parallel"] = {"autotp_size": grid.tp}
    if grid.pp > 1:  # the split itself is PipelineModule's partition_method, in the user's code (notes)
        doc["pipeline"] = {"stages": grid.pp, "activation_checkpoint_interval": 1 if grid.recompute is True else 0}
    elif grid.recompute is True:
        doc["activation_checkpointing"] = {"partition_activations": False, "number_checkpoints": sum(grid.chunk_layers)}
    # what the plan says beyond DeepSpeed's own keys (DeepSpeed ignores keys it does not know)
    doc["autotune"] = {"plan": header, "layers": sum(grid.chunk_layers)}
    return json.dumps(doc, indent=2) + "\n"


def notes(grid: EngineGrid, model: ModelSpec | None) -> list[str]:
    """What the user adds by hand beside the JSON (``export`` prints them)."""
    out = ["add: your model, data loader and training loop around deepspeed.initialize(config=<this file>)"]
    if grid.pp > 1:
        out.append(
            f"pipeline: PipelineModule(layers=..., num_stages={grid.pp}, partition_method='type:<your block "
            f"class>') gives each stage {grid.chunk_layers[0]} blocks as the plan does ('uniform' counts the "
            "embedding, the final norm and the head as layers too and splits the blocks unevenly)"
        )
    if grid.tp > 1:
        out.append(
            f"tensor parallelism (AutoTP, DeepSpeed 0.16.4 or later): pass mpu= (process groups of tp {grid.tp}) "
            f"to deepspeed.initialize, or train_batch_size {grid.global_batch_size} is checked against every rank "
            "as a data-parallel one and refused"
        )
    return out


def parse(text: str) -> EngineGrid:
    doc = json.loads(text)
    mbs, gas = doc["train_micro_batch_size_per_gpu"], doc["gradient_accumulation_steps"]
    pipe = doc.get("pipeline", {})
    pp, tp = pipe.get("stages", 1), doc.get("tensor_parallel", {}).get("autotp_size", 1)
    zero = doc.get("zero_optimization", {})
    offload = "all" if "offload_param" in zero else ("optimizer" if "offload_optimizer" in zero else "none")
    recompute = bool(pipe.get("activation_checkpoint_interval")) or "activation_checkpointing" in doc
    layers = doc.get("autotune", {}).get("layers", 0)
    return EngineGrid(
        dp=doc["train_batch_size"] // (mbs * gas),
        pp=pp,
        tp=tp,
        vpp=1,
        micro_batch_size=mbs,
        num_microbatches=gas,
        chunk_layers=(layers // pp,) * pp,
        schedule="1f1b",
        recompute=recompute,
        zero=zero.get("stage", 0),
        offload=offload,
    )
