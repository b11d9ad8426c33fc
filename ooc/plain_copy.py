"""``copy.deepcopy`` of a wrapped model: a plain copy of the user's module, with its weights.

NOTE [a deep copy of a wrapped model]
``torch.optim.swa_utils.AveragedModel`` and timm's ``ModelEmaV2``/``ModelEmaV3`` keep their average
in ``copy.deepcopy(model)``. What ``ooc.wrap`` put on the model (each block's forward, the runtime's
hooks, which hold its threads and locks) refused the copy, and a host optimizer's hooks (closures
over its update pipeline) would have come along into it, so the copy's forward or ``load_state_dict``
would have called into the original's optimizer. The wrapped model's ``__deepcopy__`` copies the
module as the user built it instead: every block's own forward, only hooks that are not ooc's, its
parameters and buffers as they are now (after the host optimizer's updates in flight: ``settle``).
It swaps those attributes out of the live model for the copy and puts them back in a ``finally``,
so the wrapped model is left as it was. A streamed parameter rests on the host between steps, and
its copy is made there. Pickling (``torch.save(model)``) is still refused: the copy is what ``copy``
asks for, not what a pickle of the wrapped model would promise to restore.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch.nn as nn

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
               "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")
"""``nn.Module``'s per-instance hook dictionaries (handle id -> hook)."""


def _is_ooc(hook: Any) -> bool:
    """A hook that ooc installed (the runtime's, a host optimizer's): defined in a module of ``ooc``."""
    hook = getattr(hook, "hook", hook)  # torch wraps load_state_dict hooks in a _WrappedHook
    module = getattr(hook, "__module__", None) or type(hook).__module__
    return module == "ooc" or module.startswith("ooc.")


@contextmanager
def _without_ooc(model: nn.Module, forwards: Sequence[tuple[nn.Module, Any]]) -> Iterator[None]:
    """``model`` with its blocks' own forwards and no ooc hook, until the block ends.
    ``forwards``: (block, the forward in its ``__dict__`` before wrap, or ``None``)."""
    undo: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for module, previous in forwards:
            undo.append((module.__dict__, "forward", module.__dict__.get("forward")))
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = previous
        for module in model.modules():
            for name in _HOOK_DICTS:
                hooks = module.__dict__.get(name)
                if hooks and any(_is_ooc(h) for h in hooks.values()):
                    undo.append((module.__dict__, name, hooks))
                    # A new dict: the live one is put back untouched, with its order.
                    module.__dict__[name] = type(hooks)((k, h) for k, h in hooks.items() if not _is_ooc(h))
        yield
    finally:
        for where, name, value in reversed(undo):
            if value is None:
                where.pop(name, None)
            else:
                where[name] = value


class PlainDeepCopy:
    """The ``__deepcopy__`` that ``ooc.wrap`` puts on the model it wraps (NOTE [a deep copy of a
    wrapped model]). ``forwards``: returns (block, its forward before wrap or ``None``) pairs;
    ``settle``: waits for the host optimizer's writes of the weights in flight."""

    def __init__(self, model: nn.Module, forwards: Callable[[], Sequence[tuple[nn.Module, Any]]],
                 settle: Callable[[], None]) -> None:
        self.model = model
        self.forwards = forwards
        self.settle = settle

    def __call__(self, memo: dict[int, Any] | None = None) -> nn.Module:
        model = self.model
        self.settle()
        own = model.__dict__.pop("__deepcopy__")
        try:
            with _without_ooc(model, self.forwards()):
                return copy.deepcopy(model, memo)
        finally:
            model.__dict__["__deepcopy__"] = own
