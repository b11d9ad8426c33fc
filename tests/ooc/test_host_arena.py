"""The host arena (NOTE [host arena] in ooc.backend.arena): DMA buffers carved from a few chunks.

On the CPU backend the arena is the same code as on CUDA with pageable chunks, so carving, alignment,
reuse under the event rule, growth and accounting are all checked here; the stream-order checker
sees each slice as a buffer of its own and reports a slice reused before its last copy ended.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn as nn

import ooc
from ooc.backend import ChaosConfig, CpuBackend
from ooc.backend.arena import ALIGN, MAX_GROWTH, MIN_CHUNK, HostArena, address_of, aligned_chunk, chunk_bytes
from ooc.backend.cpu import CpuEvent
from ooc.backend.order import StreamOrderError
from ooc.optim import HostAdamW


def _arena() -> HostArena:
    return HostArena(aligned_chunk)


def _aligned(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


@pytest.fixture
def checked():
    b = CpuBackend(chaos=ChaosConfig(seed=3, max_delay_s=0.001), check_order=True)
    yield b
    b.synchronize()
    b.close()


@pytest.mark.parametrize("sizes", [(1, 7, 4097, 0, 512, 513), (MIN_CHUNK - ALIGN, 1, 1)], ids=["odd", "to_the_brim"])
def test_slices_are_aligned_disjoint_and_counted_as_requested(sizes: tuple[int, ...]) -> None:
    arena = _arena()
    pieces = [arena.alloc(n) for n in sizes]
    spans = sorted((address_of(p), address_of(p) + _aligned(n)) for p, n in zip(pieces, sizes))
    assert all(p.dtype == torch.uint8 and p.numel() == n for p, n in zip(pieces, sizes))
    assert all(start % ALIGN == 0 for start, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), "two slices overlap"
    assert arena.requested_bytes == sum(sizes)
    assert arena.used_bytes == sum(_aligned(n) for n in sizes)
    assert arena.used_bytes - arena.requested_bytes < ALIGN * len(sizes)
    assert arena.reserved_bytes == MIN_CHUNK * arena.chunks
    for p in pieces:
        arena.free(p)
    assert (arena.used_bytes, arena.requested_bytes) == (0, 0)


def test_writes_to_one_slice_stay_in_it() -> None:
    arena = _arena()
    a, b = arena.alloc(1000), arena.alloc(1000)
    a.fill_(1)
    b.fill_(2)
    assert a.sum().item() == 1000 and b.sum().item() == 2000


def test_the_arena_grows_in_power_of_two_chunks_and_reuses_freed_bytes() -> None:
    arena = _arena()
    first = arena.alloc(MIN_CHUNK)
    assert (arena.chunks, arena.reserved_bytes) == (1, MIN_CHUNK)
    big = arena.alloc(3 * MIN_CHUNK)  # larger than the doubling step: the power of two above it
    assert (arena.chunks, arena.reserved_bytes) == (2, MIN_CHUNK + 4 * MIN_CHUNK)
    small = arena.alloc(MIN_CHUNK)  # fits in the big chunk's tail: no growth
    assert arena.chunks == 2
    arena.free(first)
    again = arena.alloc(MIN_CHUNK // 2)
    assert again.data_ptr() == first.data_ptr() and arena.chunks == 2
    arena.alloc(MIN_CHUNK // 2)
    arena.alloc(MIN_CHUNK)  # every byte is in use now: a third chunk, as large as the arena's power of two
    assert arena.chunks == 3 and arena.reserved_bytes == MIN_CHUNK + 4 * MIN_CHUNK + 4 * MIN_CHUNK
    del big, small


def test_chunks_are_powers_of_two_doubling_up_to_max_growth() -> None:
    reserved, sizes = 0, []
    for _ in range(40):
        sizes.append(chunk_bytes(ALIGN, reserved))
        reserved += sizes[-1]
    assert all(s & (s - 1) == 0 for s in sizes), "a chunk torch's pinned allocator would round up"
    assert sizes[:3] == [MIN_CHUNK, MIN_CHUNK, 2 * MIN_CHUNK] and max(sizes) == MAX_GROWTH
    assert sizes[-1] == MAX_GROWTH
    # The free tail is at most one chunk: past MAX_GROWTH it is a bounded share of what is held.
    assert reserved > 16 * MAX_GROWTH
    # A slice larger than MAX_GROWTH gets the power of two above it (and the rest serves later slices).
    assert chunk_bytes(MAX_GROWTH + 1, reserved) == 2 * MAX_GROWTH


def test_a_freed_slice_is_reused_only_after_its_event() -> None:
    arena = _arena()
    piece = arena.alloc(MIN_CHUNK)  # the whole chunk: the next slice can only be this one
    copy_done = CpuEvent()
    arena.free(piece, copy_done)
    finished_at = []
    timer = threading.Timer(0.2, lambda: (finished_at.append(time.monotonic()), copy_done.set()))
    timer.start()
    again = arena.alloc(MIN_CHUNK)
    returned_at = time.monotonic()
    timer.join()
    assert again.data_ptr() == piece.data_ptr() and arena.chunks == 1
    assert copy_done.query() and finished_at and returned_at >= finished_at[0]


def test_a_slice_whose_copies_are_done_is_preferred_and_busy_bytes_are_not_merged() -> None:
    class Pending:
        def query(self) -> bool:
            return False

        def synchronize(self) -> None:
            raise AssertionError("the arena waited for a copy still in flight while idle bytes were free")

    arena = _arena()
    busy, idle, rest = arena.alloc(4096), arena.alloc(4096), arena.alloc(MIN_CHUNK - 8192)
    arena.free(busy, Pending())
    arena.free(idle, CpuEvent(done=True))
    again = arena.alloc(4096)
    assert again.data_ptr() == idle.data_ptr()
    arena.free(again, CpuEvent(done=True))
    # 8 KiB would fit where busy and idle lie side by side, but busy's copy is not done: a new chunk.
    arena.alloc(8192)
    assert arena.chunks == 2
    del rest


def test_free_bytes_whose_copies_are_done_merge() -> None:
    arena = _arena()
    pieces = [arena.alloc(MIN_CHUNK // 4) for _ in range(4)]
    for p in pieces:
        arena.free(p, CpuEvent(done=True))
    whole = arena.alloc(MIN_CHUNK)
    assert whole.data_ptr() == pieces[0].data_ptr() and arena.chunks == 1


def test_freeing_twice_is_an_error() -> None:
    arena = _arena()
    piece = arena.alloc(10)
    arena.free(piece)
    arena.free(piece)
    with pytest.raises(ValueError, match="freed twice"):
        arena.alloc(10)


# with the stream-order checker -------------------------------------------------------------------

def test_the_checker_sees_each_slice_as_its_own_buffer(checked: CpuBackend) -> None:
    a, b = checked.arena.alloc(64), checked.arena.alloc(64)
    x = torch.arange(64, dtype=torch.uint8)
    done = checked.copy_d2h(a, x, (checked.record_compute(),))
    b.fill_(1)  # another slice of the same chunk: no conflict with the copy into a
    with pytest.raises(StreamOrderError, match=r"read\) on host"):
        a.clone()  # the copy into a is not known to be done
    done.synchronize()
    assert torch.equal(a.clone(), x)


def test_the_checker_catches_a_slice_reused_before_its_last_copy(checked: CpuBackend) -> None:
    arena = checked.arena
    piece = arena.alloc(MIN_CHUNK)
    read = checked.copy_h2d(checked.device_buffer(MIN_CHUNK), piece, (checked.record_compute(),))
    arena.free(piece)  # the bug: freed without the event of the copy still reading it
    with pytest.raises(StreamOrderError, match="reuse of a pinned buffer in flight"):
        arena.alloc(MIN_CHUNK)
    read.synchronize()


def test_the_checker_accepts_a_slice_freed_with_its_event(checked: CpuBackend) -> None:
    arena = checked.arena
    piece = arena.alloc(MIN_CHUNK)
    read = checked.copy_h2d(checked.device_buffer(MIN_CHUNK), piece, (checked.record_compute(),))
    arena.free(piece, read)
    again = arena.alloc(MIN_CHUNK)
    checked.copy_d2h(again, torch.zeros(MIN_CHUNK, dtype=torch.uint8), (checked.record_compute(),)).synchronize()


# the runtime's buffers ---------------------------------------------------------------------------

def test_the_swap_pool_and_the_optimizer_share_the_arena_and_give_back_their_bytes(checked: CpuBackend) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    ooc.wrap(model, ooc.Plan.uniform("swap", 4, min_swap_bytes=1), backend=checked)
    try:
        opt = HostAdamW(model.parameters(), model=model)
        transfer = sum(2 * _aligned(p.numel() * 4) for p in model.parameters())  # gradient in, weights out
        assert checked.arena.used_bytes == transfer
        chunk_ptrs = [(c.data_ptr(), c.data_ptr() + c.numel()) for c in checked.arena._chunks]
        for state in opt.state.values():  # masters and moments are host-only: pageable, not in the arena
            for t in state.values():
                assert not any(lo <= t.data_ptr() < hi for lo, hi in chunk_ptrs)
        x = torch.randn(8, 64)
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        report = ooc.memory_report(model)
        assert report.host_pool_bytes == checked.arena.reserved_bytes
        assert checked.arena.used_bytes == transfer  # every swapped buffer went back
        opt.close()
        assert checked.arena.used_bytes == 0
    finally:
        ooc.unwrap(model)
