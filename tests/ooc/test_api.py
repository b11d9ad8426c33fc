from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import ooc

EXPECTED = {
    "BlockError", "BlockPlan", "BudgetError", "ChainReport", "Codec", "MemoryReport", "OocError", "Plan", "PlanError",
    "Policy", "ProfileError", "Residency", "SavedTensorModifiedError", "WrapError", "is_wrapped", "memory_report", "plan", "profile", "unwrap", "wrap", "describe",
}


def test_public_api_is_pinned() -> None:
    assert set(ooc.__all__) == EXPECTED
    for name in ooc.__all__:
        assert getattr(ooc, name) is not None


def test_import_does_not_initialise_cuda() -> None:
    code = """
import torch
def boom(*a, **k):
    raise RuntimeError("CUDA touched at import")
for name in ("init", "is_available", "device_count", "current_device", "_lazy_init", "get_rng_state", "synchronize"):
    setattr(torch.cuda, name, boom)
import ooc, ooc.scheduler, ooc.kernels, ooc.models, ooc.backend, ooc.apps.cli, ooc.optim, ooc.distributed, ooc.apps.train
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_no_private_name_is_imported_across_modules() -> None:
    """A leading underscore means "this module only": another module needing it makes it public."""
    root = Path(ooc.__file__).resolve().parent.parent
    found = []
    for folder in ("ooc", "kernels", "scheduler"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ooc"):
                    found += [f"{path.relative_to(root)}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert found == []
