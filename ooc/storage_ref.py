"""A weak reference to a tensor storage whose destructor is safe on an object made without ``__init__``.

NOTE [weak storage references under torch.compile]
ooc tells whether a storage is still alive by a weak reference to it (torch's ``StorageWeakRef``:
``expired()``), taken in its pack hooks and dispatch modes. Under ``torch.compile`` of a wrapped
model, dynamo traces those hooks too (they run in the frames it compiles), and for each
``StorageWeakRef(storage)`` it meets it makes an example object with ``object.__new__``, without
``__init__``; the trace breaks at ``storage._weak_ref()`` and the hook runs eagerly, and the example
object is dropped. torch's ``__del__`` then reads the ``_free_weak_ref`` slot that only ``__init__``
sets, and every such object printed "Exception ignored in: <function StorageWeakRef.__del__>" with an
``AttributeError`` traceback: one per recomputed block of an op-level plan per step. ``StorageRef``
frees the reference only where ``__init__`` took one.
"""

from __future__ import annotations

from torch.multiprocessing.reductions import StorageWeakRef


class StorageRef(StorageWeakRef):
    """``StorageWeakRef(storage)``: ``expired()`` says whether ``storage`` was freed (NOTE [weak
    storage references under torch.compile])."""

    __slots__ = ()

    def __del__(self) -> None:
        if hasattr(self, "_free_weak_ref"):  # else made without __init__ (dynamo): it holds no reference
            super().__del__()


__all__ = ["StorageRef"]
