"""The one error type that user input can raise.

Every message names where the bad value came from (a file or a preset), the field, and the rule
it broke, so the CLI can print it as one line: ``cluster.yaml: nodes[1].count: must be >= 1, got 0``.
"""

from __future__ import annotations


class SpecError(ValueError):
    """Bad user input: a malformed file, an unknown name, an invalid or impossible plan."""

    def __init__(self, source: str, field: str, rule: str) -> None:
        self.source = source
        self.field = field
        self.rule = rule
        where = ": ".join(part for part in (source, field) if part)
        super().__init__(f"{where}: {rule}" if where else rule)
