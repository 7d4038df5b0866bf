"""Reading a user's YAML or JSON file into plain data, with bounds, before any field is interpreted.

Every file autotune reads (cluster, model, plan, calibration profile) goes through ``read_document``,
which refuses with one ``SpecError`` line: a file over ``MAX_FILE_BYTES``; bytes that are not UTF-8
(naming the line and byte); invalid YAML/JSON; YAML aliases beyond ``MAX_ALIASES`` (an alias bomb
expands exponentially); nesting deeper than ``MAX_DEPTH``; more than ``MAX_VALUES`` values; a
mapping key that is not a string; a number that is not finite (``1e400`` in JSON is infinity) or an
integer beyond ``MAX_INTEGER``. Each field's own range is checked where the field is built
(``autotune.specs``). Values echoed in messages go through ``shown`` so no message is long.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from autotune.errors import SpecError, shown

MAX_FILE_BYTES = 16 * 2**20
MAX_DEPTH = 32
MAX_VALUES = 1_000_000
MAX_ALIASES = 100
MAX_INTEGER = 2**53  # beyond it, arithmetic in floats is no longer exact


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, counting aliases (``*name``) so a small file cannot expand to gigabytes."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self.aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                mark = self.peek_event().start_mark
                raise yaml.YAMLError(
                    f"more than {MAX_ALIASES} aliases (*name) at line {mark.line + 1}; "
                    "a file that expands itself is refused"
                )
        return super().compose_node(parent, index)


def _decode(source: str, blob: bytes) -> str:
    try:
        return blob.decode("utf-8")
    except UnicodeDecodeError as e:
        line = blob[: e.start].count(b"\n") + 1
        raise SpecError(
            source,
            "",
            f"is not UTF-8 text: byte 0x{blob[e.start]:02x} at line {line} (offset {e.start}); is it a binary file?",
        ) from None


def read_document(path: str | Path, fmt: str | None = None) -> Any:
    """The data in ``path`` (JSON when ``fmt == "json"`` or the name ends in ``.json``, else YAML)."""
    path = Path(path)
    source = str(path)
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise SpecError(source, "", f"file of {size:,} bytes is larger than the limit of {MAX_FILE_BYTES:,} bytes")
        blob = path.read_bytes()
    except OSError as e:
        raise SpecError(source, "", f"cannot read file: {e.strerror}") from None
    text = _decode(source, blob)
    as_json = fmt == "json" if fmt is not None else path.suffix == ".json"
    try:
        if as_json:
            data = json.loads(text)
        else:
            data = yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 (a SafeLoader subclass)
    except RecursionError:
        raise SpecError(source, "", f"is nested too deeply to read (the limit is {MAX_DEPTH} levels)") from None
    except json.JSONDecodeError as e:
        raise SpecError(source, "", f"invalid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        raise SpecError(source, "", f"invalid YAML: {getattr(e, 'problem', None) or e}{at}") from None
    check_plain(data, source)
    return data


def check_plain(data: Any, source: str) -> None:
    """Refuse data that no spec field could want: deep nesting, too many values, non-string keys,
    numbers that are not finite or integers too large to compute with. Iterative (no recursion)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    seen = 0
    while stack:
        value, where, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise SpecError(source, "", f"holds more than {MAX_VALUES:,} values (YAML aliases count once per use)")
        if depth > MAX_DEPTH:
            raise SpecError(source, where, f"is nested deeper than the limit of {MAX_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise SpecError(source, where, f"key {shown(key)} must be a string (quote it)")
                stack.append((item, f"{where}.{key}" if where else key, depth + 1))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                stack.append((item, f"{where}[{i}]", depth + 1))
        elif isinstance(value, float) and not math.isfinite(value):
            raise SpecError(source, where, f"must be a finite number, got {value}")
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INTEGER:
            raise SpecError(source, where, f"integer {shown(value)} is beyond the limit of 2**53")
