"""A refactor changes no plan and no prediction: the searches and the simulator sweep of
``tests/pinned_behaviour.py`` give what ``tests/data/pinned_behaviour.json`` holds."""

from __future__ import annotations

import json

import pytest
from pinned_behaviour import PINNED, close, sweep


@pytest.fixture(scope="module")
def pinned():
    return json.loads(PINNED.read_text())


def test_the_simulator_predicts_what_it_predicted(pinned):
    now = json.loads(json.dumps(sweep()))
    assert close(pinned["sweep"], now) == []
