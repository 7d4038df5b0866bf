"""README.md's code blocks as tests (issue 46, case 6): read from README.md itself, not copied, and run as a
newcomer types them from the repository root, in a working directory with ``examples/``, ``scripts/``,
``docs/``, the Makefile and ``.venv`` linked in and the environment's ``autotune`` first on ``PATH``. A block
that cannot run here says so in README.md, on the line before it: ``<!-- readme-test: skip <why> -->`` (a GPU,
other machines, a database host). Where a block shows what a command prints (lines after ``$ command``), the
printed lines must appear in the output, with durations and ``...`` as wildcards (``expected_lines_match``).
A command that serves until Ctrl-C (its line says so) runs for a few seconds and must have printed its
address. ```` ```text ```` blocks are not commands. ``make test`` is the suite itself (CI runs it), the one
command not run. Two test files run the blocks (tests/integration/readme): the tour, and the rest."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from paths import REPO

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SKIP = re.compile(r"<!-- readme-test: skip (.+?) -->")
SERVES = "Ctrl-C stops it"
COMMAND_TIMEOUT_S = 900


@dataclass(frozen=True)
class Command:
    text: str  # what the shell runs (continuation lines joined)
    expected: tuple[str, ...] = ()  # what README shows it prints
    serves: bool = False  # runs until Ctrl-C: started, given a few seconds, stopped
    fails: bool = False  # README says it fails (a comment around it names "exit 2" or shows "error:")


@dataclass(frozen=True)
class Block:
    line: int  # where it starts in README.md
    language: str
    commands: tuple[Command, ...]
    skip: str = ""
    section: str = ""  # the ``## `` heading it is under


def _commands(body: str) -> tuple[Command, ...]:
    """A shell block's commands: ``$ cmd`` blocks (what follows each, up to the next ``$``, is its output), or
    every line that is not a comment (a trailing backslash continues it)."""
    lines = body.splitlines()
    out: list[Command] = []
    if any(line.startswith("$ ") for line in lines):
        i = 0
        while i < len(lines):
            if not lines[i].startswith("$ "):
                i += 1
                continue
            text = lines[i][2:]
            while text.endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text[:-1] + " " + lines[i].strip()
            i += 1
            shown = []
            while i < len(lines) and not lines[i].startswith("$ "):
                shown.append(lines[i])
                i += 1
            out.append(Command(text, tuple(shown)))
        return tuple(out)
    text, comments = "", []
    for k, raw in enumerate(lines):
        line = raw.rstrip()
        if not text and (not line.strip() or line.lstrip().startswith("#")):
            comments.append(line)
            continue
        if text and text.count('"') % 2:  # inside a quoted string spanning lines (python -c "...")
            text += "\n" + line
        else:
            text += (" " if text else "") + line.strip()
        if text.endswith("\\"):
            text = text[:-1].rstrip()
            continue
        if text.count('"') % 2:
            continue
        after = []  # the comment lines right after it: what it prints, where README shows it
        for rest in lines[k + 1 :]:
            if not rest.lstrip().startswith("#"):
                break
            after.append(rest)
        said = " ".join(comments[-2:] + after + [text])
        out.append(Command(text, serves=SERVES in text, fails="exit 2" in said or "#    error:" in "\n".join(after)))
        text, comments = "", []
    return tuple(out)


def readme_blocks(readme: Path = REPO / "README.md") -> list[Block]:
    text = readme.read_text()
    blocks, previous_end = [], 0
    for m in FENCE.finditer(text):
        before = text[previous_end : m.start()]
        skip = SKIP.findall(before)
        line = text.count("\n", 0, m.start()) + 1
        language, body = m.group(1), m.group(2)
        commands = (Command(body),) if language == "python" else _commands(body)
        headings = re.findall(r"^## (.+)$", text[: m.start()], re.M)
        blocks.append(Block(line, language, commands, skip[-1] if skip else "", headings[-1] if headings else ""))
        previous_end = m.end()
    return blocks


_DURATION = re.compile(r"\d+(\.\d+)? ?(s|min)\b")
_BOX = re.compile(r"[│┃┌┐└┘├┤┬┴┼─━┏┓┗┛┡┩╇┳┻╋]")


def _normal(line: str) -> str:
    return " ".join(_BOX.sub(" ", _DURATION.sub("<t>", line)).split())


def expected_lines_match(expected: tuple[str, ...], output: str) -> list[str]:
    """The README's shown lines that are not in ``output`` (whitespace and table borders ignored, durations
    and ``...`` wildcards); empty when all are."""
    got = "\n".join(_normal(line) for line in output.splitlines())
    missing = []
    for line in expected:
        want = _normal(line)
        if not want or want == "...":
            continue
        pattern = ".*?".join(re.escape(part.strip()) for part in want.split("...")).replace(re.escape("<t>"), r"\S+")
        if not re.search(pattern, got):
            missing.append(line)
    return missing


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), COLUMNS="120", PYTHONPATH=str(REPO))


def _run(command: Command, cwd: Path, language: str) -> tuple[int, str]:
    if language == "python":
        script = cwd / "readme_block.py"
        script.write_text(command.text)
        args, shell = [sys.executable, str(script)], False
    else:
        args, shell = ["bash", "-c", command.text], False
    if command.serves:  # an address printed, then stopped
        proc = subprocess.Popen(args, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.terminate()
            out, _ = proc.communicate(timeout=30)
            return (0 if "http://" in out else 1), out
        return proc.returncode, out
    done = subprocess.run(
        args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, shell=shell
    )
    return done.returncode, done.stdout + done.stderr


def make_workdir(d: Path) -> Path:
    for name in ("examples", "scripts", "docs", "Makefile", "pyproject.toml", ".venv"):
        if (REPO / name).exists():
            (d / name).symlink_to(REPO / name)
    return d


def check_block(block: Block, workdir: Path) -> None:
    """Run ``block``'s commands in ``workdir``, in order; fail naming the README line and what differs."""
    if block.skip:
        pytest.skip(f"README.md line {block.line}: {block.skip}")
    if block.language == "text":
        pytest.skip(f"README.md line {block.line}: text, not commands")
    for command in block.commands:
        if command.text.startswith("make test"):
            continue  # this suite itself
        code, out = _run(command, workdir, block.language)
        expect_failure = command.fails or "error:" in "\n".join(command.expected)
        assert (code != 0) == expect_failure, f"README.md line {block.line}: {command.text}\n{out[-3000:]}"
        missing = expected_lines_match(command.expected, out)
        assert not missing, f"README.md line {block.line}: {command.text}: not printed: {missing}\n{out[-3000:]}"


TOUR = "A tour of the command line"
