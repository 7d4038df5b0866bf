"""A tokenized training corpus (``train --data`` with a checkpoint's tokenizer; ``runner.data``): text and
JSONL files tokenized with Hugging Face ``tokenizers``, packed into sequences."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from autotune.errors import SpecError, shown
from autotune.specs import ModelSpec

SUFFIXES = (".txt", ".jsonl")
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


def documents(path: Path) -> list[str]:
    """The documents of a text file (the whole file), a JSONL file (each line's ``"text"``), or a directory
    of them; one line naming the file and line on anything else."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES and p.is_file())
        if not files:
            raise SpecError("--data", "", f"{shown(str(path))} holds no {' or '.join(SUFFIXES)} files")
        return [d for f in files for d in documents(f)]
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError("--data", "", f"cannot read {shown(str(path))}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise SpecError("--data", "", f"{shown(str(path))} is not UTF-8 text") from None
    if path.suffix != ".jsonl":
        return [text]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise SpecError("--data", "", f"{shown(str(path))} line {n} is not JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise SpecError("--data", "", f"{shown(str(path))} line {n} has no 'text' string")
        out.append(record["text"])
    return out


def packed_sequences(path: Path, tokenizer_dir: Path, model: ModelSpec) -> torch.Tensor:
    """``(sequences, seq_len + 1)`` int64 tokens of the corpus at ``path``."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    except Exception as e:  # tokenizers raises its own exception type for a broken file
        raise SpecError(
            "--data", "tokenizer", f"{shown(str(tokenizer_dir / 'tokenizer.json'))} cannot be read: {e}"
        ) from None
    if tok.get_vocab_size() > model.vocab_size:
        raise SpecError(
            "--data",
            "tokenizer",
            f"has {tok.get_vocab_size():,} tokens, model {shown(model.name)} embeds {model.vocab_size:,}",
        )
    eos = next((i for name in EOS_NAMES if (i := tok.token_to_id(name)) is not None), None)
    stream: list[int] = []
    for doc in documents(path):
        stream += tok.encode(doc).ids + ([eos] if eos is not None else [])
    t = model.seq_len + 1
    if len(stream) < t:
        raise SpecError("--data", "", f"{shown(str(path))} has {len(stream):,} tokens, one sequence needs {t:,}")
    n = len(stream) // t
    return torch.tensor(stream[: n * t], dtype=torch.int64).view(n, t)
