"""README.md's blocks outside its tour, each run as written (the machinery and the rules: tests/readme_blocks.py)."""

from __future__ import annotations

import pytest
from readme_blocks import TOUR, Block, check_block, make_workdir, readme_blocks

pytestmark = [pytest.mark.slow]

BLOCKS = [b for b in readme_blocks() if b.section != TOUR]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return make_workdir(tmp_path_factory.mktemp("readme"))


@pytest.mark.parametrize("block", BLOCKS, ids=[f"line{b.line}" for b in BLOCKS])
def test_the_readme_block_runs_as_written(block: Block, workdir) -> None:
    check_block(block, workdir)


def test_every_block_is_found_and_every_skip_says_why() -> None:
    everything = readme_blocks()
    assert len(everything) >= 15 and any(b.section == TOUR for b in everything)
    assert all(b.skip.strip() for b in everything if b.skip)
