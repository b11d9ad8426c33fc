"""RECOMPUTE attacked as a user who did not write it (issue 17's promise: plain PyTorch's gradients bit
for bit, or a RecomputeError). Each case failed before its fix: the re-run read the model as it is at
backward time (updated buffers, swapped-back parameters, eval mode, advanced generators), autograd's
in-place check does not run through saved-tensor hooks, a block's ``except Exception`` swallowed the
early stop, and an HF cache passed to a recomputed layer was appended to twice.
NOTE [the re-run sees the forward's state] in ``ooc.recompute``."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

import ooc
from ooc.backend.cpu import ChaosConfig, CpuBackend
from ooc.backend.order import StreamOrderError
from ooc.blocks import find_blocks
from ooc.recompute import RecomputeError

LETTERS = {"R": ooc.BlockPlan("recompute"), "r": ooc.BlockPlan("recompute", swap_input=True),
           "K": ooc.BlockPlan("keep"), "S": ooc.BlockPlan("swap")}
CODES = ["RRR", "rrr", "RSr"]


class Chain(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, *args)
        return x


def wrapped_copy(plain: Chain, code: str) -> Chain:
    model = copy.deepcopy(plain)
    plan = ooc.Plan(blocks=tuple(LETTERS[c] for c in code), min_swap_bytes=0)
    ooc.wrap(model, plan, blocks=list(model.blocks), backend="cpu")
    return model


def inputs() -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(3), requires_grad=True)


def default_step(model: Chain) -> list[torch.Tensor]:
    x = inputs()
    out = model(x)
    out.pow(2).sum().backward()
    return [out, x.grad]


def assert_same_as_plain(build: Callable[[], Chain], code: str,
                         step: Callable[[Chain], list[torch.Tensor]] = default_step) -> None:
    """``step`` on a plain model and on a wrapped copy (same seed): outputs, gradients and buffers equal."""
    torch.manual_seed(0)
    plain = build()
    wrapped = wrapped_copy(plain, code)
    results = []
    for model in (plain, wrapped):
        torch.manual_seed(1)
        tensors = step(model)
        grads = [p.grad for p in model.parameters()]
        results.append((tensors, grads, list(model.buffers())))
    ooc.unwrap(wrapped)
    for mine, theirs in zip(results[0], results[1]):
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs):
            assert (a is None and b is None) or torch.equal(a, b)


class SpectralNormed(nn.Module):
    """A spectral norm's power iteration reads and updates its ``u`` buffer in every training forward."""

    def __init__(self, parametrization: bool) -> None:
        super().__init__()
        norm = nn.utils.parametrizations.spectral_norm if parametrization else nn.utils.spectral_norm
        self.fc = norm(nn.Linear(6, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


@pytest.mark.parametrize("parametrization", [True, False], ids=["parametrization", "hook"])
@pytest.mark.parametrize("code", CODES)
def test_spectral_norm_rerun_reads_the_buffers_of_the_forward(code: str, parametrization: bool) -> None:
    """The re-run used the ``u`` the forward had updated: other weights, gradients off by 0.39, silently
    (torch's checkpoint does the same)."""
    assert_same_as_plain(lambda: Chain([SpectralNormed(parametrization) for _ in range(3)]), code)


class RandomMask(nn.Module):
    """Draws from a ``torch.Generator`` passed in, or from its own."""

    def __init__(self, own: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.generator = torch.Generator().manual_seed(11) if own else None

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        mask = torch.rand(x.shape, generator=self.generator or generator) > 0.5
        return torch.tanh(self.fc(x)) * mask * x


@pytest.mark.parametrize("own", [False, True], ids=["argument", "attribute"])
@pytest.mark.parametrize("code", CODES)
def test_generator_is_replayed(code: str, own: bool) -> None:
    """A generator other than the default one was not replayed: other masks in the re-run, wrong gradients."""

    def step(model: Chain) -> list[torch.Tensor]:
        x = inputs()
        out = model(x) if own else model(x, torch.Generator().manual_seed(11))
        out.pow(2).sum().backward()
        return [out, x.grad]

    assert_same_as_plain(lambda: Chain([RandomMask(own) for _ in range(3)]), code, step)


class Fallback(nn.Module):
    """A forward with a fallback path behind ``except Exception``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return torch.tanh(self.fc(x))
        except Exception:
            return torch.sigmoid(self.fc(x))


@pytest.mark.parametrize("code", CODES)
def test_except_exception_in_the_forward_does_not_swallow_the_early_stop(code: str) -> None:
    """The re-run's early stop was an Exception: caught by the block, it ran the fallback and raised
    RecomputeError ("saved more tensors") where plain PyTorch trains."""
    assert_same_as_plain(lambda: Chain([Fallback() for _ in range(3)]), code)


class DropoutBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.bn(self.fc(x))))


@pytest.mark.parametrize("code", CODES)
def test_eval_between_forward_and_backward(code: str) -> None:
    """``model.eval()`` after the forward made the re-run skip dropout: RecomputeError where plain trains."""

    def step(model: Chain) -> list[torch.Tensor]:
        x = inputs()
        out = model(x)
        model.eval()
        out.pow(2).sum().backward()
        model.train()
        return [out, x.grad]

    assert_same_as_plain(lambda: Chain([DropoutBatchNorm() for _ in range(3)]), code, step)


@pytest.mark.parametrize("code", CODES)
def test_functional_call_fast_weights(code: str) -> None:
    """``torch.func.functional_call`` with other weights (MAML's fast weights): the re-run, after the call,
    used the module's own parameters; gradients off by 0.035, silently (torch's checkpoint too)."""

    def step(model: Chain) -> list[torch.Tensor]:
        x = inputs()
        fast = {name: p * 1.1 for name, p in model.named_parameters()}
        out = torch.func.functional_call(model, fast, (x,))
        out.pow(2).sum().backward()
        return [out, x.grad]

    assert_same_as_plain(lambda: Chain([DropoutBatchNorm() for _ in range(3)]), code, step)


class Scaled(nn.Module):
    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.scale = scale  # a plain attribute, shared by the blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * self.scale


def _modify_parameters(model: Chain) -> None:
    for p in model.parameters():
        p.mul_(1.5)  # an optimizer step between the forward and the backward


def _modify_scale(model: Chain) -> None:
    model.blocks[0].scale.add_(1)


@pytest.mark.parametrize("modify", [_modify_parameters, _modify_scale], ids=["parameters", "attribute"])
@pytest.mark.parametrize("code", CODES)
def test_saved_tensor_modified_before_the_backward_raises(code: str, modify: Callable[[Chain], None]) -> None:
    """Plain PyTorch raises "modified by an inplace operation"; the re-run read the new values and
    returned the gradients of another function."""
    torch.manual_seed(0)
    scale = torch.full((6,), 0.5, requires_grad=True)
    plain = Chain([Scaled(scale) for _ in range(3)])
    wrapped = wrapped_copy(plain, code)
    for model, error in ((plain, RuntimeError), (wrapped, RecomputeError)):
        out = model(inputs())
        with torch.no_grad():
            modify(model)
        with pytest.raises(error, match="modified"):
            out.sum().backward()
    ooc.unwrap(wrapped)


class Shifted(nn.Module):
    """``tanh(fc(x) + shift)``: the bias and the non-persistent ``shift`` are read but saved by no node
    (``addmm`` and ``add`` save neither); ``tanh`` saves its output, which depends on both."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.register_buffer("shift", torch.full((6,), 0.25), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x) + self.shift)


@pytest.mark.parametrize("which", ["bias", "non-persistent buffer"])
@pytest.mark.parametrize("code", CODES)
def test_state_read_but_not_saved_modified_before_the_backward_raises(code: str, which: str) -> None:
    """A bias (or a non-persistent buffer) changed in place between the forward and the backward, and
    nothing else: plain PyTorch's backward uses what the forward saved, computed from the old value;
    the re-run read the new one and returned other gradients, silently."""
    torch.manual_seed(0)
    plain = Chain([Shifted() for _ in range(3)])
    wrapped = wrapped_copy(plain, code)
    outs = []
    for model in (plain, wrapped):
        outs.append(model(inputs()))
        with torch.no_grad():
            (model.blocks[0].fc.bias if which == "bias" else model.blocks[0].shift).add_(0.5)
    outs[0].sum().backward()  # plain PyTorch: no error, the forward's gradients
    try:
        with pytest.raises(RecomputeError, match=r"block blocks\.0: its (parameter fc\.bias|buffer shift) .* modified in "
                                                 r"place after the block's forward"):
            outs[1].sum().backward()
    finally:
        ooc.unwrap(wrapped)


class Squashed(nn.Module):
    """``tanh(x + bias) * scale``: saves ``tanh``'s output and ``scale``, not its argument."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(6) * 0.1)
        self.scale = nn.Parameter(torch.ones(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x + self.bias) * self.scale


class InPlaceResidual(Chain):
    """``x += block(x)``: the residual stream updated in place after each block, which plain PyTorch
    allows here (no block saves its argument)."""

    def forward(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        x = x * 1.0
        for block in self.blocks:
            x += block(x)
        return x


@pytest.mark.parametrize("chaos", [False, True], ids=["cpu", "chaos"])
def test_an_argument_modified_while_its_swap_is_in_flight_raises(chaos: bool) -> None:
    """With ``swap_input`` the argument is copied to the host after the forward; the caller's in-place
    update is not ordered with that copy (the next block's forward releases it), which reads either
    value. The stream-order checker sees that race; with it off, as a user runs, the re-run ran from
    the updated value, silently (3 steps in 10 on the CPU backend, every one under chaos). Now it
    raises, as a kept argument's re-run does."""
    torch.manual_seed(0)
    plain = InPlaceResidual([Squashed() for _ in range(3)])
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(3))
    plain(x).square().sum().backward()  # plain PyTorch: no error
    config = ChaosConfig() if chaos else None
    for code, check_order, error, match in (
            ("rrr", True, StreamOrderError, r"D2H copy .* is not ordered before aten::add_ \(write\)"),
            ("rrr", False, RecomputeError, r"block blocks\.2: its argument 0 was modified in place after the block's "
                                           "forward while its copy to the host was in flight"),
            ("RRR", False, RecomputeError, "its argument 0 was modified in place after the block's forward")):
        wrapped, backend = copy.deepcopy(plain), CpuBackend(chaos=config, check_order=check_order)
        ooc.wrap(wrapped, ooc.Plan(blocks=tuple(LETTERS[c] for c in code), min_swap_bytes=0),
                 blocks=list(wrapped.blocks), backend=backend)
        try:
            with pytest.raises(error, match=match):
                wrapped(x).square().sum().backward()
        finally:
            ooc.unwrap(wrapped)
            backend.close()


class ModifiesWhatItSaved(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        y = h.sin()  # saves h
        h.add_(1)
        return y + h.exp()


@pytest.mark.parametrize("code", ["RRR", "rrr", "RKr"])  # a swapped block copies the tensor while it is modified
def test_block_that_modifies_a_tensor_it_saved_raises(code: str) -> None:
    """Plain PyTorch raises; the re-run handed backward the modified tensor (a wrong gradient)."""
    torch.manual_seed(0)
    plain = Chain([ModifiesWhatItSaved() for _ in range(3)])
    wrapped = wrapped_copy(plain, code)
    for model, error in ((plain, RuntimeError), (wrapped, RecomputeError)):
        with pytest.raises(error, match="modified"):
            model(inputs()).sum().backward()
    ooc.unwrap(wrapped)


@pytest.mark.parametrize("code", ["KKK", "SSS"])
def test_keep_and_swap_parameter_modified_before_the_backward_raises(code: str) -> None:
    torch.manual_seed(0)
    wrapped = wrapped_copy(Chain([Scaled(torch.ones(6)) for _ in range(3)]), code)
    out = wrapped(inputs())
    with torch.no_grad():
        _modify_parameters(wrapped)
    try:
        with pytest.raises(ooc.SavedTensorModifiedError, match="modified in place after the forward"):
            out.sum().backward()
    finally:
        ooc.unwrap(wrapped)


def _tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


@pytest.mark.filterwarnings("ignore:ooc turned off use_cache")
def test_hf_use_cache_true_is_refused_before_anything_is_appended() -> None:
    """``model(..., use_cache=True)`` in training: the re-run appended to the returned cache a second time
    (20 positions for 10; with eager attention it failed on a shape inside the model)."""
    torch.manual_seed(0)
    model = _tiny_llama()
    ooc.wrap(model, ooc.Plan.of(["recompute", "keep"]), backend="cpu")
    ids = torch.randint(1, 97, (2, 10), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RecomputeError, match=r"model\.layers\.0 was passed a key/value cache \(DynamicCache"):
        model(input_ids=ids, labels=ids, use_cache=True)
    model(input_ids=ids, labels=ids).loss.backward()  # the default (use_cache off while wrapped) trains
    ooc.unwrap(model)


class Counter(nn.Module):
    """Scales by how often it ran: its forward updates a buffer, then reads it."""

    def __init__(self, persistent: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.register_buffer("count", torch.ones(()), persistent=persistent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return torch.tanh(self.fc(x) * self.count)


@pytest.mark.parametrize("code", CODES)
def test_forward_that_updates_and_reads_a_buffer(code: str) -> None:
    """The re-run reads the persistent buffer's value from before the forward, and leaves it as the forward did."""
    assert_same_as_plain(lambda: Chain([Counter(persistent=True) for _ in range(3)]), code)


def test_forward_that_updates_a_non_persistent_buffer_is_refused() -> None:
    """Non-persistent buffers (constants such as causal masks) are not copied: updating one is refused at the
    forward, before the backward could read a wrong value."""
    model = wrapped_copy(Chain([Counter(persistent=False) for _ in range(3)]), "KRK")
    with pytest.raises(RecomputeError, match=r"block blocks\.1 modifies a non-persistent buffer"):
        model(inputs())
    ooc.unwrap(model)


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=97, n_embd=32, n_layer=3, n_head=4, n_positions=64, resid_pdrop=0.2, attn_pdrop=0.2,
        bos_token_id=1, eos_token_id=2))


def _t5() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, dropout_rate=0.2))


@pytest.mark.filterwarnings("ignore:ooc turned off use_cache")
@pytest.mark.parametrize("build", [_gpt2, _t5], ids=["gpt2", "t5"])
def test_hf_models_equal_plain_without_the_cache_bit_for_bit(build: Callable[[], nn.Module]) -> None:
    """GPT-2 and T5 differ from a plain model called with its default ``use_cache=True`` by float
    rounding (logits ~1e-7), under every plan, keep-all included: ooc turns the cache off, and the
    cache's concatenation gives the keys another memory layout. Against plain PyTorch with the cache
    off too, a recompute/swap/keep mix is exact: the loss, the logits and every gradient."""
    torch.manual_seed(0)
    plain = build().train()
    for module in plain.modules():  # T5's stacks have configs of their own
        if getattr(module, "config", None) is not None:
            module.config.use_cache = False
    wrapped = copy.deepcopy(plain)
    mix = ["recompute", ooc.BlockPlan("recompute", swap_input=True), "swap"]
    ooc.wrap(wrapped, ooc.Plan.of([mix[i % 3] for i in range(len(find_blocks(wrapped)))]), backend="cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 97, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    results = []
    for model in (plain, wrapped):
        torch.manual_seed(1)
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        results.append([out.loss, out.logits, *(p.grad for p in model.parameters())])
    ooc.unwrap(wrapped)
    for a, b in zip(*results):
        assert torch.equal(a, b)
