"""The model: a GPT/Llama-style decoder, dense or mixture-of-experts (docs/formats.md, "Model")."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.errors import SpecError, shown
from autotune.specs.limits import ATTENTION_KINDS, BIAS_KINDS, MLP_KINDS, PRECISIONS, positive


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A GPT/Llama-style decoder. ``global_batch_size`` is sequences per optimizer step."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_len: int
    global_batch_size: int
    num_kv_heads: int = 0  # 0 means num_heads
    mlp: str = "gelu"
    # mixture of experts (SPEC.md "Extensions"); num_experts 0 = dense. 0 in the next two = the default
    num_experts: int = 0
    experts_per_token: int = 0  # top-k routing [2 when num_experts > 0]
    expert_ffn_hidden_size: int = 0  # [ffn_hidden_size]
    moe_layer_every: int = 1  # blocks i with (i + 1) % moe_layer_every == 0 are MoE blocks
    precision: str = "bf16"  # bf16 | fp16 (16-bit mixed precision) | fp32 (TF32 matmuls where available)
    attention: str = "flash"  # flash (fused, scores never stored) | standard (scores stored)
    dropout: float = 0.0  # dropout probability on attention probabilities and residual branches
    # what Hugging Face families add (SPEC.md "Extensions, second set"; docs/formats.md "Architecture details")
    head_dim: int = 0  # width of one attention head [hidden_size // num_heads]
    bias: str = "none"  # none (Llama) | qkv (Qwen2: Q, K, V projections) | all (GPT-2, NeoX: every linear and norm)
    tied_embeddings: bool = False  # the LM head is the input embedding (one matrix held; a pipeline keeps a copy)
    learned_positions: int = 0  # rows of a learned position embedding (GPT-2); 0 = rotary or none
    sliding_window: int = 0  # each token attends to the last sliding_window tokens; 0 = all before it
    shared_expert_ffn_hidden_size: int = 0  # width of the MLP every token passes in an MoE block (DeepSeek, Qwen-MoE)
    shared_expert_gate: bool = False  # a sigmoid gate (hidden_size -> 1) scales the shared experts' output (Qwen-MoE)
    first_dense_layers: int = 0  # the first blocks stay dense in an MoE model (DeepSeek's first_k_dense_replace)
    qk_norm: bool = False  # RMSNorm over each query and key head before the rotation (Qwen3)
    # what the runner computes with and the simulator does not need
    rope_theta: float = 10_000.0  # base of the rotary embedding's frequencies
    rms_norm_eps: float = 1e-6  # epsilon of RMSNorm (mlp: swiglu)

    def __post_init__(self) -> None:
        where = f"model {shown(self.name)}"
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "ffn_hidden_size",
            "vocab_size",
            "seq_len",
            "global_batch_size",
        ):
            positive(where, name, getattr(self, name), integer=True)
        _validate_experts(self, where)
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        positive(where, "num_kv_heads", self.num_kv_heads, integer=True)
        positive(where, "head_dim", self.head_dim, integer=True, strict=False)
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise SpecError(
                    where, "hidden_size", f"must be divisible by num_heads ({self.hidden_size} % {self.num_heads} != 0)"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _validate_details(self, where)
        if self.num_heads % self.num_kv_heads:
            raise SpecError(
                where, "num_kv_heads", f"must divide num_heads ({self.num_heads} % {self.num_kv_heads} != 0)"
            )
        if self.mlp not in MLP_KINDS:
            raise SpecError(where, "mlp", f"must be one of {', '.join(MLP_KINDS)}, got {shown(self.mlp)}")
        if self.precision not in PRECISIONS:
            raise SpecError(where, "precision", f"must be one of {', '.join(PRECISIONS)}, got {shown(self.precision)}")
        if self.attention not in ATTENTION_KINDS:
            raise SpecError(
                where, "attention", f"must be one of {', '.join(ATTENTION_KINDS)}, got {shown(self.attention)}"
            )
        positive(where, "dropout", self.dropout, strict=False)
        if self.dropout >= 1.0:
            raise SpecError(where, "dropout", f"must be a probability below 1, got {self.dropout}")

    @property
    def bytes_per_element(self) -> int:
        """Bytes of one activation, gradient or communicated element: 2 in 16-bit training, 4 in fp32."""
        return 4 if self.precision == "fp32" else 2

    @property
    def q_hidden_size(self) -> int:
        """Width of the queries (and of the attention output): ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    def attended_keys(self) -> int:
        """Keys one query attends to, counted as a full causal attention counts them (``seq_len``, every
        position, the convention of Megatron's FLOP count); a sliding window of ``w < seq_len`` keeps
        ``2 w - w^2 / s`` of them (the same 2x over the computed share as full causal attention)."""
        s, w = self.seq_len, self.sliding_window
        return s if w == 0 or w >= s else int(round(2 * w - w * w / s))

    # -- mixture of experts ------------------------------------------------------------------------
    # A MoE block is a dense block whose MLP is replaced by a router (h x E) and E expert MLPs of width
    # expert_ffn_hidden_size, each token going to its top experts_per_token experts. Parameter counts
    # come in two kinds: *held* (every expert: what memory and gradient traffic see) and *active* (the
    # routed experts only: what FLOPs per token see). For a dense model both equal the dense count.

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Block ``layer`` (0-based) is an MoE block: every ``moe_layer_every``-th block, the last of each
        run, after the ``first_dense_layers``."""
        return self.is_moe and layer >= self.first_dense_layers and (layer + 1) % self.moe_layer_every == 0

    @property
    def num_moe_layers(self) -> int:
        if not self.is_moe:
            return 0
        every, first = self.moe_layer_every, self.first_dense_layers
        return self.num_layers // every - first // every

    @property
    def moe_layer_fraction(self) -> float:
        """Share of the blocks that are MoE blocks (0 for a dense model)."""
        return self.num_moe_layers / self.num_layers

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.mlp == "swiglu" else 2

    @property
    def expert_params(self) -> int:
        """Weights of one expert MLP in one MoE block."""
        return self.mlp_params(self.expert_ffn_hidden_size) if self.is_moe else 0

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_experts

    @property
    def norm_params(self) -> int:
        """One norm's weights: a scale (RMSNorm), and a shift with ``bias: all`` (LayerNorm)."""
        return self.hidden_size * (2 if self.bias == "all" else 1)

    @property
    def attention_params(self) -> int:
        """Q, K, V, O projections (with their biases where the family has them) and the block's two norms."""
        h, q, kv = self.hidden_size, self.q_hidden_size, self.kv_hidden_size
        bias = {"none": 0, "qkv": q + 2 * kv, "all": q + 2 * kv + h}[self.bias]
        qk_norms = 2 * self.head_dim if self.qk_norm else 0
        return h * q * 2 + h * kv * 2 + bias + 2 * self.norm_params + qk_norms

    def mlp_params(self, width: int) -> int:
        """One MLP of ``width`` (a dense block's, an expert, the shared experts), biases included where
        the family has them."""
        bias = (self.mlp_matrices - 1) * width + self.hidden_size if self.bias == "all" and width else 0
        return self.mlp_matrices * self.hidden_size * width + bias

    @property
    def dense_block_params(self) -> int:
        """Weights of one dense block (attention, norms, MLP)."""
        return self.attention_params + self.mlp_params(self.ffn_hidden_size)

    @property
    def moe_block_shared_params(self) -> int:
        """Weights of one MoE block besides its routed experts: attention, norms, router, shared experts."""
        gate = self.hidden_size if self.shared_expert_gate and self.shared_expert_ffn_hidden_size else 0
        return self.attention_params + self.router_params + self.mlp_params(self.shared_expert_ffn_hidden_size) + gate

    @property
    def expert_params_per_layer(self) -> float:
        """Expert weights per block, averaged over the blocks (every expert counted)."""
        return self.moe_layer_fraction * self.num_experts * self.expert_params

    @property
    def shared_params_per_layer(self) -> float:
        """Non-expert weights per block, averaged over the blocks (dense blocks and MoE blocks' shared part)."""
        f = self.moe_layer_fraction
        return (
            (1.0 - f) * self.dense_block_params + f * self.moe_block_shared_params
            if self.is_moe
            else self.dense_block_params
        )

    @property
    def kv_hidden_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def params_per_layer(self) -> float:
        """Weights of one transformer block (attention + MLP matrices, biases ignored, 2 norms); for an MoE
        model the mean over blocks of what a block holds, every expert counted (so ``num_layers *
        params_per_layer`` is the blocks' total)."""
        if not self.is_moe:
            return self.dense_block_params
        return self.shared_params_per_layer + self.expert_params_per_layer

    @property
    def active_params_per_layer(self) -> float:
        """Weights one token passes through per block, averaged over the blocks: the routed experts only.
        Equals ``params_per_layer`` for a dense model."""
        if not self.is_moe:
            return self.dense_block_params
        return self.shared_params_per_layer + self.moe_layer_fraction * self.experts_per_token * self.expert_params

    @property
    def embedding_params(self) -> int:
        """The token embedding (the LM head's matrix has the same shape)."""
        return self.vocab_size * self.hidden_size

    def end_params(self, first: bool, last: bool) -> int:
        """Weights a pipeline stage holds besides its blocks: the embeddings (token and learned positions)
        on the first stage, the final norm and the LM head on the last. A tied head is the embedding
        itself on a stage that has both, and a copy (Megatron-LM's) on a last stage that does not."""
        params = self.embedding_params + self.hidden_size * self.learned_positions if first else 0
        if last:
            params += self.norm_params + (0 if self.tied_embeddings and first else self.embedding_params)
        return params

    @property
    def num_params(self) -> int:
        """Total weights: embeddings + blocks (every expert) + final norm + LM head (once if tied)."""
        return int(round(self.end_params(True, True) + self.num_layers * self.params_per_layer))

    @property
    def active_params(self) -> int:
        """Weights one token passes through (routed experts only): Mixtral's "active parameters"."""
        return int(round(self.end_params(True, True) + self.num_layers * self.active_params_per_layer))

    def with_global_batch_size(self, global_batch_size: int | None) -> ModelSpec:
        if global_batch_size is None:
            return self
        from dataclasses import replace

        return replace(self, global_batch_size=global_batch_size)


def _validate_details(model: ModelSpec, where: str) -> None:
    """The rules of the fields Hugging Face families add."""
    if model.bias not in BIAS_KINDS:
        raise SpecError(where, "bias", f"must be one of {', '.join(BIAS_KINDS)}, got {shown(model.bias)}")
    for name in ("tied_embeddings", "qk_norm"):
        if not isinstance(getattr(model, name), bool):
            raise SpecError(where, name, f"must be true or false, got {shown(getattr(model, name))}")
    positive(where, "rope_theta", model.rope_theta)
    positive(where, "rms_norm_eps", model.rms_norm_eps, maximum=1.0)
    for name in ("learned_positions", "sliding_window", "shared_expert_ffn_hidden_size", "first_dense_layers"):
        positive(where, name, getattr(model, name), integer=True, strict=False)
    if 0 < model.learned_positions < model.seq_len:
        raise SpecError(
            where,
            "learned_positions",
            f"{model.learned_positions} positions cannot embed sequences of seq_len={model.seq_len}",
        )
    if not model.is_moe:
        for name in ("shared_expert_ffn_hidden_size", "first_dense_layers"):
            if getattr(model, name):
                raise SpecError(where, name, "applies only to mixture-of-experts models (num_experts > 0)")


def _validate_experts(model: ModelSpec, where: str) -> None:
    """The MoE fields' rules; fills in the defaults (experts_per_token 2, expert_ffn_hidden_size
    ffn_hidden_size) of an MoE model."""
    positive(where, "num_experts", model.num_experts, integer=True, strict=False)
    for name in ("experts_per_token", "expert_ffn_hidden_size"):
        positive(where, name, getattr(model, name), integer=True, strict=False)
    positive(where, "moe_layer_every", model.moe_layer_every, integer=True)
    if not model.is_moe:
        for name, unset in (("experts_per_token", 0), ("expert_ffn_hidden_size", 0), ("moe_layer_every", 1)):
            if getattr(model, name) != unset:
                raise SpecError(
                    where,
                    name,
                    f"applies only to mixture-of-experts models (num_experts > 0), got "
                    f"{getattr(model, name)} with num_experts=0",
                )
        return
    if model.experts_per_token == 0:
        object.__setattr__(model, "experts_per_token", min(2, model.num_experts))
    if model.expert_ffn_hidden_size == 0:
        object.__setattr__(model, "expert_ffn_hidden_size", model.ffn_hidden_size)
    if model.experts_per_token > model.num_experts:
        raise SpecError(
            where,
            "experts_per_token",
            f"top-{model.experts_per_token} routing needs at least that many "
            f"experts, num_experts is {model.num_experts}",
        )
    if model.first_dense_layers >= model.num_layers:
        raise SpecError(
            where,
            "first_dense_layers",
            f"{model.first_dense_layers} >= num_layers={model.num_layers}: the model would have no MoE block",
        )
    if model.moe_layer_every > model.num_layers:
        raise SpecError(
            where,
            "moe_layer_every",
            f"{model.moe_layer_every} > num_layers={model.num_layers}: the model would have no MoE block",
        )
