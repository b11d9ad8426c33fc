"""Threads ooc starts bind to the model's device first (issue 11): CUDA's current device is per
thread and starts at cuda:0, so on rank >= 1 the host optimizer's threads would record events and
run collectives on another GPU. On the CPU the backend records each ``bind_thread`` call."""

from __future__ import annotations

import torch
import torch.nn as nn

from ooc.backend import CpuBackend
from ooc.optim import HostAdamW


def test_the_host_optimizers_threads_bind_to_the_backends_device_before_working() -> None:
    backend = CpuBackend(check_order=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    opt = HostAdamW(model.parameters(), model=model, backend=backend)
    seen: list[tuple[str, list]] = []
    opt.stage_listeners.append(lambda _bucket, stage: seen.append((stage.name, list(backend.bound_threads))))
    try:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.synchronize()
    finally:
        opt.close()
        backend.close()
    assert sorted(backend.bound_threads) == [("ooc-exchange", torch.device("cpu")),
                                             ("ooc-host-update", torch.device("cpu"))]
    # Every stage on those threads ran after its thread had bound.
    for stage, bound in seen:
        if stage == "EXCHANGE":
            assert ("ooc-exchange", torch.device("cpu")) in bound
        if stage == "UPDATE":
            assert ("ooc-host-update", torch.device("cpu")) in bound
    assert {s for s, _ in seen} >= {"EXCHANGE", "UPDATE"}


def test_without_a_model_the_host_optimizers_backend_is_on_the_parameters_device(monkeypatch) -> None:  # noqa: ANN001
    """HostAdamW(params) without a model made its CUDA backend on the current device (cuda:0 in a new
    process) for parameters on cuda:1: torch copies a cuda:1 tensor on cuda:1's stream, so the copies'
    events, recorded on cuda:0's streams, were complete at once and the host read the gradients
    before they landed. (Fake cuda:1 tensors: the device is all that is looked at.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import ooc.backend.cuda
    from ooc.optim.host_adamw import _backend_for

    monkeypatch.setattr(ooc.backend.cuda, "CudaBackend", lambda device: ("CudaBackend", device))
    with FakeTensorMode():
        params = [nn.Parameter(torch.empty(4, device="cuda:1"))]
    assert _backend_for("auto", None, params) == (("CudaBackend", torch.device("cuda", 1)), True)
    assert _backend_for("cuda", None, params) == (("CudaBackend", torch.device("cuda", 1)), True)
