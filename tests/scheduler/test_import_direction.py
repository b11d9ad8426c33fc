"""The scheduler is the lowest layer: it imports nothing from ooc's runtime, and its own imports sit
at the top of each module, where a cycle between its modules fails at import instead of hiding."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SCHEDULER = Path(__file__).resolve().parents[2] / "scheduler"
LOCAL_IMPORTS_ALLOWED = {("profile.py", "machine_header")}
"""(module, function) pairs allowed to import inside a function: each says why in a comment."""


def _modules() -> list[Path]:
    return sorted(SCHEDULER.rglob("*.py"))


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        return [node.module or ""]
    return []


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_imports_only_the_scheduler_from_ooc(path: Path) -> None:
    tree = ast.parse(path.read_text())
    names = [name for node in ast.walk(tree) for name in _imported(node)]
    assert [n for n in names if n.startswith("ooc") and not n.startswith("ooc.scheduler")] == []


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_no_imports_inside_functions(path: Path) -> None:
    tree = ast.parse(path.read_text())
    local = [
        (path.name, fn.name)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(fn)
        if isinstance(node, (ast.Import, ast.ImportFrom))
    ]
    assert set(local) <= LOCAL_IMPORTS_ALLOWED
