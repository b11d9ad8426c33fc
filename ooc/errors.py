"""Exceptions a user of ooc can catch; each message says what to do.

:class:`OocError`, the root of all of them, and the planning errors live in ``ooc.scheduler.errors``
(the lowest layer raises them too); the runtime's own errors are defined here."""

from __future__ import annotations

import torch

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


def check_saved_tensors_hooks_enabled(what: str, *, measuring: bool = False) -> None:
    """Raise :class:`WrapError` if saved-tensor hooks are disabled here (inside
    ``torch.autograd.graph.disable_saved_tensors_hooks``); ``what`` names what needs them, ``measuring``:
    a measurement before wrapping (``ooc.describe``, ``ooc.profile``, ``ooc.wrap`` with a sample).

    NOTE [disabled saved-tensor hooks]
    Every block of a wrapped model saves through ooc's saved-tensor hooks whatever its plan: a swapped
    block's are copied out, a recomputed one's dropped and made again by a re-run (whose own hooks
    catch what it saves), and a kept block's counted against the budget, which is why a plan that keeps
    everything does not run without them either (it would run, but the tracker and the budget check
    would see none of its bytes). Measuring what a forward saves takes them too. Inside
    ``disable_saved_tensors_hooks(msg)``, pushing them raised torch's RuntimeError with ``msg``, the
    caller's words, which name neither ooc nor the way out; so ooc refuses with its own error, quoting
    ``msg``."""
    if torch._C._autograd._saved_tensors_hooks_is_enabled():
        return
    message = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
    if measuring:
        needs = "ooc measures what the model's forward saves for backward through saved-tensor hooks"
        fix = "Call it outside that context"
    else:
        needs = ("ooc keeps, swaps or recomputes each block's saved activations through saved-tensor hooks, whatever "
                 "the plan (a kept block's are counted against the budget through them)")
        fix = ("Run the wrapped model's forward, and its backward, outside that context; under it, call "
               "ooc.unwrap(model) first, or run a forward that needs no backward under torch.no_grad(), where ooc "
               "sets no hooks")
    raise WrapError(
        f"{what} inside torch.autograd.graph.disable_saved_tensors_hooks (disabled with: {message!r}): {needs} "
        f"(NOTE [disabled saved-tensor hooks] in ooc.errors). {fix}"
    )


__all__ = ["BlockError", "BudgetError", "OocError", "PlanError", "ProfileError", "SavedTensorModifiedError", "WrapError"]
