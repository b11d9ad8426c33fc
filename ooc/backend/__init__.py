"""Device backends: ``cuda`` (streams and pinned memory) and ``cpu`` (copy-engine threads, chaos mode)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ooc.backend.base import Backend, Event
from ooc.backend.cpu import ChaosConfig, CpuBackend
from ooc.scheduler.errors import OocError

__all__ = ["Backend", "BackendDeviceError", "ChaosConfig", "CpuBackend", "Event", "backend_on", "model_device",
           "resolve_backend", "tensors_device"]


class BackendDeviceError(OocError, ValueError):
    """The backend asked for cannot run the model: an unknown backend name, or a backend on another device
    than the model's (nothing would be swapped or counted)."""


def model_device(model: torch.nn.Module) -> torch.device | None:
    """The device a model lives on: its CUDA device if any parameter or buffer is on one (host
    tensors beside it are streamed parameters or host-side state), ``cpu`` if all are on the host,
    ``None`` for a model with no tensors (or only ``meta`` ones). Raises
    :class:`BackendDeviceError` if the tensors are spread over several CUDA devices."""
    return tensors_device((*model.parameters(), *model.buffers()))


def tensors_device(tensors: Iterable[torch.Tensor]) -> torch.device | None:
    """The device of ``tensors`` as :func:`model_device` tells a model's (an optimizer's parameters
    without a model)."""
    return _device_of(t.device for t in tensors)


def _device_of(devices: Iterable[torch.device]) -> torch.device | None:
    seen = {d for d in devices if d.type != "meta"}
    gpus = {d for d in seen if d.type != "cpu"}
    if len(gpus) > 1:
        raise BackendDeviceError(f"the model's tensors are on several devices ({', '.join(sorted(map(str, gpus)))}); "
                                 "ooc runs one model on one device: move it with model.to(device)")
    if gpus:
        return next(iter(gpus))
    return torch.device("cpu") if seen else None


def check_backend_device(backend_device: torch.device, device: torch.device | None) -> None:
    """Raise :class:`BackendDeviceError` unless a backend on ``backend_device`` can run a model on
    ``device`` (``None``: a model without tensors, which runs anywhere)."""
    if device is None or device == backend_device:
        return
    if device.type == "cpu":
        hint = f"move the model with model.to({str(backend_device)!r}) or pass backend='cpu'"
    elif backend_device.type == "cpu":
        hint = "pass backend='auto' (or 'cuda') to run it on its GPU, or move the model with model.to('cpu')"
    else:
        hint = f"pass backend='auto' (the model's own device) or CudaBackend({str(device)!r})"
    raise BackendDeviceError(f"the model is on {device} but the backend runs on {backend_device}, so nothing would be "
                             f"swapped or counted; {hint}")


def resolve_backend(spec: str | Backend, model: torch.nn.Module) -> Backend:
    """The backend for ``model``: ``"auto"`` runs on the model's own device (its CUDA device, else
    the CPU); ``"cuda"`` on the model's CUDA device (the current one for a model without tensors);
    ``"cpu"``/``"chaos"`` on the CPU. Raises :class:`BackendDeviceError` when the backend asked for
    (or given) is on another device than the model."""
    return backend_on(spec, model_device(model))


def backend_on(spec: str | Backend, device: torch.device | None) -> Backend:
    """The backend for tensors on ``device`` (``None``: no tensors), as :func:`resolve_backend`."""
    if isinstance(spec, Backend):
        check_backend_device(spec.device, device)
        return spec
    if spec == "auto":
        spec = "cuda" if device is not None and device.type == "cuda" else "cpu"
    if spec in ("cpu", "chaos"):
        check_backend_device(torch.device("cpu"), device)
        return CpuBackend() if spec == "cpu" else CpuBackend(chaos=ChaosConfig())
    if spec == "cuda":
        if device is not None and device.type != "cuda" and torch.cuda.is_available():  # else CudaBackend says so
            check_backend_device(torch.device("cuda"), device)
        from ooc.backend.cuda import CudaBackend

        return CudaBackend(device)
    raise BackendDeviceError(f"backend must be 'auto', 'cpu', 'chaos', 'cuda' or a Backend instance, got {spec!r}")
