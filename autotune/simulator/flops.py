"""FLOP counts of a GPT/Llama decoder, per matrix multiply, and the model FLOPs used for MFU.

Forward FLOPs of one transformer layer for ``b`` sequences of ``s`` tokens, hidden ``h``, ``a`` heads,
key/value width ``h_kv`` (grouped-query attention: ``num_kv_heads * head_dim``) and MLP width ``f``
(a multiply-add is 2 FLOPs):

- Q, K, V projections: ``2 b s h (h + 2 h_kv)``
- attention scores ``Q K^T`` and scores times ``V``: ``2 b s^2 h`` each (full, unmasked, as Megatron counts)
- output projection: ``2 b s h^2``
- MLP: ``2 b s h f`` per matrix, 2 matrices (GeLU) or 3 (SwiGLU: gate, up, down)

For a GPT layer (``h_kv = h``, ``f = 4h``, GeLU) this sums to ``24 b s h^2 + 4 b s^2 h``, the per-layer
forward count of Narayanan et al. 2021 (SC'21, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", Sec. 5.1 / Appendix: ``96 B s l h^2 (1 + s/6h + V/16lh)`` per iteration
with recomputation = 4 passes of 24 B s h^2 + 4 B s^2 h per layer, plus 3 passes of the LM head
``2 B s h V``). Backward is twice the forward; recomputation adds one forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.specs import ModelSpec


@dataclass(frozen=True, slots=True)
class Matmul:
    """``count`` independent ``(m x k) @ (k x n)`` products on one device."""

    m: int
    n: int
    k: int
    count: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count

    @property
    def elements(self) -> float:
        """Elements read and written once: both operands and the result."""
        return float(self.m * self.k + self.k * self.n + self.m * self.n) * self.count

    @property
    def size(self) -> float:
        """Equivalent square size: the cube root of m * n * k (what calibration profiles index by)."""
        return float(self.m * self.n * self.k) ** (1.0 / 3.0)


def layer_matmuls(model: ModelSpec, micro_batch_size: int, tp: int) -> tuple[Matmul, ...]:
    """The forward matmuls of one transformer layer on one of ``tp`` tensor-parallel devices.

    Megatron-style splits: Q/K/V and the MLP's first matrices by columns, the output projection and
    the MLP's last matrix by rows, attention by heads. With fewer key/value heads than ``tp`` each device
    keeps one (replicated) key/value head.
    """
    b, s, h, f = micro_batch_size, model.seq_len, model.hidden_size, model.ffn_hidden_size
    q, keys = model.q_hidden_size, model.attended_keys()
    tokens = b * s
    heads = model.num_heads // tp
    kv_dev = max(model.kv_hidden_size // tp, model.head_dim)
    up = 2 * f if model.mlp == "swiglu" else f  # SwiGLU: gate and up projections, fused
    return (
        Matmul(tokens, q // tp + 2 * kv_dev, h),  # Q, K, V projections
        Matmul(s, keys, model.head_dim, b * heads),  # scores Q K^T, per sequence and head
        Matmul(s, model.head_dim, keys, b * heads),  # probabilities times V
        Matmul(tokens, h, q // tp),  # output projection
        Matmul(tokens, up // tp, h),  # MLP up (and gate)
        Matmul(tokens, h, f // tp),  # MLP down
    )


def op_recomputed_matmuls(model: ModelSpec, micro_batch_size: int, tp: int) -> tuple[Matmul, ...]:
    """The matmuls per-op selective checkpointing (``"selective-op"``) reruns in a layer's backward: every
    second linear layer (K, the output projection, SwiGLU's up or GeLU's down) and, with standard
    attention, the attention core (its batched matmuls are not kept)."""
    b, s, h, f = micro_batch_size, model.seq_len, model.hidden_size, model.ffn_hidden_size
    tokens = b * s
    mms = layer_matmuls(model, micro_batch_size, tp)
    kv_dev = max(model.kv_hidden_size // tp, model.head_dim)
    second_mlp = Matmul(tokens, f // tp, h) if model.mlp == "swiglu" else mms[5]
    core = (mms[1], mms[2]) if model.attention == "standard" else ()
    return (Matmul(tokens, kv_dev, h), mms[3], second_mlp) + core


def layer_forward_flops(model: ModelSpec, micro_batch_size: int) -> float:
    """Forward FLOPs of one layer for one micro-batch on one device (no tensor parallelism)."""
    return sum(mm.flops for mm in layer_matmuls(model, micro_batch_size, 1))


def head_matmul(model: ModelSpec, micro_batch_size: int, tp: int) -> Matmul:
    """The LM head (logits) matmul, vocabulary-parallel over ``tp`` devices."""
    return Matmul(micro_batch_size * model.seq_len, -(-model.vocab_size // tp), model.hidden_size)


def model_flops_per_token(model: ModelSpec) -> float:
    """Training FLOPs per token for MFU: ``6 N + 12 L h s`` (PaLM, Chowdhery et al. 2022, Appendix B).

    ``N`` counts the weights that take part in matmuls: every block and the untied LM head, not the
    input embedding (a table lookup). ``12 L h s`` is the attention (``Q K^T`` and ``P V``) term. No
    recomputation is counted: MFU charges only the FLOPs the model needs. For a mixture-of-experts model
    ``N`` counts the routed experts only (``ModelSpec.active_params``): a token passes through
    ``experts_per_token`` of them (plus the router), not all.
    """
    n = model.num_layers * model.active_params_per_layer + model.embedding_params + model.norm_params  # blocks, head
    return 6.0 * n + 12.0 * model.num_layers * model.q_hidden_size * model.attended_keys()


def megatron_flops_per_iteration(model: ModelSpec, recompute: bool = True) -> float:
    """Narayanan et al. 2021, Sec. 5.1: ``96 B s l h^2 (1 + s/6h + V/16lh)`` FLOPs per iteration with
    activation recomputation (4 passes over the layers), ``72 B s l h^2 (1 + s/6h + V/12lh)`` without.
    GPT shapes (``f = 4h``, no GQA). Used to compare with their Table 1."""
    B, s, L, h, V = model.global_batch_size, model.seq_len, model.num_layers, model.hidden_size, model.vocab_size
    passes = 4 if recompute else 3
    per_layer = passes * (24 * B * s * h * h + 4 * B * s * s * h)
    return L * per_layer + 6 * B * s * h * V


#: memory passes over the ``s x s`` score tensor outside the two attention matmuls, when the scores are
#: materialised (``attention: standard``), each of one element per score: forward: scale and causal mask
#: (read, write), softmax (read, write); backward: softmax backward (read probabilities, read their
#: gradient, write the scores' gradient), mask and scale backward (read, write). The matmuls' own reads
#: and writes of scores (Q K^T writes them, P V reads them; four such in the backward) are in their
#: roofline (``efficiency.DeviceRates.matmul_s``). Unfused PyTorch ops, as the runner and Megatron-LM's
#: fp32 path run them; Megatron's fused 16-bit softmax saves two passes each way.
SCORE_PASSES_FORWARD, SCORE_PASSES_BACKWARD = 4, 5
#: with dropout on the probabilities: read them, write the dropped ones and a 1-byte mask (forward); read
#: the gradient and the mask, write the gradient (backward)
DROPOUT_PASSES = 2


def score_traffic_bytes(model: ModelSpec, micro_batch_size: int, tp: int, elem_bytes: int) -> tuple[float, float]:
    """(forward, backward) bytes the non-matmul kernels move over one layer's attention scores on one of
    ``tp`` devices (0 with fused attention)."""
    if model.attention != "standard":
        return 0.0, 0.0
    scores = model.num_heads / tp * micro_batch_size * model.seq_len**2
    drop = DROPOUT_PASSES * elem_bytes + 1 if model.dropout > 0 else 0.0
    return (scores * (SCORE_PASSES_FORWARD * elem_bytes + drop), scores * (SCORE_PASSES_BACKWARD * elem_bytes + drop))
