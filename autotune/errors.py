"""The one error type that user input can raise.

Every message names where the bad value came from (a file or a preset), the field, and the rule
it broke, so the CLI can print it as one line: ``cluster.yaml: nodes[1].count: must be >= 1, got 0``.
A value echoed in a message goes through ``shown`` (a short prefix of its repr), and the parts of a
message are cut to a bounded length, so no input makes a long error line.
"""

from __future__ import annotations

from typing import Any

MAX_SHOWN_CHARS = 60
MAX_PART_CHARS = 500


def shown(value: Any, limit: int = MAX_SHOWN_CHARS) -> str:
    """``repr(value)``, cut to ``limit`` characters (a long list is described, not printed)."""
    if isinstance(value, (list, tuple, dict, set)) and len(value) > 16:
        return f"a {type(value).__name__} of {len(value)} items"
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # e.g. an integer with more digits than str() allows
        return f"a {type(value).__name__} too long to show"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _cut(text: str) -> str:
    text = str(text)
    return text if len(text) <= MAX_PART_CHARS else f"{text[:MAX_PART_CHARS]}... ({len(text):,} characters)"


class SpecError(ValueError):
    """Bad user input: a malformed file, an unknown name, an invalid or impossible plan."""

    def __init__(self, source: str, field: str, rule: str) -> None:
        self.source = _cut(source)
        self.field = _cut(field)
        self.rule = _cut(rule)
        where = ": ".join(part for part in (self.source, self.field) if part)
        super().__init__(f"{where}: {self.rule}" if where else self.rule)


def is_interrupt(e: BaseException) -> bool:
    """Whether ``e`` is the user's Ctrl-C: a KeyboardInterrupt, or an error raised while one unwound (its context
    chain holds one: a library's clean-up interrupted by Ctrl-C, such as Optuna's journal-file lock meeting its
    own ``.rename`` file gone)."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__context__
    return False
