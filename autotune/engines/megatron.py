"""Megatron-LM (Megatron-Core 0.19, checked with 0.19.2; its flags are 0.14's and later, sliding windows 0.15's): a
plan as ``pretrain_gpt.py`` arguments.

The grid (``autotune.engines.grid``) maps to ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
``--micro-batch-size`` and ``--global-batch-size`` (the data-parallel degree is the world size over
``tp x pp``, so the file says the world size in its header). An uneven layer split, or interleaving, is
``--pipeline-model-parallel-layout`` (``E`` embedding, ``t`` a block, ``L`` the loss; stages split by
``|``, virtual stages in order: chunk 0 of every stage, then chunk 1); an even one without interleaving
needs no layout. ZeRO 1 is ``--use-distributed-optimizer``; ZeRO 2 / 3 are Megatron-FSDP
(``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads | optim_grads_params``), which
does not run with pipeline parallelism and checkpoints as ``--ckpt-format fsdp_dtensor``; ``offload:
optimizer`` is ``--optimizer-cpu-offload`` with the distributed optimizer and the precision-aware one. The
header says what the user adds by hand (``notes``: data, tokenizer, iterations, and
``CUDA_DEVICE_MAX_CONNECTIONS=1`` with tensor parallelism, unset with Megatron-FSDP). What Megatron-LM cannot
run, ``refusal`` names: GPipe, parameter offload.
"""

from __future__ import annotations

import re
import shlex

from autotune.engines.grid import EngineGrid
from autotune.errors import SpecError
from autotune.specs import ModelSpec

NAME = "Megatron-LM"
RESTRICTIONS = {"schedule": ["1f1b", "interleaved-1f1b"], "recompute": ["none", "all", "low-memory", "selective"]}
_SHARDING = {2: "optim_grads", 3: "optim_grads_params"}


def refusal(grid: EngineGrid) -> str | None:
    if grid.pp > 1 and grid.schedule == "gpipe":
        return f"schedule gpipe: {NAME} runs 1F1B and interleaved 1F1B only"
    if grid.recompute not in (False, True, "selective"):
        return (
            f"recompute {grid.recompute} (torchtitan's): {NAME} recomputes whole layers (full) or the attention "
            "core (selective)"
        )
    if grid.zero >= 2 and grid.pp > 1:
        return f"zero {grid.zero} with {grid.pp} pipeline stages: {NAME}'s FSDP does not run with pipeline parallelism"
    if grid.offload == "all":
        return f"offload all (parameters in host memory): {NAME} offloads the optimizer only"
    if grid.offload == "optimizer" and grid.zero == 0:
        return f"offload optimizer without zero: {NAME}'s --optimizer-cpu-offload needs the distributed optimizer"
    return None


def layout(grid: EngineGrid) -> str:
    """The ``--pipeline-model-parallel-layout`` string of the grid's chunks."""
    parts = [f"t*{n}" if n > 2 else "t" * n for n in grid.chunk_layers]
    parts[0] = "E" + parts[0]
    parts[-1] += "L"
    return "|".join(parts)


def parse_layout(text: str) -> tuple[int, ...]:
    """Blocks per virtual stage of a layout string (``(pattern)*N`` and ``x*N`` expanded)."""
    s = text.replace(",", "")
    while "(" in s:
        s = re.sub(r"\(([^()]*)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s, count=1)
    s = re.sub(r"([EtmL])\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    return tuple(part.count("t") for part in s.split("|"))


def render(grid: EngineGrid, model: ModelSpec | None, header: list[str]) -> str:
    args: list[tuple[str, object]] = [
        ("--num-layers", sum(grid.chunk_layers)),
        ("--tensor-model-parallel-size", grid.tp),
        ("--pipeline-model-parallel-size", grid.pp),
        ("--micro-batch-size", grid.micro_batch_size),
        ("--global-batch-size", grid.global_batch_size),
    ]
    if grid.vpp > 1 or not grid.even_layers:
        args.append(("--pipeline-model-parallel-layout", layout(grid)))
    if grid.sequence_parallel:
        args.append(("--sequence-parallel", None))
    if grid.recompute is True:
        args += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"), ("--recompute-num-layers", 1)]
    elif grid.recompute == "selective":
        args.append(("--recompute-granularity", "selective"))
    if grid.zero == 1:
        args.append(("--use-distributed-optimizer", None))
    elif grid.zero >= 2:  # Megatron-FSDP checkpoints only in its own DTensor format (validate_args)
        args += [
            ("--use-megatron-fsdp", None),
            ("--data-parallel-sharding-strategy", _SHARDING[grid.zero]),
            ("--ckpt-format", "fsdp_dtensor"),
        ]
    if grid.offload == "optimizer":  # the CPU offload runs in the precision-aware optimizer (validate_args)
        args += [
            ("--optimizer-cpu-offload", None),
            ("--optimizer-offload-fraction", 1.0),
            ("--use-precision-aware-optimizer", None),
        ]
    if grid.expert_parallel > 1:
        args.append(("--expert-model-parallel-size", grid.expert_parallel))
    if model is not None:
        args += model_args(model)
    lines = [f"# {h}" for h in header] + [f"# world size {grid.world_size}"]
    lines += [f"# {note}" for note in notes(grid, model)]
    body = [f"{k} {shlex.quote(str(v))}" if v is not None else k for k, v in args]
    return "\n".join(lines + [" \\\n".join(body)]) + "\n"


def model_args(model: ModelSpec) -> list[tuple[str, object]]:
    """The model's shape as Megatron-LM arguments (``--num-layers`` is the grid's)."""
    out: list[tuple[str, object]] = [
        ("--hidden-size", model.hidden_size),
        ("--ffn-hidden-size", model.ffn_hidden_size),
        ("--num-attention-heads", model.num_heads),
        ("--kv-channels", model.head_dim),
        ("--seq-length", model.seq_len),
        ("--max-position-embeddings", max(model.seq_len, model.learned_positions)),
        ("--vocab-size", model.vocab_size),
    ]
    if model.num_kv_heads != model.num_heads:
        out += [("--group-query-attention", None), ("--num-query-groups", model.num_kv_heads)]
    if model.mlp == "swiglu":
        out += [("--swiglu", None), ("--normalization", "RMSNorm")]
    out.append(("--position-embedding-type", "learned_absolute" if model.learned_positions else "rope"))
    if not model.learned_positions:
        out.append(("--rotary-base", int(model.rope_theta)))  # Llama 3: 500000; Megatron's default is 10000
    if not model.tied_embeddings:
        out.append(("--untie-embeddings-and-output-weights", None))
    if model.bias == "none":
        out.append(("--disable-bias-linear", None))
    elif model.bias == "qkv":
        out += [("--disable-bias-linear", None), ("--add-qkv-bias", None)]
    if model.sliding_window:
        out.append(("--window-size", f"{model.sliding_window},0"))
    out += [("--attention-dropout", model.dropout), ("--hidden-dropout", model.dropout)]
    if model.precision in ("bf16", "fp16"):  # fp32 is Megatron's default: no flag (there is no --no-bf16)
        out.append((f"--{model.precision}", None))
    if model.is_moe:
        pattern = [1 if model.is_moe_layer(i) else 0 for i in range(model.num_layers)]
        out += [
            ("--num-experts", model.num_experts),
            ("--moe-router-topk", model.experts_per_token),
            ("--moe-ffn-hidden-size", model.expert_ffn_hidden_size),
            ("--moe-layer-freq", f"[{','.join(map(str, pattern))}]"),
        ]
        if model.shared_expert_ffn_hidden_size:
            out.append(("--moe-shared-expert-intermediate-size", model.shared_expert_ffn_hidden_size))
    return out


def notes(grid: EngineGrid, model: ModelSpec | None) -> list[str]:
    """What the user adds by hand beside these arguments (written in the file's header, printed by export)."""
    out = [
        "add: --data-path (or --mock-data), --tokenizer-type and its model, --train-iters, --lr and the "
        "schedule, --save / --load; run with torchrun on pretrain_gpt.py"
    ]
    if grid.zero >= 2:  # validate_args: Megatron-FSDP asserts the variable is not 1 (a warning beside tp)
        out.append("environment: leave CUDA_DEVICE_MAX_CONNECTIONS unset (Megatron-FSDP refuses 1)")
    elif grid.tp > 1:  # validate_args asserts it before Blackwell
        out.append("environment: CUDA_DEVICE_MAX_CONNECTIONS=1 (tensor parallelism overlaps its communication)")
    if model is not None and model.sliding_window:
        out.append("--window-size needs Megatron-Core 0.15 or later")
    return out


def parse(text: str) -> EngineGrid:
    """The grid of a file ``render`` wrote (for round trips and for reading a user's arguments back)."""
    world = None
    tokens: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            if m := re.match(r"# world size (\d+)", line):
                world = int(m.group(1))
            continue
        tokens += shlex.split(line.rstrip("\\"))
    args: dict[str, str | None] = {}
    i = 0
    while i < len(tokens):
        key = tokens[i]
        value = tokens[i + 1] if i + 1 < len(tokens) and not tokens[i + 1].startswith("--") else None
        args[key] = value
        i += 1 if value is None else 2
    if world is None:
        raise SpecError("megatron arguments", "", "no '# world size N' line")
    tp, pp = int(args["--tensor-model-parallel-size"]), int(args["--pipeline-model-parallel-size"])
    mbs, gbs = int(args["--micro-batch-size"]), int(args["--global-batch-size"])
    dp = world // (tp * pp)
    if "--pipeline-model-parallel-layout" in args:
        chunks = parse_layout(args["--pipeline-model-parallel-layout"] or "")
    else:
        chunks = (int(args["--num-layers"] or 0) // pp,) * pp
    vpp = len(chunks) // pp
    recompute: bool | str = False
    if args.get("--recompute-granularity") == "full":
        recompute = True
    elif args.get("--recompute-granularity") == "selective":
        recompute = "selective"
    zero = 1 if "--use-distributed-optimizer" in args else 0
    if "--use-megatron-fsdp" in args:
        zero = {v: k for k, v in _SHARDING.items()}[args["--data-parallel-sharding-strategy"] or ""]
    return EngineGrid(
        dp=dp,
        pp=pp,
        tp=tp,
        vpp=vpp,
        micro_batch_size=mbs,
        num_microbatches=gbs // (mbs * dp),
        chunk_layers=chunks,
        schedule="interleaved-1f1b" if vpp > 1 else "1f1b",
        recompute=recompute,
        sequence_parallel="--sequence-parallel" in args,
        zero=zero,
        offload="optimizer" if "--optimizer-cpu-offload" in args else "none",
        expert_parallel=int(args.get("--expert-model-parallel-size") or 1),
    )
