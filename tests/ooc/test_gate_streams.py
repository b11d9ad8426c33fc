"""The gate's waits for a bucket's copies in hold for every stream that reads the weights after it, not
only for the first one that waited (NOTE [a gate waits on every stream] in ooc.optim.pipeline).

On a GPU a second compute stream is a ``with torch.cuda.stream(s)`` block; the CPU twin has one compute
stream per thread (NOTE [stream-order checker] in ooc.backend.order), so another thread plays the other
stream here: its ``synchronize()`` (directly, or through ``model.state_dict()``) must not leave the
training thread's next forward unordered after the last update's copies into the weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from ooc.backend import ChaosConfig, CpuBackend
from ooc.models import GPT
from ooc.optim import HostAdamW
from tests.helpers import gpt_batch

STEPS = 2


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT("nano")


def _on_another_thread(work: Callable[[], object]) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - raised on the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def _train(between: Callable[[torch.nn.Module, HostAdamW], None] | None) -> tuple[list[float], list[torch.Tensor]]:
    """Losses and masters of :data:`STEPS` pipelined steps on the chaos CPU backend with the checker on,
    ``between(model, opt)`` run after each ``step()``."""
    model = _model()
    # Copies late by up to 20 ms each: the last buckets' copies in are in flight when step() returns.
    backend = CpuBackend(chaos=ChaosConfig(seed=5, max_delay_s=0.02), check_order=True)
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, backend=backend)
    try:
        losses = []
        for step in range(STEPS):
            loss = model(*gpt_batch(seed=step))[1]
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
            if between is not None:
                between(model, opt)
        opt.synchronize()
        masters = [opt.state[p]["master"].clone() for p in model.parameters()]
    finally:
        opt.close()
        backend.close()
    return losses, masters


@pytest.mark.parametrize("how", ["synchronize", "state_dict"])
def test_a_synchronize_on_another_stream_leaves_the_next_forward_waiting_for_the_copies_in(how: str) -> None:
    """A thread of the user's (a logger, an evaluator) calls ``opt.synchronize()`` or ``model.state_dict()``
    after ``step()``. The gate made that thread's compute wait for the copies in and forgot them, so the
    training thread's next forward read weights the copies were still writing: StreamOrderError here,
    half-updated weights on a GPU (where the other stream is a side stream of the same thread)."""
    def between(model: torch.nn.Module, opt: HostAdamW) -> None:
        _on_another_thread(opt.synchronize if how == "synchronize" else model.state_dict)

    losses, masters = _train(between)
    expected_losses, expected = _train(None)
    assert losses == expected_losses
    assert all(torch.equal(m, e) for m, e in zip(masters, expected))


def _train_clipped(evaluate: Callable[[Callable[[], object]], None]) -> tuple[list[float], list[torch.Tensor]]:
    """Losses and masters of :data:`STEPS` steps with ``max_grad_norm`` (the updates held until ``step()``)
    on the chaos CPU backend with the checker on, a forward without grad run by ``evaluate`` between
    each backward and its ``step()``."""
    model = _model()
    backend = CpuBackend(chaos=ChaosConfig(seed=5, max_delay_s=0.02), check_order=True)
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, backend=backend, max_grad_norm=1.0)

    def forward() -> None:
        with torch.no_grad():
            model(*gpt_batch(seed=99))

    try:
        losses = []
        for step in range(STEPS):
            loss = model(*gpt_batch(seed=step))[1]
            loss.backward()
            losses.append(loss.item())
            evaluate(forward)
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        masters = [opt.state[p]["master"].clone() for p in model.parameters()]
    finally:
        opt.close()
        backend.close()
    return losses, masters


def test_a_forward_on_another_stream_before_a_clipped_step_ends_before_the_held_copies_in() -> None:
    """NOTE [reads of held weights]: a forward between the backward and a clipped ``step()`` reads the
    weights the held updates' copies in overwrite once ``step()`` releases them. ``step()`` recorded the
    event those copies wait for on its own stream only, so a forward on another (an evaluation on a side
    stream; another thread here) was not ordered before them: StreamOrderError here, an evaluation on
    half-updated weights on a GPU."""
    losses, masters = _train_clipped(_on_another_thread)
    expected_losses, expected = _train_clipped(lambda work: work())
    assert losses == expected_losses
    assert all(torch.equal(m, e) for m, e in zip(masters, expected))
