"""Activation checkpointing: the modes a stage's ``recompute`` field takes and what each recomputes.

- ``false``: nothing; every block keeps its activations for the backward.
- ``true``: full recomputation; each block keeps its input and reruns its forward in the backward.
- ``"selective"``: Megatron's selective recomputation (Korthikanti et al. 2022): the attention core
  (``Q K^T``, softmax, dropout, ``P V``) is rerun; with fused attention it changes nothing.
- ``"selective-op"``: torchtitan's per-op selective activation checkpointing: the outputs of the block's
  matrix multiplications (every other one of its linear layers, in forward order, as torchtitan's policy
  keeps them) and of fused attention are kept; every other op of the block (the other matmuls, norms,
  activation functions, element-wise products, softmax) is rerun from them in the backward.
- ``"every-N"`` (an integer N >= 2): torchtitan's per-layer selective checkpointing: every N-th block of
  each model chunk (the N-th, 2N-th, ... counting from its first block) is fully recomputed, the others
  keep their activations. A stage without interleaving is one chunk.
"""

from __future__ import annotations

import re

from autotune.errors import shown

#: the fixed modes; ``"every-N"`` adds one per N
NAMED_MODES = (False, True, "selective", "selective-op")
_EVERY = re.compile(r"every-([0-9]+)")
#: what a bad value is told it may be
EXPECTED = 'true, false, "selective", "selective-op" or "every-N" (N >= 2)'


def every_n(mode: bool | str) -> int | None:
    """N of an ``"every-N"`` mode, None for the other modes (and for anything else)."""
    if not isinstance(mode, str):
        return None
    m = _EVERY.fullmatch(mode)
    return int(m.group(1)) if m else None


def recompute_problem(mode: object) -> str | None:
    """Why ``mode`` is not a recompute mode (the message after the field's name), None when it is one."""
    if isinstance(mode, bool) or (isinstance(mode, str) and mode in NAMED_MODES):
        return None
    n = every_n(mode) if isinstance(mode, str) else None
    if n is not None and 2 <= n <= 2048:
        return None
    return f"must be {EXPECTED}, got {shown(mode)}"


def checkpointed_blocks(mode: bool | str, blocks: int) -> int:
    """How many of a chunk's ``blocks`` are fully recomputed: all with ``true``, every N-th with
    ``"every-N"``, none otherwise."""
    if mode is True:
        return blocks
    n = every_n(mode)
    return blocks // n if n else 0


def is_checkpointed(mode: bool | str, position: int) -> bool:
    """Whether the block at 0-based ``position`` of its chunk is fully recomputed."""
    if mode is True:
        return True
    n = every_n(mode)
    return bool(n) and (position + 1) % n == 0


def flag(mode: bool | str) -> str:
    """The short flag plans print (`` R`` full, `` S`` selective, `` O`` per-op, `` R/N`` every N-th)."""
    if mode is True:
        return " R"
    if mode == "selective":
        return " S"
    if mode == "selective-op":
        return " O"
    n = every_n(mode)
    return f" R/{n}" if n else ""


def label(mode: bool | str) -> str:
    """The mode as tables print it: ``""`` (none), ``"full"``, or its name."""
    return "full" if mode is True else "" if mode is False else str(mode)


def rerun_fraction(mode: bool | str) -> float:
    """A rough share of the forward the backward reruns, for features: 1 full, 1/N every-N, 0.5 the
    selective modes (their share depends on the model), 0 none."""
    if mode is True:
        return 1.0
    n = every_n(mode)
    if n:
        return 1.0 / n
    return 0.5 if mode in ("selective", "selective-op") else 0.0
