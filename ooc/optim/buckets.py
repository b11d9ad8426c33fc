"""Buckets: the groups of parameters whose updates the host optimizer runs as one unit.

A bucket is one block of the model's chain, or one top-level child module outside it (embeddings,
final norm, head). Its update can start as soon as every parameter in it has its gradient, which
for a block is when that block's backward ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ooc.blocks import Chain


@dataclass(frozen=True)
class Bucket:
    """Parameters updated together; ``index`` is the bucket's place in the canonical order."""

    index: int
    name: str
    params: tuple[torch.Tensor, ...]
    block: int | None
    """The block of the chain this bucket is, or ``None`` for parameters outside the chain."""

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def make_buckets(model: nn.Module | None, chain: Chain | None, params: list[torch.Tensor]) -> tuple[Bucket, ...]:
    """Group ``params`` (the optimizer's, in its order) into buckets, in canonical order.

    Canonical order is the reverse of the order in which the model registers each bucket's first
    parameter: the order a backward usually completes them in (head, last block ... first block,
    embeddings). Data-parallel ranks exchange buckets in this order, so it must not depend on timing.
    Without a model every parameter is in one bucket, updated at ``step()``.
    """
    wanted = {id(p) for p in params}
    if model is None:
        return (Bucket(0, "all", tuple(params), None),)
    owner: dict[int, tuple[str, int | None]] = {}
    if chain is not None:
        for block, (name, module) in enumerate(zip(chain.names, chain.modules)):
            for p in module.parameters():
                owner.setdefault(id(p), (name, block))
    groups: dict[str, list[torch.Tensor]] = {}
    blocks: dict[str, int | None] = {}
    first_seen: dict[str, int] = {}
    for position, (qualified, p) in enumerate(model.named_parameters()):
        if id(p) not in wanted:
            continue
        name, block = owner.get(id(p), (qualified.split(".")[0], None))
        groups.setdefault(name, []).append(p)
        blocks[name] = block
        first_seen.setdefault(name, position)
    missing = wanted - {id(p) for ps in groups.values() for p in ps}
    if missing:
        groups["other"] = [p for p in params if id(p) in missing]
        blocks["other"] = None
        first_seen["other"] = -1
    ordered = sorted(groups, key=lambda name: -first_seen[name])
    return tuple(Bucket(i, name, tuple(groups[name]), blocks[name]) for i, name in enumerate(ordered))
