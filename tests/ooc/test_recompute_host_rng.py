"""RECOMPUTE of blocks that draw random numbers outside torch's default generator: Python's ``random``
and numpy's global generator (also one a forward swaps in), ``random.Random`` / numpy ``Generator`` /
``RandomState`` / bit generator objects (of subclasses too) on the block's modules, and
``torch.Generator`` objects held in a list, tuple, namedtuple, dict or dataclass attribute (deeper
ones: ``tests/ooc/test_recompute_rng_patterns.py``). The re-run
draws what the forward drew, so gradients equal plain PyTorch bit for bit over two steps, and the
generators are left where plain PyTorch leaves them (NOTE [the re-run sees the forward's state] in
``ooc.recompute``). Each failed before: the re-run drew other numbers, and the gradients differed
silently. What cannot be replayed (a draw the numpy mark sees only later, a generator seeded from the
OS, a spawned child) is refused, with what to do."""

from __future__ import annotations

import copy
import dataclasses
import importlib.machinery
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import types
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch.nn as nn

import ooc
import ooc.rng
from ooc.recompute import RecomputeError
from tests.ooc.test_recompute_adversarial import CODES, Chain, RandomMask, assert_same_as_plain, inputs, wrapped_copy


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


class NumpyGlobal(_Block):
    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.from_numpy(np.random.rand(*shape).astype(np.float32))


class NumpyGaussianGlobal(_Block):
    """One legacy Gaussian per call: ``randn`` draws them in pairs and keeps the second for its next
    call, in the global generator's legacy state (not in its bit generator's)."""

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.full(shape, float(np.random.randn(1)[0]))


class PythonGlobal(_Block):
    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.full(shape, random.uniform(0.5, 1.5))


class NumpyGeneratorAttribute(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.rng = np.random.default_rng(3)

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.from_numpy(self.rng.random(shape, dtype=np.float32))


class NumpyRandomStateAttribute(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.rng = np.random.RandomState(3)

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.from_numpy(self.rng.rand(*shape).astype(np.float32))


class PythonRandomAttribute(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.rng = random.Random(3)

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.full(shape, self.rng.uniform(0.5, 1.5))


class TorchGeneratorInAList(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.generators = [torch.Generator().manual_seed(5)]

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return (torch.rand(shape, generator=self.generators[0]) > 0.5).float()


class TorchGeneratorInADict(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.generators = {"mask": torch.Generator().manual_seed(5)}

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return (torch.rand(shape, generator=self.generators["mask"]) > 0.5).float()


class NumpyPCG64RandomStateAttribute(_Block):
    """A ``RandomState`` over another bit generator than MT19937, drawing Gaussians (one kept per pair)."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = np.random.RandomState(np.random.PCG64(3))

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.full(shape, float(self.rng.randn()))


class NumpyBitGeneratorAttribute(_Block):
    """Holds a bare bit generator, and draws through a ``Generator`` made at each call."""

    def __init__(self) -> None:
        super().__init__()
        self.bits = np.random.PCG64(3)

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.from_numpy(np.random.Generator(self.bits).random(shape, dtype=np.float32))


class _SeededRandom(random.Random):
    """A user's subclass of ``random.Random``; unhashable, as a class that defines ``__eq__`` alone is."""

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.getstate() == self.getstate()


class PythonRandomSubclassAttribute(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.rng = _SeededRandom(3)

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.full(shape, self.rng.uniform(0.5, 1.5))


class TorchGeneratorInATuple(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.generators = (torch.Generator().manual_seed(5),)

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return (torch.rand(shape, generator=self.generators[0]) > 0.5).float()


class _Generators(NamedTuple):
    mask: torch.Generator


class TorchGeneratorInANamedTuple(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.generators = _Generators(torch.Generator().manual_seed(5))

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return (torch.rand(shape, generator=self.generators.mask) > 0.5).float()


@dataclasses.dataclass
class _NoiseConfig:
    scale: float
    generator: torch.Generator


class TorchGeneratorInADataclass(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.config = _NoiseConfig(0.5, torch.Generator().manual_seed(5))

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return self.config.scale * torch.rand(shape, generator=self.config.generator)


@dataclasses.dataclass(slots=True)
class _SlottedNoiseConfig:
    scale: float
    generator: torch.Generator


class TorchGeneratorInASlottedDataclass(TorchGeneratorInADataclass):
    def __init__(self) -> None:
        super().__init__()
        self.config = _SlottedNoiseConfig(0.5, torch.Generator().manual_seed(5))


class ReseedsNumpy(_Block):
    """Seeds numpy's global generator, then draws from it: the same noise at every forward."""

    def noise(self, shape: torch.Size) -> torch.Tensor:
        np.random.seed(0)
        return torch.from_numpy(np.random.rand(*shape).astype(np.float32))


class ReseedsPython(_Block):
    def noise(self, shape: torch.Size) -> torch.Tensor:
        random.seed(0)
        return torch.full(shape, random.uniform(0.5, 1.5))


class ReseedsTorch(_Block):
    def noise(self, shape: torch.Size) -> torch.Tensor:
        torch.manual_seed(0)
        return torch.rand(shape)


BLOCKS = [NumpyGlobal, NumpyGaussianGlobal, PythonGlobal, NumpyGeneratorAttribute, NumpyRandomStateAttribute, PythonRandomAttribute,
          TorchGeneratorInAList, TorchGeneratorInADict, NumpyPCG64RandomStateAttribute, NumpyBitGeneratorAttribute,
          PythonRandomSubclassAttribute, TorchGeneratorInATuple, TorchGeneratorInANamedTuple, TorchGeneratorInADataclass,
          TorchGeneratorInASlottedDataclass, ReseedsNumpy, ReseedsPython, ReseedsTorch]


class NoiseFromAnArgument(nn.Module):
    """Draws its noise from the generator of a dataclass argument (``tree_flatten`` leaves it whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, config: _NoiseConfig) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * torch.rand(x.shape, generator=config.generator)


@pytest.mark.parametrize("code", CODES)
def test_a_generator_in_a_dataclass_argument_is_replayed(code: str) -> None:
    def step(model: Chain) -> list[torch.Tensor]:
        x = inputs()
        out = model(x, _NoiseConfig(0.5, torch.Generator().manual_seed(11)))
        out.pow(2).sum().backward()
        return [out, x.grad]

    assert_same_as_plain(lambda: Chain([NoiseFromAnArgument() for _ in range(3)]), code, step)


def _seed_host_generators(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)


def _two_steps(model: Chain) -> list[torch.Tensor]:
    """Two steps from seeded host generators, then a draw from each (left where plain leaves them)."""
    _seed_host_generators(1)
    tensors = []
    for _ in range(2):  # the second step draws where the first left the generators
        x = inputs()
        out = model(x)
        out.pow(2).sum().backward()
        tensors += [out, x.grad]
    return tensors + [torch.tensor(random.random()), torch.from_numpy(np.random.rand(1))]


@pytest.mark.filterwarnings("error")  # a RandomState over PCG64 warned at each forward (its get_state(legacy=True))
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.__name__)
@pytest.mark.parametrize("code", CODES)
def test_host_randomness_is_replayed(code: str, block: type[_Block]) -> None:
    def build() -> Chain:
        _seed_host_generators(0)
        return Chain([block() for _ in range(3)])

    assert_same_as_plain(build, code, _two_steps)


@pytest.mark.parametrize("block", [NumpyGlobal, PythonGlobal], ids=lambda b: b.__name__)
def test_profiling_leaves_the_host_generators_where_they_were(block: type[_Block]) -> None:
    """``ooc.profile`` (and ``wrap(sample=...)``) runs the forward several times and puts torch's generator
    back; Python's and numpy's were left advanced, so the training after it drew other numbers than
    a plain run seeded alike."""
    model = Chain([block() for _ in range(2)])
    _seed_host_generators(5)
    ooc.profile(model, inputs(), reps=1, codec_errors=False)
    after = (random.random(), np.random.rand())
    _seed_host_generators(5)
    assert after == (random.random(), np.random.rand())


def assert_first_step_after_a_wrap_with_a_sample_equals_plain(block: Callable[[], nn.Module]) -> None:
    """A chain of three ``block()``: its first training step after ``wrap(budget=..., sample=...)``
    (outputs, input gradient, parameter gradients) equals the plain chain's, bit for bit."""
    def one_step(model: Chain) -> list[torch.Tensor]:
        x = inputs()
        out = model(x)
        out.pow(2).sum().backward()
        return [out, x.grad]

    torch.manual_seed(0)
    plain = Chain([block() for _ in range(3)])
    wrapped = copy.deepcopy(plain)
    ooc.wrap(wrapped, budget="1GiB", sample=inputs(), backend="cpu")
    try:
        results = [one_step(model) + [p.grad for p in model.parameters()] for model in (plain, wrapped)]
    finally:
        ooc.unwrap(wrapped)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("block", [lambda: RandomMask(own=True), NumpyGeneratorAttribute, TorchGeneratorInAList,
                                   PythonRandomAttribute], ids=["torch", "numpy", "torch-in-a-list", "python"])
def test_wrap_with_a_sample_leaves_the_generators_of_the_modules_where_they_were(block: Callable[[], nn.Module]) -> None:
    """``wrap(budget=..., sample=...)`` profiles the model on the sample; the generators its blocks own
    were left advanced by the profiling forwards, so the first training forward drew other numbers
    than the plain model's: other outputs, other gradients."""
    assert_first_step_after_a_wrap_with_a_sample_equals_plain(block)


class _Scaled(_Block):
    """The same block without noise: a constant in its place."""

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.full(shape, 0.7)


@pytest.mark.parametrize("block", [NumpyGlobal, PythonRandomAttribute, TorchGeneratorInAList], ids=lambda b: b.__name__)
def test_the_codec_error_of_a_recompute_replays_the_draws_as_the_runtime_does(block: type[_Block]) -> None:
    """The profile's ``int8:recompute`` error re-runs the block from its compressed input; it replayed
    torch's generator alone, so the draws differed too and the error came out far above int8's own (0.5-1.2; the planner
    then never compressed such a block's input), where the runtime's re-run draws what the forward drew."""
    errors = {}
    for kind in (block, _Scaled):
        torch.manual_seed(0)
        _seed_host_generators(0)
        prof = ooc.profile(Chain([kind() for _ in range(2)]), inputs(), reps=1, min_swap_bytes=0)
        errors[kind] = [dict(b.codec_error)["int8:recompute"] for b in prof.blocks]
    assert max(errors[block]) < 0.02, errors  # int8's own error, as for the block without noise
    assert max(errors[_Scaled]) < 0.02, errors


class NoDraws(_Block):
    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.ones(shape)


class NumpyLater(_Block):
    """Draws from numpy's global generator only once ``later`` is set (after its first forward)."""

    later = False

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.full(shape, float(np.random.rand()) if self.later else 1.0)


def _counting_get_state(monkeypatch) -> list[int]:  # noqa: ANN001
    calls = [0]
    get_state = np.random.get_state

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        return get_state(*args, **kwargs)

    monkeypatch.setattr(np.random, "get_state", counted)
    return calls


def test_numpy_state_is_taken_only_for_the_blocks_that_draw_from_it(monkeypatch) -> None:
    """NOTE [numpy's state where it is drawn]: after their first forward, recomputed blocks that did not
    draw from numpy's generator take no copy of its state; the one that did takes one at its forward
    and one at its re-run; gradients stay plain PyTorch's."""
    calls = _counting_get_state(monkeypatch)
    torch.manual_seed(0)
    model = wrapped_copy(Chain([NoDraws(), NumpyGlobal(), NoDraws()]), "RRR")
    try:
        _seed_host_generators(1)
        model(inputs()).pow(2).sum().backward()  # the first forward of each block looks
        calls[0] = 0
        model(inputs()).pow(2).sum().backward()
    finally:
        ooc.unwrap(model)
    assert calls[0] == 2
    assert_same_as_plain(lambda: Chain([NoDraws(), NumpyGlobal(), NoDraws()]), "RRR", _two_steps)


class NumpyCachedGaussianLater(_Block):
    """Draws one Gaussian from numpy's global generator only once ``later`` is set: with one kept by a
    previous ``randn`` (drawn in pairs), it is that one, and no word of the MT19937 is used."""

    later = False

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.full(shape, float(np.random.randn()) if self.later else 1.0)


def _keep_a_gaussian(seed: int) -> None:
    """Seed numpy's global generator and draw one Gaussian: it keeps the second of the pair."""
    np.random.seed(seed)
    np.random.randn()


@pytest.mark.parametrize("block", [NumpyLater, NumpyCachedGaussianLater], ids=lambda b: b.__name__)
def test_a_block_that_starts_drawing_from_numpy_after_its_first_forward_is_refused_then_replayed(
        block: type[_Block]) -> None:
    """``NumpyCachedGaussianLater``: the mark (NOTE [numpy's state where it is drawn]) read the
    MT19937's position and key alone, so a forward whose one draw was the kept Gaussian went unseen: no
    error, and the re-run, from the state after the forward (the Gaussian gone), drew a new pair; the
    gradients differed from plain PyTorch's without a word. The mark reads the kept Gaussian's flag too."""
    torch.manual_seed(0)
    plain = Chain([NoDraws(), block()])
    model = wrapped_copy(plain, "RR")
    try:
        model(inputs()).pow(2).sum().backward()
        model.blocks[1].later = True
        _keep_a_gaussian(1)
        with pytest.raises(RecomputeError, match=r"drew from numpy's global generator in this forward but not in its first"):
            model(inputs())
        _keep_a_gaussian(2)
        x = inputs()
        model(x).pow(2).sum().backward()  # recorded as drawing now: its re-run replays numpy's draws
        grad = x.grad
    finally:
        ooc.unwrap(model)
    plain.blocks[1].later = True
    _keep_a_gaussian(2)
    x = inputs()
    plain(x).pow(2).sum().backward()
    assert torch.equal(grad, x.grad)


def test_numpy_random_half_imported_by_another_thread_is_not_read(monkeypatch) -> None:
    """A thread importing ``numpy.random`` for the first time puts the module in ``sys.modules`` before
    it has any function: a recomputed forward then failed with AttributeError ("partially initialized
    module 'numpy.random' has no attribute 'get_bit_generator'"; seen with a thread whose first
    ``np.random.rand`` imported it during a step). Until the import ends nothing can draw from it."""
    half = types.ModuleType("numpy.random")
    half.__spec__ = importlib.machinery.ModuleSpec("numpy.random", None)
    half.__spec__._initializing = True
    torch.manual_seed(0)
    plain = Chain([NoDraws(), NoDraws()])
    model = wrapped_copy(plain, "RR")
    try:
        model(inputs()).pow(2).sum().backward()  # their first forward: no numpy draws recorded
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, "numpy.random", half)
            x = inputs()
            model(x).pow(2).sum().backward()
        grad = x.grad
    finally:
        ooc.unwrap(model)
    x = inputs()
    plain(x).pow(2).sum().backward()
    assert torch.equal(grad, x.grad)


FIRST_DRAW_IMPORTS = '''
import json
import sys
{import_at_top}
import torch
import torch.nn as nn
import ooc

assert "numpy.random" not in sys.modules  # numpy 2 imports it at the first np.random attribute
drawn = []


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        {import_in_forward}
        drawn.append(float(np.random.rand()))
        return torch.tanh(self.fc(x)) * drawn[-1]


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block()])

    def forward(self, x):
        return self.blocks[0](x)


model = Chain()
ooc.wrap(model, ooc.Plan.uniform("recompute", 1, min_swap_bytes=0), blocks=list(model.blocks), backend="cpu")
loss = model(torch.ones(5, 6, requires_grad=True)).pow(2).sum()
after_forward = sys.modules["numpy.random"].get_state()[1].tolist()
loss.backward()
kept = sys.modules["numpy.random"].get_state()[1].tolist() == after_forward
print(json.dumps([drawn, kept]))
'''


@pytest.mark.parametrize("where", ["module", "forward"])
def test_a_forward_whose_first_draw_imports_numpy_random_is_replayed(where: str) -> None:
    """numpy 2 imports ``numpy.random`` at the first ``np.random`` attribute, so a program whose first
    draw is in a recomputed block's forward had no numpy state taken before it (``numpy.random`` was
    not imported then): the re-run drew another number and the gradient was silently wrong. With
    ``numpy`` imported (torch and ``ooc.scheduler`` import it), its ``random`` is imported before the
    forward. A forward that imports numpy itself (``where="forward"``) finds it imported already; the
    re-run draws the forward's number and leaves numpy's generator where the forward left it."""
    script = FIRST_DRAW_IMPORTS.format(import_at_top="import numpy as np" if where == "module" else "",
                                       import_in_forward="import numpy as np" if where == "forward" else "")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    (forward, rerun), kept = json.loads(done.stdout.strip().splitlines()[-1])
    assert forward == rerun
    assert kept


def test_a_refusal_names_another_thread_that_drew_from_numpy_meanwhile() -> None:
    """The mark is the whole process's: another thread drawing from numpy's global generator while a
    block that does not draw runs its forward (a data thread's augmentation) moves it too, and the step
    raised an error that blamed the block alone, at a random step of a long run. The error says that
    another thread may have drawn, and what to do then."""
    class OtherThreadDraws(_Block):
        later = False

        def noise(self, shape: torch.Size) -> torch.Tensor:
            if self.later:
                drawer = threading.Thread(target=np.random.rand)
                drawer.start()
                drawer.join()
            return torch.ones(shape)

    torch.manual_seed(0)
    model = wrapped_copy(Chain([OtherThreadDraws()]), "R")
    try:
        model(inputs()).pow(2).sum().backward()
        model.blocks[0].later = True
        with pytest.raises(RecomputeError, match=r"or another thread drew from it during the forward"):
            model(inputs())
    finally:
        ooc.unwrap(model)


@pytest.fixture
def numpy_global_restored():  # noqa: ANN201
    """Puts numpy's global bit generator (and its state) back after a test that swaps it."""
    bit_generator, state = np.random.get_bit_generator(), np.random.get_state(legacy=False)
    yield
    np.random.set_bit_generator(bit_generator)
    np.random.set_state(state)


class SwapsBitGenerator(_Block):
    """Seeds a fresh PCG64 from numpy's global generator, makes it the global one
    (``np.random.set_bit_generator``) and draws from it."""

    def noise(self, shape: torch.Size) -> torch.Tensor:
        np.random.set_bit_generator(np.random.PCG64(np.random.randint(2**31)))
        return torch.from_numpy(np.random.rand(*shape).astype(np.float32))


@pytest.mark.filterwarnings("error")  # numpy's get_state() warned at each forward once the global was PCG64
@pytest.mark.parametrize("code", CODES)
def test_a_forward_that_swaps_numpys_global_bit_generator_is_replayed(code: str, numpy_global_restored: None) -> None:
    """A recomputed block whose first forward put another bit generator in numpy's global one failed
    with ``KeyError: 0`` (its state came back as a dict where the MT19937 tuple taken before the
    forward was compared by index); and the re-run started from the new bit generator, not the one the
    forward started from. Now the re-run draws what the forward drew, and the global generator is left
    where plain PyTorch leaves it."""
    def steps(model: Chain) -> list[torch.Tensor]:
        np.random.set_bit_generator(np.random.MT19937(0))  # each run starts from numpy's default kind
        return _two_steps(model)

    assert_same_as_plain(lambda: Chain([SwapsBitGenerator() for _ in range(3)]), code, steps)


def test_without_the_kept_gaussians_place_numpys_state_is_taken_at_every_forward(monkeypatch) -> None:
    """Where the kept Gaussian's flag cannot be found in a ``RandomState`` (NOTE [finding the kept
    Gaussian]; another build of numpy), there is no mark: every recomputed forward takes numpy's state,
    so a block that starts drawing the kept Gaussian later is replayed, without an error."""
    monkeypatch.setattr(ooc.rng, "_has_gauss_offset", lambda kind: None)
    monkeypatch.setattr(ooc.rng, "_FLAG", (None, None, None))  # found again, with the offset above
    torch.manual_seed(0)
    plain = Chain([NoDraws(), NumpyCachedGaussianLater()])
    model = wrapped_copy(plain, "RR")
    grads = []
    try:
        model(inputs()).pow(2).sum().backward()
        for chain in (model, plain):
            chain.blocks[1].later = True
            _keep_a_gaussian(1)
            x = inputs()
            chain(x).pow(2).sum().backward()
            grads.append(x.grad)
    finally:
        ooc.unwrap(model)
    assert torch.equal(*grads)


def test_a_rerun_that_moves_numpys_generator_where_its_forward_did_not_is_refused() -> None:
    """The second of two blocks that reseed numpy's global generator finds it, at its first forward, in
    the state it leaves it in, so it was recorded as not drawing, and its later forwards and re-runs
    took no numpy state. Its re-run reseeded the generator that the loss had drawn from since: plain
    PyTorch's next draw differed from ooc's, silently (the next step's augmentation, noise). A re-run
    of a block recorded as not drawing now reads the mark too, and raises if it moved."""
    torch.manual_seed(0)
    plain = Chain([ReseedsNumpy(), ReseedsNumpy()])
    model = wrapped_copy(plain, "RR")
    try:
        model(inputs()).pow(2).sum().backward()  # the first forward of each block looks
        _seed_host_generators(1)
        out = model(inputs())
        np.random.rand()  # the loss (or the next batch) draws from numpy between the forward and the backward
        with pytest.raises(RecomputeError, match=r"block blocks.1 moved numpy's global generator in its re-run"):
            out.pow(2).sum().backward()
        _seed_host_generators(1)
        x = inputs()
        out = model(x)
        np.random.rand()
        out.pow(2).sum().backward()  # recorded as drawing now: its re-run puts numpy's state back
        after = np.random.rand()
    finally:
        ooc.unwrap(model)
    _seed_host_generators(1)
    x_plain = inputs()
    out = plain(x_plain)
    np.random.rand()
    out.pow(2).sum().backward()
    assert torch.equal(x.grad, x_plain.grad)
    assert after == np.random.rand()


def _numpy_from_the_os(shape: torch.Size) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng().random(shape, dtype=np.float32))


def _numpy_global_reseeded_from_the_os(shape: torch.Size) -> torch.Tensor:
    np.random.seed()
    return torch.from_numpy(np.random.rand(*shape).astype(np.float32))


def _python_reseeded_from_the_os(shape: torch.Size) -> torch.Tensor:
    random.seed()
    return torch.full(shape, random.random())


def _python_random_from_the_os(shape: torch.Size) -> torch.Tensor:
    return torch.full(shape, random.Random().random())


def _torch_reseeded_from_the_os(shape: torch.Size) -> torch.Tensor:
    torch.seed()
    return torch.rand(shape)


def _torch_generator_from_the_os(shape: torch.Size) -> torch.Tensor:
    generator = torch.Generator()
    generator.seed()
    return torch.rand(shape, generator=generator)


class FromTheOS(_Block):
    def __init__(self, noise: Callable[[torch.Size], torch.Tensor]) -> None:
        super().__init__()
        self.draw = noise

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return self.draw(shape)


@pytest.mark.parametrize("noise", [_numpy_from_the_os, _numpy_global_reseeded_from_the_os, _python_reseeded_from_the_os,
                                   _python_random_from_the_os, _torch_reseeded_from_the_os, _torch_generator_from_the_os],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_forward_that_seeds_a_generator_from_the_os_is_refused(noise: Callable[[torch.Size], torch.Tensor]) -> None:
    """NOTE [generators seeded from the OS] in ``ooc.rng``: its re-run seeded another generator and drew
    other numbers than the forward, so the gradients were not the forward's, without a word (unless
    ``check_recompute=True``). Its first forward is refused, saying what to do."""
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    model = wrapped_copy(Chain([NoDraws(), FromTheOS(noise)]), "RR")
    try:
        with pytest.raises(RecomputeError, match=r"block blocks.1 seeds a generator from the OS in its forward"):
            model(inputs())
    finally:
        ooc.unwrap(model)
        torch.set_rng_state(torch_state)  # the tests after this one draw from seeded generators
        random.setstate(python_state)


class SeededInTheForward(_Block):
    """Makes a numpy generator at each forward, seeded from torch's generator (which ooc replays), as the
    refusal above advises."""

    def noise(self, shape: torch.Size) -> torch.Tensor:
        rng = np.random.default_rng(torch.randint(2**31, ()).item())
        return torch.from_numpy(rng.random(shape, dtype=np.float32))


@pytest.mark.parametrize("code", CODES)
def test_a_generator_seeded_from_torchs_in_the_forward_is_replayed(code: str) -> None:
    assert_same_as_plain(lambda: Chain([SeededInTheForward() for _ in range(3)]), code, _two_steps)


class ImportsAndWritesAFile(_Block):
    """Imports a module whose own code makes a ``random.Random()`` (sympy's does, imported by torch in a
    first forward), and names a temporary file (``tempfile`` makes a ``random.Random()`` for the names):
    the OS's numbers reach no output, and nothing is refused."""

    def __init__(self, module: str) -> None:
        super().__init__()
        self.module = module

    def noise(self, shape: torch.Size) -> torch.Tensor:
        importlib.import_module(self.module)
        with tempfile.NamedTemporaryFile():
            return torch.ones(shape)


def test_seeding_from_the_os_in_an_import_or_for_a_file_name_is_not_refused(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Before the watch passed over module code and ``tempfile``, the forward that first imported sympy
    (torch's dispatch does, lazily) was refused."""
    (tmp_path / "makes_a_random.py").write_text("import random\n\nRNG = random.Random()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tempfile, "_name_sequence", None)  # made again, with a random.Random(), at the next name
    sys.modules.pop("makes_a_random", None)
    model = wrapped_copy(Chain([ImportsAndWritesAFile("makes_a_random")]), "R")
    try:
        model(inputs()).pow(2).sum().backward()
    finally:
        ooc.unwrap(model)
        sys.modules.pop("makes_a_random", None)
    assert tempfile._name_sequence is not None  # the forward made it


class SpawnsFromAGenerator(_Block):
    """Spawns a child of the numpy ``Generator`` it holds at each forward, and draws from the child."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = np.random.default_rng(3)

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.from_numpy(self.rng.spawn(1)[0].random(shape, dtype=np.float32))


class SpawnsFromASeedSequence(_Block):
    def __init__(self) -> None:
        super().__init__()
        self.seeds = np.random.SeedSequence(3)

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.from_numpy(np.random.default_rng(self.seeds.spawn(1)[0]).random(shape, dtype=np.float32))


@pytest.mark.parametrize("block", [SpawnsFromAGenerator, SpawnsFromASeedSequence], ids=lambda b: b.__name__)
def test_a_forward_that_spawns_from_a_numpy_seed_sequence_it_holds_is_refused(block: type[_Block]) -> None:
    """``Generator.spawn`` and ``SeedSequence.spawn`` count their children in the seed sequence, which
    numpy cannot set back (``n_children_spawned`` is read-only) and a generator's state does not hold:
    the re-run spawned the next child, drew other numbers, and the gradients differed, silently. The
    forward is refused, saying what to do."""
    model = wrapped_copy(Chain([NoDraws(), block()]), "RR")
    try:
        with pytest.raises(RecomputeError, match=r"block blocks.1 spawns from a numpy seed sequence it holds"):
            model(inputs())
    finally:
        ooc.unwrap(model)


class PeeksAtNumpyLater(_Block):
    """Once ``later`` is set (after its first forward): draws from numpy's global generator and puts its
    state back, so no draw is seen from outside."""

    later = False

    def noise(self, shape: torch.Size) -> torch.Tensor:
        if not self.later:
            return torch.ones(shape)
        state = np.random.get_state()
        noise = np.random.rand(*shape).astype(np.float32)
        np.random.set_state(state)
        return torch.from_numpy(noise)


def test_a_forward_that_starts_putting_numpys_state_back_later_is_caught_by_check_recompute() -> None:
    """The documented limit (NOTE [a forward that puts numpy's state back]): only the first forward is
    watched, so a block that starts this later looks like one that does not draw, and its re-run draws
    from wherever numpy's generator is then (here: after the loss drew); ``check_recompute=True`` says so.
    A block that does it from its first forward is replayed (``tests/ooc/test_recompute_rng_patterns.py``)."""
    model = Chain([NoDraws(), PeeksAtNumpyLater()])
    ooc.wrap(model, ooc.Plan.of(["recompute", "recompute"], min_swap_bytes=0), blocks=list(model.blocks),
             backend="cpu", check_recompute=True)
    try:
        model(inputs()).pow(2).sum().backward()  # the first forward of each block looks
        model.blocks[1].later = True
        out = model(inputs())
        np.random.rand()  # the loss draws from numpy between the forward and the backward
        with pytest.raises(RecomputeError, match=r"has other values when recomputed.*generators a re-run replays"):
            out.pow(2).sum().backward()
    finally:
        ooc.unwrap(model)


class FailsThenSeedsFromTheOS(_Block):
    """Its first forward fails (a user's error, fixed before the next); the next seeds from the OS."""

    calls = 0

    def noise(self, shape: torch.Size) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            raise ValueError("a bug in the first forward")
        return _numpy_from_the_os(shape)


def test_a_first_forward_that_failed_does_not_end_the_watch_for_os_seeding() -> None:
    model = wrapped_copy(Chain([FailsThenSeedsFromTheOS()]), "R")
    try:
        with pytest.raises(ValueError, match="a bug in the first forward"):
            model(inputs())
        with pytest.raises(RecomputeError, match=r"seeds a generator from the OS in its forward"):
            model(inputs())
    finally:
        ooc.unwrap(model)


def _profile_nothing(frame, event, arg) -> None:  # noqa: ANN001
    """A profile function, as a profiler sets one."""


class StartsAProfiler(_Block):
    def noise(self, shape: torch.Size) -> torch.Tensor:
        sys.setprofile(_profile_nothing)
        return torch.ones(shape)


def test_a_profiler_a_first_forward_starts_is_left_on() -> None:
    """The watch for OS seeding (NOTE [generators seeded from the OS]) set the profile function back to
    none after the first forward, also one the forward had set (a profiler started there)."""
    model = wrapped_copy(Chain([StartsAProfiler()]), "R")
    try:
        model(inputs())
        assert sys.getprofile() is _profile_nothing
    finally:
        sys.setprofile(None)
        ooc.unwrap(model)


def test_an_hf_config_is_not_looked_into() -> None:
    """transformers 5 configs are dataclasses (some forty fields, never a generator): looking into the
    one each HF attention module holds cost every recomputed forward 2 us per module; a user's
    dataclass is looked into (``TorchGeneratorInADataclass``)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=8, n_layer=1, n_head=2)
    assert ooc.rng._kind(type(config)) == ooc.rng._OTHER
    assert ooc.rng._kind(_NoiseConfig) == ooc.rng._FIELDS
