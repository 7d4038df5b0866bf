"""Hugging Face checkpoints in and out of the runner (docs/formats.md, "Hugging Face checkpoints").

In (``train --init-from DIR``): each rank reads, from the checkpoint's safetensors files (one file or
shards with ``model.safetensors.index.json``), only the tensors of the chunks it holds, under the names
``hf_name`` maps its weights to, each shape checked against the plan's model. Families: ``FAMILIES``
(Llama-style decoders: rotary positions, RMSNorm, gated MLP; Qwen2's qkv biases, Qwen3's per-head
query/key norms, Mistral's sliding window); any other ``model_type`` is refused in one line.

Out (``train --save-hf DIR``): the full weights under Hugging Face names in ``model.safetensors``, the
``config.json`` of the checkpoint it started from (or one written from the model for a model that did
not come from one), and that checkpoint's tokenizer files, so ``transformers`` loads the directory.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

from autotune.errors import SpecError, shown
from autotune.specs import ModelSpec

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
#: block parts: the runner's module name -> the Hugging Face module name
_PARTS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "attn": "self_attn", "mlp": "mlp"}


def hf_name(name: str) -> str:
    """The Hugging Face name of a runner weight (``blocks.3.attn.q_proj.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``)."""
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name == "head.weight":
        return "lm_head.weight"
    if name.startswith("norm."):
        return "model." + name
    if name.startswith("blocks."):
        _, layer, part, rest = name.split(".", 3)
        if part in _PARTS:
            return f"model.layers.{layer}.{_PARTS[part]}.{rest}"
    raise SpecError("--init-from", name, "has no Hugging Face name (this model part is not in the families read)")


def check_directory(directory: str | Path) -> Path:
    """A checkpoint directory the runner can start from: ``config.json`` of a family in ``FAMILIES`` and
    its weights; ``SpecError`` in one line otherwise (before anything is launched)."""
    path = Path(directory)
    config = path / "config.json"
    if not config.is_file():
        raise SpecError(
            "--init-from", "", f"{shown(str(path))} holds no config.json (a Hugging Face checkpoint directory does)"
        )
    data = json.loads(config.read_text())
    family = str(data.get("model_type", ""))
    if family not in FAMILIES:
        raise SpecError(
            "--init-from", "model_type", f"{shown(family)} is not a family the runner loads ({', '.join(FAMILIES)})"
        )
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind != "default":
        raise SpecError("--init-from", "rope_type", f"{shown(kind)}: the runner computes default rotary positions only")
    if not (path / INDEX).is_file() and not (path / SINGLE).is_file():
        raise SpecError("--init-from", "", f"{shown(str(path))} holds neither {SINGLE} nor {INDEX}")
    return path


def _weight_map(path: Path) -> dict[str, str]:
    if (path / INDEX).is_file():
        return dict(json.loads((path / INDEX).read_text())["weight_map"])
    from safetensors import safe_open

    with safe_open(str(path / SINGLE), framework="pt") as f:
        return {k: SINGLE for k in f.keys()}


def check_weights(model: ModelSpec, directory: str | Path) -> None:
    """Before launch: every weight the model needs is in the checkpoint with the model's shape (read from the
    safetensors headers only; the model built on the meta device, no memory); ``SpecError`` in one line
    naming the first tensor that is missing or of another shape (the ranks used to find it, after launch,
    and end in a torchrun traceback)."""
    import torch
    from safetensors import safe_open

    from runner.model import build_full_model

    path = Path(directory)
    where = _weight_map(path)
    with torch.device("meta"):
        net = build_full_model(model, 0)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(where.values())):
        with safe_open(str(path / file), framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    for name, param in net.named_parameters():
        key = hf_name(name)
        if key not in shapes:
            raise SpecError("--init-from", key, f"is not in the checkpoint {shown(str(path))}")
        if shapes[key] != tuple(param.shape):
            raise SpecError(
                "--init-from",
                key,
                f"has shape {shapes[key]} in the checkpoint, the plan's model needs {tuple(param.shape)}",
            )


def load_weights(modules: Iterable, directory: str | Path) -> None:
    """Copy each weight of ``modules`` (runner chunks, global names) from the checkpoint in ``directory``,
    reading only those tensors; ``SpecError`` naming a tensor that is missing or of another shape."""
    import torch
    from safetensors import safe_open

    path = Path(directory)
    where = _weight_map(path)
    wanted: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for module in modules:
        for name, param in module.named_parameters():
            key = hf_name(name)
            if key not in where:
                raise SpecError("--init-from", key, f"is not in the checkpoint {shown(str(path))}")
            wanted.setdefault(where[key], []).append((key, param))
    with torch.no_grad():
        for file, params in wanted.items():
            with safe_open(str(path / file), framework="pt") as f:
                for key, param in params:
                    tensor = f.get_tensor(key)
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise SpecError(
                            "--init-from",
                            key,
                            f"has shape {tuple(tensor.shape)} in the checkpoint, the plan's model needs {tuple(param.shape)}",
                        )
                    param.copy_(tensor.to(param.dtype))


def config_of(model: ModelSpec) -> dict:
    """A Llama-family ``config.json`` for a model that did not come from a checkpoint."""
    family = "qwen3" if model.qk_norm else "qwen2" if model.bias == "qkv" else "llama"
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    return {
        "architectures": [arch],
        "model_type": family,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.seq_len,
        "rope_theta": model.rope_theta,
        "rms_norm_eps": model.rms_norm_eps,
        "tie_word_embeddings": model.tied_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def check_saveable(model: ModelSpec) -> None:
    """``--save-hf`` needs a model a Llama-family config describes."""
    if model.mlp != "swiglu" or model.is_moe or model.learned_positions or model.bias == "all":
        raise SpecError(
            "--save-hf",
            "",
            f"model {shown(model.name)} is not a Llama-style dense decoder (swiglu, rotary positions, no MoE): "
            "no Hugging Face family to write it as",
        )


def save(state: Mapping, model: ModelSpec, out: str | Path, source: str | Path | None) -> Path:
    """Write ``state`` (the runner's full weights by global name) as a Hugging Face checkpoint in ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {hf_name(k): v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, str(out / SINGLE), metadata={"format": "pt"})
    if source is not None and (Path(source) / "config.json").is_file():
        shutil.copyfile(Path(source) / "config.json", out / "config.json")
        for name in TOKENIZER_FILES:
            if (Path(source) / name).is_file():
                shutil.copyfile(Path(source) / name, out / name)
    else:
        (out / "config.json").write_text(json.dumps(config_of(model), indent=2) + "\n")
    return out
