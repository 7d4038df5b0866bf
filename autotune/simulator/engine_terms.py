"""What differs between the engines that run a plan, where the simulator counts it differently.

The simulator predicts autotune's own runner by default (``"autotune"``); the published runs it is
validated on ran on other engines, so each term below is per engine (``Simulator(..., engine=...)``):

- ``loss_bytes_per_logit``: what the last stage holds per logit at the loss's peak. The loss is
  cross-entropy in fp32 (``log_softmax`` saves its 4-byte output); its backward holds that output, the
  incoming gradient and the outgoing one at once (12 bytes), plus whatever still holds the logits.
  autotune's runner: 16, torch.distributed.pipelining keeps the last stage's fp32 output for its backward;
  torchtitan: 12 (``del pred`` before the backward). Megatron-LM / DeepSpeed: ``None``, i.e. ``e + 8``
  (the logits in the model's precision plus an fp32 softmax and gradient: the rule before engines were told
  apart, kept for the published Megatron and Sailor runs; not measured). Measured on CPU with the runner's
  ``lm_loss`` (``experiments/fidelity/loss_peak.py``): 16.0 and 12.0 bytes per logit.
- ``vocab_parallel``: whether the embedding and the LM head are split across a stage's tensor-parallel
  group (Megatron-LM, DeepSpeed on Megatron, torchtitan's loss-parallel output; autotune's runner, through
  torch's ``RowwiseParallel`` embedding, ``ColwiseParallel`` head and ``loss_parallel`` cross-entropy,
  ``runner.engine``). The runner splits them only where the degree divides the vocabulary (it does not pad
  the vocabulary as Megatron-LM does: a padded model is another model); elsewhere every rank of the group
  holds the whole embedding and head, computes the whole logits and holds their loss
  (``vocab_split``).
- ``scatter_gather``: how a pipeline hand-off between two stages of the same tensor-parallel degree ``t > 1``
  (no sequence parallelism) moves the activation. Megatron-LM before Megatron-Core (v2-v3, 2020-2022; the
  engine ``"megatron-legacy"``, for the published runs of that code and of Aceso's runtime built on it)
  scatters and gathers (Narayanan et al. 2021, Sec. 4.1; on unless ``--no-scatter-gather-tensors-in-pipeline``):
  each sending rank sends its ``1/t`` of the activation to the matching receiving rank, and the receiving stage
  all-gathers it inside its group, so the link between the stages carries the activation once.
  Megatron-Core (``"megatron"``, what ``--engine megatron`` exports to: its ``p2p_communication`` sends the
  whole ``(s, b, h)`` tensor), DeepSpeed's pipeline engine and ``torch.distributed.pipelining`` (autotune's
  runner, torchtitan): every rank sends the whole activation to its peer, ``t`` copies over the link
  (``autotune.specs.handoff``).
- ``fp32_state``: what a bf16 plan's weights and gradients are held, all-reduced, reduce-scattered and
  gathered in. autotune's runner computes under ``torch.autocast(bfloat16)`` over fp32 weights: fp32
  weights and gradients, Adam's two fp32 moments beside them and no separate master copy (4 + 4 + 8 bytes
  per parameter, ``zero.FP32_ADAM``); its data-parallel all-reduce (``Engine._sync_gradients``), its
  ZeRO engine's and FSDP2's gathers and reduce-scatters all move fp32 (FSDP2 without a
  ``MixedPrecisionPolicy``; ``runner.zero``'s separate fp32 master shard, 4 bytes per parameter over the
  peers, is not counted). The other engines keep 16-bit weights and gradients beside fp32 master
  weights and reduce in 16 bits (ZeRO's mixed-precision Adam, 2 + 2 + 12, ``zero.MIXED_PRECISION_ADAM``:
  DeepSpeed's default; Megatron-LM's fp16; the published runs were fitted so). Not modelled: Megatron-LM
  reduces bf16 gradients in fp32 too (``--accumulate-allreduce-grads-in-fp32``, forced for bf16) and
  torchtitan gathers bf16 weights and reduces fp32 gradients (its ``MixedPrecisionPolicy``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineTerms:
    loss_bytes_per_logit: float | None  # None: the model's element size + 8
    vocab_parallel: bool  # embedding and LM head split across the tensor-parallel group
    pads_vocab: bool = True  # False: split only where the degree divides the vocabulary (autotune's runner)
    scatter_gather: bool = False  # pipeline hand-offs: 1/t per rank, then an all-gather in the receiving group
    fp32_state: bool = False  # bf16 plans keep, reduce and gather fp32 weights and gradients (autotune's runner)


ENGINE_TERMS: dict[str, EngineTerms] = {
    "autotune": EngineTerms(16.0, True, pads_vocab=False, fp32_state=True),
    "torchtitan": EngineTerms(12.0, True),
    "megatron": EngineTerms(None, True),
    "deepspeed": EngineTerms(None, True),
    # not an export target: Megatron-LM's published runs of 2020-2022 and Aceso's runtime
    "megatron-legacy": EngineTerms(None, True, scatter_gather=True),
}
DEFAULT_ENGINE = "autotune"


def engine_terms(engine: str) -> EngineTerms:
    if engine not in ENGINE_TERMS:
        raise ValueError(f"engine must be one of {', '.join(ENGINE_TERMS)}, got {engine!r}")
    return ENGINE_TERMS[engine]


def loss_bytes_per_logit(engine: str, elem_bytes: int) -> float:
    """Bytes per logit the loss holds at its peak under ``engine``."""
    fixed = engine_terms(engine).loss_bytes_per_logit
    return elem_bytes + 8.0 if fixed is None else fixed


def fp32_state(precision: str, engine: str) -> bool:
    """Whether a ``precision`` plan's weights and gradients are held and moved in fp32 under ``engine``:
    fp32 training, or bf16 on an engine with ``fp32_state`` (autotune's runner)."""
    return precision == "fp32" or (precision == "bf16" and engine_terms(engine).fp32_state)


def scatter_gather(engine: str, src_tp: int, dst_tp: int, sequence_parallel: bool) -> bool:
    """Whether ``engine`` hands an activation from a ``src_tp``-wide stage to a ``dst_tp``-wide one by
    scatter/gather (1/t per rank and an all-gather on the receiver) rather than t whole copies."""
    return engine_terms(engine).scatter_gather and src_tp == dst_tp > 1 and not sequence_parallel


def vocab_split(vocab_size: int, tp: int) -> bool:
    """Whether autotune's runner splits the embedding and the LM head of a ``vocab_size`` model across a
    ``tp``-wide tensor-parallel group: where ``tp`` divides the vocabulary (equal shards, which replicas of
    different degrees can average part by part, ``runner.reshard``)."""
    return tp > 1 and vocab_size % tp == 0


def head_group(engine: str, tp: int, vocab_size: int) -> int:
    """How many ranks of a ``tp``-wide group split the embedding and the LM head of a ``vocab_size`` model
    under ``engine``."""
    terms = engine_terms(engine)
    if not terms.vocab_parallel or (not terms.pads_vocab and not vocab_split(vocab_size, tp)):
        return 1
    return tp
