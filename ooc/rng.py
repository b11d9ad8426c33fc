"""The random number generators a block's forward may draw from: their states, taken and put back.

NOTE [generators a re-run replays]
A recomputed block runs its forward again in the backward, and must draw the numbers its first run
drew, or its gradients differ from plain PyTorch's without a word (dropout masks, noise, a random
scale). ``RngState`` holds the process-wide generators: torch's CPU generator, the block device's
CUDA generator, Python's ``random`` and numpy's global generator (``np.random.rand``: ``numpy`` is
imported by then, torch and ``ooc.scheduler`` import it, and ooc imports its ``random`` before a
recomputed forward that could be the first to use it, ``_numpy_random``; a forward that runs ``import
numpy`` itself finds it imported). ``generators_in`` finds generator objects
(``torch.Generator``, ``random.Random``, numpy's ``Generator``, ``RandomState`` and bit generators,
and their subclasses) in a block's arguments and in its modules' attributes (their classes' too, and
the module-level globals holding a generator that their forwards read by name: ``_shared_places``),
and inside them down to ``_DEPTH`` levels: the items of a list, tuple, dict or set (a namedtuple, an
OrderedDict, a list of lists), the attributes of an object (a dataclass, a helper object, a
``SimpleNamespace``: ``module.cfg.gen``), what a function captured (a lambda's closure cells, default
arguments, a ``functools.partial``'s arguments, a bound method's object); the re-run starts each from
the state it had before the forward, and each is put back after it, so the next forward draws where
plain PyTorch's would. Not looked into: modules (a registered one is looked at itself), tensors, HF
configs, loggers, ooc's own objects (``Opaque``), what another live thread was started with (NOTE
[generators other threads were started with]); at most ``_BUDGET`` items per block and call (a module
that holds a trainer), level by level (what is nearer the module first). A generator held anywhere else
(inside a global object or container, a global reached through another Python module's attribute, a
module's hook, deeper than ``_DEPTH`` or past the budget), or one the forward
seeds from the OS (``np.random.default_rng()``, ``random.seed()``, ``torch.seed()``, whose numbers no
state taken before the forward can replay), is not replayed: ``ooc.wrap(..., check_recompute=True)``
catches what it changes, and such blocks are planned as keep or swap. The process-wide states are the whole process's: another
thread that draws from one while a re-run runs (in the backward) draws from the replayed state, as
with torch's generators under ``torch.utils.checkpoint``. Cost: host time at every recomputed forward
and re-run, mostly numpy's ``get_state``/``set_state`` (about 50 us each on a loaded 2-core CPU,
against 1 us for torch's CPU generator; its bit generator's ``state`` alone takes half that, but
misses the Gaussian ``randn`` keeps for its next call). With ``numpy.random`` imported (transformers
imports it), 12 recomputed GPT-2 small blocks on an H200 host measured 73.8 against 70.1 ms a step
with the bit generator's state alone (two runs each, +5%): the cost is real on fast devices. So
numpy's state is taken only for the blocks that draw from it (NOTE [numpy's state where it is drawn]).

NOTE [numpy's state where it is drawn]
A recomputed block's first forward takes numpy's global state before and after it and records whether
the block drew from it (``numpy_draws``). A block that did takes it at every forward and re-run, as
above; one that did not takes none, and each later forward reads the global MT19937's position and
two words of its key where numpy keeps them, and the flag of the Gaussian a ``randn`` keeps for its next
call (``numpy_mark``: 0.3 us, nothing copied; NOTE [finding the kept Gaussian]) before and after: a
block that starts drawing after its first forward is found there (also one whose only draw is the kept
Gaussian, which uses no word of the MT19937), and its recompute raises (that step's re-run would draw
other numbers), and it is recorded as drawing from then on. Its re-runs read the mark too: a block
that reseeds numpy (``np.random.seed(0)`` then draws) can find it, at its first forward, in the state
it leaves it in (a second such block does), so it is recorded as not drawing; its re-run then reseeds a
generator that has moved since (the loss drew from it), and cannot put it back: that raises, and the
block is recorded as drawing. A forward that draws and then puts numpy's state back itself leaves
neither a changed state nor a moved mark: its first forward is watched for that (NOTE [a forward that
puts numpy's state back]). A global generator other than MT19937
(``np.random.set_bit_generator``; the state holds the bit generator object, so a forward that swaps it
is re-run from the one it started from) is taken at every forward of every block. The mark is the process's:
another thread that draws from numpy's global generator during a forward of a block that does not
(a data thread's augmentation), or during a re-run of it, moves it as well, and that step raises too
(at most once per block: it is recorded as drawing); the error says so. Such a thread should hold its own generator.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import functools
import importlib
import itertools
import random
import sys
import tempfile
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ooc.hf import is_config_class


class RngState:
    """The process-wide generators' states: torch's CPU one, ``device``'s CUDA one for a CUDA device,
    Python's ``random`` and numpy's global one (NOTE [generators a re-run replays])."""

    __slots__ = ("cpu", "cuda", "device", "python", "numpy")

    def __init__(self, device: torch.device, *, numpy: bool = True) -> None:
        """``numpy=False``: leave numpy's generator out (NOTE [numpy's state where it is drawn])."""
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.python = random.getstate()
        np_random = _numpy_random(load=True) if numpy else None  # a program without numpy draws nothing from it
        self.numpy = _numpy_state(np_random) if np_random is not None else None

    def restore(self) -> None:
        """Put every generator back in the state it had when this was taken."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        random.setstate(self.python)
        if self.numpy is not None:
            np_random = sys.modules["numpy.random"]
            bit_generator, state = self.numpy
            if np_random.get_bit_generator() is not bit_generator:
                np_random.set_bit_generator(bit_generator)  # swapped since (``np.random.set_bit_generator``)
            np_random.set_state(state)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Run the body from this state; put the current one back after."""
        outer = RngState(self.device, numpy=self.numpy is not None)
        self.restore()
        try:
            yield
        finally:
            outer.restore()

    def numpy_changed(self) -> bool:
        """numpy's global generator differs from the one taken (which must have been): another bit
        generator, or another state."""
        bit_generator, state = _numpy_state(sys.modules["numpy.random"])
        return bit_generator is not self.numpy[0] or not _same_state(state, self.numpy[1])


def _numpy_state(np_random: Any) -> tuple[Any, dict[str, Any]]:
    """numpy's global generator: its bit generator, which ``np.random.set_bit_generator`` swaps (a
    forward that swaps it must be re-run from the one it started from), and its legacy state as a
    dict (any bit generator's; the MT19937 tuple is numpy's alone, and ``get_state()`` warns and
    returns a dict for the others). The legacy state, not the bit generator's alone (half the time):
    it holds the Gaussian that ``np.random.randn`` draws in pairs and keeps for its next call."""
    return np_random.get_bit_generator(), np_random.get_state(legacy=False)


def _same_state(a: Any, b: Any) -> bool:
    """Two states of a numpy generator (dicts of numbers and arrays) are equal."""
    if type(a) is dict:
        return type(b) is dict and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if hasattr(a, "shape"):  # MT19937's key (an array)
        return sys.modules["numpy"].array_equal(a, b)
    return a == b


_NUMPY_DRAWS: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()
"""Recomputed modules -> whether their forward draws from numpy's global generator (NOTE [numpy's
state where it is drawn])."""


def numpy_draws(module: torch.nn.Module, mark: tuple[int, ...] | None) -> bool | None:
    """Whether ``module``'s forward draws from numpy's global generator; None until its first recomputed
    forward said (and where ``mark``, ``numpy_mark()`` now, is None for an imported ``numpy.random``: a
    global generator other than MT19937, which it cannot read: True)."""
    if mark is None and _numpy_random() is not None:
        return True
    return _NUMPY_DRAWS.get(module)


def note_numpy_draws(module: torch.nn.Module, draws: bool) -> None:
    _NUMPY_DRAWS[module] = draws


def numpy_mark() -> tuple[int, int, int, int] | None:
    """(bit generator, first word of the key, last word and position, kept-Gaussian flag) of numpy's global
    MT19937 and its ``RandomState``, read in place; None if ``numpy.random`` was never imported, its
    global generator is not MT19937, or the flag's place is unknown (``_has_gauss_offset``). A draw
    moves the position, or (a multiple of 624 words later) renews the whole key; a Gaussian (``randn``,
    ``normal``) flips the flag, also the one that only takes the kept Gaussian and uses no word."""
    np_random = _numpy_random()
    if np_random is None:
        return None
    generator = np_random.get_bit_generator()
    flag = _FLAG[1] if _FLAG[0] is np_random else _flag_address(np_random)
    if type(generator).__name__ != "MT19937" or flag is None:
        return None
    address = generator.ctypes.state_address  # struct {uint32_t key[624]; int pos;} (numpy's mt19937.h)
    # The last word of the key and the position are adjacent: one read (half the time of two).
    return (id(generator), ctypes.c_uint32.from_address(address).value,
            ctypes.c_uint64.from_address(address + 623 * 4).value, ctypes.c_int.from_address(flag).value)


_FLAG: tuple[Any, int | None, Any] = (None, None, None)
"""(``numpy.random``, the address of its global ``RandomState``'s kept-Gaussian flag, that object):
found once (``_flag_address``), read at every mark."""


def _flag_address(np_random: Any) -> int | None:
    """The address of the kept-Gaussian flag of ``np_random``'s global ``RandomState`` (whose methods
    ``np.random.*`` are), kept in ``_FLAG``; None where it cannot be found."""
    global _FLAG
    legacy = getattr(getattr(np_random, "mtrand", None), "_rand", None)
    offset = _has_gauss_offset(type(legacy))
    _FLAG = (np_random, None if offset is None else id(legacy) + offset, legacy)
    return _FLAG[1]


@functools.cache
def _has_gauss_offset(kind: type) -> int | None:
    """Where a ``kind`` (numpy's ``RandomState``) object keeps its kept-Gaussian flag, from its start;
    None where that cannot be found (then ``numpy_mark`` is None, and numpy's state is taken at every
    forward: slower, never wrong).

    NOTE [finding the kept Gaussian]
    numpy gives no cheap read of it: ``get_state`` copies the whole state (NOTE [numpy's state where it
    is drawn]). ``RandomState`` holds it in a C struct in the object itself (``aug_bitgen_t`` in
    numpy's legacy-distributions.h: ``{bitgen_t *bit_generator; int has_gauss; double gauss;}``), at
    an offset that depends on numpy's build; CPython's ``id`` is the object's address. So a probe
    ``RandomState`` is given two known Gaussians (values no draw gives) and its memory searched for
    the one offset that holds each with its flag next to it; then one real ``randn`` must set the flag
    and the value there as ``get_state`` reports them. Once per process; 0.1 ms."""
    np_random = _numpy_random()
    if sys.implementation.name != "cpython" or np_random is None or kind is not np_random.RandomState:
        return None
    probe = kind(np_random.MT19937(0))
    size = kind.__basicsize__
    state = probe.get_state(legacy=False)
    flags: set[int] | None = None
    for has_gauss, gauss in ((1, 1.2345678901234567e-77), (0, -3.5e101)):
        probe.set_state({**state, "has_gauss": has_gauss, "gauss": gauss})
        here = {flag for at in range(0, size - 7, 4) if ctypes.c_double.from_address(id(probe) + at).value == gauss
                for flag in (at - 4, at - 8) if flag >= 0 and ctypes.c_int.from_address(id(probe) + flag).value == has_gauss}
        flags = here if flags is None else flags & here
    probe.randn()  # draws a pair, keeps the second
    _, _, _, has_gauss, gauss = probe.get_state()
    found = [flag for flag in flags if ctypes.c_int.from_address(id(probe) + flag).value == has_gauss == 1
             and gauss in (ctypes.c_double.from_address(id(probe) + at).value for at in (flag + 4, flag + 8))]
    return found[0] if len(found) == 1 else None


def _numpy_random(*, load: bool = False) -> Any:
    """The ``numpy.random`` module once imported, else None. Another thread's first ``np.random...``
    puts the module in ``sys.modules`` before it has its functions (a recomputed forward then failed,
    "partially initialized module 'numpy.random' has no attribute 'get_bit_generator'"); nothing draws
    from it until its import ends, so a half-imported one counts as not imported.

    ``load``: import it if ``numpy`` is imported (torch and ``ooc.scheduler`` import it) and its ``random``
    is not yet.
    numpy 2 imports ``numpy.random`` at the first ``np.random`` attribute, so a program whose first
    draw was in a recomputed forward had no state taken before that draw, and the re-run drew another
    number (a silently wrong gradient). The import (16 ms, once) seeds the global generator as the
    program's own first ``np.random`` would."""
    if load and "numpy.random" not in sys.modules and sys.modules.get("numpy") is not None:
        importlib.import_module("numpy.random")
    np_random = sys.modules.get("numpy.random")
    spec = getattr(np_random, "__spec__", None)
    return None if np_random is None or getattr(spec, "_initializing", False) else np_random


_OTHER, _GENERATOR, _ITEMS, _FIELDS, _CALLABLE = range(5)
"""What ``generators_in`` does with a value of a type: nothing; take it; look at its items (a list,
tuple, dict or set, their subclasses too: a namedtuple, an OrderedDict); look at its attributes (a
dataclass, a helper object, a ``SimpleNamespace``: its ``__dict__`` and slots); look at what it captured
(a function's closure cells and default arguments, a ``functools.partial``'s function and arguments, a
bound method's object and function, a C method's object)."""

_DEPTH = 4
"""How many levels of containers, objects and callables ``generators_in`` looks through from a module's
attribute or an argument (the attribute itself is the first): ``module.cfg.gen``, ``[[gen]]``, a lambda's
cell, a helper's bound method's helper's generator are all within it."""

_BUDGET = 4096
"""How many items (of containers, objects and callables) ``generators_in`` looks at per call, at most: a
module holding a large object graph (a trainer, a tokenizer, a dict of a model's weights) costs bounded
time at every forward (about 0.3 ms at most; 0.9 ms on a loaded 2-core CPU, measured on a module holding
a logger before loggers were left out)."""


class Opaque:
    """Base of ooc's own objects that a module holds (the runtime's stand-in for a block's ``forward``,
    which holds the runtime): ``generators_in`` never looks into them."""

    __slots__ = ()


_KINDS: dict[type, int] = {}
"""Type -> what ``generators_in`` does with a value of it, found once per type (``_kind``)."""

_PLAIN: set[type] = set()
"""The types of ``_KINDS`` that are ``_OTHER`` (most attributes: tensors, numbers, strings): a set
lookup per attribute at every recomputed forward."""

_SLOTS: dict[type, tuple[Any, ...]] = {}
"""``_FIELDS`` type -> the member descriptors of its slots (``__slots__`` along its MRO; a
``dataclass(slots=True)``), taken from the classes that declare them: read through them, a slot is read
even where a subclass's property shadows its name (which reading it by name would run), and a private
slot (``__x``, stored as ``_Cls__x``) is found."""

_HAS_DICT: set[type] = set()
"""The ``_FIELDS`` types whose objects have a ``__dict__``."""

_MODULE_OWN = frozenset(("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_backward_pre_hooks",
                         "_backward_hooks", "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                         "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks",
                         "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
                         "_compiled_call_impl"))
"""``nn.Module``'s own attributes (its parameters, buffers, submodules, hooks; ``torch.compile``'s
function): never looked into. Submodules are looked at on their own (``modules``)."""

_CALLABLES = (types.FunctionType, types.MethodType, types.BuiltinMethodType, functools.partial)


def _kind(kind: type) -> int:
    """What ``generators_in`` does with a value of type ``kind`` (``_KINDS``), found from the type alone
    (``issubclass``), never ``isinstance``: the latter reads ``__class__`` through HF configs' Python
    ``__getattribute__``. ``random.SystemRandom`` has no state to replay. Not looked into: modules (a
    registered one is looked at on its own; an unregistered one is no part of the block), tensors,
    classes, Python modules, enums, weak references, HF configs (40 fields, never a generator), the
    ``logging`` module's objects (a logger's manager holds every logger of the process)."""
    found = _KINDS.get(kind)
    if found is not None:
        return found
    np_random = _numpy_random()
    generators = (torch.Generator, random.Random)
    if np_random is not None:
        generators += (np_random.Generator, np_random.RandomState, np_random.BitGenerator, np_random.SeedSequence)
    if issubclass(kind, generators) and not issubclass(kind, random.SystemRandom):
        found = _GENERATOR
    elif issubclass(kind, (list, tuple, dict, set, frozenset)):
        found = _ITEMS
    elif issubclass(kind, _CALLABLES):
        found = _CALLABLE
    elif (issubclass(kind, (torch.nn.Module, torch.Tensor, type, types.ModuleType, enum.Enum, weakref.ref,
                            BaseException, Opaque)) or is_config_class(kind)
          or (getattr(kind, "__module__", None) or "").partition(".")[0] == "logging"):
        found = _OTHER
    else:
        slots = tuple(member for k in kind.__mro__ for member in _slot_members(k))
        has_dict = kind.__dictoffset__ != 0
        found = _FIELDS if slots or has_dict else _OTHER
        if slots:
            _SLOTS[kind] = slots
        if has_dict:
            _HAS_DICT.add(kind)
    if np_random is not None or not kind.__module__.startswith("numpy"):  # numpy's types are known once imported
        if len(_KINDS) > 4096:  # classes made at run time: the cache stays bounded
            _KINDS.clear()
            _PLAIN.clear()
            _SLOTS.clear()
            _HAS_DICT.clear()
            if found != _OTHER:  # its slots and dict, just cleared
                return _kind(kind)
        _KINDS[kind] = found
        if found == _OTHER:
            _PLAIN.add(kind)
    return found


def _slot_members(kind: type) -> tuple[Any, ...]:
    """The member descriptors of the slots ``kind`` itself declares (``__slots__``: a string or an
    iterable of names; a private name is stored mangled, ``__x`` as ``_Kind__x``)."""
    slots = kind.__dict__.get("__slots__", ())
    members = []
    for name in (slots,) if isinstance(slots, str) else slots:
        if name.startswith("__") and not name.endswith("__"):
            name = f"_{kind.__name__.lstrip('_')}{name}"
        member = kind.__dict__.get(name)
        if type(member) is types.MemberDescriptorType:  # not ``__dict__``/``__weakref__``
            members.append(member)
    return tuple(members)


_ITERATE = ((dict, dict.values), (list, list.__iter__), (tuple, tuple.__iter__), (set, set.__iter__),
            (frozenset, frozenset.__iter__))
"""Per container base: how ``_contents`` reads its items from its storage (a subclass's own ``values``
or ``__iter__``, a lazy mapping's imports, is never called)."""


_COPY_TRIES = 16
"""Tries of ``_first_items`` at a container other threads keep changing, before it is left out."""


def _first_items(items: Callable[[Any], Iterator[Any]], container: Any, limit: int) -> list[Any]:
    """The first ``limit`` of ``items(container)``, in C (``list(islice(...))``: no Python code runs
    while the items are read), from a container another thread may be writing.

    NOTE [containers other threads write]
    Iterated in Python, a dict another thread writes (a shared metrics or cache dict a helper holds)
    raised "dictionary changed size during iteration" out of a recomputed forward, now and then. Read
    in one C call the items cannot change under the read, but the GIL may still pass to the writer
    between the iterator's creation (in ``islice``) and its first item (in ``list``): once in about
    two hundred searches under a writer that never stops (tests/ooc/test_recompute_rng_patterns.py).
    So a read that finds its container changed is taken again, and a container changed under every
    one of ``_COPY_TRIES`` reads is left out of the search (a generator in it is not replayed:
    ``check_recompute=True`` catches that, as for the generators the search does not reach)."""
    for _ in range(_COPY_TRIES):
        try:
            return list(itertools.islice(items(container), limit))
        except RuntimeError:  # "changed size during iteration": read it again
            continue
    return []


def _contents(value: Any, kind: int, limit: int) -> list[Any] | tuple[Any, ...]:
    """What ``value`` of kind ``kind`` holds (of a container or an object, the first ``limit`` items): a
    container's items, an object's attributes (read from its ``__dict__`` and slots, not through a Python
    ``__getattribute__``: HF configs, proxies), what a callable captured. A container's and a
    ``__dict__``'s items are taken by ``_first_items``."""
    if kind == _ITEMS:
        for base, items in _ITERATE:
            if issubclass(type(value), base):
                return _first_items(items, value, limit)
    if kind == _CALLABLE:
        if issubclass(type(value), functools.partial):
            return (value.func, *value.args, *value.keywords.values())
        if issubclass(type(value), types.MethodType):
            return (value.__self__, value.__func__)
        if issubclass(type(value), types.BuiltinMethodType):
            return (value.__self__,)  # ``rng.random`` of a ``random.Random``; a function's Python module
        return (*_cell_contents(value.__closure__), *(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values())
    if type(value) not in _KINDS:  # the cache was cleared (``_kind``) since its kind was found: its slots and dict too
        _kind(type(value))
    items: list[Any] = []
    if type(value) in _HAS_DICT:
        items = _first_items(dict.values, object.__getattribute__(value, "__dict__"), limit)
    for member in _SLOTS.get(type(value), ()):
        try:
            items.append(member.__get__(value))
        except AttributeError:  # a slot not set
            pass
    return items


def _cell_contents(cells: tuple[Any, ...] | None) -> list[Any]:
    """The values in a function's closure cells (an empty cell, a name not bound yet, is left out)."""
    values = []
    for cell in cells or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:
            pass
    return values


def _other_threads_own() -> set[int]:
    """The ids of what the other live threads were started with: each ``threading.Thread`` object, its
    target and arguments, and what a target or argument that is a function captured (a bound method's
    object, a ``functools.partial``'s arguments, closure cells, default arguments).

    NOTE [generators other threads were started with]
    The search reached a generator another thread draws from through what a block holds: a bound method
    of a prefetcher thread (``self.request = prefetcher.request``, the prefetcher holding its own
    generator), the prefetcher itself, or an object passed to a thread's target. A re-run then set that
    generator back to its state before the forward and, after the re-run, to its state before the
    re-run: the thread drew the numbers it had drawn already, again (its augmentations repeated,
    silently), and lost the draws it made during the re-run. So the search does not look into what
    another live thread was started with (``_other_threads_own``), nor takes a generator among it: those
    belong to that thread, whose draws ooc leaves alone. A block whose forward draws from such a
    generator itself is not replayed either (its re-run draws other numbers: ``check_recompute=True``
    catches that); give the block its own generator, or plan it as keep or swap. A generator another
    thread reaches some other way (a task submitted to a thread pool, a global) is not seen as
    another thread's, and is replayed as before; the process-wide generators are the whole process's
    (NOTE [generators a re-run replays]). The current thread (the one running the forward, which may
    be a thread the training loop was started in) is never another's."""
    me = threading.current_thread()
    own: set[int] = set()
    for thread in threading.enumerate():
        if thread is me:
            continue
        # Thread's own fields (CPython's threading.py; deleted once its run() returns; a subclass may
        # use the names for something else).
        args, kwargs = getattr(thread, "_args", ()), getattr(thread, "_kwargs", None)
        started_with = [thread, getattr(thread, "_target", None), *(args if isinstance(args, (tuple, list)) else ()),
                        *(kwargs.values() if isinstance(kwargs, dict) else ())]
        for value in started_with:
            own.add(id(value))
            if _kind(type(value)) == _CALLABLE:
                own.update(id(captured) for captured in _contents(value, _CALLABLE, _BUDGET))
    return own


class _Search:
    """One ``generators_in`` call: the generators found, the ids of what was looked into (each once),
    how many more items may be looked at (``_BUDGET``), and what to look into next. It goes level by
    level (breadth first), over every argument and attribute together: where a large object spends the
    budget, it spends it after everything nearer the module (a generator one level down in the next
    attribute), not before. What other live threads were started with is neither looked into nor taken
    (NOTE [generators other threads were started with]), found at the first value that is not plain."""

    __slots__ = ("found", "seen", "left", "level", "others")

    def __init__(self) -> None:
        self.found: list[Any] = []
        self.seen: set[int] = set()
        self.left = _BUDGET
        self.level: list[tuple[Any, int]] = []
        """(value, kind) to look into at the next level."""
        self.others: set[int] | None = None
        """``_other_threads_own()``, taken when a value first needs it (most blocks hold none that does)."""

    def _others(self) -> set[int]:
        if self.others is None:
            self.others = _other_threads_own()
        return self.others

    def value(self, value: Any) -> None:
        """Note ``value`` if it is a generator, else look into it at the first level (``run``)."""
        kind = _kind(type(value))
        if kind == _OTHER or id(value) in self._others():
            return
        if kind == _GENERATOR:
            self.found.append(value)
        else:
            self.level.append((value, kind))

    def run(self) -> None:
        """Note the generators that the values of the first level hold, down to ``_DEPTH`` levels."""
        plain = _PLAIN
        for depth in range(_DEPTH, 0, -1):
            level, self.level = self.level, []
            for value, kind in level:
                if id(value) in self.seen:
                    continue
                self.seen.add(id(value))
                for item in _contents(value, kind, self.left):
                    self.left -= 1
                    if self.left < 0:
                        return
                    if type(item) in plain:
                        continue
                    item_kind = _kind(type(item))
                    if item_kind == _OTHER or id(item) in self._others():
                        continue
                    if item_kind == _GENERATOR:
                        self.found.append(item)
                    elif depth > 1:
                        self.level.append((item, item_kind))


def generators_in(leaves: list[Any], modules: Iterable[torch.nn.Module]) -> list[Any]:
    """The generator objects among ``leaves`` (a call's flattened arguments) and the attributes of
    ``modules`` (and the class attributes and module-level globals their forwards share:
    ``_shared_places``), each once: the attribute or argument itself, or anything it holds down to
    ``_DEPTH`` levels (``_contents``: an item of a list, tuple, dict or set, an attribute of a dataclass
    or a helper object, a closure cell, default argument or bound object of a function, a
    ``functools.partial``'s arguments). A generator of a subclass counts (a ``random.Random`` subclass)."""
    plain = _PLAIN
    search = _Search()
    for g in leaves:
        if type(g) not in plain:
            search.value(g)
    own = _MODULE_OWN
    for m in modules:
        for name, value in vars(m).items():
            if type(value) not in plain and name not in own:
                search.value(value)
        for holder, name in _shared_places(type(m)):
            if type(value := holder.get(name)) not in plain:
                search.value(value)
    search.run()
    return list({id(g): g for g in search.found}.values())  # by identity: a class with __eq__ alone is unhashable


_SHARED: dict[type, tuple[tuple[Any, str], ...]] = {}
"""Module class -> the places outside its objects that ``generators_in`` looks at (``_shared_places``)."""

_NOT_DATA = (types.FunctionType, staticmethod, classmethod, property, type, types.ModuleType)


def _shared_places(kind: type) -> tuple[tuple[Any, str], ...]:
    """(mapping, name) per place outside a module object of class ``kind`` where its forward may find a
    generator that other objects share: the class attributes of ``kind`` and its bases
    (``_class_attributes``), and the module-level globals its forward reads (``_global_generators``).
    Found once per class (bounded cache); each forward reads the places again."""
    found = _SHARED.get(kind)
    if found is None:
        found = _class_attributes(kind) + _global_generators(kind)
        if len(_SHARED) > 4096:  # classes made at run time: the cache stays bounded
            _SHARED.clear()
        _SHARED[kind] = found
    return found


def _class_attributes(kind: type) -> tuple[tuple[Any, str], ...]:
    """(the class's ``__dict__``, name) per class attribute of a module class ``kind`` or its bases that may
    hold a generator (``class Block(nn.Module): gen = torch.Generator()``, shared by its objects): not a
    method, property or class, nor a dunder, nor a class of torch's own (``nn.Linear``). An attribute a
    class gets later, or one that held no generator, container or object then (a ``None`` set to a
    generator later), is not looked at."""
    names: dict[str, Any] = {}  # name -> the class whose attribute the module class reads (first in its MRO)
    for k in kind.__mro__:
        for name in k.__dict__:
            names.setdefault(name, k)
    return tuple((k.__dict__, name) for name, k in names.items()
                 if not _is_torchs(k.__module__ or "") and k is not object
                 and not (name.startswith("__") and name.endswith("__"))
                 and not isinstance(value := k.__dict__[name], _NOT_DATA) and _kind(type(value)) != _OTHER)


_FOLLOWED = 64
"""How many functions ``_global_generators`` reads the code of, at most, per class."""


def _global_generators(kind: type) -> tuple[tuple[Any, str], ...]:
    """(a module's globals, name) per module-level global that holds a generator (``_GEN =
    torch.Generator().manual_seed(0)``, ``rng = np.random.default_rng(0)``) and that the ``forward`` of
    module class ``kind`` (or of a base: ``super().forward``; under a decorator that sets ``__wrapped__``)
    reads, or a function it calls by name: a method of the class or its bases (``self.noise``) or a
    module-level function (``add_noise(x)``), and so on (``_FOLLOWED`` functions at most), read from
    their code (``co_names``). Not torch's own functions. Not found: a global that held no generator
    then (``_GEN = None``, made at the first call), a generator inside a global object or container, a
    function reached otherwise (through an attribute of an imported module: ``helpers.add_noise(x)``)."""
    found: dict[tuple[int, str], tuple[Any, str]] = {}
    classes = [k for k in kind.__mro__ if not _is_torchs(k.__module__ or "")]
    todo = [_function(k.__dict__.get("forward")) for k in classes]  # ``super().forward(x)`` too
    seen: set[Any] = set()
    while todo and len(seen) < _FOLLOWED:
        function = todo.pop()
        if function is None or function.__code__ in seen:
            continue
        seen.add(function.__code__)
        todo.append(_function(getattr(function, "__wrapped__", None)))  # under a decorator (torch.autocast's)
        if _is_torchs(function.__module__ or ""):
            continue
        names = function.__globals__
        for name in _code_names(function.__code__):
            todo += [_function(k.__dict__.get(name)) for k in classes]  # the class's or a base's (``super()``)
            value = names.get(name)
            if type(value) is types.FunctionType:
                todo.append(value)
            elif value is not None and _kind(type(value)) == _GENERATOR:
                found[(id(names), name)] = (names, name)
    return tuple(found.values())


def _is_torchs(module: str) -> bool:
    """``module`` (a Python module's name) is torch or one of its submodules."""
    return module == "torch" or module.startswith("torch.")


def _function(value: Any) -> types.FunctionType | None:
    """The Python function of a class attribute (a method, static or class method), else None."""
    value = getattr(value, "__func__", value)
    return value if type(value) is types.FunctionType else None


def _code_names(code: types.CodeType) -> list[str]:
    """The global and attribute names that ``code`` and the code nested in it (a lambda, a comprehension,
    an inner function) read."""
    names = list(code.co_names)
    for const in code.co_consts:
        if type(const) is types.CodeType:
            names += _code_names(const)
    return names


_WATCHED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""Recomputed modules whose first forward ``EntropyWatch`` looked at."""


class EntropyWatch:
    """Looks for a generator seeded from the OS during ``module``'s first recomputed forward; ``found``
    says which, after the ``with`` block (None: none).

    NOTE [generators seeded from the OS]
    A forward that seeds a generator from the OS (``np.random.default_rng()``, ``np.random.seed()``,
    ``random.seed()``, ``random.Random()``, ``torch.seed()``, ``torch.Generator().seed()``: no seed given)
    draws numbers that no state taken before it can replay: its re-run seeds another generator, draws
    other numbers, and the gradients differ from those of the forward, silently. ``EntropyWatch`` looks
    for that in the first recomputed forward of each block (a profile function, ``sys.setprofile``, for
    that forward alone: a few hundred ns per Python or C call, once per block), where the OS is asked:
    ``random.Random.seed`` called without a seed, ``random.SystemRandom`` (numpy's ``SeedSequence()``
    takes its entropy there), a ``torch.Generator``'s ``seed()``. The forward is then refused (the
    recompute raises), with what to do. Not looked for: another source that changes between the runs
    (``time.time()`` as a seed, a generator the forward reaches that ``generators_in`` does not find);
    ``check_recompute=True`` catches those. Nor where a profiler or debugger already set a profile
    function (``sys.getprofile()``): it is left alone.
    """

    __slots__ = ("module", "found", "base", "look")

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.found: str | None = None
        self.base: Any = None
        """The frame that entered the watch (its caller's), while watching."""
        self.look: Any = None
        """The profile function set, while watching."""

    def __enter__(self) -> EntropyWatch:
        if self.module not in _WATCHED and sys.getprofile() is None:
            _WATCHED.add(self.module)
            self.base = sys._getframe(1)
            self.look = self._look
            sys.setprofile(self.look)
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if self.base is not None:
            if sys.getprofile() is self.look:  # else the forward started a profiler of its own: left on
                sys.setprofile(None)
            self.base = self.look = None  # a frame holds its locals
            if kind is not None:  # a forward that failed is looked at again at the next one
                _WATCHED.discard(self.module)

    def _look(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code is _SEED and frame.f_locals.get("a") is None:
                self._found(frame, "random.seed() or random.Random() without a seed")
            elif code in _SYSTEM_RANDOM:
                self._found(frame, "the OS's random numbers (random.SystemRandom, secrets; numpy takes them for "
                                   "np.random.default_rng(), np.random.seed() or a bit generator made without a seed)")
        elif event == "c_call" and type(getattr(arg, "__self__", None)) is torch.Generator and arg.__name__ == "seed":
            self._found(frame, "torch.seed() or torch.Generator.seed()")

    def _found(self, frame: Any, what: str) -> None:
        """Note ``what``, unless a frame between ``frame`` and the watch's is a module's own code (an
        import: sympy makes a ``random.Random()`` when torch first imports it in a forward) or the
        ``tempfile`` module's (its file names): neither reaches the block's outputs."""
        while frame is not None and frame is not self.base:
            if frame.f_code.co_name == "<module>" or frame.f_code.co_filename == _TEMPFILE:
                return
            frame = frame.f_back
        self.found = what


_SEED = random.Random.seed.__code__
_SYSTEM_RANDOM = frozenset((random.SystemRandom.getrandbits.__code__, random.SystemRandom.random.__code__,
                            random.SystemRandom.randbytes.__code__))
_TEMPFILE = tempfile.__file__


class NumpyReadWatch:
    """Notes whether a recomputed block's first forward reads or sets numpy's global generator's state
    (``read``, after the ``with`` block), where ``watch`` (the forward whose numpy draws are recorded).

    NOTE [a forward that puts numpy's state back]
    A forward that draws from numpy's global generator and puts its state back itself (``st =
    np.random.get_state(); x = np.random.rand(); np.random.set_state(st)``; a ``temp_seed`` helper; the
    same through ``np.random.get_bit_generator().state``) leaves the state as it found it, so its first
    forward looked like one that does not draw (NOTE [numpy's state where it is drawn]): its later
    forwards took no numpy state, and its re-runs drew from wherever the generator was then (the loss or
    the next batch's augmentation had drawn from it since): other numbers, other gradients, silently.
    numpy's functions are Cython's, which a profile function does not see called (``EntropyWatch``), so
    during that first forward ``numpy.random``'s ``get_state``, ``set_state`` and ``get_bit_generator``
    (the same objects in ``numpy.random.mtrand``) are replaced by wrappers that note the call, and put
    back after it; a block that called one is recorded as drawing: its numpy state is taken at every
    forward and re-run (50 us each), and its re-runs draw what its forwards drew. Not seen: a call through
    a reference taken before the forward (``from numpy.random import get_state`` at import,
    ``np.random.mtrand._rand``), a block that starts doing this after its first forward
    (``check_recompute=True`` catches those). While the wrappers are in, another thread's call, or ooc's
    own (a backward inside the forward re-runs a block), marks the block as drawing too: time, never a
    wrong gradient."""

    __slots__ = ("watch", "read")

    def __init__(self, watch: bool) -> None:
        self.watch = watch
        self.read = False

    def __enter__(self) -> NumpyReadWatch:
        if self.watch:
            with _READ_LOCK:
                if not _READ_WATCHES:
                    _wrap_numpy_reads()
                _READ_WATCHES.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.watch:
            with _READ_LOCK:
                _READ_WATCHES.remove(self)
                if not _READ_WATCHES:
                    _unwrap_numpy_reads()


_READ_LOCK = threading.Lock()
_READ_WATCHES: list[NumpyReadWatch] = []
"""The ``NumpyReadWatch`` objects in force (blocks' first forwards in several threads): numpy's functions are
wrapped once, while there is any, and a call is noted in each."""

_NUMPY_READS = ("get_state", "set_state", "get_bit_generator")

_WRAPPED: list[tuple[Any, str, Any, Any]] = []
"""(module, name, original, wrapper) per numpy function wrapped while ``_READ_WATCHES`` is not empty."""


def _wrap_numpy_reads() -> None:
    """Wrap ``numpy.random``'s functions that read or set its global state (NOTE [a forward that puts
    numpy's state back]) in ``numpy.random`` and ``numpy.random.mtrand``; nothing if it is not imported."""
    np_random = _numpy_random()
    if np_random is None:
        return
    for module in (np_random, getattr(np_random, "mtrand", None)):
        for name in _NUMPY_READS:
            original = getattr(module, name, None)
            if original is not None:
                wrapper = _noting(original)
                setattr(module, name, wrapper)
                _WRAPPED.append((module, name, original, wrapper))


def _unwrap_numpy_reads() -> None:
    for module, name, original, wrapper in reversed(_WRAPPED):
        if getattr(module, name, None) is wrapper:  # else the forward replaced it (a test's mock): left alone
            setattr(module, name, original)
    _WRAPPED.clear()


def _noting(original: Any) -> Any:
    """``original``, noting in each ``NumpyReadWatch`` in force that it was called."""
    @functools.wraps(original)
    def noted(*args: Any, **kwargs: Any) -> Any:
        for watch in list(_READ_WATCHES):
            watch.read = True
        return original(*args, **kwargs)

    return noted


class GeneratorStates:
    """The states of generator objects (``generators_in`` finds them), taken now, to put back.

    NOTE [spawned children]
    numpy's ``Generator.spawn``, ``BitGenerator.spawn`` and ``SeedSequence.spawn`` count the children
    they made in the seed sequence (``n_children_spawned``), which numpy cannot set back (read-only)
    and a generator's state does not hold: a re-run would spawn the next children, and draw other
    numbers. So the counts are taken with the states, and a forward that changed one is refused
    (``spawned``); a ``SeedSequence`` attribute is found for that alone (it draws nothing itself)."""

    __slots__ = ("states", "spawned_before")

    def __init__(self, generators: Iterable[Any]) -> None:
        self.states = [(g, _state_of(g)) for g in generators]
        self.spawned_before = [_spawned(g) for g, _ in self.states]

    def now(self) -> GeneratorStates:
        """The same generators' states as they are now."""
        return GeneratorStates(g for g, _ in self.states)

    def restore(self) -> None:
        """Put every generator back in the state it had when this was taken."""
        for g, state in self.states:
            _set_state(g, state)

    def spawned(self) -> Any:
        """A generator (or seed sequence) that spawned children since this was taken; None if none."""
        for (g, _), before in zip(self.states, self.spawned_before):
            if before is not None and _spawned(g) != before:
                return g
        return None


def _spawned(generator: Any) -> int | None:
    """How many children the seed sequence of a numpy generator (or the seed sequence itself) spawned;
    None for the others (NOTE [spawned children])."""
    if isinstance(generator, (torch.Generator, random.Random)):
        return None
    seeds = getattr(generator, "bit_generator", generator)  # a Generator's bit generator
    seeds = getattr(seeds, "seed_seq", seeds)  # a bit generator's seed sequence
    return getattr(seeds, "n_children_spawned", None)  # RandomState, a legacy-seeded MT19937: none


def _state_of(generator: Any) -> Any:
    """The state of one generator ``generators_in`` found."""
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    if isinstance(generator, random.Random):
        return generator.getstate()
    np_random = sys.modules["numpy.random"]
    if isinstance(generator, np_random.Generator):
        return generator.bit_generator.state
    if isinstance(generator, np_random.RandomState):
        # As a dict, with the Gaussian it keeps: the legacy tuple is MT19937's alone (others warned).
        return generator.get_state(legacy=False)
    if isinstance(generator, np_random.SeedSequence):
        return None  # no state but its children's count (NOTE [spawned children])
    return generator.state  # a bit generator


def _set_state(generator: Any, state: Any) -> None:
    """Put ``state`` (from ``_state_of``) back into ``generator``."""
    if isinstance(generator, torch.Generator):
        generator.set_state(state)
    elif isinstance(generator, random.Random):
        generator.setstate(state)
    else:
        np_random = sys.modules["numpy.random"]
        if isinstance(generator, np_random.Generator):
            generator.bit_generator.state = state
        elif isinstance(generator, np_random.RandomState):
            generator.set_state(state)
        elif not isinstance(generator, np_random.SeedSequence):
            generator.state = state
