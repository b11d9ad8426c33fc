"""The random number generators a block's forward may draw from: their states, taken and put back.

NOTE [generators a re-run replays]
A recomputed block runs its forward again in the backward, and must draw the numbers its first run
drew, or its gradients differ from plain PyTorch's without a word (dropout masks, noise, a random
scale). ``RngState`` holds the process-wide generators: torch's CPU generator, the block device's
CUDA generator, Python's ``random`` and numpy's global generator (``np.random.rand``; only if the
program imported ``numpy.random``: ooc imports no numpy). ``generators_in`` finds generator objects
(``torch.Generator``, ``random.Random``, numpy's ``Generator`` and ``RandomState``) in a block's
arguments and in its modules' attributes, also inside a list, tuple or dict attribute; the re-run
starts each from the state it had before the forward, and each is put back after it, so the next
forward draws where plain PyTorch's would. A generator held anywhere else (a global, an attribute of
a helper object) is not found: ``ooc.wrap(..., check_recompute=True)`` catches what it changes, and
such blocks are planned as keep or swap. The process-wide states are the whole process's: another
thread that draws from one while a re-run runs (in the backward) draws from the replayed state, as
with torch's generators under ``torch.utils.checkpoint``. Cost: host time at every recomputed forward
and re-run, mostly numpy's ``get_state``/``set_state`` (about 50 us each on a loaded 2-core CPU,
against 1 us for torch's CPU generator; its bit generator's ``state`` alone takes half that, but
misses the Gaussian ``randn`` keeps for its next call). With ``numpy.random`` imported (transformers
imports it), 12 recomputed GPT-2 small blocks on an H200 host measured 73.8 against 70.1 ms a step
with the bit generator's state alone (two runs each, +5%): the cost is real on fast devices.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch


class RngState:
    """The process-wide generators' states: torch's CPU one, ``device``'s CUDA one for a CUDA device,
    Python's ``random`` and numpy's global one (NOTE [generators a re-run replays])."""

    __slots__ = ("cpu", "cuda", "device", "python", "numpy")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.python = random.getstate()
        np_random = sys.modules.get("numpy.random")  # a program that never imported numpy draws nothing from it
        # The legacy state, not the bit generator's alone (half the time): it holds the Gaussian that
        # ``np.random.randn`` draws in pairs and keeps for its next call.
        self.numpy = np_random.get_state() if np_random is not None else None

    def restore(self) -> None:
        """Put every generator back in the state it had when this was taken."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy.random"].set_state(self.numpy)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Run the body from this state; put the current one back after."""
        outer = RngState(self.device)
        self.restore()
        try:
            yield
        finally:
            outer.restore()


_CONTAINERS = frozenset((list, tuple, dict))


def _generator_types() -> frozenset[type]:
    types = {torch.Generator, random.Random}
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        types |= {np_random.Generator, np_random.RandomState}
    return frozenset(types)


def generators_in(leaves: list[Any], modules: Iterator[torch.nn.Module]) -> list[Any]:
    """The generator objects among ``leaves`` (a call's flattened arguments) and the attributes of
    ``modules``, each once: the attribute itself, or an item of a list, tuple or dict attribute.
    Exact types (``type() in``, not ``isinstance``: the latter reads ``__class__`` through HF configs'
    Python ``__getattribute__``); ``random.SystemRandom`` has no state to replay."""
    types = _generator_types()
    found = [g for g in leaves if type(g) in types]
    looked_for = types | _CONTAINERS
    for m in modules:
        for name, value in vars(m).items():
            kind = type(value)
            if kind not in looked_for:
                continue
            if kind in types:
                found.append(value)
            elif not name.startswith("_"):  # a container, not one of nn.Module's own dicts
                items = value.values() if kind is dict else value
                found += [g for g in items if type(g) in types]
    return list(dict.fromkeys(found))


def state_of(generator: Any) -> Any:
    """The state of one generator ``generators_in`` found."""
    if type(generator) is torch.Generator:
        return generator.get_state()
    if type(generator) is random.Random:
        return generator.getstate()
    if hasattr(generator, "bit_generator"):  # numpy's Generator
        return generator.bit_generator.state
    return generator.get_state()  # numpy's RandomState


def set_state(generator: Any, state: Any) -> None:
    """Put ``state`` (from ``state_of``) back into ``generator``."""
    if type(generator) is torch.Generator:
        generator.set_state(state)
    elif type(generator) is random.Random:
        generator.setstate(state)
    elif hasattr(generator, "bit_generator"):
        generator.bit_generator.state = state
    else:
        generator.set_state(state)
