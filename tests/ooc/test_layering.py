"""The library never imports the applications: ``ooc.apps`` (CLI, demo, ``ooc train``, check,
plots) sits on top of ``ooc``, ``ooc.scheduler`` and ``ooc.kernels``, never under them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "ooc" / "apps"
# ``python -m ooc`` runs the CLI, so ooc/__main__.py is the one module outside ooc/apps/ that may import it.
ENTRY_POINT = ROOT / "ooc" / "__main__.py"
# Every library source: ooc/ outside ooc/apps/, and the two packages mapped into ooc.
LIBRARY = sorted(
    p
    for folder in ("ooc", "scheduler", "kernels")
    for p in (ROOT / folder).rglob("*.py")
    if APPS not in p.parents and p != ENTRY_POINT
)
PACKAGE_OF = {"ooc": "ooc", "scheduler": "ooc.scheduler", "kernels": "ooc.kernels"}


def _module_name(path: Path, root: Path = ROOT) -> str:
    """``root/scheduler/plan.py`` -> ``ooc.scheduler.plan``; a package's ``__init__`` is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    parts[0] = PACKAGE_OF[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path = ROOT) -> list[str]:
    """Every module ``path`` imports, absolute, relative imports resolved; ``from a import b`` gives
    both ``a`` and ``a.b`` (``b`` may be a submodule)."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append(base)
            found += [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # importlib.import_module("ooc.apps.x") and friends.
            if node.value == "ooc.apps" or node.value.startswith("ooc.apps."):
                found.append(node.value)
    return found


def test_library_sources_found() -> None:
    names = {_module_name(p) for p in LIBRARY}
    assert {"ooc", "ooc.runtime", "ooc.scheduler.plan", "ooc.kernels.quant"} <= names
    assert not any(n == "ooc.apps" or n.startswith("ooc.apps.") for n in names)


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(ROOT)))
def test_library_does_not_import_apps(path: Path) -> None:
    bad = [m for m in imported_modules(path) if m == "ooc.apps" or m.startswith("ooc.apps.")]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: library modules must not depend on ooc.apps"


@pytest.mark.parametrize(
    "source, module",
    [
        ("import ooc.apps.cli\n", "ooc.apps.cli"),
        ("from ooc.apps import demo\n", "ooc.apps.demo"),
        ("from ooc import apps\n", "ooc.apps"),
        ("from .apps.train import main\n", "ooc.apps.train"),
        ("import importlib\nimportlib.import_module('ooc.apps.plots')\n", "ooc.apps.plots"),
    ],
)
def test_scan_sees_every_form_of_import(tmp_path: Path, source: str, module: str) -> None:
    """The scan itself can fail: each way of importing the apps is seen (as from ``ooc/x.py``)."""
    (tmp_path / "ooc").mkdir()
    path = tmp_path / "ooc" / "x.py"
    path.write_text(source, encoding="utf-8")
    assert module in imported_modules(path, tmp_path)
