"""The errors of ooc, rooted in one :class:`OocError` at the lowest layer (the scheduler), so that
``except ooc.OocError`` catches every error ooc raises on purpose. Each also derives from the
builtin it refines (``ValueError``, ...), so ``except ValueError`` keeps working."""

from __future__ import annotations


class OocError(Exception):
    """Base class of ooc's own errors."""


class PlanError(OocError, ValueError):
    """A plan that cannot be read or does not fit the model it is applied to."""


class ProfileError(OocError, ValueError):
    """A profile that cannot be read, or one that does not describe the model at hand."""


class HardwareError(OocError, ValueError):
    """Hardware figures that cannot describe a real machine (zero or negative bandwidths, ...)."""


class SizeError(OocError, ValueError):
    """A byte size (a budget, a memory size) that is not a finite number of bytes >= 0."""


class InfeasibleBudget(OocError, ValueError):
    """No plan of this planner fits; ``minimum_bytes`` is the smallest peak it can reach."""

    def __init__(self, budget: int, minimum_bytes: int) -> None:
        self.budget = budget
        self.minimum_bytes = minimum_bytes
        super().__init__(f"no plan fits {budget} bytes; the smallest peak is {minimum_bytes} bytes")


__all__ = ["HardwareError", "InfeasibleBudget", "OocError", "PlanError", "ProfileError", "SizeError"]
