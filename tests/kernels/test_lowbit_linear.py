from __future__ import annotations

import os
import statistics

import pytest
import torch
import torch.nn as nn

from ooc.kernels.lowbit_linear import LowBitLinear, convert_linear, grad_weight, lowbit_linear
from ooc.kernels.quant import quantize
from ooc.kernels.quant_reference import torch_dequantize
from tests.conftest import HAS_GPU

needs_interpreter = pytest.mark.skipif(
    not HAS_GPU and os.environ.get("TRITON_INTERPRET") != "1", reason="Triton needs a GPU or TRITON_INTERPRET=1"
)


@needs_interpreter
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 5, 63), (64, 33, 130), (40, 16, 257)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bits", [8, 4])
def test_triton_grad_weight_within_the_fp32_summation_bound(monkeypatch, shape, bits) -> None:
    M, N, K = shape
    torch.manual_seed(M * N + K)
    x, g = torch.randn(M, K), torch.randn(M, N)
    monkeypatch.setenv("OOC_KERNELS", "reference")
    q = quantize(x, bits=bits)
    exact = g.double().t() @ torch_dequantize(q).double()
    monkeypatch.setenv("OOC_KERNELS", "triton")
    got = grad_weight(g, q).double()
    # Summing M products in fp32: |error| <= M * 2^-24 * sum |g| |x'| (plus the products' own rounding)
    bound = (g.abs().double().t() @ torch_dequantize(q).abs().double()) * (M + 1) * 2**-24
    assert torch.all((got - exact).abs() <= bound)
    assert got.shape == (N, K)


def _dense_and_low_bit() -> tuple[nn.Linear, LowBitLinear, torch.Tensor, torch.Tensor]:
    """An nn.Linear, a LowBitLinear with its weights, and one input (4, 10, 96) for each."""
    torch.manual_seed(0)
    dense = nn.Linear(96, 48)
    low = LowBitLinear(96, 48, bits=8)
    low.load_state_dict(dense.state_dict())
    x = torch.randn(4, 10, 96, requires_grad=True)
    return dense, low, x, x.detach().clone().requires_grad_()


def test_autograd_matches_nn_linear_except_the_quantized_weight_grad() -> None:
    dense, low, x, x2 = _dense_and_low_bit()
    dense(x).square().sum().backward()
    low(x2).square().sum().backward()
    assert torch.equal(low(x2), dense(x2))  # the forward is the plain matmul
    assert torch.equal(x.grad, x2.grad)  # dx = dy @ W, as nn.Linear
    assert torch.equal(low.bias.grad, dense.bias.grad)
    rel = (low.weight.grad - dense.weight.grad).norm() / dense.weight.grad.norm()
    assert 0 < rel < 0.01  # int8 input: ~0.4% per value


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_under_autocast_it_trains_as_nn_linear_does(dtype) -> None:
    # The forward's matmul runs in the autocast dtype, so its output gradient comes back in it; the
    # backward multiplied that by the fp32 weight and failed ("expected m1 and m2 to have the same
    # dtype"), where nn.Linear computes in the autocast dtype.
    dense, low, x, x2 = _dense_and_low_bit()
    with torch.autocast("cpu", dtype=dtype):
        y, y2 = dense(x), low(x2)
    assert y2.dtype == y.dtype == dtype
    y.float().square().sum().backward()
    y2.float().square().sum().backward()
    assert x2.grad.dtype == torch.float32 and torch.equal(x.grad, x2.grad)
    assert torch.equal(low.bias.grad, dense.bias.grad)
    assert low.weight.grad.dtype == torch.float32
    rel = (low.weight.grad - dense.weight.grad).norm() / dense.weight.grad.norm()
    assert 0 < rel < 0.02


def test_an_empty_batch_gives_zero_gradients_as_nn_linear_does() -> None:
    # A mixture-of-experts layer hands an expert no tokens now and then; quantize refused the empty input.
    torch.manual_seed(0)
    dense = nn.Linear(96, 48)
    low = LowBitLinear(96, 48, bits=4)
    low.load_state_dict(dense.state_dict())
    x = torch.randn(0, 96, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    dense(x).sum().backward()
    y2 = low(x2)
    y2.sum().backward()
    assert y2.shape == (0, 48) and x2.grad.shape == (0, 96)
    assert torch.equal(low.weight.grad, dense.weight.grad) and torch.equal(low.bias.grad, dense.bias.grad)


def test_no_codes_are_made_where_no_weight_gradient_will_read_them(monkeypatch) -> None:
    # Under no_grad (evaluation) and with a frozen weight (the base layers of a LoRA fine-tune) the
    # backward needs no codes of x (dx = dy @ W), yet each call quantized x and synced the host for
    # its NaN check, and raised on a NaN input where nn.Linear returns NaN.
    import ooc.kernels.lowbit_linear as lowbit

    calls: list[int] = []
    real = lowbit.quantize
    monkeypatch.setattr(lowbit, "quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    dense = nn.Linear(64, 8)
    low = LowBitLinear(64, 8)
    low.load_state_dict(dense.state_dict())
    x = torch.randn(4, 64)
    x[0, 0] = float("nan")
    with torch.no_grad():
        torch.testing.assert_close(low(x), dense(x), equal_nan=True, rtol=0, atol=0)
    for p in (*low.parameters(), *dense.parameters()):
        p.requires_grad_(False)
    x = torch.randn(4, 64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    dense(x1).square().sum().backward()
    low(x2).square().sum().backward()
    assert torch.equal(x1.grad, x2.grad)
    assert calls == []
    low.weight.requires_grad_(True)
    low(x2).sum().backward()
    assert calls == [1]


def test_input_size_must_match() -> None:
    with pytest.raises(ValueError, match="features"):
        lowbit_linear(torch.randn(2, 5), torch.randn(3, 4))


def test_convert_linear_shares_parameters_and_keeps_ties() -> None:
    from ooc.models import GPT

    model = GPT("nano")
    params_before = {id(p) for p in model.parameters()}
    convert_linear(model, bits=4, filter=lambda name, m: not name.endswith("lm_head"))
    assert {id(p) for p in model.parameters()} == params_before
    assert isinstance(model.blocks[0].attn.qkv, LowBitLinear) and model.blocks[0].attn.qkv.bits == 4
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.wte.weight
    x = torch.randint(0, 65, (2, 16))
    model(x, x)[1].backward()
    with pytest.raises(ValueError, match="bits"):
        convert_linear(model, bits=2)


@pytest.mark.slow
def test_demo_gpt_trains_within_three_percent_of_full_precision() -> None:
    from ooc.apps.check import demo_model_and_batch, train_losses

    finals = {}
    for bits in (None, 8):
        model, _ = demo_model_and_batch(torch.device("cpu"))
        if bits:
            convert_linear(model, bits=bits)
        finals[bits] = statistics.mean(train_losses(model, 200)[-20:])
    print(f"final loss: {finals}")
    assert abs(finals[8] - finals[None]) / finals[None] < 0.03
