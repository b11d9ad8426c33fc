"""The CPU backend's copy engines when their threads are not scheduled (NOTE [a waiter runs the
copies] in ooc.backend.cpu): a thread that waits for a copy runs it, in issue order, one job at a
time with the engine's own thread, and a job that fails raises on the thread that ran it."""

from __future__ import annotations

import random
import threading
import weakref
from collections.abc import Callable

import pytest
import torch

import ooc
from ooc.backend import ChaosConfig, CpuBackend, cpu
from ooc.backend.cpu import CpuEvent, _CopyEngine
from ooc.models import GPT
from tests.helpers import NANO, gpt_batch, gpt_loss, train_side_by_side


@pytest.fixture()
def starved(monkeypatch):
    """Copy engines made from here on start their threads only when the returned event is set, as
    on a machine whose cores are all taken; set at the end of the test either way, or after two
    minutes, so that a wait that cannot finish without the engines' threads fails the test instead
    of hanging it."""
    gate = threading.Event()
    watchdog = threading.Timer(120, gate.set)
    watchdog.daemon = True
    watchdog.start()
    run = _CopyEngine._run

    def starved_run(self) -> None:  # noqa: ANN001
        gate.wait()
        run(self)

    monkeypatch.setattr(_CopyEngine, "_run", starved_run)
    yield gate
    gate.set()
    watchdog.cancel()


def test_a_wait_runs_the_copies_its_engine_thread_has_not(starved) -> None:
    backend = CpuBackend(check_order=False)
    try:
        src = [torch.full((1000,), float(i)) for i in range(3)]
        dst = [torch.empty(1000) for _ in range(3)]
        events = [backend.copy_d2h(d, s, ()) for d, s in zip(dst, src)]
        events[1].synchronize()  # runs the first two copies, in order, here
        assert events[0].query() and events[1].query() and not events[2].query()
        backend.synchronize()
        assert all(torch.equal(d, s) for d, s in zip(dst, src))
        assert not starved.is_set()  # the engines' threads never ran
    finally:
        starved.set()
        backend.close()


def test_jobs_run_in_issue_order_one_at_a_time_between_the_engine_and_its_waiters() -> None:
    engine = _CopyEngine("test-engine")
    order: list[int] = []
    running = [0]
    most = [0]
    lock = threading.Lock()

    def job(i: int, done: threading.Event):  # noqa: ANN202
        def run() -> None:
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            order.append(i)
            threading.Event().wait(0.0002)  # long enough for another thread to try to start a job
            with lock:
                running[0] -= 1
            done.set()
        return run

    dones = [threading.Event() for _ in range(300)]
    for i, done in enumerate(dones):
        engine.submit(job(i, done))
    waiters = [threading.Thread(target=engine.run_until, args=(dones[k],)) for k in (50, 150, 299)]
    for waiter in waiters:
        waiter.start()
    engine.run_until(dones[299])
    for waiter in waiters:
        waiter.join()
    engine.close()
    assert order == list(range(300))
    assert most[0] == 1


def test_a_job_that_fails_on_a_waiting_thread_raises_there(starved) -> None:
    engine = _CopyEngine("test-engine")
    after = threading.Event()

    def fails() -> None:
        raise OSError("the copy failed")

    engine.submit(fails)
    engine.submit(after.set)
    with pytest.raises(OSError, match="the copy failed"):
        engine.run_until(after)
    with pytest.raises(RuntimeError, match="failed earlier"):
        engine.submit(after.set)
    starved.set()
    engine.close()


@pytest.mark.parametrize("chaos", [False, True], ids=["cpu", "chaos"])
def test_training_with_starved_copy_engines_equals_plain_pytorch(starved, chaos: bool) -> None:
    """Swapped blocks, prefetched and drained, with the engines' threads never scheduled: every copy
    runs on the training thread when it waits for it, and the gradients equal plain PyTorch's."""
    backend = CpuBackend(chaos=ChaosConfig(seed=5, max_delay_s=0.0005) if chaos else None)
    plan = ooc.Plan(blocks=tuple(ooc.BlockPlan(p) for p in ("swap", "recompute", "swap", "keep")), prefetch=2, min_swap_bytes=1024)
    try:
        results = train_side_by_side(lambda: GPT(NANO), gpt_loss, [gpt_batch(seed=s) for s in range(2)],
                                     lambda m: ooc.wrap(m, plan, backend=backend))
        assert not starved.is_set()
    finally:
        starved.set()
        backend.close()
    assert results == [(True, True, True)] * 2


def _joined(thread: threading.Thread, timeout: float = 10.0) -> bool:
    """``thread`` ended within ``timeout`` seconds: a wait that never ends fails the test instead of
    hanging it (the thread is a daemon, left behind)."""
    thread.join(timeout)
    return not thread.is_alive()


def _waiting(wait: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    """``wait`` on a daemon thread; the exception it raised, if any, in the returned list."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, raised


def test_a_wait_for_a_job_that_failed_on_the_engine_thread_raises() -> None:
    """The engine's own thread runs a job that fails: whoever waits for that job's event raises
    (the engine failed earlier) instead of waiting forever for an event nothing will set."""
    engine = _CopyEngine("test-engine")
    started, release, done = threading.Event(), threading.Event(), threading.Event()

    def fails() -> None:
        started.set()
        release.wait(10)
        raise OSError("the copy failed")  # `done` is never set

    engine.submit(fails)
    assert started.wait(10)  # on the engine's thread: nobody else waits yet
    before, raised_before = _waiting(lambda: engine.run_until(done))  # waits while the job runs
    release.set()
    assert _joined(before), "a wait for a job that failed on the engine's thread never ended"
    after, raised_after = _waiting(lambda: engine.run_until(done))  # waits after the failure
    assert _joined(after), "a wait for a job that failed on the engine's thread never ended"
    for raised in (raised_before, raised_after):
        assert len(raised) == 1 and isinstance(raised[0], RuntimeError) and "failed earlier" in str(raised[0])
        assert isinstance(raised[0].__cause__, OSError)
    engine.close()


@pytest.mark.parametrize("starve_d2h", [False, True], ids=["d2h-thread-runs-it", "waiter-runs-it"])
def test_a_copy_after_a_failed_copy_of_the_other_engine_fails_instead_of_hanging(starve_d2h: bool) -> None:
    """A D2H copy ordered after an H2D copy that failed on the H2D engine's thread: the D2H job
    raises when it waits for that event, and so does whoever waits for the D2H copy, on either
    engine's path (the thread that runs the D2H job: its engine's, or the waiter's)."""
    backend = CpuBackend(check_order=False)
    release, started = threading.Event(), threading.Event()
    try:
        def fails() -> None:
            started.set()
            release.wait(10)
            raise OSError("the H2D copy failed")

        backend._h2d.submit(fails)
        # On the H2D engine's thread: a waiter that found it still queued (a loaded machine) ran it
        # itself and raised the OSError as it is, on another path than the one this test is about.
        assert started.wait(10)
        h2d_done = CpuEvent(engine=backend._h2d)  # the failed job's event, never set
        if starve_d2h:
            backend._d2h.submit(lambda: release.wait(10))  # the D2H thread is busy: a waiter runs the copy
        src, dst = torch.ones(100), torch.empty(100)
        event = backend.copy_d2h(dst, src, (h2d_done,))
        waiter, raised = _waiting(event.synchronize)
        release.set()
        assert _joined(waiter), "a wait for a copy after a failed copy never ended"
        assert len(raised) == 1 and "failed earlier" in str(raised[0]), raised
    finally:
        release.set()
        backend.close()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("starve", [False, True], ids=["engines-run", "engines-starved"])
def test_waiters_on_both_engines_with_jobs_ordered_across_them(starved, starve: bool, seed: int) -> None:
    """Jobs on both engines of a backend, each ordered after the previous job of the other engine
    (a relay, as a D2H copy waits for an H2D one), with random short sleeps; six threads wait for
    events of either engine in random order while the engines' threads run (or never do). Every
    wait ends, each engine runs its jobs in issue order, one at a time, each once."""
    if not starve:
        starved.set()
    rng = random.Random(seed)
    backend = CpuBackend(check_order=False)
    engines = (backend._d2h, backend._h2d)
    runs: list[list[int]] = [[], []]
    running = [0, 0]
    most = [0, 0]
    lock = threading.Lock()
    events: list[CpuEvent] = []
    n = 120
    try:
        for i in range(n):
            side = i % 2
            done = CpuEvent(engine=engines[side])
            previous = events[-1] if events else None
            sleep = rng.choice((0.0, 0.0, 0.0001, 0.0005))

            def job(i: int = i, side: int = side, done: CpuEvent = done, previous: CpuEvent | None = previous,
                    sleep: float = sleep) -> None:
                if previous is not None:
                    previous.synchronize()  # ordered after the other engine's previous job
                with lock:
                    running[side] += 1
                    most[side] = max(most[side], running[side])
                runs[side].append(i)
                if sleep:
                    threading.Event().wait(sleep)
                with lock:
                    running[side] -= 1
                done.set()

            engines[side].submit(job)
            events.append(done)
        plans = [[rng.randrange(n) for _ in range(8)] for _ in range(6)]

        def waits(plan: list[int]) -> Callable[[], None]:
            def run() -> None:
                for k in plan:
                    events[k].synchronize()
                    assert events[k].query()
                    if rng.random() < 0.3:
                        threading.Event().wait(0.0002)
            return run

        waiters = [_waiting(waits(plan)) for plan in plans]
        for thread, raised in waiters:
            assert _joined(thread), f"a waiter never woke (seed={seed}, starve={starve})"
            assert not raised, raised
        events[-1].synchronize()
        events[-2].synchronize()
        assert all(e.query() for e in events)
        assert runs == [list(range(0, n, 2)), list(range(1, n, 2))], f"seed={seed}"
        assert most == [1, 1], f"seed={seed}"
        if starve:
            assert not starved.is_set()  # the waiters ran every job
    finally:
        starved.set()
        backend.close()


@pytest.mark.parametrize("starve", [False, True], ids=["engines-run", "engines-starved"])
def test_close_while_threads_wait_for_copies(starved, starve: bool) -> None:
    """``close()`` on a fourth thread while three threads wait for copies issued before it: every
    copy issued before the close still runs, every wait ends, and the engines' threads end."""
    if not starve:
        starved.set()
    backend = CpuBackend(chaos=ChaosConfig(seed=3, max_delay_s=0.0005), check_order=False)
    try:
        src = [torch.full((256,), float(i)) for i in range(30)]
        dst = [torch.empty(256) for _ in src]
        events = []
        for i, (d, s) in enumerate(zip(dst, src)):
            copy = backend.copy_d2h if i % 2 else backend.copy_h2d
            events.append(copy(d, s, (events[-1],) if events else ()))
        waiters = [_waiting(lambda k=k: [events[j].synchronize() for j in range(k, 30, 3)]) for k in range(3)]
        closer, closer_raised = _waiting(backend.close)
        for thread, raised in waiters:
            assert _joined(thread), "a wait for a copy issued before close() never ended"
            assert not raised, raised
        assert all(torch.equal(d, s) for d, s in zip(dst, src))
        starved.set()  # a starved engine's thread must still take its end for close() to return
        assert _joined(closer) and not closer_raised
        assert not backend._d2h._thread.is_alive() and not backend._h2d._thread.is_alive()
    finally:
        starved.set()
        backend.close()


def test_a_copy_run_by_a_waiter_lets_go_of_its_buffers(starved) -> None:
    """A copy run on the waiting thread (the engines' threads never run) holds neither buffer
    once its event is set: the waiter may free them, and an activation must not outlive its graph."""
    backend = CpuBackend(check_order=False)
    try:
        src, dst = torch.ones(1000), torch.empty(1000)
        refs = weakref.ref(src), weakref.ref(dst)
        event = backend.copy_d2h(dst, src, ())
        del src, dst
        assert all(r() is not None for r in refs)  # held by the queued job
        event.synchronize()
        assert all(r() is None for r in refs)
        assert not starved.is_set()
    finally:
        starved.set()
        backend.close()


def test_a_submit_that_races_close_raises(starved) -> None:
    """A thread submits while another closes the engine: its checks passed before the close, its job
    reaches the queue after the engine's end. The submit raises (the engine is closed) instead of
    queueing a job behind the end, which nothing would run: a wait for it returns at the end and then
    waits forever for its event."""
    engine = _CopyEngine("test-engine")
    real = engine._lock
    paused, go = threading.Event(), threading.Event()

    class PausesTheSubmitter:
        """``engine._lock`` as ``submit`` takes it: the submitting thread stops before it takes it."""

        def __enter__(self) -> bool:
            if threading.current_thread().name == "submitter":
                paused.set()
                go.wait(10)
            return real.__enter__()

        def __exit__(self, *exc: object) -> None:
            real.__exit__(*exc)

    engine._lock = PausesTheSubmitter()
    raised: list[BaseException] = []

    def submit() -> None:
        try:
            engine.submit(lambda: None)
        except RuntimeError as exc:
            raised.append(exc)

    submitter = threading.Thread(target=submit, name="submitter", daemon=True)
    submitter.start()
    try:
        assert paused.wait(10)
        closer, _ = _waiting(engine.close)  # its thread is starved: close() waits for it, on the closer
        for _ in range(10000):
            with real:
                if None in engine._jobs:
                    break
            threading.Event().wait(0.001)
        else:
            raise AssertionError("close() never queued the engine's end")
    finally:
        go.set()
    assert _joined(submitter)
    starved.set()
    assert _joined(closer)
    assert len(raised) == 1 and "is closed" in str(raised[0]), raised


def test_a_ctrl_c_in_a_job_a_waiter_runs_leaves_the_engine_working(starved) -> None:
    """NOTE [Ctrl-C in a copy a waiter runs]: the job goes back to the front of the queue and runs again;
    the engine is not failed."""
    engine = _CopyEngine("test-engine")
    done = threading.Event()
    runs = [0]

    def interrupted_once() -> None:
        runs[0] += 1
        if runs[0] == 1:
            raise KeyboardInterrupt
        done.set()

    engine.submit(interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        engine.run_until(done)
    assert engine.error is None and not done.is_set()
    engine.run_until(done)
    assert done.is_set() and runs[0] == 2
    after = threading.Event()
    engine.submit(after.set)
    engine.run_until(after)
    starved.set()
    engine.close()


@pytest.mark.parametrize("where", ["after-the-memmove", "after-letting-go"])
def test_a_ctrl_c_in_a_copy_the_training_thread_runs_is_copied_once_more_or_just_signalled(starved, monkeypatch, where: str) -> None:
    backend = CpuBackend(check_order=False)
    interrupts = [1]
    if where == "after-the-memmove":
        memmove = cpu.ctypes.memmove

        def interrupting_memmove(*args):  # noqa: ANN002, ANN202
            memmove(*args)
            if interrupts[0]:
                interrupts[0] -= 1
                raise KeyboardInterrupt

        monkeypatch.setattr(cpu.ctypes, "memmove", interrupting_memmove)
    else:
        set_event = cpu.CpuEvent.set

        def interrupting_set(self) -> None:  # noqa: ANN001
            if interrupts[0]:
                interrupts[0] -= 1
                raise KeyboardInterrupt
            set_event(self)

        monkeypatch.setattr(cpu.CpuEvent, "set", interrupting_set)
    try:
        src, dst = torch.arange(1000.0), torch.zeros(1000)
        event = backend.copy_d2h(dst, src, ())
        with pytest.raises(KeyboardInterrupt):
            event.synchronize()
        event.synchronize()
        assert torch.equal(dst, src) and interrupts[0] == 0
        again = torch.zeros(1000)
        backend.copy_d2h(again, src, ()).synchronize()  # the engine still works
        assert torch.equal(again, src)
    finally:
        starved.set()
        backend.close()
