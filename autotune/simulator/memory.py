"""Memory per device: model states, activations for the micro-batches in flight, and a reserve.

- Model states, Adam: 16 bytes per parameter, for the parameters a device holds (its layers' share
  under tensor parallelism). Mixed precision (bf16/fp16): 2 for the 16-bit weight, 2 for its gradient,
  4 + 4 + 4 for the fp32 master weight and the two Adam moments (Rajbhandari et al. 2020, "ZeRO",
  Sec. 3.1); fp32: 4 weight + 4 gradient + 4 + 4 moments, the same 16.
- Activations of one transformer layer for one micro-batch (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", Sec. 4, Table 2): in 16-bit with dropout and
  stored attention scores, ``s b h (34 + 5 a s / h)`` bytes without tensor parallelism and
  ``s b h (10 + 24 / t + 5 a s / (h t))`` with ``t``-way tensor parallelism. Their terms, generalised
  to grouped-query attention, SwiGLU, the element size ``e`` of the model's precision (2 bytes for
  bf16/fp16, 4 for fp32) and dropout on or off (masks are 1 byte): replicated across the tensor-parallel
  group ``(4 e + 2 d) s b h`` (two layer-norm inputs, the attention and MLP inputs, and with dropout
  ``d = 1`` its two masks); split across ``t``: Q ``e s b h``, K and V ``e s b h_kv`` each, the
  output-projection input ``e s b h``, the MLP's inner activations ``2 e s b f`` (GeLU: its input and the
  second matrix's input) or ``3 e s b f`` (SwiGLU: gate, up and their product), and with standard
  attention the scores ``(e + d (1 + e)) a s^2 b`` (softmax output, and with dropout its mask and
  output). For a GPT layer (``h_kv = h``, ``f = 4h``, GeLU) in 16 bits with dropout this is exactly
  Korthikanti's formula.
- ``attention: flash`` (fused attention, Dao et al. 2022) stores no scores: the score term is 0 (its
  output and log-sum-exp are counted with the output-projection input).
- Selective recomputation (``recompute: "selective"``) recomputes the attention core (``Q K^T``,
  softmax, dropout, ``P V``) in the backward, so the score term is not kept: ``s b h (10 + 24 / t)``
  (Korthikanti Table 2, "selective"); with flash attention it changes nothing.
- Sequence parallelism (``sequence_parallel``, Korthikanti Sec. 4.2.2) splits the replicated part
  along the sequence as well: ``s b h (34 / t + 5 a s / (h t))``, and ``34 s b h / t`` with selective
  recomputation (Table 2).
- Per-op selective checkpointing (``recompute: "selective-op"``, torchtitan's policy) keeps the layer's
  input and the outputs of every other linear-layer matmul in forward order (Q, K, V, output projection,
  then the MLP's gate, up, down or fc1, fc2: the 1st, 3rd, 5th, 7th are kept) and of fused attention:
  replicated ``e h`` (the input, split along the sequence with sequence parallelism) plus, with SwiGLU,
  ``e h`` (the down projection's output); split across ``t`` Q ``e h_q``, V ``e h_kv``, the MLP's first
  matmul ``e f`` and with flash attention its output ``e h_q``. Standard attention keeps nothing of its
  core (batched matmuls are not on the list). K, the output projection, the second MLP matmul, norms,
  activation functions and softmax are rebuilt for one layer in its backward.
- Every-N checkpointing (``"every-N"``) keeps the input of every N-th block of a chunk and full
  activations of the others (``autotune.specs.recompute``).
- Full recomputation keeps only each layer's input (``e s b h``, ``/ t`` with sequence parallelism)
  and rebuilds one layer's full activations during its backward.
- The schedule decides how many micro-batches' activations a stage holds at once (1F1B: ``min(m, p - i)``
  for stage ``i`` of ``p``; GPipe: ``m``; interleaved: Megatron's warm-up count plus one, in chunks);
  ``autotune.simulator.schedule`` counts them from the stage's operation order.
- Mixture-of-experts blocks: ``autotune.simulator.moe`` (router probabilities, dispatched copies, expert
  activations; expert states of the experts a device holds and trains).
- First stage, with dropout: the embedding's dropout mask per micro-batch in flight (``s b h`` bytes).
  Last stage: one micro-batch's logits at the loss's peak, ``loss_bytes_per_logit`` bytes each, by the
  engine that runs the plan (``autotune.simulator.engine_terms``): ``s b V / t`` logits where the engine
  splits the head across the tensor-parallel group, ``s b V`` where it does not (autotune's runner).

This is the allocator's view (``allocated_memory_GiB``). What the device holds besides (CUDA context,
library and NCCL buffers, the allocator's pool) and the out-of-memory rule are in
``autotune.simulator.device_memory``. ``usable_memory_GiB`` (capacity minus ``RESERVE_GiB +
RESERVE_FRACTION * capacity``) is the older, allocator-side form of the same reserve, kept for callers.
"""

from __future__ import annotations

from autotune.simulator.engine_terms import DEFAULT_ENGINE, head_group, loss_bytes_per_logit
from autotune.simulator.moe import activation_delta_per_token
from autotune.specs import ModelSpec
from autotune.specs.recompute import checkpointed_blocks

GiB = float(2**30)
BYTES_PER_PARAM_STATE = 16  # Rajbhandari et al. 2020 (ZeRO), mixed-precision Adam: 2 + 2 + 12
RESERVE_GiB = 1.0  # CUDA context + library workspaces + communication buffers
RESERVE_FRACTION = 0.05  # caching-allocator fragmentation


def usable_memory_GiB(capacity_GiB: float) -> float:
    return capacity_GiB - RESERVE_GiB - RESERVE_FRACTION * capacity_GiB


def layer_activation_bytes(
    model: ModelSpec,
    micro_batch_size: int,
    tp: int,
    selective: bool = False,
    sequence_parallel: bool = False,
    elem_bytes: int | None = None,
) -> float:
    """Bytes one transformer layer keeps for the backward of one micro-batch (Korthikanti et al. 2022,
    generalised as the module docstring says). ``elem_bytes``: the element size, default the model's
    precision's (``ModelSpec.bytes_per_element``)."""
    e = model.bytes_per_element if elem_bytes is None else elem_bytes
    d = 1 if model.dropout > 0 else 0
    s, b, h, f = model.seq_len, micro_batch_size, model.hidden_size, model.ffn_hidden_size
    a, hkv = model.num_heads, model.kv_hidden_size
    mlp_inner = (3 if model.mlp == "swiglu" else 2) * e * f
    replicated = (4 * e + 2 * d) * h
    split = e * model.q_hidden_size + 2 * e * hkv + e * model.q_hidden_size + mlp_inner
    stored_scores = model.attention == "standard" and not selective
    scores = (e + d * (1 + e)) * a * s * s * b / tp if stored_scores else 0.0
    if sequence_parallel and tp > 1:
        replicated /= tp
    # MoE blocks store router probabilities, dispatched token copies and expert activations instead
    moe_blocks = activation_delta_per_token(model, tp) * e / 2  # counted in 16-bit bytes there
    return s * b * (replicated + split / tp + moe_blocks) + scores


def layer_op_kept_bytes(
    model: ModelSpec,
    micro_batch_size: int,
    tp: int,
    sequence_parallel: bool = False,
    elem_bytes: int | None = None,
) -> float:
    """What per-op selective checkpointing (``"selective-op"``) keeps per layer: its input and every other
    matmul's output (module docstring). MoE blocks keep what they keep without it."""
    e = model.bytes_per_element if elem_bytes is None else elem_bytes
    s, b, h, f = model.seq_len, micro_batch_size, model.hidden_size, model.ffn_hidden_size
    swiglu = model.mlp == "swiglu"
    replicated = e * h / (tp if sequence_parallel and tp > 1 else 1) + (e * h if swiglu else 0.0)
    attention_out = e * model.q_hidden_size if model.attention == "flash" else 0.0
    split = e * model.q_hidden_size + e * model.kv_hidden_size + attention_out + e * f
    moe_blocks = activation_delta_per_token(model, tp) * e / 2
    return s * b * (replicated + split / tp + moe_blocks)


def layer_input_bytes(
    model: ModelSpec, micro_batch_size: int, tp: int = 1, sequence_parallel: bool = False, elem_bytes: int | None = None
) -> float:
    """What full recomputation keeps per layer: its input (split along the sequence with sequence
    parallelism)."""
    e = model.bytes_per_element if elem_bytes is None else elem_bytes
    split = tp if sequence_parallel and tp > 1 else 1
    return e * model.seq_len * micro_batch_size * model.hidden_size / split


def stage_params(model: ModelSpec, layers: int, tp: int, first: bool, last: bool, head_tp: int | None = None) -> float:
    """Parameters one device of a stage holds: its 1/tp share of the blocks, and of the embedding and the
    head 1/``head_tp`` (default ``tp``; 1 where the engine keeps them whole: ``engine_terms.head_group``)."""
    return layers * model.params_per_layer / tp + model.end_params(first, last) / (head_tp or tp)


def stage_activation_bytes(
    model: ModelSpec,
    micro_batch_size: int,
    tp: int,
    layers: int,
    recompute: bool | str,
    in_flight_chunks: int,
    chunks: int,
    first: bool,
    last: bool,
    measured_full_bytes: float | None = None,
    measured_kept_bytes: float | None = None,
    sequence_parallel: bool = False,
    elem_bytes: int | None = None,
    engine: str = DEFAULT_ENGINE,
) -> float:
    """Peak activation bytes of one device of a stage holding ``in_flight_chunks`` chunk activations.
    ``recompute``: a mode of ``autotune.specs.recompute``. ``measured_full_bytes`` /
    ``measured_kept_bytes`` (a calibration profile's per-layer ``activation_bytes`` without / with
    recomputation) replace the formulas when given. ``engine``: whose loss and head (``engine_terms``)."""
    e = model.bytes_per_element if elem_bytes is None else elem_bytes
    layers_per_chunk = layers / chunks
    full = layer_activation_bytes(model, micro_batch_size, tp, sequence_parallel=sequence_parallel, elem_bytes=e)
    if measured_full_bytes is not None:
        full = measured_full_bytes
    n_full = checkpointed_blocks(recompute, round(layers_per_chunk))
    if n_full and recompute is not True:  # every-N: the N-th blocks keep inputs, the others everything
        kept = (
            layer_input_bytes(model, micro_batch_size, tp, sequence_parallel, e)
            if measured_kept_bytes is None
            else measured_kept_bytes
        )
        per_chunk = n_full * kept + (layers_per_chunk - n_full) * full
        total = in_flight_chunks * per_chunk + full
    elif recompute is True:
        kept = (
            layer_input_bytes(model, micro_batch_size, tp, sequence_parallel, e)
            if measured_kept_bytes is None
            else measured_kept_bytes
        )
        total = in_flight_chunks * layers_per_chunk * kept + (full if layers else 0.0)
    elif recompute in ("selective", "selective-op"):
        if measured_kept_bytes is not None:
            kept = measured_kept_bytes
        elif recompute == "selective":
            kept = layer_activation_bytes(model, micro_batch_size, tp, True, sequence_parallel, e)
        else:
            kept = layer_op_kept_bytes(model, micro_batch_size, tp, sequence_parallel, e)
        kept = min(kept, full)
        # the backward rebuilds one layer's recomputed part on top of what the others keep
        total = in_flight_chunks * layers_per_chunk * kept + ((full - kept) if layers else 0.0)
    else:
        total = in_flight_chunks * layers_per_chunk * full
    s, b = model.seq_len, micro_batch_size
    if first and model.dropout > 0:
        total += -(-in_flight_chunks // chunks) * s * b * model.hidden_size  # embedding dropout mask (chunk 0)
    if last:
        total += (
            loss_bytes_per_logit(engine, e) * s * b * model.vocab_size / head_group(engine, tp, model.vocab_size)
        )  # the loss
    return total


def stage_peak_GiB(
    model: ModelSpec,
    micro_batch_size: int,
    tp: int,
    layers: int,
    recompute: bool | str,
    in_flight_chunks: int,
    chunks: int,
    first: bool,
    last: bool,
    measured_full_bytes: float | None = None,
    measured_kept_bytes: float | None = None,
    baseline_GiB: float = 0.0,
    state_bytes_per_param: float | None = None,
    activation_factor: float = 1.0,
    states_bytes: float | None = None,
    sequence_parallel: bool = False,
    elem_bytes: int | None = None,
    engine: str = DEFAULT_ENGINE,
) -> float:
    """``baseline_GiB``: a profile's measured per-process memory besides states and activations;
    ``state_bytes_per_param``: a profile's measured bytes per parameter (default 16, ZeRO's figure);
    ``activation_factor``: a profile's measured peak bytes per saved activation byte (default 1);
    ``states_bytes``: the model-state bytes on the device when sharding or offload change them
    (``autotune.simulator.zero``), in place of bytes per parameter x parameters."""
    per_param = BYTES_PER_PARAM_STATE if state_bytes_per_param is None else state_bytes_per_param
    if states_bytes is None:
        states = per_param * stage_params(model, layers, tp, first, last, head_group(engine, tp, model.vocab_size))
    else:
        states = states_bytes
    acts = stage_activation_bytes(
        model,
        micro_batch_size,
        tp,
        layers,
        recompute,
        in_flight_chunks,
        chunks,
        first,
        last,
        measured_full_bytes,
        measured_kept_bytes,
        sequence_parallel,
        elem_bytes,
        engine,
    )
    return (states + activation_factor * acts) / GiB + baseline_GiB
