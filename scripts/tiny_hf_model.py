"""Build a tiny Hugging Face checkpoint locally (no hub access): random weights from a seed, a byte-level
BPE tokenizer trained on a few lines, and those lines as a JSONL corpus. The README's fine-tuning
walkthrough and the tests (``tests/hf_models.py``) use it.

    .venv/bin/python scripts/tiny_hf_model.py tiny-llama [--family llama|mistral|qwen2|qwen3] [--corpus corpus.jsonl]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CORPUS = [
    "autotune finds the fastest plan for a mixed cluster of GPUs.",
    "The simulator predicts each plan; the runner trains the best one.",
    "Pipelines, tensor parallelism and ZeRO share the work between devices.",
    "A fast card takes more layers, a slow card takes fewer.",
] * 8

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=64,
)
FAMILIES = {
    "llama": dict(tie_word_embeddings=False, rms_norm_eps=1e-5),
    "mistral": dict(tie_word_embeddings=False, sliding_window=16),  # a window shorter than the sequence
    "qwen2": dict(tie_word_embeddings=True),  # qkv biases, tied head
    "qwen3": dict(tie_word_embeddings=False, head_dim=32),  # per-head query/key norms, head_dim != hidden / heads
}


def tokenizer_files(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(out))


def tiny_model(family: str, out: Path, seed: int = 0) -> Path:
    """A tiny ``family`` checkpoint (config, safetensors, tokenizer) in ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    config = AutoConfig.for_model(family, **SHAPE, **FAMILIES[family])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # biases are zero and norms one at init: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(out))
    tokenizer_files(out, SHAPE["vocab_size"])
    return out


def write_corpus(path: Path, repeats: int = 4) -> Path:
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in CORPUS * repeats))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the checkpoint directory to write")
    ap.add_argument("--family", default="llama", choices=sorted(FAMILIES))
    ap.add_argument("--corpus", type=Path, help="also write the lines as a JSONL corpus here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tiny_model(args.family, args.out, args.seed)
    print(f"tiny {args.family} checkpoint written to {args.out}")
    if args.corpus:
        write_corpus(args.corpus)
        print(f"corpus of {len(CORPUS) * 4} lines written to {args.corpus}")


if __name__ == "__main__":
    main()
