"""Packing many small tensors into one buffer (``pack``) and back (``unpack``).

On CUDA tensors with CuPy installed, one launch of ``pack.cu``'s ``copy_many`` on PyTorch's current
stream of the tensors' device (the buffer may be pinned host memory: the kernel reads and writes it
through the unified address space, which pageable memory is not part of); everywhere else the torch
reference (``torch_pack`` / ``torch_unpack``: slice assignments), which is also the spec. The
argument checks run first on every path. CuPy is imported on first use, never at import time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources

import torch

ALIGN = 16
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y; the kernel strides over more copies than that
THREADS = 256


@dataclass(frozen=True)
class PackLayout:
    """Where each tensor lives in the packed buffer: byte offsets (16-aligned) and sizes, shapes, dtypes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]

    @property
    def nbytes(self) -> int:
        return (self.offsets[-1] + self.sizes[-1]) if self.offsets else 0


def layout_of(tensors: list[torch.Tensor]) -> PackLayout:
    if not tensors:
        raise ValueError("pack needs at least one tensor")
    device = tensors[0].device
    offsets, sizes, offset = [], [], 0
    for k, t in enumerate(tensors):
        if t.device != device:
            raise ValueError(f"tensor {k} is on {t.device}, the first on {device}; pack tensors of one device")
        if not t.is_contiguous():
            raise ValueError(f"tensor {k} is not contiguous; pass t.contiguous()")
        offsets.append(offset)
        sizes.append(t.numel() * t.element_size())
        offset += -(-sizes[-1] // ALIGN) * ALIGN
    return PackLayout(tuple(offsets), tuple(sizes), tuple(t.shape for t in tensors), tuple(t.dtype for t in tensors))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def torch_pack(tensors: list[torch.Tensor], out: torch.Tensor, layout: PackLayout) -> None:
    for t, offset, size in zip(tensors, layout.offsets, layout.sizes):
        out[offset : offset + size].copy_(_bytes(t), non_blocking=True)


def torch_unpack(buffer: torch.Tensor, layout: PackLayout, device: torch.device) -> list[torch.Tensor]:
    result = []
    for offset, size, shape, dtype in zip(layout.offsets, layout.sizes, layout.shapes, layout.dtypes):
        t = torch.empty(shape, dtype=dtype, device=device)
        _bytes(t).copy_(buffer[offset : offset + size], non_blocking=True)
        result.append(t)
    return result


def check_pack(tensors: list[torch.Tensor], out: torch.Tensor, layout: PackLayout) -> None:
    """``out`` must be a contiguous 1-D ``uint8`` tensor of at least ``layout.nbytes`` on the tensors' device, or
    in pinned host memory when they are on an accelerator (the kernel writes it in place, asynchronously)."""
    if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous() or out.numel() < layout.nbytes:
        raise ValueError(f"out must be a 1-D uint8 tensor of at least {layout.nbytes} bytes, contiguous "
                         "(the kernel writes at out.data_ptr() + offset)")
    _check_host_side(out, tensors[0].device, "out")


def check_unpack(buffer: torch.Tensor, layout: PackLayout, device: torch.device) -> None:
    """``buffer`` must be a contiguous 1-D ``uint8`` tensor of at least ``layout.nbytes`` on ``device``, or in
    pinned host memory when ``device`` is an accelerator."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError("buffer must be a 1-D uint8 tensor, contiguous (the kernel reads at buffer.data_ptr() + offset)")
    if buffer.numel() < layout.nbytes:
        raise ValueError(f"buffer holds {buffer.numel()} bytes, the layout needs {layout.nbytes}")
    _check_host_side(buffer, device, "buffer")


def _check_host_side(buffer: torch.Tensor, device: torch.device, name: str) -> None:
    if buffer.device == device or (device.type == "cpu" and buffer.device.type == "cpu"):
        return
    if buffer.device.type == "cpu" and device.type != "cpu":
        if not buffer.is_pinned():
            raise ValueError(f"{name} is pageable host memory; a copy to or from {device} needs pinned memory "
                             f"(torch.empty(n, dtype=torch.uint8, pin_memory=True))")
        return
    raise ValueError(f"{name} is on {buffer.device}; it must be on {device} or in pinned host memory")


def copy_table(src: list[int], dst: list[int], sizes: tuple[int, ...]) -> list[list[int]]:
    """The kernel's metadata, one column per copy: source and destination addresses, byte counts, and
    whether both addresses are 16-byte aligned (the kernel then moves 16-byte words)."""
    vector_ok = [int((s | d) % ALIGN == 0) for s, d in zip(src, dst)]
    return [list(src), list(dst), list(sizes), vector_ok]


def launch_grid(sizes: tuple[int, ...]) -> tuple[int, int]:
    """(blocks along bytes, blocks along copies): enough blocks for the largest copy's 16-byte words,
    at most 1024; one row of blocks per copy up to CUDA's gridDim.y limit (the kernel strides past it)."""
    blocks_x = max(1, min(1024, -(-max(sizes) // (THREADS * 16))))
    return blocks_x, min(len(sizes), MAX_GRID_Y)


@functools.cache
def _module():
    import cupy  # optional extra: ooc[cuda]

    return cupy.RawModule(code=resources.files("ooc.kernels").joinpath("pack.cu").read_text())


def _cupy_ready(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


class _StreamHandle:
    """A raw ``cudaStream_t`` as an object of the CUDA stream protocol (``__cuda_stream__``: version
    0 and the handle), which CuPy's ``Stream.from_external`` takes."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.ptr


def cupy_stream(cupy, stream: torch.cuda.Stream):  # noqa: ANN001, ANN201 - cupy is an optional import
    """``stream`` (PyTorch's) as a CuPy stream that CuPy does not own: ``Stream.from_external`` from
    CuPy 14 on, which deprecates ``ExternalStream``; ``ExternalStream`` on older CuPy, which has no
    ``from_external``. Either launches on the very stream PyTorch queued the tensors' producers on."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:
        return cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index)
    return from_external(_StreamHandle(stream.cuda_stream))


def _launch(device: torch.device, table: list[list[int]], layout: PackLayout) -> None:
    import cupy
    import numpy

    stream = torch.cuda.current_stream(device)
    # Pinned, so the H2D copy of the metadata is asynchronous on `stream` (no sync per call); the
    # caching host allocator keeps `host` until that copy has run, and `meta` is freed on `stream`.
    host = torch.tensor(table, dtype=torch.int64, pin_memory=True)
    meta = host.to(device, non_blocking=True)
    count = len(layout.sizes)
    with cupy.cuda.Device(device.index):  # CuPy launches on its current device, not the tensors'
        with cupy_stream(cupy, stream):
            _module().get_function("copy_many")(
                launch_grid(layout.sizes), (THREADS,),
                (meta[0].data_ptr(), meta[1].data_ptr(), meta[2].data_ptr(), meta[3].data_ptr(), numpy.uint64(count)),
            )


def pack(tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> tuple[torch.Tensor, PackLayout]:
    """Copy ``tensors`` (contiguous, one device) into one ``uint8`` buffer; returns it and its layout.

    ``out`` (``uint8``, at least ``layout.nbytes``; on the tensors' device, or pinned host memory)
    receives the bytes; without it a device buffer is allocated.
    """
    layout = layout_of(tensors)
    device = tensors[0].device
    if out is None:
        out = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    check_pack(tensors, out, layout)
    if _cupy_ready(device):
        base = out.data_ptr()
        _launch(device, copy_table([t.data_ptr() for t in tensors], [base + o for o in layout.offsets], layout.sizes), layout)
    else:
        torch_pack(tensors, out, layout)
    return out, layout


def unpack(buffer: torch.Tensor, layout: PackLayout, device: torch.device | str | None = None) -> list[torch.Tensor]:
    """New tensors on ``device`` (default: the buffer's) with the shapes and dtypes of ``layout``."""
    device = torch.device(device) if device is not None else buffer.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    check_unpack(buffer, layout, device)
    if not _cupy_ready(device):
        return torch_unpack(buffer, layout, device)
    result = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in zip(layout.shapes, layout.dtypes)]
    base = buffer.data_ptr()
    _launch(device, copy_table([base + o for o in layout.offsets], [t.data_ptr() for t in result], layout.sizes), layout)
    return result
