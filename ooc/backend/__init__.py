"""Device backends: ``cuda`` (streams and pinned memory) and ``cpu`` (copy-engine threads, chaos mode)."""

from __future__ import annotations

import torch

from ooc.backend.base import Backend, Event
from ooc.backend.cpu import ChaosConfig, CpuBackend

__all__ = ["Backend", "ChaosConfig", "CpuBackend", "Event", "resolve_backend"]


def resolve_backend(spec: str | Backend, model: torch.nn.Module) -> Backend:
    """``"auto"`` picks ``cuda`` when the model's parameters live on a CUDA device, else ``cpu``."""
    if isinstance(spec, Backend):
        return spec
    if spec == "auto":
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        spec = "cuda" if device.type == "cuda" else "cpu"
        if spec == "cuda":
            from ooc.backend.cuda import CudaBackend

            return CudaBackend(device)
    if spec == "cpu":
        return CpuBackend()
    if spec == "chaos":
        return CpuBackend(chaos=ChaosConfig())
    if spec == "cuda":
        from ooc.backend.cuda import CudaBackend

        return CudaBackend()
    raise ValueError(f"backend must be 'auto', 'cpu', 'chaos', 'cuda' or a Backend instance, got {spec!r}")
