"""A lossy codec stays off the blocks whose gradients it would move (issue 13, item 5).

int8 is fine on a transformer block and ruinous on BatchNorm over tiny maps, though it reconstructs
both blocks' saved tensors equally well: the profiler measures the gradients (NOTE [codec error]).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import ooc
from ooc.codec_error import block_codec_errors
from ooc.models import GPT
from ooc.scheduler import BlockProfile, Profile, ProfileError, preset
from ooc.scheduler.codecs import CODEC_ERROR_BOUND
from ooc.scheduler.costmodel import BASE_OPTIONS, CODEC_OPTIONS, build_options, model_peak
from ooc.scheduler.milp import solve_milp
from ooc.scheduler.optimal import optimal
from ooc.scheduler.plan import Codec
from tests.helpers import NANO, gpt_batch


def _conv_bn(channels: int, *, relu: bool = False) -> nn.Module:
    layers = [nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)]
    return nn.Sequential(*layers, nn.ReLU()) if relu else nn.Sequential(*layers)


def _errors(block: nn.Module, x: torch.Tensor) -> dict[Codec, float]:
    x = x.requires_grad_()
    out = block(x)
    grad = torch.randn_like(out)
    return block_codec_errors(block, ((x.detach().requires_grad_(),), {}), [grad], [Codec.INT8, Codec.INT4],
                              skip_ptrs=frozenset(), min_swap_bytes=0)


def test_int8_is_refused_on_batchnorm_over_tiny_maps_and_accepted_on_large_ones() -> None:
    torch.manual_seed(0)
    block = _conv_bn(64)
    tiny = _errors(block, torch.randn(2, 64, 1, 1))  # two values per channel: ResNet-18's layer4 at 32x32
    large = _errors(block, torch.randn(8, 64, 16, 16))
    assert tiny[Codec.INT8] > CODEC_ERROR_BOUND
    assert large[Codec.INT8] < CODEC_ERROR_BOUND
    assert large[Codec.INT4] > large[Codec.INT8]


def test_int8_is_refused_where_relu_saves_its_output() -> None:
    # ReLU's backward reads the sign of its saved output: int8 rounds every value below 1/254 of its
    # group's largest to zero, and those elements lose their gradient (about 9% here), though the
    # output itself is reconstructed to well under 1%.
    torch.manual_seed(0)
    block = _conv_bn(64, relu=True)
    assert _errors(block, torch.randn(8, 64, 16, 16))[Codec.INT8] > CODEC_ERROR_BOUND


def test_the_measured_error_is_the_gradients_error_under_the_codec() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(32, 64)
    errors = _errors(block, x.clone())
    assert 0 < errors[Codec.INT8] < CODEC_ERROR_BOUND
    # The same gradients by hand: every saved activation quantized and dequantized.
    from ooc.kernels.quant import dequantize, quantize

    def roundtrip(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.data_ptr() in {p.data_ptr() for p in block.parameters()}:
            return t
        return dequantize(quantize(t.contiguous().reshape(-1), codec="int8", check_finite=False)).reshape(t.shape)

    torch.manual_seed(1)
    grad = torch.randn(32, 64)

    def grads(lossy: bool) -> torch.Tensor:
        xi = x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, roundtrip if lossy else (lambda t: t)):
            out = block(xi)
        got = torch.autograd.grad(out, [xi, *block.parameters()], grad)
        return torch.cat([g.reshape(-1) for g in got])

    exact, lossy = grads(False), grads(True)
    by_hand = float((lossy - exact).norm() / exact.norm())
    assert by_hand > 0
    torch.manual_seed(1)
    again = block_codec_errors(block, ((x.clone().requires_grad_(),), {}), [grad], [Codec.INT8],
                               skip_ptrs=frozenset(p.untyped_storage().data_ptr() for p in block.parameters()), min_swap_bytes=0)
    assert again[Codec.INT8] == pytest.approx(by_hand, rel=1e-5)  # float32 norms by hand


def test_profile_measures_every_codec_per_block_and_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model = GPT(NANO)
    batch = gpt_batch(batch=2, seq=16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    prof = ooc.profile(model, batch, backend="cpu", reps=1, min_swap_bytes=1024)
    names = {"int8", "int4", "fp8"} | {f"{c}:recompute" for c in ("int8", "int4", "fp8")}
    assert all({name for name, _ in b.codec_error} == names for b in prof.blocks)
    assert all(0 < b.codec_error_of("int8") < CODEC_ERROR_BOUND for b in prof.blocks)
    assert all(b.codec_error_of("int4") > b.codec_error_of("int8") for b in prof.blocks)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert Profile.from_json(prof.to_json()) == prof
    assert all(not b.codec_error for b in ooc.profile(model, batch, backend="cpu", reps=1, codec_errors=False).blocks)


MiB = 2**20


def _chain(errors: list[float]) -> Profile:
    blocks = [
        BlockProfile(f"b{i}", 2e-3, 4e-3, 64 * MiB, 64 * MiB, 4 * MiB, 4 * MiB, 4 * MiB, 0, 0,
                     codec_error=(("int8", e), ("int4", e), ("fp8", e)))
        for i, e in enumerate(errors)
    ]
    return Profile(tuple(blocks), outside_forward_s=2e-3)


@pytest.mark.parametrize("solver", ["optimal", "milp"])
def test_the_planner_never_gives_a_block_a_codec_above_the_bound(solver: str) -> None:
    hw = preset("v100-16gb")
    choices = BASE_OPTIONS + CODEC_OPTIONS
    errors = [0.5, 0.001, 0.5, 0.001]
    lossy = [i for i, e in enumerate(errors) if e > CODEC_ERROR_BOUND]
    tolerant, measured = _chain([0.0] * len(errors)), _chain(errors)
    budget = model_peak(build_options(tolerant, hw), [0] * len(errors), 2) // 2  # half of keep-all

    def picks(prof: Profile, bound: float = CODEC_ERROR_BOUND) -> list:
        if solver == "optimal":
            return [b.codec for b in optimal(prof, hw, budget, choices=choices, max_codec_error=bound).blocks]
        opts = build_options(prof, hw, choices, bound)
        solved = solve_milp(opts, budget, 2)
        assert solved is not None
        return [opts.choices[k].codec for k in solved[0]]

    # Where errors do not matter, the tight budget makes codecs worth it on the lossy blocks too...
    assert any(picks(tolerant)[i] is not Codec.NONE for i in lossy)
    # ...measured, they stay off them; raising the bound lets them back.
    assert all(picks(measured)[i] is Codec.NONE for i in lossy)
    assert any(picks(measured)[i] is not Codec.NONE for i in range(len(errors)) if i not in lossy)
    assert any(picks(measured, bound=1.0)[i] is not Codec.NONE for i in lossy)


@pytest.mark.parametrize("entry, message", [
    (("int8",), "codec, error"),
    (("int8", float("nan")), "finite"),
    (("int8", -0.1), ">= 0"),
    ((3, 0.1), "must be a string"),
])
def test_a_bad_codec_error_in_a_profile_is_refused(entry: tuple, message: str) -> None:
    block = BlockProfile("b0", 1e-3, 1e-3, 0, 0, 0, 0, 0, 0, 0)
    with pytest.raises(ProfileError, match=message):
        dataclasses.replace(block, codec_error=(entry,))
