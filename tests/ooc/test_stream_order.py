"""The CPU backend's stream-order checker (NOTE [stream-order checker] in ooc.backend.order).

First the rules, each on a bare backend: a copy into a compute-allocated buffer needs an event after
the allocation; a copy of a tensor written after its event reads unfinished work; a host read of a
D2H destination needs the copy's event; a pooled host buffer is not rewritten before its last copy;
an allocation may not take memory another thread's compute still uses. Then the races it found in
ooc, each a test that failed before its fix.
"""

from __future__ import annotations

import copy
import os
import queue
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn as nn

import ooc
from ooc.backend import ChaosConfig, CpuBackend
from ooc.backend.arena import MIN_CHUNK
from ooc.backend.order import StreamOrderError
from ooc.checkpoint import MODEL_FILE, Checkpointer
from ooc.models import GPT
from ooc.optim import HostAdamW
from ooc.pool import HostPool
from ooc.scheduler.plan import Plan
from tests.helpers import gpt_batch


@pytest.fixture
def backend():
    b = CpuBackend(chaos=ChaosConfig(seed=1, max_delay_s=0.001), check_order=True)
    yield b
    b.synchronize()
    b.close()


# the rules ---------------------------------------------------------------------------------------

def test_a_copy_into_a_compute_allocated_buffer_waits_for_the_allocation(backend: CpuBackend) -> None:
    host, dev = backend.host_buffer(64), backend.device_buffer(64)
    with pytest.raises(StreamOrderError, match=r"device buffer .* allocated by device_buffer .* H2D copy"):
        backend.copy_h2d(dev, host, ())
    backend.wait_compute(backend.copy_h2d(dev, host, (backend.record_compute(),)))
    assert dev.sum().item() == host.sum().item()


def test_a_copy_of_a_tensor_written_after_its_event_is_caught(backend: CpuBackend) -> None:
    x = torch.ones(16)
    host = backend.host_buffer(64).view(torch.float32)
    event = backend.record_compute()
    x.mul_(2)  # a kernel queued after the event: the copy may read x before it ran
    with pytest.raises(StreamOrderError, match=r"aten::mul_ on compute\[.*\] .* D2H copy"):
        backend.copy_d2h(host, x, (event,))
    backend.copy_d2h(host, x, (backend.record_compute(),)).synchronize()
    assert host.tolist() == [2.0] * 16


def test_compute_reading_a_copy_destination_waits_for_the_copy(backend: CpuBackend) -> None:
    host, dev = backend.host_buffer(64).view(torch.float32), backend.device_buffer(64).view(torch.float32)
    host.fill_(3)
    done = backend.copy_h2d(dev, host, (backend.record_compute(),))
    with pytest.raises(StreamOrderError, match="wait_compute"):
        dev.sum()
    backend.wait_compute(done)
    assert dev.sum().item() == 48


def test_a_host_read_of_a_d2h_destination_waits_for_its_event(backend: CpuBackend) -> None:
    x = torch.arange(16, dtype=torch.float32)
    host = backend.host_buffer(64).view(torch.float32)
    done = backend.copy_d2h(host, x, (backend.record_compute(),))
    with pytest.raises(StreamOrderError, match=r"read\) on host"):
        host.clone()
    done.synchronize()
    assert torch.equal(host.clone(), x)


def test_a_host_buffer_is_not_rewritten_before_its_last_copy(backend: CpuBackend) -> None:
    host, dev = backend.host_buffer(64), backend.device_buffer(64)
    backend.copy_h2d(dev, host, (backend.record_compute(),))
    x = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(StreamOrderError, match="last reader"):
        backend.copy_d2h(host, x, (backend.record_compute(),))  # reuse without waiting for the H2D


def test_the_pool_waits_for_the_last_copy_before_reuse(backend: CpuBackend) -> None:
    pool = HostPool(backend)
    host = pool.acquire(MIN_CHUNK)  # fills the arena's chunk: the next buffer must reuse these bytes
    dev = backend.device_buffer(MIN_CHUNK)
    read = backend.copy_h2d(dev, host, (backend.record_compute(),))
    pool.release(host, read)
    again = pool.acquire(MIN_CHUNK)
    assert again.data_ptr() == host.data_ptr()
    assert pool.allocated_bytes == MIN_CHUNK
    backend.copy_d2h(again, torch.zeros(MIN_CHUNK, dtype=torch.uint8), (backend.record_compute(),)).synchronize()


def test_the_pool_prefers_a_buffer_whose_last_copy_is_done() -> None:
    class Pending:
        def query(self) -> bool:
            return False

        def synchronize(self) -> None:
            raise AssertionError("the pool waited for a copy still in flight while an idle buffer was free")

    class Done:
        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    pool = HostPool(CpuBackend(check_order=False))
    idle, busy = pool.acquire(100), pool.acquire(100)
    pool.release(idle, Done())
    pool.release(busy, Pending())  # LIFO would hand this one out next
    assert pool.acquire(100).data_ptr() == idle.data_ptr()


def test_an_allocation_over_memory_another_threads_compute_still_uses_is_caught(backend: CpuBackend) -> None:
    backend.record_compute()  # the main thread issues device work: the checker watches it

    def use_on_another_thread(victim: torch.Tensor) -> None:
        def work() -> None:
            backend.record_compute()  # this thread issues device work too
            victim.add_(1)  # queued on that thread's compute stream, never waited for

        worker = threading.Thread(target=work)
        worker.start()
        worker.join()

    with pytest.raises(StreamOrderError, match=r"use after free: aten::empty .* aten::add_ on compute\[Thread"):
        # Until the CPU allocator hands a freed block straight back (it does within a few tries).
        for _ in range(50):
            victim = torch.empty(1024).zero_()  # every allocation here is an aten::empty, whichever reuses
            use_on_another_thread(victim)
            del victim
            torch.empty(1024)


def test_a_block_freed_and_reallocated_on_another_thread_is_no_use_after_free(backend: CpuBackend) -> None:
    """The CPU allocator hands a block one thread freed to another thread's allocation; CUDA's
    caching allocator keeps a pool per stream and never does (e.g. a host copy made by
    ``.to("cpu")`` on the optimizer's exchange thread: CI's false positive). The same block
    allocated again on the stream that allocated it, before another thread's use is ordered, is
    still a use after free. (Storages over one bytearray stand for the reused block: each is a new
    storage at the same address, whatever the allocator does.)"""
    block = bytearray(256)
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    results: queue.SimpleQueue = queue.SimpleQueue()

    def allocate(what: str) -> torch.Tensor:
        tensor = torch.frombuffer(block, dtype=torch.float32)
        backend._checker.allocated(tensor, what, host=False)
        return tensor

    def serve() -> None:  # thread B: one compute stream for all its jobs
        backend.record_compute()  # this thread issues device work: the checker watches it
        while (job := jobs.get()) is not None:
            try:
                results.put(job())
            except BaseException as exc:  # noqa: BLE001 - raised on the test's thread below
                results.put(exc)

    def on_b(job: Callable[[], object]) -> object:
        jobs.put(job)
        result = results.get()
        if isinstance(result, BaseException):
            raise result
        return result

    worker = threading.Thread(target=serve, name="B")
    worker.start()
    try:
        backend.record_compute()
        allocate("on main").zero_()  # queued on main's compute stream, never waited for; then freed
        theirs = on_b(lambda: allocate("on B"))  # B's pool could not hold main's block: no error
        theirs.zero_()  # main uses B's block, unordered with B; then it is freed
        del theirs
        with pytest.raises(StreamOrderError, match=r"use after free: on B .* aten::zero_ on compute\[MainThread\]"):
            on_b(lambda: allocate("on B"))  # B's own pool hands it back: main may still use it
    finally:
        jobs.put(None)
        worker.join()


@pytest.mark.parametrize("non_blocking", [False, True], ids=["blocking", "non-blocking"])
def test_a_blocking_copy_into_a_host_buffer_is_done_when_it_returns(backend: CpuBackend, non_blocking: bool) -> None:
    """NOTE [a blocking torch copy waits for compute]: ``host.copy_(device)`` returns on CUDA only after
    the copy, so the device tensor may be freed then, whichever thread issued the copy on its own
    stream (the exchange thread's gather of own-master gradients in a data-parallel HostAdamW on the
    plain CPU backend: the checker took the next allocation at their address for a use after free).
    A ``non_blocking`` copy is still queued on that stream when it returns: a use after free.
    (Storages over one bytearray stand for the reused block, as above.)"""
    block = bytearray(256)

    def allocate(what: str) -> torch.Tensor:
        tensor = torch.frombuffer(block, dtype=torch.float32)
        backend._checker.allocated(tensor, what, host=False)
        return tensor

    backend.record_compute()  # the training thread issues device work: the checker watches it
    grad = allocate("the gradient")
    grad.fill_(1)
    written = backend.record_compute()
    host = backend.host_buffer(256).view(torch.float32)
    failures: list[BaseException] = []

    def gather() -> None:  # the exchange thread: its collectives give it a compute stream
        try:
            backend.record_compute()
            written.synchronize()  # the job's event: the gradient is written
            host.copy_(grad, non_blocking=non_blocking)
        except BaseException as exc:  # noqa: BLE001 - raised on the test's thread below
            failures.append(exc)

    worker = threading.Thread(target=gather, name="exchange")
    worker.start()
    worker.join()
    assert not failures, failures
    grad = None  # the job lets go of the gradient once the gather returned
    if non_blocking:
        with pytest.raises(StreamOrderError, match=r"use after free: the next .* aten::copy_ on compute\[exchange\]"):
            allocate("the next")
    else:
        assert allocate("the next").sum().item() == 64


@pytest.mark.parametrize("op", ["mul", "zero", "copy"])
def test_a_foreach_write_on_a_watched_thread_bumps_the_version_counter(backend: CpuBackend, op: str) -> None:
    """NOTE [foreach writes under the checker]: under a dispatch mode torch's in-place foreach ops left
    the version counters alone, so on a watched thread HostAdamW's check of gradients changed after the
    backward missed ``clip_grad_norm_``'s ``_foreach_mul_``. A write bumps the counter once, as unwatched."""
    write = {"mul": lambda ts: torch._foreach_mul_(ts, 0.5), "zero": torch._foreach_zero_,
             "copy": lambda ts: torch._foreach_copy_(ts, [torch.ones(4), torch.ones(4)])}[op]
    backend.record_compute()  # the calling thread is watched from here on
    tensors = [torch.full((4,), 3.0), torch.full((4,), 3.0)]
    before = [t._version for t in tensors]
    write(tensors)
    assert [t._version - v for t, v in zip(tensors, before)] == [1, 1]


def test_the_checker_is_off_unless_asked() -> None:
    b = CpuBackend(check_order=False)
    b.copy_h2d(b.device_buffer(8), b.host_buffer(8), ()).synchronize()
    assert not b.check_order


def test_a_watched_thread_lets_go_of_the_checkers_mode_before_it_ends(backend: CpuBackend) -> None:
    """NOTE [a watched thread ends unwatched]: the mode went only with torch's C++ thread-local state,
    after the thread's end, where its destructor waits for the GIL (at exit: SIGABRT). It is gone
    by the time the thread is seen to have ended, each of 50 times."""
    modes: list[weakref.ref] = []

    def work() -> None:
        backend.record_compute()  # watched from here on: the checker's mode is on this thread's stack
        modes.append(weakref.ref(torch._C._get_dispatch_stack_at(0)))

    kept = 0
    for _ in range(50):
        worker = threading.Thread(target=work)
        worker.start()
        while worker.is_alive():
            pass  # not join(): this thread keeps the GIL, which the old thread-local destructor waited for
        kept += modes[-1]() is not None
    assert len(modes) == 50 and kept == 0


def test_a_process_whose_watched_threads_end_just_before_it_exits_exits_cleanly(tmp_path) -> None:  # noqa: ANN001
    """NOTE [a watched thread ends unwatched]: threads that the checker watched, ending right before the
    interpreter finalized, aborted the process ("terminate called without an active exception") in
    about half of such exits; each of 4 processes here exits with 0."""
    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "script.py"
    script.write_text(
        "import threading\n"
        "from ooc.backend import CpuBackend\n"
        "backend = CpuBackend(check_order=True)\n"
        "backend.close()  # its copy engines end first: nothing else runs at exit\n"
        "threads = [threading.Thread(target=backend.record_compute) for _ in range(8)]\n"
        "for t in threads:\n"
        "    t.start()\n"
        "for t in threads:\n"
        "    t.join()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    runs = [subprocess.Popen([sys.executable, str(script)], cwd=root, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outcomes = []
    for run in runs:
        _, err = run.communicate(timeout=120)
        outcomes.append((run.returncode, err))
    assert all(code == 0 for code, _ in outcomes), [(code, err[-500:]) for code, err in outcomes]
    assert not any("terminate called" in err for _, err in outcomes), outcomes


def test_a_copy_between_host_buffers_waits_on_the_host_for_the_copies_before_it(backend: CpuBackend) -> None:
    """CUDA copies between two host buffers on the calling thread at once, on no stream, whatever
    the ``after`` events: the backend waits on the host for them and for the copies issued before
    on its engine (an H2D copy still reading the destination)."""
    old, new = backend.host_buffer(64), backend.host_buffer(64)
    old.fill_(1)
    new.fill_(2)
    device = backend.device_buffer(64)
    read = backend.copy_h2d(device, old, (backend.record_compute(),))
    backend.copy_h2d(old, new, ())
    backend.wait_compute(read)
    assert torch.equal(device, torch.ones(64, dtype=torch.uint8))


def test_a_backend_that_forgets_the_compute_wait_raises_at_once() -> None:
    class ForgetfulBackend(CpuBackend):
        def wait_compute(self, event) -> None:  # the bug: do not wait for the copy
            return None

    backend = ForgetfulBackend(check_order=True)
    model = GPT("nano")
    ooc.wrap(model, Plan.uniform("swap", 4, min_swap_bytes=4096), backend=backend)
    try:
        with pytest.raises(StreamOrderError, match="H2D copy"):
            model(*gpt_batch())[1].backward()
    finally:
        ooc.unwrap(model)
        backend.close()


# the races it found ------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["keep", "swap"])
def test_weight_streaming_orders_its_copies(policy: str) -> None:
    """Race (a): the stream-in copies waited on nothing, though their buffers were allocated on compute
    (on a GPU: the block just released, its kernels still queued); the gradient went back with a
    blocking copy the checker could not see. Streamed training must still equal plain PyTorch."""
    torch.manual_seed(0)
    plain = GPT("nano")
    model = copy.deepcopy(plain)
    backend = CpuBackend(chaos=ChaosConfig(seed=4, max_delay_s=0.001), check_order=True)
    ooc.wrap(model, Plan.uniform(policy, 4, min_swap_bytes=4096).streaming([1, 2, 3]), backend=backend)
    try:
        for m in (plain, model):
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            for step in range(2):
                torch.manual_seed(step)  # same dropout masks for both
                m(*gpt_batch(seed=step))[1].backward()
                opt.step()
                opt.zero_grad()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
    finally:
        ooc.unwrap(model)
        backend.close()


def test_a_streamed_parameter_is_back_on_the_host_only_after_its_stream_in_read_it() -> None:
    """Race (f): ``release`` pointed ``p.data`` back at the host copy while the block's stream-in copy
    could still be reading it (queued behind the host; a forward without grad has no later sync).
    An in-place write to the weights after the forward (a clamp, an EMA, a load) then ran on the
    host at once, and the forward's kernels read half-new weights."""
    torch.manual_seed(0)
    model = GPT("nano").eval()
    expected = copy.deepcopy(model)(*gpt_batch())[0]
    backend = CpuBackend(chaos=ChaosConfig(seed=2, max_delay_s=0.002), check_order=True)
    ooc.wrap(model, Plan.uniform("keep", 4).streaming([0, 1, 2, 3]), backend=backend)
    try:
        with torch.no_grad():
            logits = model(*gpt_batch())[0]
            for p in model.blocks.parameters():
                p.mul_(0.5)  # on the host copy, at once
        assert torch.equal(logits, expected)
    finally:
        ooc.unwrap(model)
        backend.close()


def test_a_rollback_copies_the_old_weights_in_after_the_forwards_that_read_the_new_ones() -> None:
    """Race (g): with ``rollback``, a forward between the backward and ``zero_grad()`` (warned: it reads
    the new weights) queued kernels that read them; the reset's copies of the old weights into the
    parameters waited on no compute event, and on a GPU overwrote them under those kernels."""
    torch.manual_seed(0)
    model = GPT("nano")
    backend = CpuBackend(chaos=ChaosConfig(seed=2, max_delay_s=0.002), check_order=True)
    ooc.wrap(model, Plan.uniform("keep", 4), backend=backend)
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, backend=backend, rollback=True)
    try:
        model(*gpt_batch())[1].backward()
        with pytest.warns(ooc.optim.UncommittedStepWarning):
            model(*gpt_batch(seed=1))
        opt.zero_grad()  # undoes the step: the old weights go back in
        opt.synchronize()
    finally:
        opt.close()
        ooc.unwrap(model)
        backend.close()


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


def _pipelined_steps(model: nn.Module, opt: HostAdamW, batch, steps: int = 3) -> None:  # noqa: ANN001
    for _ in range(steps):
        model(batch).backward() if not isinstance(batch, tuple) else model(*batch)[1].backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()


def test_delayed_update_copies_weights_in_after_the_backward_read_them() -> None:
    """Race (b): with delayed_update the new weights' H2D copies are issued from the grad hook with no
    event, while the GPU may still run the backward that reads the old weights."""
    torch.manual_seed(0)
    model = GPT("nano")
    backend = CpuBackend(chaos=ChaosConfig(seed=2, max_delay_s=0.001), check_order=True)
    ooc.wrap(model, Plan.uniform("keep", 4), backend=backend)
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, backend=backend, delayed_update=True)
    try:
        _run_and_unwrap_cause(lambda: _pipelined_steps(model, opt, gpt_batch()))
    finally:
        opt.close()
        ooc.unwrap(model)
        backend.close()


def test_delayed_update_writes_a_streamed_host_copy_after_its_stream_in_read_it() -> None:
    """Race (e), which the checker could not see: a streamed parameter's new weights go from the
    staging buffer into its host copy, a copy between host buffers, which CUDA makes on the calling
    thread at once whatever its ``after``; with delayed_update that is in the grad hook, while the
    block's stream-in copy of the old weights for its backward may still be queued. The backends
    now wait on the host first; the training equals the unwrapped one."""
    runs = []
    for streamed in (True, False):
        torch.manual_seed(0)
        model = GPT("nano")
        backend = CpuBackend(chaos=ChaosConfig(seed=2, max_delay_s=0.002), check_order=True)
        if streamed:
            ooc.wrap(model, Plan.uniform("keep", 4).streaming([0, 1, 2, 3]), backend=backend)
        opt = HostAdamW(model.parameters(), lr=1e-2, model=model, backend=backend, delayed_update=True)
        try:
            losses = []

            def train(m=model, o=opt, out=losses) -> None:  # noqa: ANN001
                for step in range(3):
                    torch.manual_seed(step)
                    loss = m(*gpt_batch(seed=step))[1]
                    loss.backward()
                    out.append(loss.item())
                    o.step()
                    o.zero_grad()
                o.synchronize()

            _run_and_unwrap_cause(train)
        finally:
            opt.close()
            if streamed:
                ooc.unwrap(model)
            backend.close()
        runs.append((losses, model))
    (losses, model), (expected, plain) = runs
    assert losses == expected
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))


def test_a_lazy_checkpoint_reads_the_live_weights_after_compute_passed_save(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Race (f), which the checker cannot see (the writer reads a live tensor's bytes through numpy, no
    torch op): a lazy version's writer thread reads each bucket's live device weights while training
    goes on. ``save()``'s ``optimizer.synchronize()`` makes only the compute stream wait for the last
    update's H2D copies into them (the gate), and on CUDA the writer's ``.to("cpu")`` runs on its own
    thread's current stream, the default one: with training on another stream (``with
    torch.cuda.stream(s)``), nothing ordered the read after those copies, and the version held weights
    part from before the last update, part from after it, under valid checksums. The writer now waits
    first for a compute event that ``save()`` records after the gate. Here that event stands for the
    compute stream: the copies it waited for have landed once it completes."""
    torch.manual_seed(0)
    model = GPT("nano")
    backend = CpuBackend(chaos=ChaosConfig(seed=2, max_delay_s=0.001), check_order=False)
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, backend=backend)
    ckpt = Checkpointer(tmp_path, model, opt)
    landed = {}

    class _ComputeAfterTheGate:
        """An event on a compute stream that waited for H2D copies still in flight when save() returned."""

        def __init__(self) -> None:
            self.done = False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            if not self.done:
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        p.copy_(landed[name])
                self.done = True

    try:
        assert ckpt.lazy
        _pipelined_steps(model, opt, gpt_batch(), steps=1)
        landed.update((name, p.detach() + 1) for name, p in model.named_parameters())
        monkeypatch.setattr(backend, "record_compute", _ComputeAfterTheGate)
        ckpt.save(1)
        ckpt.wait()
    finally:
        monkeypatch.undo()
        ckpt.close()
        opt.close()
        backend.close()
    saved = safetensors.torch.load_file(tmp_path / "step-000000001" / MODEL_FILE)
    for name, weight in landed.items():
        assert torch.equal(saved[name], weight), name


def test_the_gradient_copy_follows_the_kernel_that_makes_it_contiguous() -> None:
    """Race (d): the pipeline's compute event was recorded before ``.contiguous()`` built the copy's
    source; a channels_last conv weight's gradient is not contiguous, so the copy read unfinished work."""
    torch.manual_seed(0)
    model = _ConvNet().to(memory_format=torch.channels_last)
    backend = CpuBackend(chaos=ChaosConfig(seed=2, max_delay_s=0.001), check_order=True)
    ooc.wrap(model, Plan.uniform("keep", 2), blocks=list(model.blocks), backend=backend)
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, backend=backend)
    x = torch.randn(2, 4, 8, 8).to(memory_format=torch.channels_last)
    assert not next(model.parameters()).is_contiguous()
    try:
        _run_and_unwrap_cause(lambda: _pipelined_steps(model, opt, x))
    finally:
        opt.close()
        ooc.unwrap(model)
        backend.close()


def test_the_reduced_gradient_leaves_the_device_after_the_collective(tmp_path) -> None:  # noqa: ANN001
    """Race (c): with ``reduce_on="device"`` the D2H copy of the all-reduced gradient waited on nothing,
    though the collective ran on the exchange thread's compute stream (and the gather before it ran
    after the compute event the exchange waited for). One gloo rank in this process drives it."""
    import torch.distributed as dist

    from ooc.distributed import DataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = GPT("nano")
    backend = CpuBackend(chaos=ChaosConfig(seed=2, max_delay_s=0.001), check_order=True)
    ooc.wrap(model, Plan.uniform("keep", 4), backend=backend)
    opt = None
    try:
        opt = HostAdamW(model.parameters(), lr=1e-2, model=model, backend=backend,
                        data_parallel=DataParallel(reduce_on="device", check=False))
        _run_and_unwrap_cause(lambda: _pipelined_steps(model, opt, gpt_batch()))
    finally:
        if opt is not None:
            opt.close()
        ooc.unwrap(model)
        backend.close()
        dist.destroy_process_group()


@pytest.mark.parametrize(("plan", "reduce_on"), [(None, "host"), ("swap", "host"), ("swap", "device")],
                         ids=["unwrapped", "wrapped", "wrapped-device-sum"])
def test_data_parallel_own_master_gradients_are_gathered_with_no_use_after_free(tmp_path, plan: str | None,  # noqa: ANN001
                                                                                 reduce_on: str) -> None:
    """The checker's false positive that kept it off in the data-parallel tests: on the plain CPU
    backend fp32 parameters are their own masters, and the exchange thread gathers their gradients
    into a host buffer for the collective (``aten::copy_`` on its compute stream). The training
    thread's next allocation at a freed gradient's address was reported as a use after free of that
    read, though the copy had returned, as a blocking copy on CUDA does only when it is done (NOTE [a
    blocking torch copy waits for compute]). One gloo rank in this process drives it."""
    import torch.distributed as dist

    from ooc.distributed import DataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = GPT("nano")
    backend = CpuBackend(check_order=True)
    assert not backend.separate_memory  # own masters: the exchange thread gathers the gradients
    if plan is not None:
        ooc.wrap(model, Plan.uniform(plan, 4), backend=backend)
    opt = None
    try:
        opt = HostAdamW(model.parameters(), lr=1e-2, model=model, backend=backend,
                        data_parallel=DataParallel(reduce_on=reduce_on, check=False))
        _run_and_unwrap_cause(lambda: _pipelined_steps(model, opt, gpt_batch()))
        opt.close()
        opt = None
        # The optimizer's buffers are free now (``device_flat`` with a device sum): plain PyTorch's
        # allocations may be handed their memory.
        plain = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            model(*gpt_batch())[1].backward()
            plain.step()
            plain.zero_grad()
    finally:
        if opt is not None:
            opt.close()
        if plan is not None:
            ooc.unwrap(model)
        backend.close()
        dist.destroy_process_group()


def _run_and_unwrap_cause(fn) -> None:  # noqa: ANN001
    """Run ``fn``; a checker error raised on a pipeline thread comes back as the PipelineError's cause."""
    try:
        fn()
    except ooc.OocError as exc:
        cause = exc
        while cause is not None and not isinstance(cause, StreamOrderError):
            cause = cause.__cause__
        raise (cause or exc) from None


def test_a_watch_that_a_backward_node_dropped_is_taken_again() -> None:
    """A thread's first call into the checking backend from inside a backward node (a hook) pushes the
    checker's mode, and autograd drops it when the node returns; the thread's next call outside a
    backward watches it again (it used to count as watched for good, and nothing more was checked)."""
    backend = CpuBackend(check_order=True)
    x = torch.ones(4, requires_grad=True)
    y = x * 2

    def first_call_in_the_backward(grad: torch.Tensor) -> torch.Tensor:
        backend.record_compute()
        return grad

    y.register_hook(first_call_in_the_backward)
    y.sum().backward()
    assert torch._C._len_torch_dispatch_stack() == 0  # the node's mode is gone
    backend.record_compute()
    assert torch._C._len_torch_dispatch_stack() == 1
