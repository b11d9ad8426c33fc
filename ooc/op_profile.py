"""A block's forward op by op: measured for the op-level profile, and cached for selective recompute.

NOTE [counting a block's ops]
A ``TorchDispatchMode`` sees every aten op the block's forward dispatches below autograd (composite
ops such as ``linear`` arrive decomposed: ``t``, ``addmm``), in order, views and in-place ops
included; the ``k``-th op is the ``k``-th one the mode sees (NOTE [op-level profile] in
``ooc.scheduler.profile``). The profile, the forward and the re-run count with the same mode class,
and ops that ooc's own hooks run while the mode is on (a pack hook's ``detach``, a value check's
copy) are not counted (``OpCounter.paused``): the count is the model's alone.

NOTE [selective recompute]
A RECOMPUTE block with ``BlockPlan.cached_ops`` runs its forward under :class:`ForwardCache`, which
keeps the outputs of the listed ops (through the block's keep hook: the tracker counts each of their
storages once, as "cache", and frees them with the block's kept bytes when its backward ends). Its
re-run runs under :class:`Replay`, which counts the ops again: a cached op is not run, its kept
outputs are returned instead (fresh aliases: autograd sets the re-run's graph on what an op
returns), and every op is checked against the forward's (another op at the same index raises
:class:`~ooc.recompute.RecomputeError`). Autograd, above the mode, builds the same graph and saves
the same tensors as without the cache, so gradients are those of the plain forward; a tensor the
re-run saves that lies in a cached storage is that storage, counted once (``Replay.ptrs``).
What can be cached (``why_not_cacheable``): an op that creates new storages, is not random (a
skipped random op would leave its generator where it was and shift every later draw; attention with
``dropout_p=0`` draws nothing), does not modify a tensor in place, and whose outputs nothing modifies
in place afterwards (the forward's ops are checked by storage; the cached outputs, which a forward
hook may have handed the caller, and the block's outputs that lie in a cached storage, by version
counter when the re-run takes them from the cache).
The outputs of ``BlockPlan.swapped_ops`` (among the cached ones) go through the block's swap hook
instead of its keep hook: the swap engine copies each storage to the host as its op ends, the
schedule's RELEASE drops the device bytes and its SWAP_IN brings them back before the block's
backward, where ``Replay`` loads them like kept ones (NOTE [swapped cached ops] in
``ooc.scheduler.schedule``). An output the block returns cannot be swapped (``ForwardCache.finish``
refuses it): it is the next block's input and stays on the device.

NOTE [a forward the plan does not fit]
``cached_ops`` index the ops of the training step the profile measured. A forward that runs other
ops (``model.eval()``: no dropout ops; a second forward inside one autocast: no weight casts; a
batch of one row that skips a batch statistic) finds at such an index an op that cannot be cached,
or ends before it, or modifies a cached output in place, or (``finish``) returns the output of an op
the plan swaps. That last one is a plan error when the forward ran the profiled ops (a plan that
swaps a returned output), so it is told apart by the ops' ``op_signature`` the plan carries
(``BlockPlan.op_signature``, hashed only then), or by eval mode; without either it raises. The forward does
not raise: it records why (``ForwardCache.refused``), caches nothing more, and runs on as plain
PyTorch; its re-run runs whole, without the cache (a plain recompute: the
same gradients), under a :class:`~ooc.recompute.PlanMismatchWarning` naming the reason. So a
forward that is never differentiated (a validation loss in eval mode without ``torch.no_grad()``)
runs as without ooc, and one that is differentiated (a batch without padding where the profile's
had some: HF sdpa runs other kernels) trains at plain recompute's cost for that block. It raised
``RecomputeError`` before, which stopped training on batches unlike the profiled one. The outputs
cached before the refusal stay held until the backward (the plan counted them).

NOTE [the re-run leaves ops out]
The re-run also leaves out the uncached ops whose outputs only cached ops read (NOTE [ops a re-run
skips] in ``ooc.scheduler.oplevel``, whose ``dead_ops`` decides it here as for the planner).
:class:`ForwardCache` sees, per op of the forward, the storages it creates and those its tensor
arguments lie in (a view's storage is its base's), whether it only makes views (``_only_views``),
which storages autograd saves (``note_saved``, from the block's pack hook) and which the block
returns (``finish``), and at the end of the forward computes the left-out set. An op is a
candidate only if, besides, none of its storages is alive after the forward (nothing stashed it in
an attribute or a list, nor holds it for its backward outside autograd's saved tensors).
:class:`Replay` hands out, for a left-out op, uninitialised tensors of the forward's sizes,
strides, offsets, dtypes and storage sizes, allocated as the op would (the re-run's memory walk is
that of a full re-run), and no kernel runs; left-out ops draw no random numbers (they are
cacheable), so every later draw is the same. It then refuses, with :class:`RecomputeError`, rather
than hand on a wrong value: an op that is not cached and not a view op reading a left-out storage
(checked before it runs), a view op that turned out to copy, and autograd saving a left-out storage
(the re-run's pack hook). What it cannot see is a read that dispatches nothing (a Triton kernel
launched directly on the tensor, ``.tolist()``, ``.numpy()``) of an output a cached op also reads.
Such a kernel mostly writes into a buffer from ``torch.empty`` (or grown by ``resize_``, as
``torch.empty(..., out=)`` does: ``_RESIZES``): where an op reads (or autograd
saves, or the block returns) bytes of such a buffer that no seen op wrote (an in-place op other than
a copy or a fill reads what it writes; seen writes are tracked per byte, so a seen op that writes
part of it leaves the rest blank), the forward shows that a kernel ran unseen (``_UnseenWrites``),
and the re-run leaves nothing out (a measured profile records no ``reads`` for it, so the planner
prices it so). The rest
(``.tolist()``) ``check_recompute=True`` catches: the re-run's saved tensors, all a re-run hands the
backward, are compared with the forward's.
The forward drops a candidate as soon as it cannot be left out (``dead_ops`` then decides the same):
an op that computes (no view op), is not cached and is no candidate itself runs in the re-run and
reads what it read here; autograd saving a storage keeps its op; an unseen kernel keeps them all.
Past the last cached op no op is cached or becomes a candidate, so later ops can only rule
candidates out: at the last cached op the forward keeps those ``dead_ops`` finds then (a superset
of the final set), and once none is left it records nothing more for the left-out set (each op's
bookkeeping is host time in Python, on the critical path where kernels are short).
"""

from __future__ import annotations

import statistics
import weakref
from collections.abc import Callable, Collection
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from ooc.clock import Clock
from ooc.errors import ProfileError
from ooc.scheduler.oplevel import dead_ops
from ooc.scheduler.plan import op_signature
from ooc.scheduler.profile import OpProfile
from ooc.storage_ref import StorageRef

_UNINITIALISED = frozenset({"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::empty_permuted",
                            "aten::new_empty", "aten::new_empty_strided"})
"""Ops that allocate without writing (NOTE [the re-run leaves ops out])."""

_RESIZES = frozenset({"aten::resize_", "aten::resize_as_"})
"""In-place ops that allocate like ``empty`` (NOTE [the re-run leaves ops out]): a resize that grows
its ``self`` past its storage moves it into a new one, uninitialised past the old bytes (which it
copies, reading no values); one that does not writes nothing (``torch.empty(..., out=)`` resizes)."""

_NO_VALUES = frozenset({"aten::set_", "aten::t_", "aten::transpose_", "aten::swapdims_", "aten::swapaxes_",
                        "aten::squeeze_", "aten::unsqueeze_", "aten::as_strided_", "aten::detach_"})
"""In-place ops that change only a tensor's metadata (its storage, sizes, strides): they read and
write no values, and a ``set_`` onto a storage creates none."""

_OVERWRITES = frozenset({"aten::copy_", "aten::fill_", "aten::zero_", "aten::normal_", "aten::uniform_",
                         "aten::random_", "aten::bernoulli_", "aten::exponential_", "aten::geometric_",
                         "aten::cauchy_", "aten::log_normal_"})
"""In-place ops that write their ``self`` without reading what was there (``_read_tensors``)."""

_NOT_DETERMINISTIC = ("the forward is not deterministic (data-dependent control flow, or state changed between the "
                      "runs); plan this block without cached_ops, or as keep or swap")


_NONE: frozenset[int] = frozenset()
"""No storages, or no ops: what the forward records for an op once nothing can be left out."""


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _op_tensors(*parts: Any) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments or outputs (``parts``: its args tuple, kwargs dict,
    its output): a schema nests them one list deep at most, so no pytree walk (a few microseconds
    per op, on every op of a selective block)."""
    found: list[torch.Tensor] = []
    for part in parts:
        for value in part.values() if isinstance(part, dict) else part if isinstance(part, (tuple, list)) else (part,):
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, (tuple, list)):
                found += [t for t in value if isinstance(t, torch.Tensor)]
    return found


def _flatten(out: Any) -> tuple[list[Any], Any]:
    """``tree_flatten(out)`` of an op's output, with None for the spec of one tensor (most ops'
    output; ``tree_flatten`` takes a microsecond and more even then)."""
    return ([out], None) if isinstance(out, torch.Tensor) else tree_flatten(out)


def _unflatten(leaves: list[Any], spec: Any) -> Any:
    """The inverse of ``_flatten``."""
    return leaves[0] if spec is None else tree_unflatten(leaves, spec)


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    return t.untyped_storage() if t.layout == torch.strided else None


def _outputs(out: Any) -> list[tuple[torch.Tensor, torch.UntypedStorage | None, int | None]]:
    """An op's output tensors, each with its storage (None: not strided) and that storage's address
    (None: no storage, or an empty one, whose address may be another's). Read once per op and
    passed on: each ``untyped_storage()`` builds a Python object."""
    found: list[tuple[torch.Tensor, torch.UntypedStorage | None, int | None]] = []
    for t in _op_tensors(out):
        if t.layout != torch.strided:
            found.append((t, None, None))
        else:
            storage = t.untyped_storage()
            found.append((t, storage, storage.data_ptr() if storage.nbytes() else None))
    return found


class _Schema:
    """What an aten op's schema says about every call of it, read once per op (``_schema``): the
    selective forward and re-run ask on each of a block's ops, and each read of a schema's fields
    builds Python objects (a tenth of a microsecond and up apiece)."""

    __slots__ = ("name", "mutable", "written", "read", "random", "dropout_p", "returns_view", "allocates", "values",
                 "factory")

    def __init__(self, func: torch._ops.OpOverload) -> None:
        schema = func._schema
        self.name: str = schema.name
        self.mutable: bool = schema.is_mutable
        arguments = list(enumerate(schema.arguments))
        writes = [arg.alias_info is not None and arg.alias_info.is_write for _, arg in arguments]
        self.written = tuple((k, arg.name) for k, arg in arguments if writes[k])
        """(Position, name) of the arguments it writes in place (its schema's ``Tensor(a!)``)."""
        whole = self.name in _OVERWRITES
        self.read = tuple((k, arg.name) for k, arg in arguments if not (writes[k] and (whole or arg.kwarg_only)))
        """(Position, name) of the arguments whose values it reads (``_read_tensors``)."""
        self.random: bool = torch.Tag.nondeterministic_seeded in func.tags
        self.dropout_p = next(((k, arg.default_value) for k, arg in arguments if arg.name == "dropout_p"), None)
        """(Position, default) of its ``dropout_p`` argument, if it has one (``_draws_random_numbers``)."""
        self.returns_view: bool = any(r.alias_info is not None for r in schema.returns)
        self.allocates: bool = self.name in _UNINITIALISED or self.name in _RESIZES
        """It allocates without writing values (``_UnseenWrites.op``)."""
        self.values: bool = not self.allocates and self.name not in _NO_VALUES
        """It reads or writes values, not only a tensor's metadata (``_UnseenWrites.op``)."""
        self.factory: bool = {"dtype", "layout", "device", "pin_memory"} <= {arg.name for _, arg in arguments}
        """It takes tensor options (``zeros``, ``arange``, ``_to_copy``): torch's Python binding of a
        factory re-wraps its output (``_alias``)."""


_SCHEMAS: dict[int, tuple[torch._ops.OpOverload, _Schema]] = {}
"""Op id -> (the op, what its schema says). Keyed by ``id``: an op's ``__hash__`` is Python code (a
third of a microsecond); the entry holds the op, so no other op ever has its id."""


def _schema(func: torch._ops.OpOverload) -> _Schema:
    entry = _SCHEMAS.get(id(func))
    if entry is None:
        entry = _SCHEMAS[id(func)] = (func, _Schema(func))
    return entry[1]


_AD_INPLACE_OR_VIEW = torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)


def _alias(t: torch.Tensor, schema: _Schema) -> tuple[torch.Tensor, bool]:
    """An alias of ``t``, an output of an op with ``schema``, for the cache: the same storage, no graph;
    and whether it shares ``t``'s version counter, as ``detach`` above autograd does (so an in-place
    change through ``t``, a view or a ``detach()`` of it shows). In a dispatch mode ``detach`` runs
    below ``ADInplaceOrView`` and makes a counter of its own, unless that key is let through. Not for
    a factory's output: torch's Python binding re-wraps it (``make_variable``) and, finding its counter
    shared, hands the caller a detached copy with a counter of its own, dispatching a ``detach`` that
    the forward would count and the re-run would not."""
    if schema.factory:
        return t.detach(), False
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                         torch._C._dispatch_tls_local_exclude_set() - _AD_INPLACE_OR_VIEW):
        return t.detach(), True


def _argument(args: tuple, kwargs: dict, k: int, name: str, default: Any = None) -> Any:
    """Argument ``k`` of an op's schema, called ``name``: positional or keyword."""
    return args[k] if k < len(args) else kwargs.get(name, default)


def _draws_random_numbers(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    schema = _schema(func)
    if not schema.random:
        return False
    if schema.dropout_p is None:
        return True
    # Fused attention is tagged random for its dropout; with dropout_p=0 it draws nothing (its CPU
    # and CUDA kernels take no generator offset then), so caching it shifts no later draw.
    k, default = schema.dropout_p
    return _argument(args, kwargs, k, "dropout_p", default) != 0


def why_not_cacheable(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any) -> str | None:
    """Why the re-run cannot take this op's output from a cache (NOTE [selective recompute]), or None.

    Does not see later in-place changes of the output: the profile (``OpRecorder``) and the runtime
    (version counters) check those."""
    return _why_not_cacheable(func, args, kwargs, _read_storages(args, kwargs), _outputs(out))


def _why_not_cacheable(func: torch._ops.OpOverload, args: tuple, kwargs: dict, inputs: set[int],
                       outputs: list[tuple[torch.Tensor, torch.UntypedStorage | None, int | None]]) -> str | None:
    """``why_not_cacheable``, given the storages the op's arguments lie in (``_read_storages``,
    before or after it ran: an op that writes nothing in place moves no argument to another storage)
    and its ``_outputs``."""
    if _draws_random_numbers(func, args, kwargs):
        return "it draws random numbers (skipping it would shift every later random op)"
    schema = _schema(func)
    if schema.mutable:
        return "it modifies a tensor in place"
    if not outputs:
        return "it returns no tensor"
    for t, storage, ptr in outputs:
        if storage is None:
            return f"it returns a {t.layout} tensor"
        if ptr is not None and ptr in inputs:
            return "it returns a view of its input"
    if schema.returns_view:
        return "it returns a view of its input"
    return None


def _mutated(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op writes to in place (its schema's ``Tensor(a!)`` arguments)."""
    return _op_tensors(*((_argument(args, kwargs, k, name),) for k, name in _schema(func).written))


def _read_tensors(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an op's arguments whose values it reads: all but its ``out=`` arguments and
    the ``self`` of a copy or fill, which it writes without reading what was there. Any other op that
    writes a tensor in place (``add_``, ``relu_``, ``index_put_``) reads it too."""
    schema = _schema(func)
    if not schema.mutable:
        return _op_tensors(args, kwargs)
    return _op_tensors(*((_argument(args, kwargs, k, name),) for k, name in schema.read))


def _read_storages(args: tuple, kwargs: dict) -> set[int]:
    """Addresses of the (non-empty) storages an op's tensor arguments lie in: what it may read."""
    return {s.data_ptr() for t in _op_tensors(args, kwargs) if t.layout == torch.strided and (s := t.untyped_storage()).nbytes()}


def _only_views(func: torch._ops.OpOverload, inputs: set[int], out: Any,
                outputs: list[tuple[torch.Tensor, torch.UntypedStorage | None, int | None]] | None = None) -> bool:
    """The op only makes views of its arguments (``inputs``: their storages): it writes nothing, and
    returns tensors only, each in one of those storages. It reads no values (NOTE [the re-run
    leaves ops out]); an op that copies, or returns a number (``.item()``), or an empty new tensor
    (whose shape it may have read from values), is no view op. ``outputs``: ``_outputs(out)``, if read."""
    leaves = out if isinstance(out, (tuple, list)) else (out,)
    if not leaves or _schema(func).mutable:
        return False
    for t in leaves:
        if not isinstance(t, torch.Tensor):
            return False
    for _, _, ptr in _outputs(out) if outputs is None else outputs:  # every leaf is a tensor: these
        if ptr is None or ptr not in inputs:
            return False
    return True


def _covers(t: torch.Tensor, nbytes: int) -> bool:
    """``t`` covers every byte of its storage (``nbytes`` long), in any order of its dimensions: it
    is dense and as long as the storage. Allocates nothing (it runs on every write to a blank storage)."""
    if t.storage_offset() or t.numel() * t.element_size() != nbytes:
        return False
    expected = 1
    for size, stride in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _bytes(mask: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``mask`` (uint8, one per byte of ``t``'s storage) that ``t``'s elements occupy,
    shape ``t.shape + (t.element_size(),)``: exact for any strided view, overlapping ones too."""
    size = t.element_size()
    return mask.as_strided((*t.shape, size), (*(s * size for s in t.stride()), 1), t.storage_offset() * size)


class _UnseenWrites:
    """Whether a block's forward ran a kernel no dispatch shows (NOTE [the re-run leaves ops out]).

    Such a kernel (Triton, a CUDA extension) mostly writes into a buffer from ``torch.empty``: an op
    that reads bytes of such a buffer that no op wrote (or autograd saving them, or the block
    returning them) shows that one ran, and it may have read any output, so no op may be left out of a
    re-run. Seen writes are tracked per byte: a seen op that writes part of the buffer leaves the rest
    blank (an unseen kernel may fill it)."""

    def __init__(self) -> None:
        self.blank: dict[int, torch.Tensor | None] = {}
        """Storages an ``empty`` op made that seen ops have not wholly written yet, by address: None
        while no op wrote any of it, else a uint8 mask with one element per byte (1: written)."""
        self._refs: dict[int, StorageRef] = {}
        """The storages that have a mask: a mask whose storage died is dropped (``_mask``)."""
        self.reason: str | None = None

    def op(self, index: int, func: torch._ops.OpOverload, args: tuple, kwargs: dict, read: set[int],
           created: Collection[int], view: bool) -> None:
        """Op ``index`` ran, its tensor arguments lying in ``read`` and creating ``created`` (storage
        addresses); ``view``: it only makes views (``_only_views``), reading no values."""
        schema = _schema(func)
        if self.reason is not None or not (self.blank or schema.allocates):
            # Seen already; or no blank storage to read or write, and this op makes none (nor does
            # one it creates need forgetting: ``_refs`` holds only storages that ``blank`` holds).
            return
        # An allocation reads and writes no values; its new storage is blank (a grown one wholly:
        # the old bytes it copied count as unwritten, which at worst leaves nothing out).
        allocates, values = schema.allocates, schema.values
        reads_blank = not view and values and not self.blank.keys().isdisjoint(read) and any(
            self._unwritten(t) for t in _read_tensors(func, args, kwargs))
        if self.blank and schema.mutable and values:
            for t in _mutated(func, args, kwargs):
                self._write(t)
        for ptr in created if schema.name not in _NO_VALUES else ():
            self._forget(ptr)
        if allocates:
            self.blank.update(dict.fromkeys(created))
        elif reads_blank:
            self.seen(f"op {index} ({func}) reads")

    def used(self, tensor: torch.Tensor, how: str) -> None:
        """``how`` (autograd saves, the block returns) uses ``tensor``."""
        if self.blank and self._unwritten(tensor):
            self.seen(how)

    def seen(self, how: str) -> None:
        if self.reason is None:
            self.reason = f"{how} a buffer from torch.empty that no op wrote"

    def _unwritten(self, t: torch.Tensor) -> bool:
        """Some byte of ``t`` lies in a blank storage where no seen op wrote."""
        if (storage := _storage(t)) is None or not storage.nbytes() or storage.data_ptr() not in self.blank or not t.numel():
            return False
        mask = self._mask(storage, create=False)
        return mask is None or not bool(_bytes(mask, t).all())

    def _write(self, t: torch.Tensor) -> None:
        """A seen op wrote all of ``t``."""
        if (storage := _storage(t)) is None or (ptr := storage.data_ptr()) not in self.blank or not t.numel():
            return
        if _covers(t, storage.nbytes()):
            self._forget(ptr)
            return
        mask = self._mask(storage, create=True)
        _bytes(mask, t).fill_(1)
        if bool(mask.all()):
            self._forget(ptr)

    def _mask(self, storage: torch.UntypedStorage, create: bool) -> torch.Tensor | None:
        """The blank storage's mask; a new one (nothing written) if it has none and ``create``, or
        if its mask is another storage's (an address reused by a storage no op was seen to create)."""
        ptr = storage.data_ptr()
        mask = self.blank[ptr]
        if mask is not None and mask.numel() != storage.nbytes():
            mask = None
        if mask is None and create:
            for dead in [p for p, ref in self._refs.items() if ref.expired()]:
                self._forget(dead)
            mask = self.blank[ptr] = torch.zeros(storage.nbytes(), dtype=torch.uint8, device="cpu")
            self._refs[ptr] = StorageRef(storage)
        return mask

    def _forget(self, ptr: int) -> None:
        self.blank.pop(ptr, None)
        self._refs.pop(ptr, None)


class _Paused:
    """``OpCounter.paused``: a class, not a ``contextlib.contextmanager`` generator (a microsecond and
    more per use, and the pack hooks use it for every tensor a selective block saves)."""

    __slots__ = ("counter",)

    def __init__(self, counter: OpCounter) -> None:
        self.counter = counter

    def __enter__(self) -> None:
        self.counter._paused += 1

    def __exit__(self, *exc: object) -> None:
        self.counter._paused -= 1


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched while it is on (NOTE [counting a block's ops]) and hands each to ``op``."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self._paused = 0

    def paused(self) -> _Paused:
        """Ops dispatched inside run uncounted (ooc's own hooks)."""
        return _Paused(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        index = self.count
        self.count += 1
        return self.op(index, func, args, kwargs)

    def op(self, index: int, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        return func(*args, **kwargs)


# -- measuring (the op-level profile) ----------------------------------------------------------------


class OpRecorder(OpCounter):
    """One forward of one block, op by op: name, time, the device storages each op creates, which of
    them the block saves for backward (``note_saved``, its pack hook), and whether it is cacheable."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.clock = Clock(device)
        self.names: list[str] = []
        self.stamps: list[Any] = []
        self.created: list[dict[int, int]] = []
        """Per op: storage address -> bytes, for the new storages it created on the block's device."""
        self.saved: list[set[int]] = []
        self.reads: list[tuple[int, ...]] = []
        """Per op: the earlier ops whose storages it reads (none for an op that only makes views:
        what reads through the view reads the storage itself), ``OpProfile.reads``."""
        self.why_not: list[str | None] = []
        self.returned: set[int] = set()
        """The ops whose storages the block returns (``note_returned``)."""
        self.outlive: set[int] = set()
        """The ops a storage of which is alive after the forward, neither returned nor saved
        (``note_returned``; ``OpProfile.outlives_forward``)."""
        self._refs: list[list[StorageRef]] = []
        self._creator: dict[int, int] = {}
        """Storage address -> the latest op that created a storage there: while a storage lives, no
        other op can create one at its address, so this names the creator of every live storage."""
        self.unseen = _UnseenWrites()
        """Whether a kernel ran unseen (then ``reads`` is not what the ops read, and not recorded)."""
        self.replayed = 0
        """The ops dispatched when autograd saved the block's last tensor: where a re-run stops
        (``OpProfile.replayed``; NOTE [a re-run stops at the last save] in ``ooc.scheduler.profile``)."""

    def op(self, index: int, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        read = _read_storages(args, kwargs)  # before it runs: a resize_ moves its self into a new storage
        started = self.clock.now()
        out = func(*args, **kwargs)
        self.stamps.append((started, self.clock.now()))
        self.names.append(str(func))
        self.why_not.append(why_not_cacheable(func, args, kwargs, out))
        for t in _mutated(func, args, kwargs):
            storage = _storage(t)
            creator = None if storage is None else self._creator.get(storage.data_ptr())
            if creator is not None and self.why_not[creator] is None:
                self.why_not[creator] = f"op {index} ({func}) modifies its output in place later"
        view = _only_views(func, read, out)
        self.reads.append(() if view else tuple(sorted({op for p in read if (op := self._creator.get(p)) is not None})))
        created: dict[int, int] = {}
        refs: list[StorageRef] = []
        for t in _tensors(out):
            storage = _storage(t)
            if storage is None or t.device != self.device or not storage.nbytes() or storage.data_ptr() in read:
                continue
            created[storage.data_ptr()] = storage.nbytes()
            self._creator[storage.data_ptr()] = index
            refs.append(StorageRef(storage))
        self.unseen.op(index, func, args, kwargs, read, created, view)
        self.created.append(created)
        self._refs.append(refs)
        self.saved.append(set())
        return out

    def note_saved(self, tensor: torch.Tensor) -> None:
        """Autograd saves ``tensor`` for the block's backward: credit its storage to the op that made it.
        An op's inputs are saved before it is dispatched, its outputs after: ``count`` is then the
        ops a re-run dispatches before this save (``replayed``)."""
        self.replayed = self.count
        self.unseen.used(tensor, "autograd saves")
        storage = _storage(tensor)
        if storage is not None and tensor.device == self.device and (op := self._creator.get(storage.data_ptr())) is not None:
            self.saved[op].add(storage.data_ptr())

    def note_returned(self, out: Any) -> None:
        """The block returned ``out``: mark the ops that created its storages (``OpProfile.returned``:
        the next block's input, which a plan may cache but not swap), and the ops whose storages are
        alive nonetheless (``OpProfile.outlives_forward``: the measuring pack hook holds no saved
        tensor, so what holds one is autocast's cache, an attribute, a custom Function's context)."""
        for t in _tensors(out):
            self.unseen.used(t, "the block returns")
            storage = _storage(t)
            if storage is not None and (op := self._creator.get(storage.data_ptr())) is not None:
                self.returned.add(op)
        self.outlive = {k for k, refs in enumerate(self._refs)
                        if k not in self.returned and not self.saved[k] and not all(r.expired() for r in refs)}
        self._refs = []

    def seconds(self) -> list[float]:
        return [self.clock.seconds(start, end) for start, end in self.stamps]


class _Dropped:
    """What the measuring pack hook leaves in the graph: nothing (that graph never runs backward)."""

    __slots__ = ()


_DROPPED = _Dropped()


def _never_unpacked(_packed: object) -> torch.Tensor:
    raise ProfileError("a graph built while measuring a block's ops was differentiated; this is a bug in ooc")


def measure_ops(
    modules: list[torch.nn.Module], names: list[str], run: Callable[[], Any], *, device: torch.device, reps: int,
) -> list[tuple[OpProfile, ...]]:
    """Each block's forward op by op (NOTE [op-level profile] in ``ooc.scheduler.profile``).

    ``run()`` runs the model's forward once; it runs ``reps`` times after one warm-up, with grad
    enabled (as in training: some ops depend on it), and no saved tensor is held (the graph is
    dropped unused), so this needs no more memory than the leanest plan. An op's time is its median.
    Raises :class:`ProfileError` if a block dispatches other ops from one forward to the next.
    """
    records: list[list[OpRecorder]] = [[] for _ in modules]
    installed = []

    def measured(i: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            recorder = OpRecorder(device)

            def pack(tensor: torch.Tensor) -> _Dropped:
                with recorder.paused():
                    recorder.note_saved(tensor)
                return _DROPPED

            with saved_tensors_hooks(pack, _never_unpacked), recorder:
                out = original(*args, **kwargs)
            recorder.note_returned(out)
            records[i].append(recorder)
            return out

        return forward

    try:
        for i, module in enumerate(modules):
            installed.append((module, module.__dict__.get("forward")))
            module.forward = measured(i, module.forward)
        for _ in range(reps + 1):
            # Under the caller's autocast, the first forward's casts of the weights stay cached for
            # the next ones, which would then dispatch fewer ops than a training step's forward (a
            # step enters autocast anew, and casts again): every plan's op indices would be off.
            torch.clear_autocast_cache()
            with torch.enable_grad():
                run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # every op's end event has completed (Clock.seconds)
    finally:
        for module, previous in installed:
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
    profiles = []
    for name, runs in zip(names, records):
        runs = runs[1:]  # the first forward warms up allocators and kernels
        if not runs:
            raise ProfileError(f"block {name} did not run in the model's forward; check the chain (ooc.describe)")
        last = runs[-1]
        for other in runs[:-1]:
            if other.names != last.names:
                raise ProfileError(f"block {name} dispatched {len(other.names)} ops in one forward and {len(last.names)} "
                                   f"in the next ({_first_difference(other.names, last.names)}): its ops cannot be "
                                   "counted; profile without ops=True")
        times = [statistics.median(column) for column in zip(*(r.seconds() for r in runs))]
        profiles.append(tuple(
            OpProfile(name=op, forward_s=seconds, output_bytes=sum(created.values()),
                      saved_bytes=sum(created[p] for p in saved), cacheable=why is None, returned=k in last.returned,
                      reads=None if last.unseen.reason else reads, outlives_forward=k in last.outlive,
                      replayed=k < last.replayed)
            for k, (op, seconds, created, saved, why, reads) in enumerate(zip(last.names, times, last.created, last.saved,
                                                                              last.why_not, last.reads))
        ))
    return profiles


def _first_difference(a: list[str], b: list[str]) -> str:
    k = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"op {k}: {a[k] if k < len(a) else 'none'} vs {b[k] if k < len(b) else 'none'}"


# -- executing (selective recompute) -----------------------------------------------------------------


class _Layout:
    """What one op returned in the forward, to hand out uninitialised in a re-run that leaves it out
    (NOTE [the re-run leaves ops out]): the output's tree; per leaf, a non-tensor's value or a
    tensor's (storage number, size, stride, offset, dtype); per storage, its bytes and device."""

    __slots__ = ("spec", "leaves", "storages")

    def __init__(self, out: Any) -> None:
        leaves, self.spec = _flatten(out)
        numbers: dict[object, int] = {}
        self.storages: list[tuple[int, torch.device]] = []
        self.leaves: list[tuple[bool, Any]] = []
        for t in leaves:
            if not isinstance(t, torch.Tensor):
                self.leaves.append((False, t))
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr() if storage.nbytes() else object()  # empty storages may share address 0
            if key not in numbers:
                numbers[key] = len(self.storages)
                self.storages.append((storage.nbytes(), t.device))
            self.leaves.append((True, (numbers[key], t.shape, t.stride(), t.storage_offset(), t.dtype)))

    def allocate(self) -> tuple[Any, list[torch.UntypedStorage]]:
        """Tensors like the forward's, uninitialised (no kernel runs), and their new storages."""
        storages = [torch.UntypedStorage(nbytes, device=device) for nbytes, device in self.storages]
        out = [torch.empty(0, dtype=v[4], device=storages[v[0]].device).set_(storages[v[0]], v[3], v[1], v[2])
               if is_tensor else v for is_tensor, v in self.leaves]
        return _unflatten(out, self.spec), storages


class ForwardCache(OpCounter):
    """The forward of a selectively recomputed block: keeps the outputs of the ``cached`` ops through
    ``keep`` (the block's keep hook) and records every op, for the re-run (NOTE [selective recompute]).

    The outputs of the ``swapped`` ops (a subset of ``cached``) go through ``swap`` instead (the
    block's swap hook: copied to the host, NOTE [swapped cached ops] in ``ooc.scheduler.schedule``);
    the re-run's ``load`` brings them back as it does a kept one. What ``swap`` returns for a tensor it
    copies has ``watch(tensor) -> Callable[[], bool]`` (``ooc.saved.SwappedView``): whether the tensor
    was modified in place while the copy was in flight. ``signature``: ``BlockPlan.op_signature``."""

    def __init__(self, block: str, cached: tuple[int, ...], keep: Callable[[torch.Tensor], object],
                 error: type[Exception], *, swapped: tuple[int, ...] = (),
                 swap: Callable[[torch.Tensor], object] | None = None, eval_mode: bool = False,
                 signature: str | None = None) -> None:
        super().__init__()
        if not set(swapped) <= set(cached):
            raise ValueError(f"ForwardCache: swapped ops {sorted(set(swapped) - set(cached))[:8]} are not among the cached ops")
        if swapped and swap is None:
            raise ValueError("ForwardCache: swapped ops need a swap hook")
        self.block = block
        self.cached = frozenset(cached)
        self.swapped = frozenset(swapped)
        self.last = max(cached)
        self.keep = keep
        self.swap = swap
        self.error = error
        self.eval_mode = eval_mode
        """The forward runs with modules in eval mode, so other ops than the profiled training step: a
        swapped output it returns is one more way it does not fit the plan (``finish``), not a plan error."""
        self.signature = signature
        """``BlockPlan.op_signature``: the profiled forward's ops, or ``None`` if the plan does not say."""
        self.funcs: list[torch._ops.OpOverload] = []
        self.outputs: dict[int, tuple[Any, list[tuple[bool, object]]]] = {}
        """Op index -> its output flattened: the tree's spec, and per leaf (is a tensor, the leaf or
        what ``keep`` returned for the tensor)."""
        self.storages: dict[int, int] = {}
        """Storage address of a cached output -> its op (the cache holds the storage: the address is its)."""
        self.in_flight: dict[int, list[Callable[[], bool]]] = {}
        """Op -> per swapped output: whether it was modified in place while its copy out was in flight (``_watch``)."""
        self.escaped: dict[int, list[tuple[torch.Tensor, int]]] = {}
        """Op -> tensors in its cached storages that the caller may change in place after the forward:
        (an alias sharing their version counter, its version then). The kept outputs themselves (a
        forward hook may hold one, a view or a ``detach()`` of it) and the block's outputs (an
        ``_unsafe_view`` of a cached output has a counter of its own)."""
        self.done = False
        self.refused: str | None = None
        """Why the re-run cannot take its outputs from this forward (NOTE [a forward the plan does not
        fit]): the re-run raises it; the forward, from there on, caches nothing."""
        # What the re-run may leave out (NOTE [the re-run leaves ops out]):
        self.reads: list[AbstractSet[int]] = []
        """Per op: the earlier ops whose storages its tensor arguments lie in (none recorded once
        nothing can be left out, ``_tracking``)."""
        self.views: list[bool] = []
        """Per op: it only makes views of its arguments (``_only_views``), reading no values (False
        once nothing can be left out)."""
        self.left_out: dict[int, _Layout] = {}
        """The ops the re-run leaves out, after the forward, and what each returned."""
        self._candidates: dict[int, tuple[_Layout, list[StorageRef]]] = {}
        """Uncached, cacheable ops that create storages and may yet be left out (NOTE [the re-run leaves
        ops out]): their outputs' layout, their new storages."""
        self._creator: dict[int, int] = {}
        """Storage address -> the latest op that created a storage there (that of every live storage),
        while ``_tracking``."""
        self.unseen = _UnseenWrites()
        """Whether a kernel ran unseen (then the re-run leaves nothing out)."""
        self._casts: dict[int, weakref.ref] = {}
        """Op -> the leaf it casts, for the casts autocast caches (NOTE [a weight another block cast])."""

    def op(self, index: int, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        if self.refused is not None:
            return func(*args, **kwargs)  # the re-run raises (NOTE [a forward the plan does not fit])
        if self.storages and _schema(func).mutable:  # (none cached yet: nothing to refuse)
            for t in _mutated(func, args, kwargs):
                if (storage := _storage(t)) is not None and (op := self.storages.get(storage.data_ptr())) is not None:
                    self.refused = self._modified(op, f"by op {index} ({func}) later in its forward")
                    return func(*args, **kwargs)
        tracking, cached = self._tracking(index), index in self.cached
        read = _read_storages(args, kwargs) if tracking or cached else _NONE
        out = func(*args, **kwargs)
        if _a_cached_cast(func, args):
            self._casts[index] = weakref.ref(args[0])
        self.funcs.append(func)
        outputs = _outputs(out) if tracking or cached else []
        if tracking:
            self._track(index, func, args, kwargs, read, out, outputs, cached)
        else:
            self.reads.append(_NONE)
            self.views.append(False)
        if cached:
            reason = _why_not_cacheable(func, args, kwargs, read, outputs)
            if reason is not None:
                self.refused = (
                    f"block {self.block}: its plan caches op {index} ({func}), which cannot be cached: {reason}; "
                    "leave it out of cached_ops (the op-level profile, ooc.profile(..., ops=True), marks such ops "
                    f"cacheable=False){_OTHER_FORWARD_HINT}"
                )
                return out
            # Below autograd the outputs have no graph yet: an alias (same storage and version
            # counter, ``_alias``) is held without holding the forward's graph.
            leaves, spec = _flatten(out)
            schema, hold = _schema(func), self.swap if index in self.swapped else self.keep
            held: list[tuple[bool, object]] = []
            for t in leaves:
                if not isinstance(t, torch.Tensor):
                    held.append((False, t))
                    continue
                alias, shared = _alias(t, schema)
                self.storages[alias.untyped_storage().data_ptr()] = index
                # A swapped output's copy out is issued here, after a compute event recorded past this
                # op (SwappedStorage): the rest of the forward only reads the storage (a write is
                # refused above), and its device bytes live until the schedule's RELEASE waits for that copy.
                kept = hold(alias)
                if shared:
                    self._watch(index, alias, kept)
                held.append((True, kept))
            self.outputs[index] = (spec, held)
        return out

    def _watch(self, index: int, alias: torch.Tensor, held: object) -> None:
        """Watch cached op ``index``'s output (``alias`` shares its version counter) for an in-place
        change after the forward: a kept one for the whole backward (``escaped``); a swapped one (``held``
        has ``watch``, SwappedView) until the copy out is ordered before compute (a change after it
        leaves the host copy as the forward made it; one before may race the copy)."""
        watch = getattr(held, "watch", None)
        if watch is None:
            self.escaped.setdefault(index, []).append((alias, alias._version))
        else:
            self.in_flight.setdefault(index, []).append(watch(alias))

    def _tracking(self, index: int) -> bool:
        """Op ``index`` may matter to what the re-run leaves out: an op before the last cached one may
        be left out; after it, only the candidates left may (NOTE [the re-run leaves ops out])."""
        return index < self.last or bool(self._candidates)

    def _track(self, index: int, func: torch._ops.OpOverload, args: tuple, kwargs: dict, read: set[int], out: Any,
               outputs: list[tuple[torch.Tensor, torch.UntypedStorage | None, int | None]], cached: bool) -> None:
        """Record op ``index`` (``read``: its arguments' storages; ``outputs``: ``_outputs(out)``) for
        the left-out set (NOTE [the re-run leaves ops out])."""
        view = _only_views(func, read, out, outputs)
        reads = {op for p in read if (op := self._creator.get(p)) is not None}
        self.reads.append(reads)
        self.views.append(view)
        created = {ptr: s for _, s, ptr in outputs if ptr is not None and ptr not in read}
        self.unseen.op(index, func, args, kwargs, read, created, view)
        self._creator.update(dict.fromkeys(created, index))
        if self.unseen.reason is not None:
            self._candidates.clear()
        # Only an op some cached op reads, directly or through left-out ones, is left out: none after the last.
        elif (created and index < self.last and not cached
                and _why_not_cacheable(func, args, kwargs, read, outputs) is None):
            self._candidates[index] = (_Layout(out), [StorageRef(s) for s in created.values()])
        elif not view and not cached:
            for k in reads:  # this op computes in the re-run too, from what it read here
                self._candidates.pop(k, None)
        if index == self.last:
            # Later ops are neither cached nor candidates, so they can only rule candidates out: those
            # ``dead_ops`` does not find now it will not find after the forward either.
            possible = dead_ops(self.cached, self._readers(), [k in self._candidates for k in range(index + 1)], self.views)
            for k in [k for k in self._candidates if k not in possible]:
                del self._candidates[k]

    def _readers(self) -> list[list[int]]:
        """Per op so far: the later ops that read its storages."""
        readers: list[list[int]] = [[] for _ in self.funcs]
        for r, reads in enumerate(self.reads):
            for k in reads:
                readers[k].append(r)
        return readers

    def cast(self, index: int, leaf: torch.Tensor) -> bool:
        """Whether op ``index`` of the forward cast ``leaf`` (NOTE [a weight another block cast])."""
        ref = self._casts.get(index)
        return ref is not None and ref() is leaf

    def note_saved(self, tensor: torch.Tensor) -> None:
        """Autograd saves ``tensor`` in the forward (the block's pack hook): the op that made its
        storage cannot be left out of the re-run."""
        if not self._tracking(self.count):  # (``count``: the next op's index)
            return
        self.unseen.used(tensor, "autograd saves")
        if self.unseen.reason is not None:
            self._candidates.clear()
        elif (storage := _storage(tensor)) is not None and (op := self._creator.get(storage.data_ptr())) is not None:
            self._candidates.pop(op, None)

    def finish(self, out: Any) -> None:
        """After the forward (``out``: what it returned): every cached op ran; watch the block outputs
        that lie in a cached storage, the one way it can be modified before the re-run; decide which
        ops the re-run leaves out (NOTE [the re-run leaves ops out])."""
        self.done = True
        if self.refused is None and self.count <= self.last:
            self.refused = (f"block {self.block}: its plan caches op {self.last} but its forward ran {self.count} ops; "
                            "make the plan from this model's op-level profile (ooc.profile(..., ops=True))"
                            + _AUTOCAST_HINT * _in_autocast() + _OTHER_FORWARD_HINT)
        if self.refused is not None:
            return  # the re-run raises (NOTE [a forward the plan does not fit])
        self._decide_left_out(out)
        for t in _tensors(out):
            if (storage := _storage(t)) is not None and (op := self.storages.get(storage.data_ptr())) is not None:
                if op in self.swapped:
                    # The block's output is the next block's input and stays on the device: its
                    # release would count as freed bytes the next block still holds, and its copy back
                    # would allocate them a second time (measured equal to the schedule, wrong on a GPU).
                    reason = (f"block {self.block}: its plan swaps the output of op {op} ({self.funcs[op]}), which the "
                              f"block returns (the next block's input stays on the device); leave op {op} out of "
                              "swapped_ops (it may stay in cached_ops)")
                    if not (self.eval_mode or self._ran_other_ops()):
                        raise self.error(reason)
                    # NOTE [a forward the plan does not fit]: this forward returns what the profiled
                    # one's op at that index was not; the re-run runs whole.
                    self.refused = reason + _OTHER_FORWARD_HINT
                    return
                alias = t.detach()  # above autograd: shares the output's version counter, not its graph
                self.escaped.setdefault(op, []).append((alias, alias._version))

    def _ran_other_ops(self) -> bool:
        """The plan says which ops the profiled forward ran, and this forward ran others."""
        return self.signature is not None and self.signature != op_signature(str(f) for f in self.funcs)

    def _decide_left_out(self, out: Any) -> None:
        if not self._candidates:
            return
        for t in _tensors(out):
            self.unseen.used(t, "the block returns")
        if self.unseen.reason is not None:
            self._candidates = {}
        returned = {op for t in _tensors(out) if (s := _storage(t)) is not None and (op := self._creator.get(s.data_ptr())) is not None}
        readers = self._readers()
        skippable = [False] * len(self.funcs)
        for k, (_, storages) in self._candidates.items():
            # Alive after the forward (not returned; a saved one is no candidate): held where the
            # re-run's stand-in would end up too (an attribute, a list, a custom Function's ctx): not left out.
            skippable[k] = k not in returned and all(s.expired() for s in storages)
        dead = dead_ops(self.cached, readers, skippable, self.views)
        self.left_out = {k: self._candidates[k][0] for k in sorted(dead)}
        self._candidates = {}

    def check_unchanged(self, index: int) -> None:
        """As the re-run takes op ``index``'s outputs from the cache: neither they nor a block output in
        their storages were modified in place since the forward (``escaped``), nor a swapped one while
        its copy to the host was in flight (``in_flight``; later changes leave the copy as the forward
        made it, which is what the re-run needs). Checked then, not before
        the re-run: a re-run that stops before the op (at the last tensor the block saves; the add a
        block returns often comes after) never reads the changed bytes, as plain PyTorch never reads a
        returned tensor nothing saved."""
        for alias, version in self.escaped.get(index, ()):
            if alias._version != version:
                raise self.error(self._modified(index, "after the forward"))
        if any(modified() for modified in self.in_flight.get(index, ())):
            raise self.error(self._modified(index, "after the forward while its copy to the host was in flight (its "
                                                   "plan swaps it), so the copy may hold either value"))

    def _modified(self, op: int, when: str) -> str:
        return (
            f"block {self.block}: the output of op {op} ({self.funcs[op]}), which its plan caches, is modified in "
            f"place {when}, so the re-run cannot take it from the cache; leave op {op} out of cached_ops, or make "
            "that operation out of place"
        )


_OTHER_FORWARD_HINT = ("; if the plan came from this model's op-level profile, this forward ran other ops than the "
                       "profiled one (Hugging Face sdpa attention runs one fused kernel for a batch without padding and "
                       "the math path op by op for one with it; a sequence of length 1 skips copies): profile on a batch "
                       "like this one, or plan this block without cached_ops")

_AUTOCAST_HINT = ("; under autocast, a forward after another inside the same torch.autocast (gradient "
                  "accumulation) finds the weights' casts still in autocast's cache and runs fewer ops than a "
                  "step's: enter torch.autocast once per forward")


def _in_autocast() -> bool:
    return any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))


_TO_COPY = torch.ops.aten._to_copy.default
"""Held: ``torch.ops.aten._to_copy.default`` is three attribute lookups (half a microsecond, on every op)."""


def _a_cached_cast(func: torch._ops.OpOverload, args: tuple) -> bool:
    """``func`` is a cast autocast would cache: ``_to_copy`` of a leaf that requires grad (below autocast,
    where a dispatch mode runs, whether autocast is on cannot be read; a cast outside it is recorded alike)."""
    return (func is _TO_COPY and torch.is_autocast_cache_enabled() and bool(args)
            and isinstance(args[0], torch.Tensor) and args[0].is_leaf and args[0].requires_grad)


class Replay(OpCounter):
    """The re-run of a selectively recomputed block: counts the ops as the forward did, checks each
    one, and returns a cached op's outputs instead of running it (NOTE [selective recompute])."""

    def __init__(self, cache: ForwardCache, load: Callable[[object], torch.Tensor]) -> None:
        super().__init__()
        self.cache = cache
        self.load = load
        self.ptrs: set[int] = set()
        """Storages of the cached outputs handed out: already counted, never counted again."""
        self.fakes: dict[int, tuple[int, StorageRef]] = {}
        """Storage address -> (the left-out op, the uninitialised storage handed out for it)."""

    def op(self, index: int, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        cache = self.cache
        expected = cache.funcs[index] if index < len(cache.funcs) else None
        if _a_cached_cast(func, args) and not cache.cast(index, args[0]):
            # NOTE [a weight another block cast]: autocast caches its casts of leaves that require grad
            # (weights). A weight shared with an earlier block (tied layers) was cast there: this
            # block's forward found the cast cached and dispatched none, but its re-run starts from an
            # empty cache and casts it. That cast is no op of the forward's: run it uncounted.
            self.count -= 1
            return func(*args, **kwargs)
        if func is not expected:
            raise cache.error(
                f"block {cache.block}: op {index} of its re-run is {func} but its forward ran "
                f"{expected or f'only {len(cache.funcs)} ops'} there, so the cached outputs cannot be matched; "
                f"{_NOT_DETERMINISTIC}"
            )
        if (layout := cache.left_out.get(index)) is not None:
            out, storages = layout.allocate()
            self.fakes.update((s.data_ptr(), (index, StorageRef(s))) for s in storages if s.nbytes())
            return out
        if index not in cache.outputs:
            return self._run(index, func, args, kwargs)

        cache.check_unchanged(index)
        spec, leaves = cache.outputs[index]
        out = []
        for is_tensor, leaf in leaves:
            if is_tensor:
                tensor = self.load(leaf)
                self.ptrs.add(tensor.untyped_storage().data_ptr())
                leaf = tensor.detach()  # a fresh alias each time: autograd sets the re-run's graph on it
            out.append(leaf)
        return _unflatten(out, spec)

    def _run(self, index: int, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        """Run an op that is neither cached nor left out; refuse one that would read a left-out
        output's uninitialised bytes (NOTE [the re-run leaves ops out])."""
        if not self.fakes:
            return func(*args, **kwargs)
        read = _read_storages(args, kwargs)
        left_out = next((op for p in read if (op := self._left_out_at(p)) is not None), None)
        if left_out is None:
            return func(*args, **kwargs)
        if not self.cache.views[index]:  # refused before it runs: garbage indices could crash a kernel
            raise self._refused(left_out, f"op {index} ({func}) reads it")
        out = func(*args, **kwargs)
        if not _only_views(func, read, out):
            raise self._refused(left_out, f"op {index} ({func}), a view in the forward, copies it")
        return out

    def check_saved(self, tensor: torch.Tensor) -> None:
        """The re-run's pack hook: autograd must not save a left-out op's output (the forward's did not)."""
        if self.fakes and (storage := _storage(tensor)) is not None and storage.nbytes() and \
                (op := self._left_out_at(storage.data_ptr())) is not None:
            raise self._refused(op, "autograd saves it for the backward")

    def _left_out_at(self, ptr: int) -> int | None:
        """The left-out op whose uninitialised storage lies at ``ptr`` (alive: the address is not reused)."""
        entry = self.fakes.get(ptr)
        return entry[0] if entry is not None and not entry[1].expired() else None

    def _refused(self, op: int, what: str) -> Exception:
        cache = self.cache
        readers = [r for r, reads in enumerate(cache.reads) if op in reads and r in cache.cached]
        return cache.error(
            f"block {cache.block}: its re-run leaves out op {op} ({cache.funcs[op]}), whose output only cached ops "
            f"{readers} read in the forward, and hands on uninitialised bytes for it (NOTE [the re-run leaves ops "
            f"out] in ooc.op_profile), but in the re-run {what}; {_NOT_DETERMINISTIC}. If the forward is "
            f"deterministic, leave op {readers[-1] if readers else op} out of cached_ops (the re-run then computes "
            f"op {op}) and report this to ooc"
        )
