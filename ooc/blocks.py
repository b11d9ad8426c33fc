"""Finding a model's chain of blocks (transformer layers, ResNet blocks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from ooc.errors import BlockError


@dataclass(frozen=True)
class Chain:
    """The blocks of a model in forward order, with their qualified names."""

    modules: tuple[nn.Module, ...]
    names: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.modules)


def _candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name or "<model>", module)
        for name, module in model.named_modules()
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 0
    ]


def _uniform_run(container: nn.Module) -> int:
    children = list(container.children())
    return len(children) if children and len({type(c) for c in children}) == 1 else 0


def find_blocks(model: nn.Module, blocks: object = None) -> Chain:
    """The chain of blocks of ``model``.

    ``blocks`` may be a list of submodules, or an ``nn.ModuleList``/``nn.Sequential``. Without it,
    the longest ``ModuleList``/``Sequential`` whose children all share one class is used (how
    FSDP's transformer auto-wrap policy picks layers); ties go to the first in module order.
    """
    names_by_id = {id(m): name for name, m in model.named_modules()}
    if blocks is None:
        best_name, best, best_len = None, None, 1
        for name, container in _candidates(model):
            length = _uniform_run(container)
            if length > best_len:
                best_name, best, best_len = name, container, length
        if best is None:
            found = [f"{name} ({type(m).__name__}, {len(m)} children)" for name, m in _candidates(model)]
            hint = "; candidates: " + ", ".join(found) if found else "; the model has no ModuleList/Sequential"
            raise BlockError(
                "found no chain of blocks (a ModuleList/Sequential of at least 2 modules of one class)"
                f"{hint}. Pass blocks=[...] (a list of submodules, in forward order) to ooc.wrap."
            )
        modules = tuple(best.children())
        prefix = best_name + "." if best_name != "<model>" else ""
        return Chain(modules, tuple(f"{prefix}{i}" for i in range(len(modules))))

    if isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        modules = tuple(blocks.children())
    elif isinstance(blocks, (list, tuple)):
        modules = tuple(blocks)
    else:
        raise BlockError(f"blocks must be a list of submodules, a ModuleList or a Sequential, got {type(blocks).__name__}")
    if not modules:
        raise BlockError("blocks is empty; pass the submodules that form the model's chain, in forward order")
    for m in modules:
        if not isinstance(m, nn.Module) or id(m) not in names_by_id:
            raise BlockError(f"every block must be a submodule of the model; {type(m).__name__} is not")
    if len({id(m) for m in modules}) != len(modules):
        raise BlockError("a block appears twice in blocks; each submodule may be one block only")
    return Chain(modules, tuple(names_by_id[id(m)] for m in modules))
