"""The layers import in one direction, counting every import (function-level, ``TYPE_CHECKING`` and
``try`` blocks included): no module of the project reaches, directly or through others, back into
itself; what every method shares (specs, the simulator, ``autotune.planning``, the env) knows nothing of
the agents, the library call, the tracking or the RL policy's training code; function-level imports are
kept for heavy third-party libraries, never to hide a circle; no module is over 650 lines and no function
over 100."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO

ROOT = REPO
PACKAGES = ("autotune", "envs", "runner")
MAX_MODULE_LINES = 650
MAX_FUNCTION_LINES = 100
#: the lower layers and what sits above them: nothing in a lower layer imports an upper one
LOWER = ("autotune.specs", "autotune.simulator", "autotune.planning", "autotune.evaluator", "envs")
UPPER = ("autotune.search", "autotune.policy", "autotune.commands", "autotune.cli")


def modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    mods = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


MODULES = modules()


def import_graph(mods: dict[str, Path] = MODULES) -> dict[str, set[str]]:
    """Module -> the project modules it imports, every import statement counted."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                r = resolve(t)
                # a package's __init__ re-exporting its own modules is not an edge back
                if r and r != mod and not (path.name == "__init__.py" and r.startswith(mod + ".")):
                    graph[mod].add(r)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_among_the_projects_modules():
    assert circles(import_graph()) == []


def test_the_rule_sees_circles_held_open_by_function_level_and_type_checking_imports(tmp_path):
    """The rule can fail: a package whose modules import each other only inside a function or a
    ``TYPE_CHECKING`` block has a circle, and the rule finds it."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg import a\n")  # a re-export: not an edge back
    (pkg / "a.py").write_text("from pkg.b import helper\n")
    (pkg / "b.py").write_text("def helper():\n    from pkg.c import x\n    return x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\nx = 1\n")
    assert circles(import_graph(modules(tmp_path, ("pkg",)))) == [["pkg.a", "pkg.b", "pkg.c"]]


@pytest.mark.parametrize("lower", LOWER)
def test_lower_layers_never_import_upper_ones(lower):
    graph = import_graph()
    bad = sorted(
        (m, t)
        for m, targets in graph.items()
        if m == lower or m.startswith(lower + ".")
        for t in targets
        if t.startswith(UPPER)
    )
    assert bad == []


def test_no_module_over_650_lines_and_no_function_over_100():
    long_modules = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    long_functions = []
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{mod}.{node.name} ({n})")
    assert long_modules == {} and long_functions == []


@pytest.mark.parametrize(
    "module",
    [
        "envs.parallel_config",
        "autotune.planning.space",
        "autotune.planning.budget",
        "autotune.evaluator",
        "autotune.simulator",
        "autotune.planning.planner",
    ],
)
def test_shared_layers_load_no_agent_api_or_policy_code(module):
    code = (
        f"import sys, {module}\nbad = sorted(m for m in sys.modules if m.startswith({UPPER!r}))\nprint(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{module} pulls in {out.stdout.strip()}"


def test_the_env_builds_its_own_evaluator_without_the_library_call():
    code = (
        "import sys\nfrom envs.parallel_config import ParallelConfigEnv\n"
        "env = ParallelConfigEnv(cluster='cpu-2', model='tiny')\nenv.reset(seed=0)\n"
        f"print(','.join(sorted(m for m in sys.modules if m.startswith({UPPER!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
