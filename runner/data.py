"""Training batches, deterministic from ``(seed, step)`` so every rank and every resumed run sees the same data.

- Synthetic (default): each sequence counts up from a random start with a random stride
  (``t[k+1] = (t[k] + stride) mod vocab``), so the loss visibly falls; no downloads.
- Text file: the file's bytes are the tokens (byte-level, vocab 256); each sequence is a window at a
  random offset. Needs ``vocab_size >= 256``.
- With a tokenizer (a Hugging Face checkpoint directory's ``tokenizer.json``, ``train --init-from``):
  ``--data`` is a text file, a JSONL file (one document per line, its ``"text"``), or a directory of
  them (``*.txt``, ``*.jsonl``, in name order), each document tokenized and followed by the end-of-text
  token, all packed into one stream cut into sequences of ``seq_len + 1`` tokens. Step ``k`` takes
  sequences ``k * B .. k * B + B - 1`` (modulo their number: another epoch), so the data position is the
  step a checkpoint stores, and a resumed run continues exactly.

``global_batch(step)`` returns ``(global_batch_size, seq_len + 1)`` int64 tokens; a pipeline takes its
rows, inputs are ``[:, :-1]`` and targets ``[:, 1:]``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from autotune.errors import SpecError
from autotune.specs import ModelSpec

BYTE_VOCAB = 256
_MAX_STRIDE = 7


class TokenSource:
    def __init__(
        self,
        model: ModelSpec,
        seed: int = 0,
        text_path: str | Path | None = None,
        tokenizer: str | Path | None = None,
    ) -> None:
        self.model = model
        self.seed = seed
        self.text: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None  # (sequences, seq_len + 1) with a tokenizer
        if text_path is not None and tokenizer is not None:
            from runner.corpus import packed_sequences

            self.packed = packed_sequences(Path(text_path), Path(tokenizer), model)
        elif text_path is not None:
            path = Path(text_path)
            if model.vocab_size < BYTE_VOCAB:
                raise SpecError(
                    str(path),
                    "vocab_size",
                    f"byte-level text needs vocab_size >= {BYTE_VOCAB}, model {model.name!r} has {model.vocab_size}",
                )
            try:
                raw = path.read_bytes()
            except OSError as e:
                raise SpecError(str(path), "", f"cannot read data file: {e.strerror}") from None
            if len(raw) < model.seq_len + 2:
                raise SpecError(
                    str(path), "", f"has {len(raw)} bytes, needs at least seq_len + 2 = {model.seq_len + 2}"
                )
            self.text = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)

    def _generator(self, step: int) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 1_000_003 + step) % (2**63))

    def global_batch(self, step: int) -> torch.Tensor:
        b, t = self.model.global_batch_size, self.model.seq_len + 1
        if self.packed is not None:
            rows = (torch.arange(b) + step * b) % len(self.packed)
            return self.packed[rows]
        gen = self._generator(step)
        if self.text is not None:
            starts = torch.randint(0, len(self.text) - t + 1, (b,), generator=gen)
            return torch.stack([self.text[s : s + t] for s in starts.tolist()])
        vocab = self.model.vocab_size
        start = torch.randint(0, vocab, (b, 1), generator=gen)
        stride = torch.randint(1, _MAX_STRIDE + 1, (b, 1), generator=gen)
        return (start + stride * torch.arange(t).unsqueeze(0)) % vocab

    def pipeline_batch(self, step: int, offset: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of the ``size`` sequences starting at ``offset`` of step ``step``."""
        rows = self.global_batch(step)[offset : offset + size]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
