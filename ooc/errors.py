"""Exceptions a user of ooc can catch; each message says what to do.

:class:`OocError`, the root of all of them, and the planning errors live in ``ooc.scheduler.errors``
(the lowest layer raises them too); the runtime's own errors are defined here."""

from __future__ import annotations

from ooc.scheduler.errors import OocError, PlanError, ProfileError
from ooc.scheduler.units import format_bytes


class WrapError(OocError, ValueError):
    """The model cannot be wrapped as asked (already wrapped, nothing to train, ...)."""


class BlockError(OocError, ValueError):
    """No chain of blocks could be found or the given blocks are not usable."""


class BudgetError(OocError, ValueError):
    """No plan fits the device-memory budget."""

    def __init__(self, budget_bytes: int, minimum_bytes: int, detail: str = "", *, what: str = "saved activations") -> None:
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes
        super().__init__(
            f"no plan fits a budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes) for {what}; "
            f"the smallest peak any plan reaches is {format_bytes(minimum_bytes)} "
            f"({minimum_bytes} bytes). Raise the budget to at least that, or use a smaller batch or "
            f"sequence length.{(' ' + detail) if detail else ''}"
        )


class SavedTensorModifiedError(OocError, RuntimeError):
    """A tensor a block saved for its backward was modified in place before the backward used it
    (plain PyTorch raises "modified by an inplace operation" here; ooc's saved-tensor hooks switch
    autograd's own check off, so the runtime makes it)."""


__all__ = ["BlockError", "BudgetError", "OocError", "PlanError", "ProfileError", "SavedTensorModifiedError", "WrapError"]
