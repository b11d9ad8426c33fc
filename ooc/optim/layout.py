"""Where each bucket's parameters, gradients and new weights sit on the host.

A bucket's parameters are split by dtype into segments; each segment is laid out in flat host
buffers (the gradients copied out, the new weights to copy in), with its parameters ordered by owner
rank so that, sharded, each owner's range is contiguous. Everything here is allocated once, when
the optimizer is built: a buffer allocated each step costs its page faults (~35 ms per 57 MB on the
CI machine) and, on CUDA, a pinned allocation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ooc.backend import Backend
from ooc.optim.buckets import Bucket


@dataclass
class Segment:
    """The parameters of one bucket that share a dtype, laid out in one flat host buffer.

    Every buffer is 1-D with one element per parameter element; ``views`` cuts it into per-parameter
    views of the parameters' shapes. Parameters are ordered by owner rank (sharded).
    """

    params: list[torch.Tensor]
    offsets: list[int]
    dtype: torch.dtype
    owners: list[int]
    host_grad: torch.Tensor | None = None
    """Gradients on the host, in the parameters' dtype (``None`` for own-master segments)."""
    staging: torch.Tensor | None = None
    """New weights in the parameters' dtype, the source of the H2D copies."""
    flat: torch.Tensor | None = None
    """Data parallel, own-master parameters: their gradients side by side for one collective, and
    the owners' new weights for the broadcast."""
    device_flat: torch.Tensor | None = None
    """``reduce_on="device"``: the gradients side by side on the device."""
    grad32: torch.Tensor | None = None
    """Parameters not in fp32: the fp32 gradients this rank updates with, for the elements
    ``mine[0]:mine[1]`` of the segment. Buckets may share this memory (see :func:`make_layout`)."""
    mine: tuple[int, int] = (0, 0)
    """The elements of the segment this rank updates (sharded: its owner range; else all)."""

    @property
    def numel(self) -> int:
        return self.offsets[-1] + self.params[-1].numel() if self.params else 0

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a segment-sized 1-D buffer."""
        return [flat[o:o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]

    def weight_views(self, flat: torch.Tensor, homes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per-parameter views of a segment-sized 1-D buffer with the strides of each parameter's
        home (``homes``, in the segment's order): a copy into such a view lays the weights out as
        their home holds them (channels_last too), so the H2D copy moves the bytes as they are."""
        return [flat[o:o + p.numel()].as_strided(h.shape, h.stride()) for p, o, h in zip(self.params, self.offsets, homes)]

    def grad32_view(self, index: int) -> torch.Tensor:
        """The fp32 gradient buffer of the ``index``-th parameter (one this rank updates)."""
        p, start = self.params[index], self.offsets[index] - self.mine[0]
        return self.grad32[start:start + p.numel()].view_as(p)

    def owner_ranges(self, world: int) -> list[tuple[int, int, int]]:
        """(owner, start, end) of each owner's contiguous range; empty ranges left out."""
        ranges = []
        for rank in range(world):
            idx = [i for i, o in enumerate(self.owners) if o == rank]
            if idx:
                start = self.offsets[idx[0]]
                end = self.offsets[idx[-1]] + self.params[idx[-1]].numel()
                ranges.append((rank, start, end))
        return ranges


@dataclass(frozen=True)
class Layout:
    """The buckets, their segments and the facts about each parameter the stages look up (by ``id``)."""

    buckets: tuple[Bucket, ...]
    segments: tuple[tuple[Segment, ...], ...]
    """Per bucket, its segments."""
    params: dict[int, torch.Tensor]
    own: dict[int, bool]
    """The parameter is its own fp32 master (host fp32 on the plain CPU backend): no copies."""
    owner: dict[int, int]
    home: dict[int, torch.Tensor]
    """Where the weights the device reads live: the parameter itself, or a streamed parameter's
    host copy (NOTE [streamed parameters] in ooc.streaming)."""
    norm_order: tuple[torch.Tensor, ...]
    """Every parameter in the optimizer's order (the device-kept ones too, ``device_params_below``):
    the order of the clipping norms, as ``clip_grad_norm_`` stacks them."""
    rank: int
    world: int
    sharded: bool

    def mine(self, p: torch.Tensor) -> bool:
        """This rank updates ``p`` (always, unless sharded)."""
        return not self.sharded or self.owner[id(p)] == self.rank


def dense(t: torch.Tensor) -> bool:
    """The elements of ``t`` fill ``t.numel()`` consecutive places of its storage, in some order
    (contiguous, or a permutation such as channels_last)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def storage_span(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's memory as a 1-D tensor, in storage order (the bytes a copy engine moves)."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def grad32_elements(buckets: Sequence[Bucket], mine: Callable[[torch.Tensor], bool], *, per_bucket: bool) -> int:
    """Elements of the fp32 gradient buffer: the non-fp32 parameters this rank updates, of the
    largest bucket (one bucket is updated at a time), or of all buckets when every bucket's fp32
    gradients must live until ``step()`` (``per_bucket``: clipping needs the global norm first)."""
    sizes = [sum(p.numel() for p in b.params if p.dtype != torch.float32 and mine(p)) for b in buckets]
    return (sum(sizes) if per_bucket else max(sizes, default=0))


def make_layout(
    buckets: Sequence[Bucket],
    *,
    backend: Backend,
    own_master: Callable[[torch.Tensor], bool],
    home: dict[int, torch.Tensor],
    owner: dict[int, int],
    norm_order: Sequence[torch.Tensor],
    rank: int = 0,
    world: int = 1,
    sharded: bool = False,
    exchange: bool = False,
    reduce_on_device: bool = False,
    grad32_per_bucket: bool = False,
) -> Layout:
    """Lay out ``buckets`` and allocate their buffers.

    ``exchange``: gradients are summed across ranks (own-master segments get a ``flat`` buffer);
    ``reduce_on_device``: summed on the device first (a ``device_flat`` per segment);
    ``grad32_per_bucket``: each bucket its own fp32 gradient memory, else all share the largest's.
    """
    own = {id(p): own_master(p) for b in buckets for p in b.params}
    params = {id(p): p for b in buckets for p in b.params}
    segments = tuple(tuple(_segments(b, backend, own, owner, exchange, reduce_on_device)) for b in buckets)
    layout = Layout(tuple(buckets), segments, params, own, owner, home, tuple(norm_order), rank, world, sharded)
    for per_bucket in segments:
        for seg in per_bucket:
            for p in seg.params if seg.staging is not None else ():
                if not dense(home[id(p)]):
                    raise ValueError(
                        f"HostAdamW copies weights as dense blocks of memory, but a parameter of shape "
                        f"{tuple(p.shape)} has strides {p.stride()}; make it contiguous (or channels_last)"
                    )
            ranges = {r: (s, e) for r, s, e in seg.owner_ranges(world)} if sharded else {rank: (0, seg.numel)}
            seg.mine = ranges.get(rank, (0, 0))
    total = grad32_elements(buckets, layout.mine, per_bucket=grad32_per_bucket)
    # Gradients leave the device in the parameters' dtype; AdamW runs in fp32 on this buffer.
    grad32 = torch.empty(total, dtype=torch.float32)
    offset = 0
    for per_bucket in segments:
        start = offset
        for seg in per_bucket:
            if seg.dtype != torch.float32:
                n = seg.mine[1] - seg.mine[0]
                seg.grad32 = grad32[start:start + n]
                start += n
        if grad32_per_bucket:
            offset = start
    return layout


def release_buffers(layout: Layout, backend: Backend) -> None:
    """Give the layout's DMA buffers back to the backend's arena (the optimizer is closing and no
    thread of it runs any more). The host waits for every copy issued on the backend first: the
    last copies into or out of these buffers may still run."""
    backend.synchronize()
    for per_bucket in layout.segments:
        for seg in per_bucket:
            for name in ("host_grad", "staging", "flat"):
                buffer = getattr(seg, name)
                if buffer is not None:
                    backend.arena.free(buffer)
                    setattr(seg, name, None)


def _segments(bucket: Bucket, backend: Backend, own: dict[int, bool], owner: dict[int, int], exchange: bool,
              reduce_on_device: bool) -> list[Segment]:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in bucket.params:
        by_dtype.setdefault(p.dtype, []).append(p)
    segments = []
    for dtype, params in by_dtype.items():
        params = sorted(params, key=lambda p: owner[id(p)])  # stable: keeps registration order
        offsets = _offsets(params)
        total = sum(p.numel() for p in params)
        seg = Segment(params, offsets, dtype, [owner[id(p)] for p in params])
        nbytes = total * torch.empty((), dtype=dtype).element_size()
        # The gradient and staging buffers are DMA buffers, so slices of the backend's arena (pinned
        # on CUDA, NOTE [host arena]): the copy engines read and write them. (Own-master segments,
        # hence ``flat``, exist only on the plain CPU backend, whose arena is pageable.)
        if not all(own[id(p)] for p in params):
            seg.host_grad = backend.arena.alloc(nbytes).view(dtype)
            seg.staging = backend.arena.alloc(nbytes).view(dtype)
        elif exchange:
            seg.flat = backend.arena.alloc(nbytes).view(dtype)
        if reduce_on_device:
            seg.device_flat = backend.device_buffer(nbytes).view(dtype)
        segments.append(seg)
    return segments


def _offsets(params: Sequence[torch.Tensor]) -> list[int]:
    out, total = [], 0
    for p in params:
        out.append(total)
        total += p.numel()
    return out
