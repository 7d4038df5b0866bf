"""Tiny Hugging Face models of each family the runner loads, built locally by ``scripts/tiny_hf_model.py``
(``transformers``: random weights from a seed, a BPE tokenizer trained on a few lines): no hub access."""

from __future__ import annotations

import importlib.util

from paths import REPO

_spec = importlib.util.spec_from_file_location("tiny_hf_model", REPO / "scripts" / "tiny_hf_model.py")
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

CORPUS = _module.CORPUS
FAMILIES = _module.FAMILIES
tiny_model = _module.tiny_model
write_corpus = _module.write_corpus
