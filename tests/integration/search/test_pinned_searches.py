"""A refactor changes no plan: the searches of ``tests/pinned_behaviour.py`` at fixed seeds return what ``tests/data/pinned_behaviour.json`` holds."""

from __future__ import annotations

import json

import pytest
from pinned_behaviour import PINNED, close, searches


@pytest.fixture(scope="module")
def pinned():
    return json.loads(PINNED.read_text())


@pytest.mark.slow
def test_search_returns_the_same_plans_at_the_same_seeds(pinned):
    now = json.loads(json.dumps(searches()))
    assert close(pinned["search"], now) == []
