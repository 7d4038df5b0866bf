"""Where the tests find the repository, its examples and their own data, from any tier and package."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
DATA = Path(__file__).resolve().parent / "data"
