"""A GPT/Llama-style decoder in plain torch, built from a ``ModelSpec`` and split into pipeline chunks.

- Pre-norm blocks: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; causal attention through
  ``F.scaled_dot_product_attention`` (``attention: flash``, fused: the scores are never kept) or written
  out as ``softmax(Q K^T / sqrt(d)) V`` (``attention: standard``, the scores are stored for the
  backward); grouped-query attention when ``num_kv_heads < num_heads``. ``dropout`` > 0 drops attention
  probabilities and both residual branches (as GPT-2 / Megatron-LM do); the default 0 has none.
- Recomputation per chunk: ``True`` checkpoints every block (``torch.utils.checkpoint``, non-reentrant:
  only the block's input is kept), ``"selective"`` checkpoints only the attention core (``Q K^T``,
  softmax, dropout, ``P V``; Korthikanti et al. 2022): Q, K and V are kept, the scores are recomputed.
  ``"selective-op"`` checkpoints every block keeping the outputs of every other linear-layer matmul (the
  1st, 3rd, ...: Q, V, the MLP's first, SwiGLU's down) and of fused attention (torch's selective
  checkpointing with torchtitan's policy: the other matmuls, norms, activations and products are rerun); ``"every-N"`` checkpoints the N-th, 2N-th, ... block of the chunk whole.
- ``mlp: gelu`` is GPT-2's two-matrix MLP with LayerNorm; ``mlp: swiglu`` is Llama's three-matrix
  MLP with RMSNorm (``rms_norm_eps``). Positions: rotary embeddings on queries and keys (Llama's
  half-split rotation, base ``rope_theta``), or a learned position embedding (``learned_positions``).
  Biases as ``bias`` says (none: Llama; qkv: Qwen2; all: GPT-2); ``qk_norm``: an RMSNorm over each query
  and key head before the rotation (Qwen3); ``sliding_window``: each token attends to the last
  ``sliding_window`` positions (Mistral). A tied LM head multiplies by the embedding (one chunk holds
  both; the runner refuses a tied model whose embedding and head are on different ranks).
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

from collections.abc import Callable, Iterable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from autotune.simulator.flops import model_flops_per_token
from autotune.specs import ModelSpec
from autotune.specs.recompute import is_checkpointed

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
    if spec.mlp == "swiglu":
        return RMSNorm(spec.hidden_size, spec.rms_norm_eps)
    return nn.LayerNorm(spec.hidden_size, bias=spec.bias == "all")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(q: torch.Tensor, k: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of ``(batch, heads, seq, head_dim)`` queries and keys at positions
    ``0 .. seq-1``: Llama's rotation of the two halves of each head (frequencies in fp32)."""
    t, d = q.shape[-2], q.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=q.device).float() / d)
    freqs = torch.arange(t, device=q.device, dtype=torch.float32)[:, None] * inv[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _window_mask(t: int, window: int, device) -> torch.Tensor:
    """``True`` where a query (row) attends to a key (column): the key is not later and ``i - j < window``."""
    i = torch.arange(t, device=device)
    offset = i[:, None] - i[None, :]
    return (offset >= 0) & (offset < window)


def attention_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    standard: bool,
    dropout: float,
    training: bool,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of ``(batch, heads, seq, head_dim)`` tensors: fused SDPA, or the written-out
    ``softmax(Q K^T / sqrt(d)) V`` whose scores autograd keeps (``standard``); ``window`` > 0 and shorter
    than the sequence: each query sees only the last ``window`` keys."""
    p = dropout if training else 0.0
    t = q.shape[-2]
    mask = _window_mask(t, window, q.device) if 0 < window < t else None
    if not standard:
        gqa = k.shape[1] != q.shape[1]
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, enable_gqa=gqa)
    if k.shape[1] != q.shape[1]:  # grouped-query attention: repeat each key/value head for its query heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    hidden = ~mask if mask is not None else torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return F.dropout(probs, p) @ v


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, q, kv = spec.hidden_size, spec.q_hidden_size, spec.kv_hidden_size
        self.head_dim = spec.head_dim
        self.standard = spec.attention == "standard"
        self.dropout = spec.dropout
        self.selective = False  # StageChunk sets it: checkpoint the attention core only
        self.rope_theta = spec.rope_theta if not spec.learned_positions else 0.0
        self.window = spec.sliding_window
        qkv_bias = spec.bias in ("qkv", "all")
        self.q_proj = nn.Linear(h, q, bias=qkv_bias)
        self.k_proj = nn.Linear(h, kv, bias=qkv_bias)
        self.v_proj = nn.Linear(h, kv, bias=qkv_bias)
        self.o_proj = nn.Linear(q, h, bias=spec.bias == "all")
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.q_proj(x).view(b, t, -1, self.head_dim)
        k = self.k_proj(x).view(b, t, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.rope_theta:
            q, k = rotary(q, k, self.rope_theta)
        kwargs = dict(standard=self.standard, dropout=self.dropout, training=self.training, window=self.window)
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
        bias = spec.bias == "all"
        self.up_proj = nn.Linear(h, f, bias=bias)
        if self.swiglu:
            self.gate_proj = nn.Linear(h, f, bias=bias)
        self.down_proj = nn.Linear(f, h, bias=bias)

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
            elif name.endswith("bias"):
                p.zero_()
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
        self.recompute = recompute  # a mode of autotune.specs.recompute; "selective" is set on each attention
        self.dropout = spec.dropout
        self.autocast_dtype: torch.dtype | None = None  # set by the engine for bf16 on CUDA
        self.sequence_mesh = None  # sequence parallelism: the tensor-parallel mesh (runner.engine)
        self.vocab_mesh = None  # the head's logits split over the vocabulary across this mesh (runner.engine)
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size) if first else None
        self.positions = (
            nn.Embedding(spec.learned_positions, spec.hidden_size) if first and spec.learned_positions else None
        )
        self.blocks = nn.ModuleDict({str(i): Block(spec, i, experts) for i in self.layer_ids})
        self.norm = _norm(spec) if last else None
        self.head: nn.Module | None = None
        if last:
            self.head = (
                TiedHead(self.embed)
                if spec.tied_embeddings and first
                else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
            )
        if self.embed is not None:
            _init_(self.embed, seed * 7919 + _EMBED_SEED)
        if self.positions is not None:
            _init_(self.positions, seed * 7919 + _EMBED_SEED + 1)
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
            _init_(self.norm, 0)  # scale 1, shift 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.autocast_dtype is not None:  # bf16 on CUDA: matmuls in 16 bits, weights and optimizer fp32
            with torch.autocast(x.device.type, dtype=self.autocast_dtype):
                out = self._forward(x)
            # what leaves the chunk is fp32 as the pipeline's metadata says (the last chunk's logits come out
            # of the head's matmul in 16 bits: torch.distributed.pipelining refused them on CUDA) and the
            # loss is taken in fp32
            return out.float()
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        for piece in self.pieces():
            x = piece(x)
        return x

    def pieces(self) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        """The chunk's forward as its layers in order, ``forward`` being their composition: the embedding
        (first chunk), each block under the chunk's recompute mode, the final norm + LM head (last chunk).
        Layer-wise execution (``runner.layerwise``) runs them one at a time over all micro-batches."""
        out: list[Callable[[torch.Tensor], torch.Tensor]] = [self._embed] if self.embed is not None else []
        out += [partial(self._block, position, block) for position, block in enumerate(self.blocks.values())]
        return out + ([self._head] if self.head is not None else [])

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        x = self.embed(x)
        if self.positions is not None:
            x = x + self.positions(torch.arange(t, device=x.device))
        if self.dropout > 0 and self.training:
            x = F.dropout(x, self.dropout)
        if self.sequence_mesh is not None:  # this rank's part of the sequence from here on
            x = _redistribute(x, self.sequence_mesh, "shard")
        return x

    def _block(self, position: int, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return checkpointed(block, x, self.recompute, position) if torch.is_grad_enabled() else block(x)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_mesh is not None:  # the whole sequence again for the (replicated) head
            x = _redistribute(x, self.sequence_mesh, "gather")
        return self.head(self.norm(x))


#: the linear layers' matmuls (counted in order: every second one is recomputed) and the fused attention
#: ops whose outputs per-op selective checkpointing keeps (torchtitan's ``_save_list``)
_MATMULS = ("aten.mm.default", "aten.addmm.default")
_SAVED_OPS = _MATMULS + (
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_cudnn_attention.default",
)


def _op_policy():
    """``"selective-op"``'s policy for one block's forward (and its recomputation), torchtitan's: keep the
    outputs of ``_SAVED_OPS`` except every second linear-layer matmul (the 2nd, 4th, ... of the block),
    rerun every other op."""
    from torch.utils.checkpoint import CheckpointPolicy

    count = {False: 0, True: 0}  # matmuls seen in the forward / in the recomputation

    def policy(ctx, op, *args, **kwargs):
        name = str(op)
        if name in _MATMULS:
            count[ctx.is_recompute] += 1
            if count[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if name in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def compile_blocks(chunks: list[StageChunk]) -> None:
    """``torch.compile`` each transformer block's forward (``autotune train --compile``), in place: the block's
    module hooks (FSDP2's gathers) and the chunk's recomputation (``checkpointed``) stay outside the compiled
    region, so every engine calls the block as before. Compiled on the first call of each (TorchInductor; a
    C++ compiler on CPU ranks), cached across runs by torch."""
    for chunk in chunks:
        for block in chunk.blocks.values():
            block.forward = torch.compile(block.forward)


def checkpointed(block: nn.Module, x: torch.Tensor, mode: bool | str, position: int) -> torch.Tensor:
    """``block(x)`` under the stage's recompute ``mode`` (``autotune.specs.recompute``), the block being the
    ``position``-th of its chunk: fully recomputed (``true``, every N-th block under ``"every-N"``),
    per-op selective (``"selective-op"``), or as is (``"selective"`` sits inside the attention)."""
    if is_checkpointed(mode, position):
        return checkpoint(block, x, use_reentrant=False)
    if mode == "selective-op":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        return checkpoint(
            block, x, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(_op_policy())
        )
    return block(x)


class TiedHead(nn.Module):
    """The LM head of a tied model: the logits multiply by the embedding's matrix (held, not registered:
    the weight has one name, ``embed.weight``, and one gradient)."""

    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        object.__setattr__(self, "embed", embed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate

        w = self.embed.weight
        if isinstance(w, DTensor):  # a vocabulary-parallel embedding: this rank's rows of the logits
            x = DTensor.from_local(x, w.device_mesh, [Replicate()], run_check=False)
            return F.linear(x, w).to_local()
        return F.linear(x, w)


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


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, mesh=None) -> torch.Tensor:
    """Mean next-token cross entropy over every token of the (micro-)batch. With ``mesh`` the logits are this
    rank's part of the vocabulary (a vocabulary-parallel head, ``StageChunk.vocab_mesh``): torch's
    ``loss_parallel`` cross entropy over the mesh (its backward too must run inside ``loss_parallel()``,
    ``vocab_parallel_loss``); every rank gets the whole loss."""
    if mesh is None:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    from torch.distributed.tensor import DTensor, Shard

    parts = DTensor.from_local(logits.flatten(0, 1).float(), mesh, [Shard(1)], run_check=False)
    return F.cross_entropy(parts, targets.flatten()).to_local()


def vocab_parallel_loss(chunks: Iterable[StageChunk]):
    """The context a rank's forwards and backwards run in: torch's ``loss_parallel()`` where one of its
    ``chunks`` ends in a vocabulary-parallel head, else nothing."""
    from contextlib import nullcontext

    if any(c.vocab_mesh is not None for c in chunks):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return nullcontext()


def flops_per_token(spec: ModelSpec) -> float:
    """Training FLOPs per token for MFU: the simulator's ``model_flops_per_token`` (PaLM's ``6 N + 12 L h s``
    with the model's query width, sliding window and MoE routing), so ``measure`` and ``simulate`` report
    MFU by one formula."""
    return model_flops_per_token(spec)
