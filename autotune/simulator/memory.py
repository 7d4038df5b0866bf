"""Memory per device: model states, activations for the micro-batches in flight, and a reserve.

- Model states, mixed-precision Adam: 16 bytes per parameter (2 for the 16-bit weight, 2 for its
  gradient, 4 + 4 + 4 for the fp32 master weight and the two Adam moments; Rajbhandari et al. 2020,
  "ZeRO", Sec. 3.1), for the parameters a device holds (its layers' share under tensor parallelism).
- Activations of one transformer layer for one micro-batch, 16-bit, no sequence parallelism,
  no flash attention (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", Sec. 4): ``s b h (34 + 5 a s / h)`` bytes without tensor parallelism and
  ``s b h (10 + 24 / t + 5 a s / (h t))`` with ``t``-way tensor parallelism. Their terms, generalised
  to grouped-query attention and SwiGLU: replicated ``10 s b h`` (layer-norm inputs 4, attention and MLP
  inputs 2 + 2, two dropout masks 1 + 1); split across ``t``: Q 2 s b h, K and V 2 s b h_kv each, the
  output-projection input 2 s b h, the MLP's inner activations ``4 s b f`` (GeLU: its input and the
  second matrix's input) or ``6 s b f`` (SwiGLU: gate, up and their product), and the attention
  scores ``5 a s^2 b`` (softmax output 2, dropout mask 1, dropout output 2). For a GPT layer
  (``h_kv = h``, ``f = 4h``, GeLU) this is exactly Korthikanti's formula.
- Full recomputation keeps only each layer's input (``2 s b h``) and rebuilds one layer's full
  activations during its backward.
- The schedule decides how many micro-batches' activations a stage holds at once (1F1B: ``min(m, p - i)``
  for stage ``i`` of ``p``; GPipe: ``m``; interleaved: Megatron's warm-up count plus one, in chunks);
  ``autotune.simulator.schedule`` counts them from the stage's operation order.
- Mixture-of-experts blocks: ``autotune.simulator.moe`` (router probabilities, dispatched copies, expert
  activations; expert states of the experts a device holds and trains).
- First stage: the embedding's dropout mask per micro-batch in flight (``s b h`` bytes). Last stage:
  one micro-batch's logits in 16 bits plus their fp32 softmax and gradient (``10 s b V / t`` bytes).

A device runs out of memory when its peak exceeds its capacity minus a reserve of
``RESERVE_GiB + RESERVE_FRACTION * capacity``: about 1 GiB for the CUDA context, cuBLAS/NCCL
workspaces and buffers, and 5% for caching-allocator fragmentation (PyTorch's allocator typically
leaves a few percent of reserved memory unusable).
"""

from __future__ import annotations

from autotune.simulator.moe import activation_delta_per_token
from autotune.specs import ModelSpec

GiB = float(2**30)
BYTES_PER_PARAM_STATE = 16  # Rajbhandari et al. 2020 (ZeRO), mixed-precision Adam: 2 + 2 + 12
RESERVE_GiB = 1.0           # CUDA context + library workspaces + communication buffers
RESERVE_FRACTION = 0.05     # caching-allocator fragmentation


def usable_memory_GiB(capacity_GiB: float) -> float:
    return capacity_GiB - RESERVE_GiB - RESERVE_FRACTION * capacity_GiB


def layer_activation_bytes(model: ModelSpec, micro_batch_size: int, tp: int, flash_attention: bool = False) -> float:
    """Bytes one transformer layer keeps for the backward of one micro-batch (Korthikanti et al. 2022).
    ``flash_attention`` drops the ``5 a s^2 b`` attention-score term (fused attention stores no scores)."""
    s, b, h, f = model.seq_len, micro_batch_size, model.hidden_size, model.ffn_hidden_size
    a, hkv = model.num_heads, model.kv_hidden_size
    mlp_inner = (6 if model.mlp == "swiglu" else 4) * f
    replicated = 10 * h
    split = 2 * h + 4 * hkv + 2 * h + mlp_inner
    scores = 0.0 if flash_attention else 5.0 * a * s * s * b / tp
    # MoE blocks store router probabilities, dispatched token copies and expert activations instead
    moe_blocks = activation_delta_per_token(model, tp)
    return s * b * (replicated + split / tp + moe_blocks) + scores


def layer_input_bytes(model: ModelSpec, micro_batch_size: int) -> float:
    """What full recomputation keeps per layer: its 16-bit input."""
    return 2.0 * model.seq_len * micro_batch_size * model.hidden_size


def stage_params(model: ModelSpec, layers: int, tp: int, first: bool, last: bool) -> float:
    """Parameters one device of a stage holds (its 1/tp share)."""
    params = layers * model.params_per_layer
    if first:
        params += model.embedding_params
    if last:
        params += model.embedding_params + model.hidden_size  # untied LM head + final norm
    return params / tp


def stage_activation_bytes(model: ModelSpec, micro_batch_size: int, tp: int, layers: int, recompute: bool,
                           in_flight_chunks: int, chunks: int, first: bool, last: bool,
                           flash_attention: bool = False, measured_full_bytes: float | None = None,
                           measured_kept_bytes: float | None = None) -> float:
    """Peak activation bytes of one device of a stage holding ``in_flight_chunks`` chunk activations.
    ``measured_full_bytes`` / ``measured_kept_bytes`` (a calibration profile's per-layer
    ``activation_bytes`` without / with recomputation) replace the formulas when given."""
    layers_per_chunk = layers / chunks
    full = layer_activation_bytes(model, micro_batch_size, tp, flash_attention)
    if measured_full_bytes is not None:
        full = measured_full_bytes
    if recompute:
        kept = layer_input_bytes(model, micro_batch_size) if measured_kept_bytes is None else measured_kept_bytes
        total = in_flight_chunks * layers_per_chunk * kept + (full if layers else 0.0)
    else:
        total = in_flight_chunks * layers_per_chunk * full
    s, b = model.seq_len, micro_batch_size
    if first:
        total += -(-in_flight_chunks // chunks) * s * b * model.hidden_size  # embedding dropout mask (chunk 0)
    if last:
        total += 10.0 * s * b * model.vocab_size / tp  # logits: 16-bit + fp32 softmax + fp32 gradient
    return total


def stage_peak_GiB(model: ModelSpec, micro_batch_size: int, tp: int, layers: int, recompute: bool,
                   in_flight_chunks: int, chunks: int, first: bool, last: bool, flash_attention: bool = False,
                   measured_full_bytes: float | None = None, measured_kept_bytes: float | None = None,
                   baseline_GiB: float = 0.0, state_bytes_per_param: float | None = None,
                   activation_factor: float = 1.0, states_bytes: float | None = None) -> float:
    """``baseline_GiB``: a profile's measured per-process memory besides states and activations;
    ``state_bytes_per_param``: a profile's measured bytes per parameter (default 16, ZeRO's figure);
    ``activation_factor``: a profile's measured peak bytes per saved activation byte (default 1);
    ``states_bytes``: the model-state bytes on the device when sharding or offload change them
    (``autotune.simulator.zero``), in place of bytes per parameter x parameters."""
    per_param = BYTES_PER_PARAM_STATE if state_bytes_per_param is None else state_bytes_per_param
    states = per_param * stage_params(model, layers, tp, first, last) if states_bytes is None else states_bytes
    acts = stage_activation_bytes(model, micro_batch_size, tp, layers, recompute, in_flight_chunks, chunks,
                                  first, last, flash_attention, measured_full_bytes, measured_kept_bytes)
    return (states + activation_factor * acts) / GiB + baseline_GiB
