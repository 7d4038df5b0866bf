"""A Hugging Face ``config.json`` as a ``ModelSpec`` (docs/formats.md, "A Hugging Face config as the model").

Families read (``model_type``): ``llama`` (Llama 2 / 3), ``mistral``, ``qwen2`` (Qwen2 / 2.5), ``qwen3``,
``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``olmoe``, ``deepseek`` (DeepSeek-MoE: shared experts, dense
first layers), ``gpt2`` and ``gpt_neox``. Any other architecture is refused in one line naming it.

What the file does not say comes from the caller or a documented default: the training sequence length
(``--seq-len``; else ``max_position_embeddings`` capped at ``DEFAULT_SEQ_LEN``) and the global batch
(``--global-batch-size``; else about ``DEFAULT_BATCH_TOKENS`` tokens per step). Fields autotune does not
model are named in ``HFModel.warnings``, each saying whether it changes time or memory.

``HFModel.implied_params`` is the parameter count the config implies, counted from the file's own fields
as the family's Hugging Face module builds its weights (including the few small tensors autotune leaves
out, such as Qwen3's per-head query/key norms); the CLI prints it beside ``ModelSpec.num_params``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import SpecError, shown
from autotune.specs import ModelSpec

DEFAULT_SEQ_LEN = 4096  # a training length, not the model's context limit
DEFAULT_BATCH_TOKENS = 2**20  # ~1M tokens per optimizer step (GPT-3 1.3B's batch; Llama 2 used 4M)

DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "gpt_neox")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek")
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES
#: families whose config names itself differently in ``model_type`` on the hub
_ALIASES = {"deepseek_moe": "deepseek"}
#: architectures we know and cannot model, with why
_REFUSED = {
    "deepseek_v2": "multi-head latent attention (kv_lora_rank) is not modelled",
    "deepseek_v3": "multi-head latent attention (kv_lora_rank) is not modelled",
    "mamba": "a state-space model, not a decoder of attention blocks",
    "t5": "an encoder-decoder model",
    "bert": "an encoder, not a causal decoder",
}


@dataclass(frozen=True, slots=True)
class HFModel:
    """A model read from a Hugging Face config, with what the reading decided."""

    model: ModelSpec
    family: str  # the config's model_type
    implied_params: int  # the count the config implies (module docstring)
    notes: tuple[str, ...]  # where values the file does not hold came from
    warnings: tuple[str, ...]  # fields not modelled, each saying whether it changes time or memory


def hf_config_path(ref: str | Path) -> Path | None:
    """The ``config.json`` ``ref`` names (the file, or a directory holding one), else None."""
    path = Path(ref)
    if path.is_dir():
        return path / "config.json" if (path / "config.json").is_file() else None
    if path.suffix == ".json" and path.is_file():
        try:
            with path.open("rb") as f:  # a config is a few KiB: a larger file is not one
                head = json.loads(f.read(2**20).decode("utf-8", errors="replace"))
        except ValueError:
            return None  # not JSON: the model-file reader reports it
        if isinstance(head, dict) and ("model_type" in head or "architectures" in head):
            return path
    return None


def model_from_hf(
    data: Mapping[str, Any], source: str, seq_len: int | None = None, global_batch_size: int | None = None
) -> HFModel:
    """The ``ModelSpec`` of a config's mapping; ``SpecError`` naming an architecture it cannot model."""
    family = str(data.get("model_type", ""))
    family = _ALIASES.get(family, family)
    if family in _REFUSED:
        raise SpecError(source, "model_type", f"{shown(family)} cannot be modelled: {_REFUSED[family]}")
    if family not in FAMILIES:
        arch = data.get("architectures")
        named = f"{shown(family)}" + (f" ({shown(arch)})" if arch else "")
        raise SpecError(source, "model_type", f"{named} is not a family autotune reads; it reads {', '.join(FAMILIES)}")
    reader = _Reader(data, source)
    fields, warnings = _fields(family, reader)
    notes = []
    limit = int(fields.pop("_max_positions", 0)) or None
    if seq_len is None:
        seq_len = min(limit or DEFAULT_SEQ_LEN, DEFAULT_SEQ_LEN)
        why = "the model's max_position_embeddings" if limit and limit < DEFAULT_SEQ_LEN else "the default"
        notes.append(f"seq_len {seq_len:,} ({why}; --seq-len sets it)")
    elif limit and seq_len > limit:
        warnings.append(
            f"--seq-len {seq_len:,} exceeds max_position_embeddings {limit:,}: the model was not trained so long"
        )
    if global_batch_size is None:
        global_batch_size = max(1, DEFAULT_BATCH_TOKENS // seq_len)
        notes.append(
            f"global batch {global_batch_size:,} sequences (~{DEFAULT_BATCH_TOKENS / 1e6:.0f}M tokens a step; "
            "--global-batch-size sets it)"
        )
    path = Path(source)
    # a published config has no name of its own: its directory's (also for ./config.json), else the file's
    name = str(data.get("_name_or_path") or "") or (
        path.resolve().parent.name if path.name == "config.json" else path.stem
    )
    try:
        model = ModelSpec(name=name[-128:], seq_len=seq_len, global_batch_size=global_batch_size, **fields)
    except SpecError as e:
        raise SpecError(source, e.field, e.rule) from None
    return HFModel(model, family, _implied_params(family, reader), tuple(notes), tuple(warnings))


class _Reader:
    """Typed access to a config's fields, each failure one line naming the field."""

    def __init__(self, data: Mapping[str, Any], source: str) -> None:
        self.data, self.source = data, source

    def int(self, *names: str, default: int | None = None) -> int:
        for name in names:
            value = self.data.get(name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise SpecError(self.source, name, f"must be a non-negative integer, got {shown(value)}")
                return value
        if default is None:
            raise SpecError(self.source, names[0], "is required")
        return default

    def flag(self, name: str, default: bool) -> bool:
        value = self.data.get(name, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise SpecError(self.source, name, f"must be true or false, got {shown(value)}")
        return value

    def number(self, name: str, default: float = 0.0) -> float:
        value = self.data.get(name, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(self.source, name, f"must be a number, got {shown(value)}")
        return float(value)

    def has(self, name: str) -> bool:
        return self.data.get(name) not in (None, False, 0, [], {})


def _fields(family: str, r: _Reader) -> tuple[dict[str, Any], list[str]]:
    """ModelSpec fields (and ``_max_positions``) of a family's config, and the warnings."""
    warnings: list[str] = []
    if family == "gpt2":
        h = r.int("n_embd", "hidden_size")
        positions = r.int("n_positions", "n_ctx", default=1024)
        fields = dict(
            num_layers=r.int("n_layer", "num_hidden_layers"),
            hidden_size=h,
            num_heads=r.int("n_head", "num_attention_heads"),
            ffn_hidden_size=r.int("n_inner", default=4 * h),
            vocab_size=r.int("vocab_size"),
            mlp="gelu",
            bias="all",
            tied_embeddings=r.flag("tie_word_embeddings", True),
            learned_positions=positions,
            dropout=max(r.number("attn_pdrop", 0.1), r.number("resid_pdrop", 0.1), r.number("embd_pdrop", 0.1)),
            _max_positions=positions,
        )
        return fields, warnings
    fields = dict(
        num_layers=r.int("num_hidden_layers"),
        hidden_size=r.int("hidden_size"),
        num_heads=r.int("num_attention_heads"),
        num_kv_heads=r.int("num_key_value_heads", default=0),
        ffn_hidden_size=r.int("intermediate_size"),
        vocab_size=r.int("vocab_size"),
        tied_embeddings=r.flag("tie_word_embeddings", False),
        _max_positions=r.int("max_position_embeddings", default=0),
    )
    explicit = r.int("head_dim", default=0)
    if explicit and explicit * fields["num_heads"] != fields["hidden_size"]:
        fields["head_dim"] = explicit
    if family == "gpt_neox":
        fields.update(mlp="gelu", bias="all" if r.flag("attention_bias", True) else "none")
        fields["dropout"] = max(r.number("attention_dropout"), r.number("hidden_dropout"))
        if r.flag("use_parallel_residual", True):
            warnings.append("use_parallel_residual: attention and MLP in parallel is not modelled (time: a little)")
        return fields, warnings
    fields["mlp"] = "swiglu"  # every other family here has a gated MLP (gate, up, down)
    _refuse_unmodelled(family, r)
    rope = r.data.get("rope_parameters") or r.data.get("rope_scaling") or {}
    rope = rope if isinstance(rope, Mapping) else {}
    fields["rope_theta"] = r.number("rope_theta", 0.0) or float(rope.get("rope_theta") or 10_000.0)
    fields["rms_norm_eps"] = r.number("rms_norm_eps", 1e-6)
    fields["dropout"] = r.number("attention_dropout")
    if family in ("qwen2", "qwen2_moe"):
        fields["bias"] = "qkv"
    _sliding_window(family, r, fields, warnings)
    if family in MOE_FAMILIES:
        _experts(family, r, fields, warnings)
    if family in ("qwen3", "qwen3_moe"):
        fields["qk_norm"] = True
    if family == "olmoe":
        warnings.append("query/key norms over the whole projection are not modelled (time: a few elementwise passes)")
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        warnings.append(
            f"rope type {shown(rope.get('rope_type', rope.get('type')))}: changes neither time nor memory; "
            "the runner computes default rotary positions"
        )
    return fields, warnings


#: the activations a gated MLP family's config may name: SiLU (Swish) is what every family here uses and the
#: runner computes
_GATED_ACTIVATIONS = ("silu", "swish")


def _refuse_unmodelled(family: str, r: _Reader) -> None:
    """A gated-MLP family's fields that change what the model computes and that autotune does not model,
    each refused in one line naming it (where it used to be trained without them, silently)."""
    act = r.data.get("hidden_act", "silu")
    if act not in _GATED_ACTIVATIONS:
        raise SpecError(
            r.source, "hidden_act", f"{shown(act)}: the gated MLP is modelled and trained with SiLU (silu) only"
        )
    if family not in ("qwen2", "qwen2_moe") and r.flag("attention_bias", False):
        raise SpecError(
            r.source,
            "attention_bias",
            "true: biases on the query, key, value and output projections are not modelled (Qwen2's on "
            "query, key and value are); set it to false or use a qwen2 config",
        )
    if r.flag("mlp_bias", False):
        raise SpecError(r.source, "mlp_bias", "true: biases on the gated MLP's projections are not modelled")


def _sliding_window(family: str, r: _Reader, fields: dict[str, Any], warnings: list[str]) -> None:
    window = r.int("sliding_window", default=0)
    if not window:
        return
    if family in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe") and not r.flag("use_sliding_window", False):
        return  # Qwen ships sliding_window with use_sliding_window false: full attention
    fields["sliding_window"] = window
    if family.startswith("qwen") and r.int("max_window_layers", default=fields["num_layers"]) < fields["num_layers"]:
        raise SpecError(
            r.source,
            "max_window_layers",
            f"{r.int('max_window_layers')} < num_hidden_layers {fields['num_layers']}: blocks from that index on "
            "attend through the window, the others to every token before; only one window on every block is "
            "modelled (set max_window_layers to num_hidden_layers, or use_sliding_window to false)",
        )


def _experts(family: str, r: _Reader, fields: dict[str, Any], warnings: list[str]) -> None:
    if family == "mixtral":
        fields.update(num_experts=r.int("num_local_experts"), experts_per_token=r.int("num_experts_per_tok", default=2))
        fields["expert_ffn_hidden_size"] = fields["ffn_hidden_size"]
        return
    if family == "olmoe":
        fields.update(num_experts=r.int("num_experts"), experts_per_token=r.int("num_experts_per_tok", default=8))
        fields["expert_ffn_hidden_size"] = fields["ffn_hidden_size"]
        return
    if family == "deepseek":
        experts = r.int("n_routed_experts")
        fields.update(num_experts=experts, experts_per_token=r.int("num_experts_per_tok"))
        fields["expert_ffn_hidden_size"] = r.int("moe_intermediate_size")
        fields["shared_expert_ffn_hidden_size"] = (
            r.int("n_shared_experts", default=0) * fields["expert_ffn_hidden_size"]
        )
        fields["first_dense_layers"] = r.int("first_k_dense_replace", default=0)
        every = r.int("moe_layer_freq", default=1)
        fields["moe_layer_every"] = every
        if every > 1:
            warnings.append(
                "moe_layer_freq > 1: MoE blocks are placed where (i + 1) % n == 0, not i % n == 0 "
                "(memory: a stage may hold one MoE block more or less)"
            )
        return
    # qwen2_moe, qwen3_moe
    fields.update(num_experts=r.int("num_experts"), experts_per_token=r.int("num_experts_per_tok"))
    fields["expert_ffn_hidden_size"] = r.int("moe_intermediate_size")
    fields["moe_layer_every"] = r.int("decoder_sparse_step", default=1)
    if family == "qwen2_moe":
        fields["shared_expert_ffn_hidden_size"] = r.int("shared_expert_intermediate_size", default=0)
        fields["shared_expert_gate"] = bool(fields["shared_expert_ffn_hidden_size"])  # sigmoid(x W), W: h x 1
    dense = r.data.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise SpecError(r.source, "mlp_only_layers", f"must be a list of block indices, got {shown(dense)}")
    if dense:
        if sorted(dense) != list(range(len(dense))):
            raise SpecError(
                r.source,
                "mlp_only_layers",
                f"{shown(dense)}: only dense blocks at the start (0, 1, ...) are modelled",
            )
        fields["first_dense_layers"] = len(dense)


def _implied_params(family: str, r: _Reader) -> int:
    """The parameter count of the family's Hugging Face module built from this config."""
    if family == "gpt2":
        h, layers, v = r.int("n_embd", "hidden_size"), r.int("n_layer", "num_hidden_layers"), r.int("vocab_size")
        f = r.int("n_inner", default=4 * h)
        block = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # c_attn, c_proj, MLP, 2 LayerNorms
        head = 0 if r.flag("tie_word_embeddings", True) else v * h
        return v * h + r.int("n_positions", "n_ctx", default=1024) * h + layers * block + 2 * h + head
    h, layers, v = r.int("hidden_size"), r.int("num_hidden_layers"), r.int("vocab_size")
    heads = r.int("num_attention_heads")
    kv_heads = r.int("num_key_value_heads", default=heads)
    hd = r.int("head_dim", default=h // heads)
    q, kv, f = heads * hd, kv_heads * hd, r.int("intermediate_size")
    attention = 2 * h * q + 2 * h * kv
    norms = 2 * h
    if family == "gpt_neox":
        attention += (q + 2 * kv + h) if r.flag("attention_bias", True) else 0
        block = attention + 2 * h * f + f + h + 4 * h
        head = 0 if r.flag("tie_word_embeddings", False) else v * h
        return v * h + layers * block + 2 * h + head
    if family in ("qwen2", "qwen2_moe") or r.flag("attention_bias", False):
        attention += q + 2 * kv + (h if family not in ("qwen2", "qwen2_moe") else 0)
    if family in ("qwen3", "qwen3_moe"):
        attention += 2 * hd  # q_norm, k_norm over one head
    if family == "olmoe":
        attention += q + kv  # q_norm, k_norm over the projections
    dense_mlp = 3 * h * f
    total = 0
    for i in range(layers):
        moe = _moe_mlp_params(family, r, i, h) if family in MOE_FAMILIES else 0
        total += attention + norms + (moe or dense_mlp)
    head = 0 if r.flag("tie_word_embeddings", False) else v * h
    return v * h + total + h + head


def _moe_mlp_params(family: str, r: _Reader, i: int, h: int) -> int:
    """Block ``i``'s MLP weights in an MoE family, 0 meaning a dense MLP."""
    if family in ("mixtral", "olmoe"):
        e = r.int("num_local_experts" if family == "mixtral" else "num_experts")
        return e * 3 * h * r.int("intermediate_size") + h * e
    if family == "deepseek":
        first, every = r.int("first_k_dense_replace", default=0), r.int("moe_layer_freq", default=1)
        if i < first or i % every:
            return 0
        e, fe = r.int("n_routed_experts"), r.int("moe_intermediate_size")
        return (e + r.int("n_shared_experts", default=0)) * 3 * h * fe + h * e
    step = r.int("decoder_sparse_step", default=1)
    if i in (r.data.get("mlp_only_layers") or []) or (i + 1) % step:
        return 0
    e, fe = r.int("num_experts"), r.int("moe_intermediate_size")
    shared = r.int("shared_expert_intermediate_size", default=0) if family == "qwen2_moe" else 0
    return e * 3 * h * fe + h * e + (3 * h * shared + h if shared else 0)  # + the shared expert's gate
