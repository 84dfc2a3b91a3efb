"""The import graph between the project's packages, read from the source (every import statement, the lazy ones
inside functions and ``TYPE_CHECKING`` blocks included).

Why: a lazy import hides a cycle from Python but not from a reader: two packages that import each other are one
room with two doors. The rules: no cycle between packages; ``hardware/`` (device models and single measurements)
imports nothing of the project but ``units``; ``apply/`` (the runtime) never imports the planner (``solve/``), the
integrations or the calibration. The test fails on the first new edge that breaks one, naming the file and line.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "hf_colossal_auto"
PACKAGE = "hf_colossal_auto"

ALLOWED: dict[tuple[str, str], str] = {
    # (importing file, imported package) -> why it is allowed for now. Each entry is an edge in a file that is
    # (none left: add an edge here only with the file move that will remove it)
}
"""Edges that break a rule only because of a file another change is moving (named, not a skipped rule)."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The absolute project modules an ``import from`` names (``from . import x`` may name a submodule)."""
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not target.startswith(PACKAGE):
        return []
    if node.module is None:  # from . import a, b: a and b may be modules
        return [f"{target}.{alias.name}" for alias in node.names]
    return [target]


@functools.cache
def _imports() -> list[tuple[str, int, str]]:
    """(file relative to the package, line, imported project module) for every import in the package."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        is_package = path.name == "__init__.py"
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith(PACKAGE)]
            elif isinstance(node, ast.ImportFrom):
                targets = _resolve(module, is_package, node)
            else:
                continue
            out.extend((rel, node.lineno, t) for t in targets)
    return out


def _room(module_or_file: str) -> str:
    """The package (or top-level module) a module or file belongs to: ``solve``, ``units``, ``cli``..."""
    parts = module_or_file.replace("/", ".").removesuffix(".py").split(".")
    if parts[0] == PACKAGE:
        parts = parts[1:]
    return parts[0] if parts and parts[0] != "__init__" else "__init__"


def _edges() -> dict[tuple[str, str], list[str]]:
    """(room, imported room) -> where, for every import between two rooms (allowed edges left out)."""
    edges: dict[tuple[str, str], list[str]] = {}
    for rel, line, target in _imports():
        src, dst = _room(rel), _room(target)
        if src == dst or dst == "__init__" or (rel, dst) in ALLOWED:
            continue
        edges.setdefault((src, dst), []).append(f"{rel}:{line} imports {target}")
    return edges


def _cycle(edges: dict[tuple[str, str], list[str]]) -> list[str] | None:
    graph: dict[str, set[str]] = {}
    for src, dst in edges:
        graph.setdefault(src, set()).add(dst)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_source_is_read():
    """The walk sees the project: imports resolved to rooms the rules below talk about."""
    rooms = {_room(t) for _, _, t in _imports()}
    assert {"solve", "apply", "hardware", "capture", "units"} <= rooms


def test_no_cycle_between_packages():
    edges = _edges()
    cycle = _cycle(edges)
    if cycle:
        where = [edges[(a, b)][0] for a, b in zip(cycle, cycle[1:], strict=False)]
        pytest.fail(f"import cycle {' -> '.join(cycle)}: " + "; ".join(where))


def test_hardware_imports_only_units():
    bad = [
        where
        for (src, dst), places in _edges().items()
        if src == "hardware" and dst != "units"
        for where in places
    ]
    assert not bad, "hardware/ may import only units: " + "; ".join(bad)


@pytest.mark.parametrize("forbidden", ["solve", "integrations", "calibration"])
def test_apply_does_not_import(forbidden: str):
    bad = [
        where
        for (src, dst), places in _edges().items()
        if (src, dst) == ("apply", forbidden)
        for where in places
    ]
    assert not bad, f"apply/ must not import {forbidden}/: " + "; ".join(bad)


def test_only_the_overheads_run_the_planner_and_runtime():
    """Within calibration/, one module measures what the planner and the runtime cost per op; every other
    module measures the device (so a calibration of kernels never drags the planner in)."""
    bad = [
        f"{rel}:{line} imports {target}"
        for rel, line, target in _imports()
        if rel.startswith("calibration/")
        and rel != "calibration/overheads.py"
        and _room(target) in ("solve", "apply", "integrations")
    ]
    assert not bad, "only calibration/overheads.py may import solve/, apply/ or integrations/: " + "; ".join(
        bad
    )


def test_allowances_are_still_needed():
    """Each allowance names an edge that still exists: remove it once its file moved."""
    present = {(rel, _room(target)) for rel, _, target in _imports()}
    stale = [key for key in ALLOWED if key not in present]
    assert not stale, f"allowed edges no longer present, remove them from ALLOWED: {stale}"
