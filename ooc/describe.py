"""``ooc.describe``: which chains of blocks ooc sees in a model, and how much of it they cover.

A budget covers the saved activations of the chain's blocks only; whatever the model saves outside
them (a stem, a head, the loss) stays on the device unplanned. So before training, a user should
see which chain was found and what share of the saved activations it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from ooc.blocks import (
    Candidate,
    Chain,
    by_saved_activations,
    candidates,
    find_blocks,
    in_run_order,
    saved_shares,
    with_stem,
)
from ooc.runtime import check_not_wrapped, is_wrapped, runtime_of
from ooc.scheduler.units import format_bytes


@dataclass(frozen=True)
class ChainShare:
    """One candidate chain: where its blocks are, and its shares of the model."""

    containers: tuple[str, ...]
    blocks: int
    block_class: str
    param_share: float
    """Fraction of the model's parameter bytes held by the chain's blocks."""
    saved_share: float | None
    """Fraction of the bytes saved for backward by one forward of ``sample`` that the chain's blocks
    save (``None`` without a sample)."""
    chosen: bool


@dataclass(frozen=True)
class ChainReport:
    """What :func:`describe` found: every candidate chain, the chosen one first."""

    model: str
    chains: tuple[ChainShare, ...]
    saved_bytes: int | None
    """Bytes saved for backward by one forward of the sample (all of the model)."""

    @property
    def chosen(self) -> ChainShare:
        return next(c for c in self.chains if c.chosen)

    def __str__(self) -> str:
        head = f"{self.model}: chains of blocks ooc found (the chosen one first)"
        if self.saved_bytes is not None:
            head += f"; one forward saves {format_bytes(self.saved_bytes)} for backward"
        rows = [head, f"  {'':2}{'blocks':>7}  {'params':>7}  {'saved':>7}  where"]
        for c in self.chains:
            saved = "-" if c.saved_share is None else f"{c.saved_share:7.1%}"
            rows.append(f"  {'*' if c.chosen else ' ':2}{c.blocks:>7}  {c.param_share:7.1%}  {saved:>7}  "
                        f"{' + '.join(c.containers)} ({c.block_class})")
        return "\n".join(rows)


def describe(model: nn.Module, sample: Any = None, *, blocks: object = None) -> ChainReport:
    """Which chains of blocks ``ooc.wrap`` would consider in ``model``, which it picks, and their
    shares of the model's parameters and (with ``sample``, one input batch as the model takes it)
    of the bytes one forward saves for backward. ``print()`` the result for a table. With a sample,
    the chosen chain includes the stem that runs before it (NOTE [the stem joins the chain]), as
    ``ooc.wrap(model, budget=..., sample=sample)`` uses it.

    With a sample, the model is left as it was (``ooc.profiler.ModelState``): no backward runs, and the
    trial forwards' changes to buffers (BatchNorm's running statistics), to the modules' own attributes
    (a step counter, a running state: NOTE [attributes a forward sets] in ``ooc.recompute``) and to RNG
    state are undone.
    """
    if sample is not None:
        # A wrapped block saves through ooc's own hooks, which the measurement's hooks do not see (its
        # shares read 0%), and a grad forward through the runtime is a training step to it (the
        # first step that wrap(budget=...) without a sample measures).
        check_not_wrapped(model, why="to measure what its forward saves (without a sample, describe works on a wrapped model)")
    found = candidates(model)
    chosen = find_blocks(model, blocks)
    if blocks is None and is_wrapped(model):
        # The chain the model runs (its stem included, when it was wrapped with a sample), not the one
        # a fresh wrap without a sample would pick: the table starred that one beside the running chain.
        chosen = runtime_of(model).chain
        if not any(c.chain.modules == chosen.modules for c in found):
            found.insert(0, _wrapped_candidate(chosen, found))
    if blocks is None and sample is not None and found:
        # The chain wrap(budget=..., sample=...) uses: the candidate (or candidates run one after the
        # other) holding the most saved activations, with its stem.
        found = by_saved_activations(model, found, sample)
        found[0] = with_stem(model, found[0], sample)
        chosen = found[0].chain
    if blocks is not None and not any(c.chain.modules == chosen.modules for c in found):
        params = {id(p): p for b in chosen.modules for p in b.parameters()}
        found.insert(0, Candidate(("blocks=",), chosen, sum(p.numel() * p.element_size() for p in params.values())))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) or 1
    shares: list[float | None] = [None] * len(found)
    total: int | None = None
    if sample is not None:
        measured, total, _ = saved_shares(model, sample, found)
        shares = list(measured)
    rows = [
        ChainShare(c.containers, len(c.chain), c.block_class, c.param_bytes / model_bytes, share,
                   c.chain.modules == chosen.modules)
        for c, share in zip(found, shares)
    ]
    rows.sort(key=lambda r: not r.chosen)
    return ChainReport(type(model).__name__, tuple(rows), total)


def _wrapped_candidate(chain: Chain, found: list[Candidate]) -> Candidate:
    """The running chain of a wrapped model as a row: the candidate it ends with, after its stem's
    modules by name (NOTE [the stem joins the chain]); ``blocks=`` where it ends with none."""
    params = {id(p): p for b in chain.modules for p in b.parameters()}
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    for c in found:
        n = len(c.chain)
        tail = chain.modules[-n:]
        if len(chain) >= n and {id(m) for m in tail} == {id(m) for m in c.chain.modules}:
            # In the order it runs (NOTE [containers in run order] in ooc.blocks).
            ran = in_run_order(c, [next(i for i, m in enumerate(c.chain.modules) if m is b) for b in tail])
            return Candidate(chain.names[:-n] + ran.containers, chain, nbytes)
    return Candidate(("blocks=",), chain, nbytes)
