"""Find the storages that more than one block of a chain holds (NOTE [storages shared between blocks]
in ``ooc.scheduler.sharing``), for the profile: in a forward of its own (``measure_shared_storages``,
for ``ooc.profile``), or in the first training step of ``wrap(model, budget=...)`` (``SharingMeter``,
fed by the step's recorder)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_leaves

from ooc.scheduler.codecs import dtype_name
from ooc.scheduler.profile import SharedStorage
from ooc.storage_ref import StorageRef


@dataclass
class _Seen:
    """One storage a block holds: its identity and in which roles."""

    storage: int
    nbytes: int
    dtype: str
    saved: bool = False
    input: bool = False


@dataclass
class StorageIdentities:
    """Storages by identity: an address names a storage only while that storage lives (a weak
    reference to it tells), so a storage freed and another made at its address get two identities."""

    weak: dict[int, tuple[int, StorageRef]] = field(default_factory=dict)
    """Address -> (identity, weak reference to the storage first seen there)."""
    count: int = 0

    def identity(self, storage: torch.UntypedStorage) -> int:
        ptr = storage.data_ptr()
        entry = self.weak.get(ptr)
        if entry is not None and not entry[1].expired():
            return entry[0]
        self.count += 1
        self.weak[ptr] = (self.count, StorageRef(storage))
        return self.count


class SharingMeter:
    """Notes which storages each block of a forward holds (saves, or takes as a tensor argument),
    and tells which more than one block holds (:meth:`result`). Parameters and buffers
    (``skip_ptrs``), storages on another device and empty ones are not counted."""

    def __init__(self, num_blocks: int, *, skip_ptrs: frozenset[int], device: torch.device) -> None:
        self.skip_ptrs = skip_ptrs
        self.device = device
        self.storages = StorageIdentities()
        self.held: list[dict[int, _Seen]] = [{} for _ in range(num_blocks)]

    def note(self, block: int, tensor: torch.Tensor, role: str) -> None:
        """``block`` holds ``tensor``'s storage as ``role`` ("saved" or "input")."""
        if tensor.device != self.device:
            return
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self.skip_ptrs or storage.nbytes() == 0:
            return
        key = self.storages.identity(storage)
        seen = self.held[block].setdefault(key, _Seen(key, storage.nbytes(), dtype_name(tensor.dtype)))
        setattr(seen, role, True)

    def note_inputs(self, block: int, args: Any) -> None:
        for leaf in tree_leaves(args):
            if isinstance(leaf, torch.Tensor):
                self.note(block, leaf, "input")

    def result(self) -> list[tuple[SharedStorage, ...]]:
        """One tuple per block, in block order, of the :class:`SharedStorage` it holds."""
        holders: dict[int, int] = {}
        for block in self.held:
            for key in block:
                holders[key] = holders.get(key, 0) + 1
        shared_ids = {key: n for n, key in enumerate(sorted(k for k, c in holders.items() if c > 1))}
        return [
            tuple(SharedStorage(shared_ids[s.storage], s.nbytes, s.dtype, s.saved, s.input)
                  for s in block.values() if s.storage in shared_ids)
            for block in self.held
        ]


def measure_shared_storages(
    modules: list[nn.Module], run_forward: Callable[[], Any], *, skip_ptrs: frozenset[int], device: torch.device,
) -> list[tuple[SharedStorage, ...]]:
    """Per block of ``modules``, the storages it holds that another block holds too.

    ``run_forward()`` runs the model's forward once, with autograd on; nothing it saves is kept (the
    pack hook records the storage and returns nothing, and no backward runs), so the pass needs the
    memory of a forward without saved activations. A storage counts as held by a block when the
    block's forward saves it or when it is one of the block's tensor arguments (:class:`SharingMeter`).
    Returns one tuple per block, in the order of ``modules``, of :class:`SharedStorage`.
    """
    meter = SharingMeter(len(modules), skip_ptrs=skip_ptrs, device=device)
    current: list[int] = []

    def pack(tensor: torch.Tensor) -> None:
        if current:
            meter.note(current[-1], tensor, "saved")

    def before(block: int) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            current.append(block)
            meter.note_inputs(block, (args, kwargs))
        return hook

    def after(_module: nn.Module, _args: tuple, _kwargs: dict, _out: Any) -> None:
        current.pop()

    handles = []
    try:
        for i, module in enumerate(modules):
            handles.append(module.register_forward_pre_hook(before(i), with_kwargs=True))
            handles.append(module.register_forward_hook(after, with_kwargs=True))
        with torch.enable_grad(), saved_tensors_hooks(pack, never_unpacked):
            run_forward()
    finally:
        for handle in handles:
            handle.remove()
    return meter.result()


def never_unpacked(_packed: object) -> torch.Tensor:
    """The unpack hook of a measuring forward whose pack hook keeps nothing: no backward may run."""
    raise RuntimeError("ooc measured saved storages with a forward that has no backward; nothing was kept to unpack")
