"""RECOMPUTE of blocks that draw random numbers the way users write it, beyond the attribute and
container one level down that ``tests/ooc/test_recompute_host_rng.py`` covers: a forward that draws
from numpy's global generator and puts its state back itself, generators held deeper in a module (an
attribute of a helper object, a list inside a list, a closure or ``functools.partial`` on the module),
and other patterns (a generator passed as a keyword argument, ``torch.bernoulli``, dropout whose
training flag is toggled, a forward that reseeds torch, ``torch.random.fork_rng``). Each is compared
with plain PyTorch bit for bit over two steps, with a draw from numpy's global generator (the loss's)
between each forward and its backward. What ooc cannot replay is refused or caught, with what to do.
NOTE [generators a re-run replays] in ``ooc.rng``."""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import random
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ooc
import ooc.rng
from ooc.backend.cpu import ChaosConfig, CpuBackend
from ooc.recompute import RecomputeError
from tests.ooc.test_recompute_adversarial import CODES, LETTERS, Chain, inputs
from tests.ooc.test_recompute_host_rng import assert_first_step_after_a_wrap_with_a_sample_equals_plain


class _Block(nn.Module):
    """``tanh(fc(x)) * noise(shape)``: (5, 6) -> (5, 6), the noise drawn by ``noise``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def noise(self, shape: torch.Size) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.tanh(h) * self.noise(h.shape)


def _steps(model: nn.Module, steps: int = 2) -> list[torch.Tensor]:
    """``steps`` steps from seeded generators; between each forward and its backward the loss draws from
    numpy's global and torch's generators (a re-run that draws from where they are then draws other
    numbers); then a draw from each, which must be where plain PyTorch leaves them."""
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    tensors = []
    for _ in range(steps):
        x = inputs()
        out = model(x)
        loss = out.pow(2).sum() * float(1 + np.random.rand()) + torch.rand(()) * 0
        loss.backward()
        tensors += [out, x.grad]
    return tensors + [torch.tensor(random.random()), torch.from_numpy(np.random.rand(1)), torch.rand(1)]


def _assert_same_as_plain(build: Callable[[], nn.Module], code: str,
                          step: Callable[[nn.Module], list[torch.Tensor]] = _steps) -> None:
    """``step`` on a plain model and on a wrapped one built alike (not a deep copy: a closure's
    generator would be shared by both): outputs, gradients and the generators after, bit for bit."""
    results = []
    for wrap in (False, True):
        torch.manual_seed(0)
        np.random.seed(0)
        model = build()
        if wrap:
            ooc.wrap(model, ooc.Plan(blocks=tuple(LETTERS[c] for c in code), min_swap_bytes=0),
                     blocks=list(model.blocks), backend="cpu")
        try:
            results.append(step(model) + [p.grad for p in model.parameters()])
        finally:
            if wrap:
                ooc.unwrap(model)
    plain, wrapped = results
    assert len(plain) == len(wrapped)
    for a, b in zip(plain, wrapped):
        assert torch.equal(a, b)


# -- numpy's global generator, its state put back by the forward ---------------------------------------


class PeeksAtNumpy(_Block):
    """Draws from numpy's global generator and puts its state back: no draw is seen from outside."""

    def noise(self, shape: torch.Size) -> torch.Tensor:
        state = np.random.get_state()
        noise = np.random.rand(*shape).astype(np.float32)
        np.random.set_state(state)
        return torch.from_numpy(noise)


class PeeksAtNumpysBitGenerator(_Block):
    """The same through the global bit generator's ``state``."""

    def noise(self, shape: torch.Size) -> torch.Tensor:
        bits = np.random.get_bit_generator()
        state = bits.state
        noise = np.random.rand(*shape).astype(np.float32)
        bits.state = state
        return torch.from_numpy(noise)


class SeedsNumpyTemporarily(_Block):
    """A ``temp_seed`` helper as users write it: seed, draw, put the previous state back."""

    def noise(self, shape: torch.Size) -> torch.Tensor:
        state = np.random.get_state()
        np.random.seed(7)
        try:
            return torch.from_numpy(np.random.rand(*shape).astype(np.float32))
        finally:
            np.random.set_state(state)


@pytest.mark.parametrize("block", [PeeksAtNumpy, PeeksAtNumpysBitGenerator, SeedsNumpyTemporarily],
                         ids=lambda b: b.__name__)
@pytest.mark.parametrize("code", CODES)
def test_a_forward_that_puts_numpys_state_back_itself_is_replayed(code: str, block: type[_Block]) -> None:
    """The block looked like one that does not draw (numpy's state after its forward is the one before),
    so its later forwards took no numpy state and its re-run drew from wherever the generator was then
    (here: after the loss drew), silently other gradients (``check_recompute=True`` alone caught it).
    Its first forward now sees it read numpy's global state, and it is replayed as a block that draws."""
    _assert_same_as_plain(lambda: Chain([block() for _ in range(3)]), code)


def test_numpys_functions_are_themselves_again_after_a_first_forward() -> None:
    """The first forward's watch (NOTE [a forward that puts numpy's state back] in ``ooc.rng``) wraps
    numpy's state functions for that forward alone, also one that fails."""
    names = ("get_state", "set_state", "get_bit_generator")
    before = [getattr(module, name) for module in (np.random, np.random.mtrand) for name in names]

    class Fails(PeeksAtNumpy):
        def noise(self, shape: torch.Size) -> torch.Tensor:
            assert np.random.get_state is not before[0]  # wrapped during the forward
            raise ValueError("a bug in the forward")

    model = Chain([PeeksAtNumpy(), Fails()])
    ooc.wrap(model, ooc.Plan.of(["recompute", "recompute"], min_swap_bytes=0), blocks=list(model.blocks),
             backend="cpu")
    try:
        with pytest.raises(ValueError, match="a bug in the forward"):
            model(inputs())
    finally:
        ooc.unwrap(model)
    after = [getattr(module, name) for module in (np.random, np.random.mtrand) for name in names]
    assert all(a is b for a, b in zip(after, before, strict=True))


# -- generators deeper in a module ---------------------------------------------------------------------


class _Helper:
    """A helper object holding a generator (``module.helper.generator``)."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def draw(self, shape: torch.Size) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator)


class _SlottedHelper:
    __slots__ = ("generator",)

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)


@dataclasses.dataclass
class _Inner:
    generator: torch.Generator


@dataclasses.dataclass
class _Outer:
    inner: _Inner


class OnAHelper(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.helper = _Helper(5)

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return self.helper.draw(shape)


class OnASlottedHelper(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.helper = _SlottedHelper(5)

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.rand(shape, generator=self.helper.generator)


class OnANamespace(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = types.SimpleNamespace(scale=0.5, gen=torch.Generator().manual_seed(5))

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return self.cfg.scale * torch.rand(shape, generator=self.cfg.gen)


class InADataclassInADataclass(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = _Outer(_Inner(torch.Generator().manual_seed(5)))

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.rand(shape, generator=self.cfg.inner.generator)


class InAListInAList(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.generators = [[torch.Generator().manual_seed(5)]]

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.rand(shape, generator=self.generators[0][0])


class InADictInADict(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.generators = {"noise": {"mask": torch.Generator().manual_seed(5)}}

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.rand(shape, generator=self.generators["noise"]["mask"])


class OnAHelperInAList(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.helpers = [_Helper(5)]

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return self.helpers[0].draw(shape)


class InALambda(_Block):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(5)
        self.draw = lambda shape: torch.rand(shape, generator=generator)

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return self.draw(shape)


class InAPartial(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.draw = functools.partial(torch.rand, generator=torch.Generator().manual_seed(5))

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return self.draw(shape)


class InABoundMethod(_Block):
    """Holds a helper's bound method, not the helper."""

    def __init__(self) -> None:
        super().__init__()
        self.draw = _Helper(5).draw

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return self.draw(shape)


class InADefaultArgument(_Block):
    def __init__(self) -> None:
        super().__init__()

        def draw(shape: torch.Size, generator: torch.Generator = torch.Generator().manual_seed(5)) -> torch.Tensor:
            return torch.rand(shape, generator=generator)

        self.draw = draw

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return self.draw(shape)


class NumpyOnAHelper(_Block):
    """A numpy ``Generator`` on a helper object."""

    def __init__(self) -> None:
        super().__init__()
        self.helper = types.SimpleNamespace(rng=np.random.default_rng(5))

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.from_numpy(self.helper.rng.random(shape, dtype=np.float32))


DEEP = [OnAHelper, OnASlottedHelper, OnANamespace, InADataclassInADataclass, InAListInAList, InADictInADict,
        OnAHelperInAList, InALambda, InAPartial, InABoundMethod, InADefaultArgument, NumpyOnAHelper]


@pytest.mark.parametrize("block", DEEP, ids=lambda b: b.__name__)
@pytest.mark.parametrize("code", CODES)
def test_a_generator_deeper_in_a_module_is_replayed(code: str, block: type[_Block]) -> None:
    """``generators_in`` looked one level into an attribute (a list, tuple, dict or dataclass): a generator
    on a helper object, in a list inside a list, or captured by a lambda or ``functools.partial`` on the
    module was not replayed; the re-run drew the next numbers and the gradients differed, silently."""
    _assert_same_as_plain(lambda: Chain([block() for _ in range(3)]), code)


class OnTheClass(_Block):
    """A generator shared by the class's objects (a class attribute)."""

    generator = torch.Generator()

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator)


class OnABaseClassInADict(OnTheClass):
    generators = {"mask": OnTheClass.generator}

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.rand(shape, generator=self.generators["mask"])


@pytest.mark.parametrize("block", [OnTheClass, OnABaseClassInADict], ids=lambda b: b.__name__)
@pytest.mark.parametrize("code", CODES)
def test_a_generator_on_the_modules_class_is_replayed(code: str, block: type[_Block]) -> None:
    """A class attribute is no attribute of the module object: it was not replayed (the re-run drew the
    next numbers, and the gradients differed, silently)."""
    def build() -> Chain:
        OnTheClass.generator.manual_seed(5)  # the plain and the wrapped model share it
        return Chain([block() for _ in range(3)])

    _assert_same_as_plain(build, code)


@pytest.mark.parametrize("block", [OnAHelper, InADictInADict], ids=lambda b: b.__name__)
def test_wrap_with_a_sample_leaves_a_deeper_generator_where_it_was(block: type[_Block]) -> None:
    """``wrap(budget=..., sample=...)`` profiles the model on the sample and puts the generators it finds
    back; a deeper one was left advanced, so the first training forward drew other numbers than the plain
    model's."""
    assert_first_step_after_a_wrap_with_a_sample_equals_plain(block)


def test_the_search_does_not_look_into_the_runtime_a_wrapped_block_holds() -> None:
    """A wrapped block's ``forward`` is the runtime's stand-in, which holds the runtime: looking into it
    walked ooc's own objects at every recomputed forward, and found the chaos backend's
    ``random.Random``, whose state each re-run then put back."""
    model = Chain([OnAHelper() for _ in range(2)])
    backend = CpuBackend(chaos=ChaosConfig())
    ooc.wrap(model, ooc.Plan.of(["recompute", "recompute"], min_swap_bytes=0), blocks=list(model.blocks),
             backend=backend)
    try:
        found = ooc.rng.generators_in([], model.blocks[0].modules())
    finally:
        ooc.unwrap(model)
        backend.close()
    assert [id(g) for g in found] == [id(model.blocks[0].helper.generator)]


_GLOBAL = torch.Generator()
_NUMPY_GLOBAL = np.random.default_rng(5)


def _add_noise(x: torch.Tensor) -> torch.Tensor:
    """A module-level helper that draws from a module-level generator."""
    return x * torch.rand(x.shape, generator=_GLOBAL)


class FromAGlobal(_Block):
    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.rand(shape, generator=_GLOBAL)


class FromANumpyGlobal(_Block):
    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.from_numpy(_NUMPY_GLOBAL.random(shape, dtype=np.float32))


class ThroughAHelperFunction(_Block):
    def noise(self, shape: torch.Size) -> torch.Tensor:
        return _add_noise(torch.ones(shape))


class ThroughAStaticMethod(_Block):
    @staticmethod
    def draw(shape: torch.Size) -> torch.Tensor:
        return (lambda: torch.rand(shape, generator=_GLOBAL))()  # in nested code too

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return self.draw(shape)


class UnderADecorator(FromAGlobal):
    """Its forward under a decorator (``functools.wraps``): the function the class holds is the decorator's."""

    @torch.autocast("cpu", enabled=False)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


@pytest.mark.parametrize("block", [FromAGlobal, FromANumpyGlobal, ThroughAHelperFunction, ThroughAStaticMethod,
                                   UnderADecorator],
                         ids=lambda b: b.__name__)
@pytest.mark.parametrize("code", CODES)
def test_a_module_level_generator_the_forward_reads_is_replayed(code: str, block: type[_Block]) -> None:
    """A module-level generator the forward reads, itself or through a method or a module-level function
    it calls, was not replayed: its re-run drew the numbers after the forward's, silently other gradients."""
    def build() -> Chain:
        global _NUMPY_GLOBAL
        _GLOBAL.manual_seed(5)  # the plain and the wrapped model share them
        _NUMPY_GLOBAL = np.random.default_rng(5)
        return Chain([block() for _ in range(3)])

    _assert_same_as_plain(build, code)


_IN_A_GLOBAL_LIST = [torch.Generator().manual_seed(5)]


class FromAGlobalList(_Block):
    """Draws from a generator in a module-level list: no global that holds a generator itself."""

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.rand(shape, generator=_IN_A_GLOBAL_LIST[0])


def test_a_generator_ooc_cannot_find_is_caught_by_check_recompute() -> None:
    """The documented limit (NOTE [generators a re-run replays] in ``ooc.rng``): a generator inside a
    global container is not replayed; the re-run draws other numbers, and ``check_recompute=True`` says so."""
    model = Chain([FromAGlobalList() for _ in range(2)])
    ooc.wrap(model, ooc.Plan.of(["recompute", "recompute"], min_swap_bytes=0), blocks=list(model.blocks),
             backend="cpu", check_recompute=True)
    try:
        out = model(inputs())
        with pytest.raises(RecomputeError, match=r"has other values when recomputed.*generators a re-run replays"):
            out.pow(2).sum().backward()
    finally:
        ooc.unwrap(model)


# -- other patterns users write ------------------------------------------------------------------------


class KeywordChain(nn.Module):
    """Passes keyword arguments on to each block."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor, **kwargs: object) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, **kwargs)
        return x


class RandnFromAKeyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
        return torch.tanh(self.fc(x)) + torch.randn(x.shape, generator=generator)


@pytest.mark.parametrize("code", CODES)
def test_randn_from_a_generator_passed_as_a_keyword_is_replayed(code: str) -> None:
    def step(model: nn.Module) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(11)
        tensors = []
        for _ in range(2):
            x = inputs()
            out = model(x, generator=generator)
            torch.randn(1, generator=generator)  # the loss draws from it before the backward
            out.pow(2).sum().backward()
            tensors += [out, x.grad]
        return tensors + [torch.randn(1, generator=generator)]

    _assert_same_as_plain(lambda: KeywordChain([RandnFromAKeyword() for _ in range(3)]), code, step)


class Bernoulli(_Block):
    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.bernoulli(torch.full(shape, 0.3))


class DropoutFollowsTraining(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(torch.tanh(self.fc(x)), p=0.4, training=self.training)


class ReseedsTorchInTheForward(_Block):
    """Reseeds torch's global generator from a number, then draws."""

    def noise(self, shape: torch.Size) -> torch.Tensor:
        torch.manual_seed(3)
        return torch.rand(shape) + torch.randn(shape)


class ForksTorchsGenerator(_Block):
    """Draws inside ``torch.random.fork_rng``: torch's generator is put back after."""

    def noise(self, shape: torch.Size) -> torch.Tensor:
        with torch.random.fork_rng():
            return torch.rand(shape)


class PeeksAtPython(_Block):
    def noise(self, shape: torch.Size) -> torch.Tensor:
        state = random.getstate()
        value = random.random()
        random.setstate(state)
        return torch.full(shape, value)


@pytest.mark.parametrize("block", [Bernoulli, DropoutFollowsTraining, ReseedsTorchInTheForward, ForksTorchsGenerator,
                                   PeeksAtPython], ids=lambda b: b.__name__)
@pytest.mark.parametrize("code", CODES)
def test_other_random_patterns_are_replayed(code: str, block: Callable[[], nn.Module]) -> None:
    _assert_same_as_plain(lambda: Chain([block() for _ in range(3)]), code)


@pytest.mark.parametrize("code", CODES)
def test_dropout_toggled_between_the_forward_and_the_backward_is_replayed(code: str) -> None:
    """Steps in train mode, one in eval mode, and one whose model is put in eval mode between its forward
    and its backward (a validation batch run before the training loss is backwarded): the re-run uses
    the training flags of the forward."""
    def step(model: nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(1)
        tensors = []
        for train, eval_before_backward in ((True, False), (False, False), (True, True), (True, False)):
            model.train(train)
            x = inputs()
            out = model(x)
            if eval_before_backward:
                model.eval()
                with torch.no_grad():
                    model(inputs())
            out.pow(2).sum().backward()
            tensors += [out, x.grad]
        return tensors

    _assert_same_as_plain(lambda: Chain([DropoutFollowsTraining() for _ in range(3)]), code, step)


class _CountingDict(dict):
    """A dict subclass whose own ``values``/``__iter__`` are user code (a lazy mapping imports on them)."""

    calls: list[str] = []

    def values(self):  # type: ignore[override]
        self.calls.append("dict.values")
        return super().values()

    def __iter__(self):  # type: ignore[override]
        self.calls.append("dict.__iter__")
        return super().__iter__()


class _CountingList(list):
    def __iter__(self):  # type: ignore[override]
        _CountingDict.calls.append("list.__iter__")
        return super().__iter__()


class _SlotBase:
    __slots__ = ("value",)


class _SlotShadowed(_SlotBase):
    """A subclass whose property shadows its base's slot: reading ``value`` by name runs the property."""

    __slots__ = ()

    @property
    def value(self) -> int:  # type: ignore[override]
        _CountingDict.calls.append("property")
        return 0


class _PrivateSlot:
    """A private slot: its member is stored under the mangled name ``_PrivateSlot__generator``."""

    __slots__ = ("__generator",)

    def __init__(self) -> None:
        self.__generator = torch.Generator().manual_seed(5)


def test_the_search_runs_no_code_of_what_it_looks_into_and_reads_every_slot() -> None:
    """The search runs at every recomputed forward, a few levels into a block's helper objects: it called a
    dict or list subclass's own ``values``/``__iter__`` and read slots by name (a subclass's property
    ran), user code per forward (a lazy mapping's imports; a property's side effects), and missed a
    private slot (``__slots__ = ("__generator",)``, stored under its mangled name), whose generator was
    then not replayed. It reads the containers' and slots' storage itself."""
    _CountingDict.calls.clear()
    shadowed = _SlotShadowed()
    _SlotBase.value.__set__(shadowed, torch.Generator())
    private = _PrivateSlot()
    module = nn.Module()
    module.mapping = _CountingDict(gen=torch.Generator())
    module.items = _CountingList([torch.Generator()])
    module.helper = types.SimpleNamespace(mapping=_CountingDict(gen=torch.Generator()), shadowed=shadowed)
    module.private = private
    expected = [module.mapping["gen"], module.items[0], module.helper.mapping["gen"], _SlotBase.value.__get__(shadowed),
                private._PrivateSlot__generator]
    found = ooc.rng.generators_in([], [module])
    assert _CountingDict.calls == []
    assert sorted(map(id, found)) == sorted(map(id, expected))


def test_the_search_survives_another_thread_changing_what_it_looks_into() -> None:
    """The search iterated a container the block holds item by item, in Python: a dict another thread
    writes (a shared metrics or cache dict a helper holds) raised "dictionary changed size during
    iteration" out of a recomputed forward, now and then. It takes each container's items in one C
    call (atomic under the GIL), at most as many as it may still look at."""
    shared = {i: float(i) for i in range(2000)}
    module = nn.Module()
    module.helper = types.SimpleNamespace(stats=shared, gen=torch.Generator())
    stop = threading.Event()

    def write() -> None:
        while not stop.is_set():  # the GIL is let go between the writes (I/O, a lock), as a real writer does
            shared[-1] = 0.0
            time.sleep(0)
            del shared[-1]
            time.sleep(0)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, as a loaded machine does
    writer = threading.Thread(target=write)
    writer.start()
    try:
        for _ in range(200):
            found = ooc.rng.generators_in([], [module])
            assert [id(g) for g in found] == [id(module.helper.gen)]
    finally:
        stop.set()
        writer.join()
        sys.setswitchinterval(interval)


def test_a_large_object_the_block_holds_leaves_the_budget_for_a_shallower_generator() -> None:
    """The search went depth first within ``_BUDGET`` items: a large helper met first (a list of a
    cache's keys, a logger's manager) spent the whole budget, and a generator one level down in the
    next attribute was not found, so not replayed: other gradients, silently. It goes level by level
    now: what is nearer the module is looked at first."""
    module = nn.Module()
    module.big = types.SimpleNamespace(keys=[types.SimpleNamespace(k=i) for i in range(ooc.rng._BUDGET)])
    module.cfg = types.SimpleNamespace(gen=torch.Generator())
    assert [id(g) for g in ooc.rng.generators_in([], [module])] == [id(module.cfg.gen)]


def test_a_logger_on_a_module_is_not_looked_into(monkeypatch: pytest.MonkeyPatch) -> None:
    """``self.logger = logging.getLogger(...)``: its manager holds every logger of the process, which
    the search looked through at every recomputed forward to the end of its budget (about a
    millisecond per block per forward on a loaded CPU), for no generator."""
    for i in range(64):
        logging.getLogger(f"ooc.tests.many.{i}")
    module = nn.Module()
    module.logger = logging.getLogger("ooc.tests")
    module.cfg = types.SimpleNamespace(gen=torch.Generator())
    looked: list[Any] = []
    contents, threads_own = ooc.rng._contents, ooc.rng._other_threads_own
    listing_threads = [False]  # what other threads were started with is listed with _contents too: not the search

    def listed_apart() -> set[int]:
        listing_threads[0] = True
        try:
            return threads_own()
        finally:
            listing_threads[0] = False

    def counted(value: Any, kind: int, limit: int) -> Any:
        if not listing_threads[0]:
            looked.append(value)
        return contents(value, kind, limit)

    monkeypatch.setattr(ooc.rng, "_other_threads_own", listed_apart)
    monkeypatch.setattr(ooc.rng, "_contents", counted)
    assert [id(g) for g in ooc.rng.generators_in([], [module])] == [id(module.cfg.gen)]
    assert looked == [module.cfg]


def test_a_generator_is_found_when_the_type_cache_is_cleared_during_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache of what the search does per type is cleared when it grows past 4096 types (classes made
    at run time). Cleared during a search, after a helper's type was found to be looked into but before
    it was, the helper's ``__dict__`` was forgotten with the cache, and its generator was not found."""
    monkeypatch.setattr(ooc.rng, "_KINDS", dict(ooc.rng._KINDS))
    monkeypatch.setattr(ooc.rng, "_PLAIN", set(ooc.rng._PLAIN))
    monkeypatch.setattr(ooc.rng, "_HAS_DICT", set(ooc.rng._HAS_DICT))
    monkeypatch.setattr(ooc.rng, "_SLOTS", dict(ooc.rng._SLOTS))
    module = nn.Module()
    module.helper = _Helper(5)
    ooc.rng.generators_in([], [module])  # every type the module holds is in the cache
    for k in range(4097 - len(ooc.rng._KINDS)):
        ooc.rng._KINDS[type(f"Filler{k}", (), {})] = ooc.rng._OTHER
    module.other = type("MadeAtRunTime", (), {})()  # the type that overflows the cache, after the helper
    assert [id(g) for g in ooc.rng.generators_in([], [module])] == [id(module.helper.generator)]


def test_a_container_read_while_another_thread_changes_it_is_read_again() -> None:
    """NOTE [containers other threads write]: the GIL may pass to a writer between the iterator's
    creation and its first item (the test above hit it once in CI in 200 searches); such a read is
    taken again, and a container changed under every try is left out rather than raising."""
    changes = iter([True, True, False])

    def items(container: dict) -> Iterator[float]:
        if next(changes):
            raise RuntimeError("dictionary changed size during iteration")
        return iter(container.values())

    assert ooc.rng._first_items(items, {1: 1.0, 2: 2.0}, 5) == [1.0, 2.0]

    def always_changing(container: dict) -> Iterator[float]:
        raise RuntimeError("dictionary changed size during iteration")

    assert ooc.rng._first_items(always_changing, {1: 1.0}, 5) == []


class _Prefetcher(threading.Thread):
    """A thread that draws one number from its own generator per request, as a prefetcher's augmentation
    does; ``request`` waits for the draw."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.generator = torch.Generator().manual_seed(0)
        self.requests: queue.Queue[bool] = queue.Queue()
        self.answers: queue.Queue[None] = queue.Queue()
        self.draws: list[float] = []

    def run(self) -> None:
        while self.requests.get():
            self.draws.append(torch.rand((), generator=self.generator).item())
            self.answers.put(None)

    def request(self) -> None:
        self.requests.put(True)
        self.answers.get()


class _Requesting(nn.Module):
    """``tanh(fc(x))``: (5, 6) -> (5, 6), asking the prefetcher for a draw first (through a bound method)."""

    def __init__(self, request: Callable[[], None]) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.request = request

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.request()
        return torch.tanh(self.fc(x))


def test_a_generator_another_thread_draws_from_is_left_to_it() -> None:
    """NOTE [generators other threads were started with]: the search reached the prefetcher's generator
    through the bound method a block holds, and each re-run set it back to its state before the forward:
    the prefetcher drew the forward's numbers again, and after the re-run the state was put back behind
    its draws (8 draws: 4 distinct numbers, each twice). Its stream is its own, as in plain PyTorch."""
    prefetcher = _Prefetcher()
    prefetcher.start()
    try:
        model = nn.Sequential(*[_Requesting(prefetcher.request) for _ in range(2)])
        ooc.wrap(model, ooc.Plan.uniform("recompute", 2, min_swap_bytes=0), blocks=list(model), backend="cpu")
        try:
            for _ in range(2):
                model(inputs()).pow(2).sum().backward()
        finally:
            ooc.unwrap(model)
    finally:
        prefetcher.requests.put(False)
        prefetcher.join()
    stream = torch.Generator().manual_seed(0)
    assert len(prefetcher.draws) == 8  # two blocks, each a forward and a re-run, two steps
    assert prefetcher.draws == [torch.rand((), generator=stream).item() for _ in range(8)]


def test_what_another_live_thread_was_started_with_is_not_searched() -> None:
    """The thread object (reached through its bound method) and a thread's arguments are another
    thread's while it runs, from any thread that searches; a thread that ended holds nothing."""
    held = _Helper(1)
    prefetcher = _Prefetcher()
    done = threading.Event()
    passed = threading.Thread(target=lambda helper: done.wait(60), args=(held,))
    module = nn.Module()
    module.request = prefetcher.request  # the bound method of another thread's object
    module.helper = held  # an argument another thread was started with

    def found() -> set[int]:
        return {id(g) for g in ooc.rng.generators_in([], [module])}

    expected = {id(prefetcher.generator), id(held.generator)}
    assert found() == expected
    for thread in (prefetcher, passed):
        thread.start()
    try:
        assert found() == set()
        inside: list[set[int]] = []
        third = threading.Thread(target=lambda: inside.append(found()))
        third.start()
        third.join()
        assert inside == [set()]
    finally:
        done.set()
        prefetcher.requests.put(False)
        for thread in (prefetcher, passed):
            thread.join()
    assert found() == expected


def test_the_thread_a_forward_runs_in_is_not_another_threads() -> None:
    """A training loop started in a thread with the model's helper as an argument: the forward runs in
    that thread, whose arguments are its own, and the helper's generator is replayed, bit for bit."""
    def build() -> nn.Module:
        return Chain([OnAHelper() for _ in range(3)])

    def in_a_thread(model: nn.Module) -> list[torch.Tensor]:
        out: list[list[torch.Tensor]] = []
        worker = threading.Thread(target=lambda m, *helpers: out.append(_steps(m)),
                                  args=(model, *(b.helper for b in model.blocks)))
        worker.start()
        worker.join()
        return out[0]

    _assert_same_as_plain(build, "RKR", in_a_thread)
