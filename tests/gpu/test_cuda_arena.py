"""The pinned host arena on CUDA (NOTE [host arena] in ooc.backend.arena): the page-locked bytes torch
holds for ooc are the arena's chunks, with nothing rounded up behind them, and what is carved from
them is what was asked for, rounded to the arena's alignment."""

from __future__ import annotations

import pytest
import torch

from ooc.backend.arena import ALIGN

pytestmark = pytest.mark.gpu

SIZES = [3 << 20, 5_000_001, 1, 123_457, 7 << 20, 640 << 10, 33]


def _pinned_bytes() -> int:
    """Pinned bytes handed out by torch's host allocator (blocks at their rounded size), cached
    ones not counted: newer torch calls them active bytes, older ones allocated bytes."""
    stats = torch.cuda.host_memory_stats()
    return stats.get("active_bytes.current", stats["allocated_bytes.current"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_bytes_are_the_arenas_and_within_alignment_of_the_request() -> None:
    if not hasattr(torch.cuda, "host_memory_stats"):
        pytest.skip("this torch has no torch.cuda.host_memory_stats")
    from ooc.backend.cuda import CudaBackend

    backend = CudaBackend()
    before = _pinned_bytes()
    pieces = [backend.arena.alloc(n) for n in SIZES]
    assert all(p.is_pinned() and p.data_ptr() % ALIGN == 0 for p in pieces)
    requested = sum(SIZES)
    assert backend.arena.requested_bytes == requested
    assert requested <= backend.arena.used_bytes < requested + ALIGN * len(SIZES)
    # Every pinned byte torch added is a chunk of the arena: no power-of-two rounding per buffer.
    assert _pinned_bytes() - before == backend.arena.reserved_bytes
    # The chunks double with the arena: what is pinned and not carved is less than what is carved.
    assert backend.arena.reserved_bytes - backend.arena.used_bytes < backend.arena.used_bytes
    # A DMA round trip through a slice.
    x = torch.arange(SIZES[0], dtype=torch.uint8, device="cuda")
    pieces[0].copy_(x, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(pieces[0].cuda(), x)
