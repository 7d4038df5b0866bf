"""What a command is doing while nothing else shows: a spinner line on stderr (terminals only).

Commands import MLflow or torch lazily, and each takes seconds to import; ``loading(text)`` says so
at once instead of leaving the terminal silent. The line disappears when the work is done, so a
command's own output (a table, one JSON object) is all that remains; on a pipe nothing is drawn.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def loading(text: str) -> Iterator[callable]:
    """``with loading("reading the MLflow store") as say: ...; say("next step")``."""
    from rich.console import Console
    from rich.markup import escape

    console = Console(stderr=True)
    if not console.is_terminal:
        yield lambda _text: None
        return
    with console.status(escape(text), spinner="dots") as status:
        yield lambda new: status.update(escape(new))
