"""The device rules of issue 11 that a CPU can check: backend and model devices, the process group a
collective's tensor needs, ``ooc train``'s device, the once-per-step NaN check of compressed swaps,
and the allocator's per-step peak. The CUDA calls are faked; the rules around them are real."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import ooc
import ooc.backend as backend_mod
import ooc.distributed as distributed
from ooc.apps.train import TrainConfig, train_device
from ooc.backend import BackendDeviceError, CpuBackend, check_backend_device, model_device, resolve_backend
from ooc.calibrate import calibration_device
from ooc.models import GPT
from ooc.saved import NonFiniteActivationError
from ooc.tracker import MemoryTracker
from tests.helpers import NANO_NO_DROPOUT, gpt_batch

CUDA0, CUDA1, CPU = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")


# 1. backend device ----------------------------------------------------------------------------------

def test_the_model_device_is_its_gpu_beside_host_tensors() -> None:
    assert backend_mod._device_of([CPU, CUDA1, CPU]) == CUDA1  # streamed parameters stay on the host
    assert backend_mod._device_of([CPU]) == CPU
    assert backend_mod._device_of([torch.device("meta")]) is None
    assert model_device(nn.Module()) is None
    assert model_device(nn.Linear(2, 2)) == CPU
    with pytest.raises(BackendDeviceError, match="several devices"):
        backend_mod._device_of([CUDA0, CUDA1])


@pytest.mark.parametrize(("backend_device", "device", "hint"), [
    (CPU, CUDA0, "backend='auto'"), (CUDA0, CPU, "backend='cpu'"), (CUDA0, CUDA1, "CudaBackend")])
def test_a_backend_on_another_device_than_the_model_is_refused(backend_device, device, hint: str) -> None:
    with pytest.raises(BackendDeviceError, match=hint):
        check_backend_device(backend_device, device)
    check_backend_device(device, device)
    check_backend_device(backend_device, None)


def test_a_backend_instance_is_checked_against_the_model() -> None:
    backend = CpuBackend()
    try:
        assert resolve_backend(backend, nn.Linear(2, 2)) is backend
        backend.device = CUDA0  # a backend for the GPU, given a model on the CPU
        with pytest.raises(BackendDeviceError, match="model is on cpu"):
            resolve_backend(backend, nn.Linear(2, 2))
    finally:
        backend.close()


@pytest.mark.parametrize("how", ["params", "model", "wrapped model"])
def test_a_backend_instance_given_to_host_adamw_is_checked_against_the_parameters(how: str) -> None:
    """A Backend passed to HostAdamW was taken as it was: one for the GPU copied the host's
    parameters' gradients on streams they never ran on. It is refused as ``ooc.wrap`` refuses it."""
    from ooc.optim import HostAdamW

    model = GPT(NANO_NO_DROPOUT)
    if how == "wrapped model":
        ooc.wrap(model, ooc.Plan.uniform("keep", NANO_NO_DROPOUT.n_layer), backend="cpu")
    backend = CpuBackend()
    backend.device = CUDA0  # a backend for the GPU, given parameters on the CPU
    try:
        with pytest.raises(BackendDeviceError, match="model is on cpu"):
            HostAdamW(model.parameters(), model=None if how == "params" else model, backend=backend)
        backend.device = CPU
        HostAdamW(model.parameters(), model=None if how == "params" else model, backend=backend).close()
    finally:
        backend.close()
        if how == "wrapped model":
            ooc.unwrap(model)


class _FakeCudaBackend:
    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device


def test_cuda_and_auto_resolve_to_the_models_own_gpu(monkeypatch) -> None:
    import ooc.backend.cuda

    monkeypatch.setattr(ooc.backend.cuda, "CudaBackend", _FakeCudaBackend)
    monkeypatch.setattr(backend_mod, "model_device", lambda model: CUDA1)
    assert resolve_backend("cuda", nn.Module()).device == CUDA1
    assert resolve_backend("auto", nn.Module()).device == CUDA1
    for spec in ("cpu", "chaos"):
        with pytest.raises(BackendDeviceError, match="model is on cuda:1"):
            resolve_backend(spec, nn.Module())


def test_cuda_for_a_cpu_model_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(BackendDeviceError, match="model.to"):
        resolve_backend("cuda", nn.Linear(2, 2))


def test_calibrate_auto_measures_the_gpu_when_there_is_one(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert calibration_device("auto") == "cuda"
    assert calibration_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert calibration_device("auto") == "cpu"


# 2. process groups by tensor device ------------------------------------------------------------------

class _Group:
    def __init__(self, backend: str) -> None:
        self.backend = backend


@pytest.fixture
def nccl_world(monkeypatch):
    """A fake two-rank NCCL world: groups remember their backend, collectives record their group."""
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend=None, timeout=None: _Group(backend))
    for name in ("broadcast", "all_reduce", "reduce"):
        monkeypatch.setattr(dist, name, lambda tensor, *a, _name=name, group=None, **k: calls.append((_name, group)))
    return calls


def _backend_of(group: object) -> str:
    return "default" if group is None else group.backend


@pytest.mark.parametrize("reduce_on", ["device", "host"])
def test_host_tensors_go_over_gloo_and_device_tensors_over_nccl(nccl_world, reduce_on: str) -> None:
    comm = distributed.GroupCommunicator(distributed.DataParallel(shard=True, reduce_on=reduce_on))
    host, device = torch.zeros(4), torch.zeros(4, device="meta")  # meta stands for a GPU tensor
    comm.broadcast(host, src=1)  # the staging buffers of a sharded update
    comm.sum_vector(host)  # the clipping norms
    exchanged = device if reduce_on == "device" else host
    comm.all_reduce(exchanged)
    comm.reduce(exchanged, dst=1)
    exchange = "nccl" if reduce_on == "device" else "gloo"
    assert [(name, _backend_of(g)) for name, g in nccl_world] == [
        ("broadcast", "gloo"), ("all_reduce", "gloo"), ("all_reduce", exchange), ("reduce", exchange)]
    with pytest.raises(distributed.WorldError, match="internal error"):
        comm.broadcast(device, src=0)  # nothing on the update thread lives on the device


def test_start_up_broadcast_sends_streamed_host_parameters_over_gloo(nccl_world) -> None:
    comm = distributed.GroupCommunicator(distributed.DataParallel())
    distributed.broadcast_parameters([torch.zeros(2), torch.zeros(2, device="meta")], comm)
    # Device parameters over NCCL, on the training thread's group (made with timeout_s: NOTE [every
    # collective times out]), not the default group.
    assert [_backend_of(g) for _, g in nccl_world] == ["gloo", "nccl"]


def test_backend_for_is_gloo_for_host_tensors() -> None:
    assert distributed.backend_for(torch.zeros(1), "nccl") == "gloo"
    assert distributed.backend_for(torch.zeros(1, device="meta"), "nccl") == "nccl"
    assert distributed.backend_for(torch.zeros(1), "gloo") == "gloo"


# 3. ooc train's device ---------------------------------------------------------------------------

def test_train_device_follows_local_rank_when_cuda_exists() -> None:
    assert train_device("auto", {}, cuda_available=False) == CPU
    assert train_device("auto", {"LOCAL_RANK": "3"}, cuda_available=True) == torch.device("cuda", 3)
    assert train_device("cuda", {}, cuda_available=True) == CUDA0
    assert train_device("cuda:2", {"LOCAL_RANK": "1"}, cuda_available=True) == torch.device("cuda", 2)
    assert train_device("cpu", {"LOCAL_RANK": "1"}, cuda_available=True) == CPU
    with pytest.raises(ValueError, match="--device cpu"):
        train_device("cuda", {}, cuda_available=False)
    with pytest.raises(ValueError, match="cuda:N"):
        TrainConfig(device="gpu")


@pytest.mark.parametrize(("device", "backend", "current"), [(torch.device("cuda", 1), "nccl", [torch.device("cuda", 1)]),
                                                            (CPU, "gloo", [])])
def test_init_from_env_sets_the_device_before_the_group(monkeypatch, device, backend: str, current: list) -> None:
    events: list[object] = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: events.append(d))
    monkeypatch.setattr(dist, "init_process_group", lambda b, timeout: events.append(b))
    assert distributed.init_from_env(5.0, device=device)
    assert events == [*current, backend]


# 4. compressed swaps: one NaN check per step ----------------------------------------------------------

def _int8_swap(model: nn.Module) -> None:
    ooc.wrap(model, ooc.Plan.of([ooc.BlockPlan("swap", codec="int8")] * 4, min_swap_bytes=1024), backend="cpu")


def test_a_nan_activation_under_an_int8_swap_raises_naming_the_block(monkeypatch) -> None:
    import ooc.kernels.quant as quant

    checks: list[bool] = []
    real = quant.quantize
    monkeypatch.setattr(quant, "quantize", lambda *a, **k: checks.append(k.get("check_finite", True)) or real(*a, **k))
    torch.manual_seed(0)
    model = GPT(NANO_NO_DROPOUT)
    with torch.no_grad():
        model.blocks[2].mlp.fc.weight[0, 0] = float("nan")
    _int8_swap(model)
    try:
        loss = model(*gpt_batch())[1]
        with pytest.raises(NonFiniteActivationError, match=r"blocks\.2 \(") as err:
            loss.backward()
        assert "blocks.0" not in str(err.value) and "blocks.1" not in str(err.value)
        assert isinstance(err.value, ValueError)
    finally:
        ooc.unwrap(model)
    assert checks and not any(checks), "the per-storage host sync is off: the runtime checks once per step"


def test_a_forward_without_backward_does_not_leave_its_nan_count_to_the_next_step() -> None:
    torch.manual_seed(0)
    model = GPT(NANO_NO_DROPOUT)
    fc = model.blocks[1].mlp.fc.weight
    saved = fc[0, 0].item()
    _int8_swap(model)
    try:
        with torch.no_grad():
            fc[0, 0] = float("nan")
        model(*gpt_batch())  # its graph is dropped without a backward
        with torch.no_grad():
            fc[0, 0] = saved
        model(*gpt_batch())[1].backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    finally:
        ooc.unwrap(model)


# 5. the allocator's peak over the tracker's step -----------------------------------------------------

def test_the_allocator_peak_is_reset_at_each_step_on_cuda_only(monkeypatch) -> None:
    resets: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    MemoryTracker(2).start_step()
    MemoryTracker(2, CPU).start_step()
    assert resets == []
    MemoryTracker(2, CUDA1).start_step()
    assert resets == [CUDA1]


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8_e5m2"])
def test_quantize_writes_scales_then_codes_into_out(codec: str) -> None:
    from ooc.kernels.quant import encoded_nbytes, quantize

    x = torch.randn(1000) * 3
    plain = quantize(x, codec=codec, group_size=64)
    out = torch.full((encoded_nbytes(x, codec=codec, group_size=64),), 0xAB, dtype=torch.uint8)
    q = quantize(x, codec=codec, group_size=64, out=out)
    scale_bytes = plain.scales.numel() * 4
    assert out.numel() == scale_bytes + plain.codes.numel() * plain.codes.element_size()
    assert torch.equal(out[:scale_bytes], plain.scales.reshape(-1).view(torch.uint8))
    assert torch.equal(out[scale_bytes:], plain.codes.reshape(-1).view(torch.uint8))
    assert q.codes.data_ptr() == out.data_ptr() + scale_bytes and q.scales.data_ptr() == out.data_ptr()
    with pytest.raises(ValueError, match="bytes on cpu"):
        quantize(x, codec=codec, group_size=64, out=out[1:])
