"""Finding a model's chain of blocks (transformer layers, ResNet blocks).

NOTE [which chain]
A chain is a run of containers (``ModuleList``/``Sequential``) whose children all share one class,
in forward order. Models split their blocks over several such containers: a ResNet's stages
(``layer1`` ... ``layer4``), a ConvNeXt's ``stages.i.blocks``, T5's ``encoder.block`` and
``decoder.block``. Containers that sit at the same relative path under consecutive siblings (or are
consecutive siblings themselves) and hold the same block class are concatenated into one chain; at
the same relative path the classes may differ (BART's, Whisper's, Marian's ``encoder.layers`` of one
class and ``decoder.layers`` of another).
A ``ModuleList`` inside a block of another candidate is not a chain: nothing says its children
run one after another (the experts of a mixture-of-experts layer); a ``Sequential`` runs them so.
Among the candidate chains, one whose blocks hold parameters wins over one whose blocks hold none
(a list of activations declared beside the layers); then the chain holding the most parameters,
where chains within 10% of the largest count as equal and the one with more blocks wins (finer
blocks give the planner more choices). With a sample (``ooc.describe(model, sample)``,
``ooc.wrap(..., sample=...)``), one forward that keeps nothing measures each candidate's share of
the bytes saved for backward and the order its blocks run in; candidates whose blocks run one after
the other at different paths (ViT-MAE's ``vit.layers`` then ``decoder.decoder_layers``) are joined,
and the chain holding the most saved activations wins when the one chosen by parameters holds less
than 90% of it. The runtime then checks, at the first training forward, that
every block of the chain ran, once and in chain order (``check_first_forward``), so a chain that
does not run is refused instead of silently planning nothing.

NOTE [the stem joins the chain]
What runs before the chain's containers saves activations the plan cannot touch: a ResNet's stem
(``conv1``, ``bn1``, ``act1``, ``maxpool``) at full resolution saves as much as ``layer1``, so the
budget covered 62% of ResNet-18's saved bytes. When a sample is given (``ooc.describe``,
``ooc.wrap(budget=..., sample=...)``) and the chain's containers are children of one module, the
siblings declared before the first container become blocks too, if one trial forward shows that
they ran once each, in declaration order, before the chain's first block (the closest ones first:
the run stops at the first sibling that did not, that is an ``Identity`` or that shares parameters
with modules outside it, as tied embeddings do). Structure alone cannot say so (HF's ``rotary_emb``
is declared after ``layers`` but runs before them), and the runtime refuses a chain that does not
run as found (``check_first_forward``), so without a sample the chain stays as found. The trial
forward runs without gradients and leaves buffers and RNG state as it found them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ooc.errors import BlockError, check_saved_tensors_hooks_enabled

_COVERAGE_TIE = 0.9
"""Chains holding at least this fraction of the best chain's parameters count as equal."""


@dataclass(frozen=True)
class Chain:
    """The blocks of a model in forward order, with their qualified names."""

    modules: tuple[nn.Module, ...]
    names: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.modules)


@dataclass(frozen=True)
class Candidate:
    """One possible chain: its containers (qualified names), blocks and parameter bytes."""

    containers: tuple[str, ...]
    chain: Chain
    param_bytes: int

    @property
    def block_class(self) -> str:
        """The class most blocks have (a chain extended by its stem starts with other classes)."""
        classes = [type(m).__name__ for m in self.chain.modules]
        return max(classes, key=classes.count)

    def describe(self) -> str:
        where = " + ".join(self.containers)
        return f"{where}: {len(self.chain)} x {self.block_class}"


def _uniform_containers(model: nn.Module) -> dict[str, type]:
    """Qualified name -> block class of every non-empty ModuleList/Sequential whose children share one class."""
    found: dict[str, type] = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 0:
            classes = {type(c) for c in module.children()}
            if len(classes) == 1:
                found[name] = classes.pop()
    return found


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _group_of(name: str, containers: dict[str, type], modules: dict[str, nn.Module]) -> tuple[str, ...]:
    """The containers concatenated with ``name``: same block class, same relative path under
    consecutive siblings, at the closest ancestor where there are at least two."""
    parts = name.split(".") if name else []
    for level in range(len(parts) - 1, -1, -1):
        prefix, head, suffix = ".".join(parts[:level]), parts[level], ".".join(parts[level + 1:])
        siblings = [child for child, _ in modules[prefix].named_children()]
        at = siblings.index(head)

        def member(sibling: str, prefix: str = prefix, suffix: str = suffix) -> bool:
            # Stacks at one path under consecutive siblings may hold two classes (BART's
            # encoder.layers and decoder.layers); sibling containers themselves must share one.
            found = containers.get(_join(prefix, sibling, suffix))
            return found is containers[name] or (bool(suffix) and found is not None)

        start = at
        while start > 0 and member(siblings[start - 1]):
            start -= 1
        end = at
        while end + 1 < len(siblings) and member(siblings[end + 1]):
            end += 1
        if end > start:
            return tuple(_join(prefix, s, suffix) for s in siblings[start:end + 1])
    return (name,)


def _inside_a_block(name: str, containers: dict[str, type]) -> bool:
    """Whether container ``name`` sits inside a child of another uniform container."""
    parts = name.split(".")
    return any(".".join(parts[:k]) in containers for k in range(len(parts) - 1))


def candidates(model: nn.Module) -> list[Candidate]:
    """Every chain ``find_blocks`` considers, best first (NOTE [which chain])."""
    containers = _uniform_containers(model)
    modules = dict(model.named_modules())
    groups: list[tuple[str, ...]] = []
    for name in containers:
        for group in (_group_of(name, containers, modules), (name,)):
            if group not in groups:
                groups.append(group)
    found = []
    for group in groups:
        if any(isinstance(modules[c], nn.ModuleList) and _inside_a_block(c, containers) for c in group):
            continue
        blocks: list[nn.Module] = []
        names: list[str] = []
        for container in group:
            for child, module in modules[container].named_children():
                blocks.append(module)
                names.append(_join(container, child))
        if len(blocks) < 2 or len({id(b) for b in blocks}) != len(blocks):
            continue
        params = {id(p): p for b in blocks for p in b.parameters()}
        nbytes = sum(p.numel() * p.element_size() for p in params.values())
        found.append(Candidate(group, Chain(tuple(blocks), tuple(names)), nbytes))
    best_bytes = max((c.param_bytes for c in found), default=0)

    def rank(c: Candidate) -> tuple[bool, bool, int]:
        return (c.param_bytes > 0, c.param_bytes >= _COVERAGE_TIE * best_bytes, len(c.chain))

    # sorted() is stable: equal ranks keep module order, so the first container wins a tie.
    return sorted(found, key=rank, reverse=True)


def shared_parameter_ids(model: nn.Module, chain: Chain) -> frozenset[int]:
    """``id`` of each parameter of the chain that more than one block holds, or a block and a module
    outside the chain (NOTE [parameters shared between blocks] in ``ooc.streaming``)."""
    holders: dict[int, int] = {}
    for block in chain.modules:
        for p in block.parameters():
            holders[id(p)] = holders.get(id(p), 0) + 1
    inside = {id(m) for block in chain.modules for m in block.modules()}
    outside = {id(p) for m in model.modules() if id(m) not in inside for p in m.parameters(recurse=False)}
    return frozenset(i for i, count in holders.items() if count > 1 or i in outside)


def _param_bytes(modules: Iterable[nn.Module]) -> int:
    params = {id(p): p for m in modules for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in params.values())


def _shares_parameters(model: nn.Module, module: nn.Module) -> bool:
    """Whether a parameter of ``module`` is also used outside it (tied embeddings)."""
    inside = {id(m) for m in module.modules()}
    outside = {id(p) for m in model.modules() if id(m) not in inside for p in m.parameters(recurse=False)}
    return any(id(p) in outside for p in module.parameters())


def saved_shares(model: nn.Module, sample: Any, found: list[Candidate]) -> tuple[list[float], int, list[tuple[int, int]]]:
    """One forward of ``sample``: each candidate's share of the bytes saved for backward, the total,
    and the calls ``(candidate, block)`` in the order the blocks ran.

    Each saved storage is counted once (parameters and buffers never), for every candidate whose
    blocks were running when it was saved. Nothing saved is kept (no backward runs), so the forward
    needs the memory of one without saved activations; buffers and RNG state are restored after it.
    """
    from torch.autograd.graph import saved_tensors_hooks

    from ooc.profiler import ModelState, call_model
    from ooc.storage_sharing import StorageIdentities, never_unpacked

    check_saved_tensors_hooks_enabled("ooc measured the bytes a forward of the sample saves (ooc.describe, or "
                                      "ooc.wrap with a sample)", measuring=True)
    state_ptrs = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    running: dict[int, int] = {}  # candidate -> depth of its blocks on the stack
    storages = StorageIdentities()
    seen: set[int] = set()
    per_candidate = [0] * len(found)
    total = 0
    calls: list[tuple[int, int]] = []

    def enter(k: int, i: int) -> Any:
        def hook(_module: nn.Module, _args: Any) -> None:
            calls.append((k, i))
            running[k] = running.get(k, 0) + 1
        return hook

    def leave(k: int) -> Any:
        def hook(_module: nn.Module, _args: Any, _out: Any) -> None:
            running[k] -= 1
        return hook

    def pack(tensor: torch.Tensor) -> None:
        nonlocal total
        storage = tensor.untyped_storage()
        if storage.data_ptr() in state_ptrs:
            return
        key = storages.identity(storage)
        if key in seen:
            return
        seen.add(key)
        total += storage.nbytes()
        for k, depth in running.items():
            if depth > 0:
                per_candidate[k] += storage.nbytes()

    handles = []
    for k, cand in enumerate(found):
        for i, block in enumerate(cand.chain.modules):
            handles.append(block.register_forward_pre_hook(enter(k, i)))
            handles.append(block.register_forward_hook(leave(k)))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    state = ModelState(model, device)
    try:
        with saved_tensors_hooks(pack, never_unpacked), torch.enable_grad():
            call_model(model, sample)
    finally:
        for handle in handles:
            handle.remove()
        state.restore()
    return [b / total if total else 0.0 for b in per_candidate], total, calls


def by_saved_activations(model: nn.Module, found: list[Candidate], sample: Any) -> list[Candidate]:
    """``found`` (best first) with, when one forward of ``sample`` shows it, the chain holding the most
    saved activations first: chains whose blocks run one after the other (a ViT-MAE's encoder, then its
    decoder, at different paths) are joined (NOTE [which chain])."""
    if not found:
        return found
    shares, _, calls = saved_shares(model, sample, found)
    inside = [{id(m) for block in c.chain.modules for m in block.modules()} for c in found]
    options = list(zip(found, shares))
    for a, b in itertools.permutations(range(len(found)), 2):
        if inside[a] & inside[b]:
            continue
        ran = [call for call in calls if call[0] in (a, b)]
        if ran == [(a, i) for i in range(len(found[a].chain))] + [(b, i) for i in range(len(found[b].chain))]:
            chain = Chain(found[a].chain.modules + found[b].chain.modules, found[a].chain.names + found[b].chain.names)
            joined = Candidate(found[a].containers + found[b].containers, chain, _param_bytes(chain.modules))
            options.append((joined, shares[a] + shares[b]))  # never running at once, they save apart
    best, best_share = max(options, key=lambda o: o[1])  # max() keeps the first of equals
    ranked = found if shares[0] >= _COVERAGE_TIE * best_share else [best, *(c for c in found if c is not best)]
    order = {id(c): k for k, c in enumerate(found)}
    return [in_run_order(c, [i for k, i in calls if k == order[id(c)]]) if id(c) in order else c for c in ranked]


def in_run_order(candidate: Candidate, ran: list[int]) -> Candidate:
    """``candidate`` with its blocks in the order one forward ran them, when it ran each once.

    NOTE [containers in run order]
    Containers are concatenated in declaration order, which need not be the order the forward runs
    them: CLIP declares ``text_model`` before ``vision_model`` and encodes the image first, so its
    chain of both towers' layers (one block class) was refused at the first training forward, with
    a sample that had just shown the order. A chain whose blocks ran once each takes that order, its
    containers too; one that ran otherwise stays as found, for the runtime's check to refuse."""
    n = len(candidate.chain)
    if ran == list(range(n)) or sorted(ran) != list(range(n)):
        return candidate
    chain = Chain(tuple(candidate.chain.modules[i] for i in ran), tuple(candidate.chain.names[i] for i in ran))
    # The model itself may be the container (a ModuleList whose forward runs its blocks): its name is "".
    first_run = {c: min(k for k, name in enumerate(chain.names) if not c or name.startswith(c + "."))
                 for c in candidate.containers}
    return Candidate(tuple(sorted(candidate.containers, key=first_run.__getitem__)), chain, candidate.param_bytes)


def with_stem(model: nn.Module, candidate: Candidate, sample: Any) -> Candidate:
    """``candidate`` with the siblings declared before its first container that one trial forward
    of ``sample`` shows to run once each, in order, before its first block (NOTE [the stem joins
    the chain])."""
    from ooc.profiler import ModelState, call_model

    parents = {c.rpartition(".")[0] for c in candidate.containers}
    if len(parents) != 1 or "" in candidate.containers:
        return candidate  # several parents; or the model itself holds the blocks, with no siblings before them
    parent_name = parents.pop()
    modules = dict(model.named_modules())
    siblings = [name for name, _ in modules[parent_name].named_children()]
    first = siblings.index(candidate.containers[0].rpartition(".")[2])
    before = [(_join(parent_name, s), modules[_join(parent_name, s)]) for s in siblings[:first]]
    if not before:
        return candidate
    calls: list[int] = []  # indices into before; len(before) for the chain's first block
    handles = [m.register_forward_pre_hook(lambda _m, _a, i=i: calls.append(i)) for i, (_, m) in enumerate(before)]
    handles.append(candidate.chain.modules[0].register_forward_pre_hook(lambda _m, _a: calls.append(len(before))))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    state = ModelState(model, device)
    try:
        with torch.no_grad():
            call_model(model, sample)
    finally:
        for handle in handles:
            handle.remove()
        state.restore()
    if len(before) not in calls:
        return candidate
    ran = calls[:calls.index(len(before))]
    stem: list[int] = []  # closest sibling last; each ran once, before the one after it
    for i in range(len(before) - 1, -1, -1):
        if getattr(before[i][1], "inplace", False) is True and calls.count(i) == 1 and i in ran:
            continue  # runs between two blocks, as code outside the chain
        if (calls.count(i) != 1 or i not in ran or isinstance(before[i][1], nn.Identity) or _shares_parameters(model, before[i][1])
                or (stem and ran.index(i) > ran.index(stem[0]))):
            break
        stem.insert(0, i)
    if not stem:
        return candidate
    names = tuple(before[i][0] for i in stem)
    chain = Chain(tuple(before[i][1] for i in stem) + candidate.chain.modules, names + candidate.chain.names)
    return Candidate(names + candidate.containers, chain, _param_bytes(chain.modules))


def find_blocks(model: nn.Module, blocks: object = None, *, sample: Any = None) -> Chain:
    """The chain of blocks of ``model``.

    ``blocks`` may be a list of submodules, or an ``nn.ModuleList``/``nn.Sequential``. Without it,
    the best of :func:`candidates` is used (NOTE [which chain]), with its stem when ``sample`` (one
    input batch) shows which modules run before it (NOTE [the stem joins the chain]).
    """
    names_by_id = {id(m): name for name, m in model.named_modules()}
    if blocks is None:
        found = candidates(model)
        if not found:
            hint = ", ".join(
                f"{name or '<model>'} ({type(m).__name__}, {len(m)} children)"
                for name, m in model.named_modules()
                if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 0
            )
            hint = "; candidates: " + hint if hint else "; the model has no ModuleList/Sequential"
            raise BlockError(
                "found no chain of blocks (ModuleLists/Sequentials of at least 2 modules of one class)"
                f"{hint}. Pass blocks=[...] (a list of submodules, in forward order) to ooc.wrap."
            )
        if sample is None:
            return found[0].chain
        return with_stem(model, by_saved_activations(model, found, sample)[0], sample).chain

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
    nested = [(names_by_id[id(a)], names_by_id[id(b)]) for a in modules for b in modules
              if a is not b and any(sub is b for sub in a.modules())]
    if nested:
        outer, inner = nested[0]
        raise BlockError(f"block {inner} is inside block {outer}; the blocks of a chain must not contain each other")
    return Chain(modules, tuple(names_by_id[id(m)] for m in modules))


def check_first_forward(chain: Chain, calls: list[int], *, layerdrop: str | None = None, skips: bool = False) -> None:
    """Raise :class:`BlockError` unless the blocks ran once each, in chain order.

    ``calls``: the block indices in the order their forwards ran during one training forward of
    the model. The runtime's schedule (releases, prefetches, the backward's order) assumes it.
    ``layerdrop``: the model skips layers at random in training (``ooc.hf.layerdrop``); with
    ``skips``, blocks missing from an otherwise ordered forward are what it skipped, not an error (a
    skipped block opens no pass and runs nothing: the runtime takes any later forward as it comes).
    """
    if calls == list(range(len(chain))):
        return
    if layerdrop is not None and skips and calls and calls == sorted(set(calls)):
        return
    hint = ("Pass blocks=[...] to ooc.wrap: the submodules that run one after another in every forward, "
            "each once, in forward order.")
    if layerdrop is not None:
        hint = (f"(This model's config has {layerdrop}: LayerDrop skips layers at random in training; ooc takes "
                "forwards that skip them once it has a plan, so pass one, or set LayerDrop to 0 for the step "
                f"ooc measures.) {hint}")
    never = [chain.names[i] for i in range(len(chain)) if i not in calls]
    if len(never) == len(chain):
        raise BlockError(f"none of the {len(chain)} blocks ooc found ({chain.names[0]} ... {chain.names[-1]}) ran in "
                         f"the model's forward, so a plan for them would change nothing. {hint}")
    if never:
        raise BlockError(f"blocks {never[:4]} of the chain never ran in the model's forward. {hint}")
    twice = sorted({chain.names[i] for i in calls if calls.count(i) > 1})
    if twice:
        raise BlockError(f"blocks {twice[:4]} ran more than once in one forward (a block called twice, or one module "
                         f"used at two places); ooc plans each block once per forward. {hint}")
    order = [chain.names[i] for i in calls]
    raise BlockError(f"the blocks ran in the order {order[:6]}..., not in chain order. {hint}")
