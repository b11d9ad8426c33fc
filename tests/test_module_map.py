"""The README's module map names every module of the tree (issue 10: the map matches the tree)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_names_every_module() -> None:
    readme = ROOT.joinpath("README.md").read_text()
    section = readme[readme.index("## What is where"):readme.index("## Plans, planners")]
    missing = []
    for package in ("ooc", "scheduler", "kernels"):
        for path in sorted(ROOT.joinpath(package).rglob("*.py")) + sorted(ROOT.joinpath(package).rglob("*.cu")):
            if path.name in ("__init__.py", "__main__.py"):
                continue
            if f"`{path.name}`" not in section:
                missing.append(str(path.relative_to(ROOT)))
    assert missing == [], f"add these to the README's 'What is where' table: {missing}"
