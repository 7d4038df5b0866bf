"""Every command's ``--help``: each option says what it does, and flags show no value type
(typer 0.29 prints ``--json <bool>`` as if the flag took a value)."""

from __future__ import annotations

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from autotune.cli import app

COMMANDS = sorted(get_command(app).commands)


def test_every_command_is_listed():
    assert {"simulate", "measure", "profile", "search", "compare", "best", "train", "ui"} <= set(COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_has_help_and_flags_take_no_value(name):
    command = get_command(app).commands[name]
    missing = [p.opts[0] for p in command.params if getattr(p, "help", None) in (None, "") and p.name != "ctx"]
    assert not missing, f"{name}: options without help text: {missing}"
    out = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "160"}).output
    assert "<bool>" not in out, out
    for p in command.params:
        if getattr(p, "is_flag", False):
            line = next(line for line in out.splitlines() if p.opts[0] + " " in line)
            assert "<" not in line.split(p.opts[0], 1)[1].split()[0], line
