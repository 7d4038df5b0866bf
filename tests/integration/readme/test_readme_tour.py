"""README.md's tour of the command line, run as written (the machinery and the rules: tests/readme_blocks.py).
Its own file: the longest README block (searches, training, real runs, the profiler), which ``make test``
runs beside the others."""

from __future__ import annotations

import pytest
from readme_blocks import TOUR, Block, check_block, make_workdir, readme_blocks

pytestmark = [pytest.mark.slow]

BLOCKS = [b for b in readme_blocks() if b.section == TOUR]


@pytest.mark.parametrize("block", BLOCKS, ids=[f"line{b.line}" for b in BLOCKS])
def test_the_tour_runs_as_written(block: Block, tmp_path) -> None:
    check_block(block, make_workdir(tmp_path))
