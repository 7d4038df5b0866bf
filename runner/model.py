"""A GPT/Llama-style decoder in plain torch, built from a ``ModelSpec`` and split into pipeline chunks.

- Pre-norm blocks: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; causal attention through
  ``F.scaled_dot_product_attention`` (``attention: flash``, fused: the scores are never kept) or written
  out as ``softmax(Q K^T / sqrt(d)) V`` (``attention: standard``, the scores are stored for the
  backward); grouped-query attention when ``num_kv_heads < num_heads``. ``dropout`` > 0 drops attention
  probabilities and both residual branches (as GPT-2 / Megatron-LM do); the default 0 has none.
- Recomputation per chunk: ``True`` checkpoints every block (``torch.utils.checkpoint``, non-reentrant:
  only the block's input is kept), ``"selective"`` checkpoints only the attention core (``Q K^T``,
  softmax, dropout, ``P V``; Korthikanti et al. 2022): Q, K and V are kept, the scores are recomputed.
- ``mlp: gelu`` is GPT-2's two-matrix MLP with LayerNorm; ``mlp: swiglu`` is Llama's three-matrix
  MLP with RMSNorm. No biases (Llama); untied LM head (``ModelSpec.num_params`` counts it).
- Precision: weights, gradients and optimizer state are fp32. ``precision: bf16`` on CUDA runs the
  forward under ``torch.autocast(bfloat16)`` (matmuls and attention in 16 bits; the engine sets
  ``StageChunk.autocast_dtype``); ``fp32`` uses TF32 matmuls on CUDA (the worker allows them). On CPU
  every precision computes in fp32.
- Initialisation is random from a seed, **per layer index**: block ``i`` draws its weights from a
  generator seeded by ``(seed, i)``, the embedding and the head from their own seeds. So block ``i``
  starts from the same weights whichever stage or chunk holds it, and every plan of the same model
  and seed starts from identical weights (the equivalence tests rely on this).

A ``StageChunk`` is what one pipeline (virtual) stage runs: optional embedding, a run of blocks,
optional final norm + LM head. Its parameter names carry the global layer index
(``blocks.7.attn.q_proj.weight``), so the same weight has the same name on every rank and in every
plan: gradient sync groups and checkpoints key on it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from autotune.specs import ModelSpec

INIT_STD = 0.02  # GPT-2 / nanoGPT initialiser
_EMBED_SEED, _HEAD_SEED = 1_000_003, 2_000_003


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _norm(spec: ModelSpec) -> nn.Module:
    return RMSNorm(spec.hidden_size) if spec.mlp == "swiglu" else nn.LayerNorm(spec.hidden_size, bias=False)


def attention_core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, standard: bool, dropout: float, training: bool
) -> torch.Tensor:
    """Causal attention of ``(batch, heads, seq, head_dim)`` tensors: fused SDPA, or the written-out
    ``softmax(Q K^T / sqrt(d)) V`` whose scores autograd keeps (``standard``)."""
    p = dropout if training else 0.0
    if not standard:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p, enable_gqa=k.shape[1] != q.shape[1])
    if k.shape[1] != q.shape[1]:  # grouped-query attention: repeat each key/value head for its query heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    t = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
    return F.dropout(probs, p) @ v


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, q, kv = spec.hidden_size, spec.q_hidden_size, spec.kv_hidden_size
        self.head_dim = spec.head_dim
        self.standard = spec.attention == "standard"
        self.dropout = spec.dropout
        self.selective = False  # StageChunk sets it: checkpoint the attention core only
        self.q_proj = nn.Linear(h, q, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(q, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        kwargs = dict(standard=self.standard, dropout=self.dropout, training=self.training)
        if self.selective and torch.is_grad_enabled():
            y = checkpoint(attention_core, q, k, v, use_reentrant=False, **kwargs)
        else:
            y = attention_core(q, k, v, **kwargs)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, f = spec.hidden_size, spec.ffn_hidden_size
        self.swiglu = spec.mlp == "swiglu"
        self.up_proj = nn.Linear(h, f, bias=False)
        if self.swiglu:
            self.gate_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class Block(nn.Module):
    """``layer``: the block's index; an MoE block (``ModelSpec.is_moe_layer``) gets ``runner.moe.MoEMLP`` with
    the ``experts`` this rank holds (all by default) in place of the MLP."""

    def __init__(self, spec: ModelSpec, layer: int = 0, experts: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.attn_norm = _norm(spec)
        self.attn = Attention(spec)
        self.mlp_norm = _norm(spec)
        if spec.is_moe_layer(layer):
            from runner.moe import MoEMLP

            self.mlp = MoEMLP(spec, experts)
        else:
            self.mlp = MLP(spec)
        self.dropout = spec.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout > 0 and self.training:
            x = x + F.dropout(self.attn(self.attn_norm(x)), self.dropout)
            return x + F.dropout(self.mlp(self.mlp_norm(x)), self.dropout)
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def _init_(module: nn.Module, seed: int, skip: str | None = None) -> None:
    """Deterministic init from ``seed``: matrices N(0, 0.02) in name order, norms 1; parameters whose name
    starts with ``skip`` are left alone (an MoE block's experts: each has its own seed).

    Output projections get GPT-2's 1/sqrt(2 * num_layers) scaling left out on purpose: the std must
    not depend on how many layers a stage holds.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            if skip is not None and name.startswith(skip):
                continue
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * INIT_STD)
            else:
                p.fill_(1.0)


def layer_seed(seed: int, layer: int) -> int:
    return seed * 7919 + 17 + layer


class StageChunk(nn.Module):
    """Embedding (first chunk) -> blocks ``layers`` -> final norm + LM head (last chunk).

    Input: token ids ``(batch, seq)`` on the first chunk, hidden states ``(batch, seq, hidden)``
    elsewhere. Output: logits ``(batch, seq, vocab)`` on the last chunk, hidden states elsewhere.
    """

    def __init__(
        self,
        spec: ModelSpec,
        layers: Iterable[int],
        *,
        first: bool,
        last: bool,
        seed: int,
        recompute: bool | str = False,
        experts: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        self.layer_ids = tuple(layers)
        self.recompute = recompute is True  # whole blocks; "selective" is set on each block's attention
        self.dropout = spec.dropout
        self.autocast_dtype: torch.dtype | None = None  # set by the engine for bf16 on CUDA
        self.sequence_mesh = None  # sequence parallelism: the tensor-parallel mesh (runner.engine)
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size) if first else None
        self.blocks = nn.ModuleDict({str(i): Block(spec, i, experts) for i in self.layer_ids})
        self.norm = _norm(spec) if last else None
        self.head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False) if last else None
        if self.embed is not None:
            _init_(self.embed, seed * 7919 + _EMBED_SEED)
        for i in self.layer_ids:
            block = self.blocks[str(i)]
            if spec.is_moe_layer(i):  # the shared part from the layer's seed, every expert from its own
                from runner.moe import expert_seed

                _init_(block, layer_seed(seed, i), skip="mlp.experts.")
                for e, expert in block.mlp.experts.items():
                    _init_(expert, expert_seed(layer_seed(seed, i), int(e)))
            else:
                _init_(block, layer_seed(seed, i))
            block.attn.selective = recompute == "selective"
        if self.head is not None:
            _init_(self.head, seed * 7919 + _HEAD_SEED)
            self.norm.weight.data.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.autocast_dtype is not None:  # bf16 on CUDA: matmuls in 16 bits, weights and optimizer fp32
            with torch.autocast(x.device.type, dtype=self.autocast_dtype):
                return self._forward(x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
            if self.dropout > 0 and self.training:
                x = F.dropout(x, self.dropout)
            if self.sequence_mesh is not None:  # this rank's part of the sequence from here on
                x = _redistribute(x, self.sequence_mesh, "shard")
        for block in self.blocks.values():
            if self.recompute and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.head is not None:
            if self.sequence_mesh is not None:  # the whole sequence again for the (replicated) head
                x = _redistribute(x, self.sequence_mesh, "gather")
            x = self.head(self.norm(x))
        return x


def _redistribute(x: torch.Tensor, mesh, to: str) -> torch.Tensor:
    """Split a replicated ``(batch, seq, hidden)`` tensor along the sequence across ``mesh`` (``"shard"``;
    backward: all-gather of the gradient) or gather the parts back (``"gather"``; backward: each rank's
    part of the replicated gradient)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if to == "shard":
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()
    return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()


def build_full_model(spec: ModelSpec, seed: int) -> StageChunk:
    """The whole model as one chunk: the single-process reference the equivalence tests train."""
    return StageChunk(spec, range(spec.num_layers), first=True, last=True, seed=seed)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every token of the (micro-)batch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def flops_per_token(spec: ModelSpec) -> float:
    """Training FLOPs per token: 6 N (forward + backward matmuls, N = non-embedding weights + LM head)
    plus attention scores 12 L h s (PaLM, Chowdhery et al. 2022, appendix B). MoE: routed experts only."""
    n = spec.num_layers * spec.active_params_per_layer + spec.embedding_params  # head matmul; the lookup is free
    return 6.0 * n + 12.0 * spec.num_layers * spec.hidden_size * spec.seq_len
