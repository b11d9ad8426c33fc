"""ooc: out-of-core training of PyTorch models. Wrap a model; keep your training loop.

    model = ooc.wrap(model, budget="20GiB", sample=batch)
    loss = model(x).loss; loss.backward(); opt.step()
"""

from __future__ import annotations

from ooc.api import plan, wrap
from ooc.describe import ChainReport, describe
from ooc.errors import BlockError, BudgetError, OocError, PlanError, ProfileError, SavedTensorModifiedError, WrapError
from ooc.profiler import profile
from ooc.runtime import is_wrapped, memory_report, unwrap
from ooc.scheduler.plan import BlockPlan, Codec, Plan, Policy, Residency
from ooc.tracker import MemoryReport

__version__ = "0.1.0"

_SUBMODULES = ("optim", "distributed", "models")


def __getattr__(name: str) -> object:
    """``ooc.optim``, ``ooc.distributed`` and ``ooc.models`` load on first use."""
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"ooc.{name}")
    raise AttributeError(f"module 'ooc' has no attribute {name!r}")

__all__ = [
    "BlockError",
    "BlockPlan",
    "BudgetError",
    "ChainReport",
    "Codec",
    "MemoryReport",
    "OocError",
    "Plan",
    "PlanError",
    "Policy",
    "ProfileError",
    "Residency",
    "SavedTensorModifiedError",
    "WrapError",
    "describe",
    "is_wrapped",
    "memory_report",
    "plan",
    "profile",
    "unwrap",
    "wrap",
]
