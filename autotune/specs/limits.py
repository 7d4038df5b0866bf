"""Upper bounds of every numeric field and the one check of a number against its bound.

The vocabulary of plans (schedules, ZeRO stages, offload and recompute modes) is here too, so that the
cluster, model and plan modules and every feature part (``mixed_stage``, ``roundpipe``) share one list.
"""

from __future__ import annotations

import math

from autotune.errors import SpecError, shown

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")
#: RoundPipe's dispatch (``autotune.specs.roundpipe``)
ROUNDPIPE = "roundpipe"
#: every schedule a plan may name: the pipeline schedules above and RoundPipe's dispatch
ALL_SCHEDULES = SCHEDULES + (ROUNDPIPE,)
MLP_KINDS = ("gelu", "swiglu")
#: ZeRO / FSDP stages (Rajbhandari et al. 2020): 0 none, 1 optimizer state, 2 + gradients, 3 + parameters
ZERO_STAGES = (0, 1, 2, 3)
#: per-stage CPU offload: nothing, optimizer state + master weights (ZeRO-Offload), everything (ZeRO-Infinity)
OFFLOAD_MODES = ("none", "optimizer", "all")
PRECISIONS = ("bf16", "fp16", "fp32")  # fp32: fp32 tensors, TF32 matmuls where the GPU has them
BIAS_KINDS = ("none", "qkv", "all")  # which linear layers (and norms) carry biases
ATTENTION_KINDS = ("flash", "standard")  # flash: fused, scores never stored; standard: scores stored
RECOMPUTE_MODES = (False, True, "selective", "selective-op")  # and "every-N": autotune.specs.recompute
#: an inline GPU without its own TF32 / FP32 peaks gets ``peak_tflops`` divided by these (the ratios of the
#: A100 and H100 datasheets: TF32 dense = half the 16-bit dense rate, FP32 = 1/16 of it)
DEFAULT_TF32_RATIO, DEFAULT_FP32_RATIO = 2.0, 16.0


#: Upper bounds per field (docs/formats.md, "Limits"): a value above one is refused with the number in
#: the message, before anything is simulated, searched or launched. A field not listed here gets
#: ``DEFAULT_LIMIT``; a new field with a sharper natural bound adds it here.
LIMITS: dict[str, float] = {
    # cluster (rates such as peak_tflops or bandwidth_GBps cost nothing to compute with: DEFAULT_LIMIT)
    "count": 1024,
    "repeat": 4096,
    "latency_us": 100_000_000,
    "slowdown": 1000,
    # model
    "num_layers": 2048,
    "hidden_size": 131_072,
    "num_heads": 4096,
    "num_kv_heads": 4096,
    "ffn_hidden_size": 1_048_576,
    "vocab_size": 16_777_216,
    "seq_len": 4_194_304,
    "global_batch_size": 1_048_576,
    "num_experts": 4096,
    "experts_per_token": 4096,
    "expert_ffn_hidden_size": 1_048_576,
    "moe_layer_every": 2048,
    "head_dim": 65_536,
    "learned_positions": 4_194_304,
    "sliding_window": 4_194_304,
    "shared_expert_ffn_hidden_size": 1_048_576,
    "first_dense_layers": 2048,
    # plan
    "expert_parallel": 16_384,
    "sync_every_steps": 1_000_000,
    "micro_batch_size": 65_536,
    "num_microbatches": 65_536,
    "virtual_stages": 128,
    "layers": 2048,
}
DEFAULT_LIMIT = 1e18
#: devices in one cluster, over all nodes (after ``repeat``)
MAX_DEVICES = 16_384


def limit_of(name: str) -> float:
    """The upper bound of field ``name`` (``pipelines[0].num_microbatches`` -> that of ``num_microbatches``)."""
    return LIMITS.get(name.rsplit(".", 1)[-1].split("[", 1)[0], DEFAULT_LIMIT)


def positive(
    source: str,
    name: str,
    value: float,
    *,
    integer: bool = False,
    minimum: float = 0.0,
    strict: bool = True,
    maximum: float | None = None,
) -> None:
    """A number (an integer with ``integer``) above ``minimum`` (or equal, without ``strict``) and at
    most ``maximum`` (default: the field's entry in ``LIMITS``)."""
    if integer and (isinstance(value, bool) or not isinstance(value, int)):
        raise SpecError(source, name, f"must be an integer, got {shown(value)}")
    if not integer and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
        raise SpecError(source, name, f"must be a number, got {shown(value)}")
    if strict and value <= minimum:
        raise SpecError(source, name, f"must be > {minimum:g}, got {shown(value)}")
    if not strict and value < minimum:
        raise SpecError(source, name, f"must be >= {minimum:g}, got {shown(value)}")
    top = limit_of(name) if maximum is None else maximum
    if value > top:
        shown_top = f"{int(top):,}" if float(top).is_integer() else f"{top:g}"
        raise SpecError(source, name, f"must be <= {shown_top} (the documented limit), got {shown(value)}")
