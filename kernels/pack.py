"""Packing many small tensors into one buffer (``pack``) and back (``unpack``).

On CUDA tensors with CuPy installed, one launch of ``pack.cu``'s ``gather_bytes`` / ``scatter_bytes``
on PyTorch's current stream (the buffer may be pinned host memory: the kernel writes it through the
unified address space); everywhere else the torch reference (``torch_pack`` / ``torch_unpack``:
slice assignments), which is also the spec. CuPy is imported on first use, never at import time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources

import torch

ALIGN = 16


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


def _launch(name: str, args: tuple, layout: PackLayout) -> None:
    import cupy

    threads = 256
    blocks_x = max(1, min(1024, -(-max(layout.sizes) // (threads * 16))))
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    with stream:
        _module().get_function(name)((blocks_x, len(layout.sizes)), (threads,), args)


def pack(tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> tuple[torch.Tensor, PackLayout]:
    """Copy ``tensors`` (contiguous, one device) into one ``uint8`` buffer; returns it and its layout.

    ``out`` (``uint8``, at least ``layout.nbytes``; e.g. pinned host memory) receives the bytes;
    without it a device buffer is allocated.
    """
    layout = layout_of(tensors)
    device = tensors[0].device
    if out is None:
        out = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < layout.nbytes:
        raise ValueError(f"out must be a 1-D uint8 tensor of at least {layout.nbytes} bytes")
    if _cupy_ready(device):
        meta = torch.tensor([[t.data_ptr() for t in tensors], list(layout.offsets), list(layout.sizes)], dtype=torch.int64, device=device)
        _launch("gather_bytes", (meta[0].data_ptr(), meta[1].data_ptr(), meta[2].data_ptr(), out.data_ptr()), layout)
        # The launch is asynchronous: keep the metadata alive until the stream has read it.
        meta.record_stream(torch.cuda.current_stream())
    else:
        torch_pack(tensors, out, layout)
    return out, layout


def unpack(buffer: torch.Tensor, layout: PackLayout, device: torch.device | str | None = None) -> list[torch.Tensor]:
    """New tensors on ``device`` (default: the buffer's) with the shapes and dtypes of ``layout``."""
    device = torch.device(device) if device is not None else buffer.device
    if buffer.numel() < layout.nbytes:
        raise ValueError(f"buffer holds {buffer.numel()} bytes, the layout needs {layout.nbytes}")
    if not _cupy_ready(device):
        return torch_unpack(buffer, layout, device)
    result = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in zip(layout.shapes, layout.dtypes)]
    meta = torch.tensor([[t.data_ptr() for t in result], list(layout.offsets), list(layout.sizes)], dtype=torch.int64, device=device)
    _launch("scatter_bytes", (buffer.data_ptr(), meta[0].data_ptr(), meta[1].data_ptr(), meta[2].data_ptr()), layout)
    meta.record_stream(torch.cuda.current_stream())
    return result
