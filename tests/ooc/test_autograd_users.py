"""Autograd patterns of real training code under every plan kind: each equals plain PyTorch bit for
bit (loss and every gradient), or raises a clear error (an adversarial pass by a user of autograd)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ooc
from ooc.models import GPT
from ooc.runtime import runtime_of
from tests.helpers import NANO, gpt_batch

PLANS = {
    "keep": ooc.Plan.uniform("keep", NANO.n_layer, min_swap_bytes=0),
    "swap": ooc.Plan.uniform("swap", NANO.n_layer, min_swap_bytes=0),
    "recompute": ooc.Plan.uniform("recompute", NANO.n_layer, min_swap_bytes=0),
    "mixed": ooc.Plan.of(["keep", "swap", "recompute", ooc.BlockPlan("recompute", swap_input=True)], min_swap_bytes=0),
    "streamed": ooc.Plan.of(["recompute", "swap", "keep", "recompute"], min_swap_bytes=0).streaming(range(NANO.n_layer)),
    "streamed-keep": ooc.Plan.uniform("keep", NANO.n_layer).streaming(range(NANO.n_layer)),
}


class FrozenBottomGPT(nn.Module):
    """The reference GPT whose forward runs its first two blocks under ``torch.no_grad()`` (a frozen
    bottom of the chain, as in partial fine-tuning); ``(idx, targets) -> (logits, loss)``."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(NANO)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.gpt
        h = g.drop(g.wte(idx) + g.wpe(torch.arange(idx.shape[1])))
        with torch.no_grad():
            for block in g.blocks[:2]:
                h = block(h)
        for block in g.blocks[2:]:
            h = block(h)
        logits = g.lm_head(g.ln_f(h))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("how", ["plan", "budget", "budget+sample"])
def test_blocks_a_training_forward_runs_without_grad_train_as_plain(how: str) -> None:
    # NOTE [blocks run without grad]: the chain check counted only calls with grad, so it said the
    # frozen blocks "never ran in the model's forward" and unwrapped a model plain PyTorch trains.
    torch.manual_seed(0)
    plain = FrozenBottomGPT()
    wrapped = copy.deepcopy(plain)
    batch = gpt_batch(batch=2, seq=16)
    kwargs = {"plan": dict(plan=PLANS["mixed"]), "budget": dict(budget=120_000),
              "budget+sample": dict(budget=120_000, sample=batch)}[how]
    ooc.wrap(wrapped, blocks=list(wrapped.gpt.blocks), backend="cpu", **kwargs)
    try:
        for step in range(3):
            for model in (plain, wrapped):
                model.zero_grad(set_to_none=True)
                torch.manual_seed(step)  # dropout
                model(*batch)[1].backward()
            for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
                assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad), (step, name)
        assert runtime_of(wrapped).tracker.current == 0
    finally:
        ooc.unwrap(wrapped)


class SelfDistilledGPT(nn.Module):
    """The reference GPT whose forward runs its blocks twice: without grad for a target, then with grad
    for the loss against it; ``idx -> loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(NANO)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = self.gpt(idx)[0]
        return F.mse_loss(self.gpt(idx)[0], target)


def test_blocks_run_without_grad_and_again_with_grad_are_checked_by_their_training_calls() -> None:
    # The calls without grad of blocks that also ran with grad in the same forward are not counted
    # (they would read as each block run twice).
    torch.manual_seed(0)
    plain = SelfDistilledGPT()
    wrapped = copy.deepcopy(plain)
    x, _ = gpt_batch(batch=2, seq=16)
    ooc.wrap(wrapped, PLANS["mixed"], blocks=list(wrapped.gpt.blocks), backend="cpu")
    try:
        for model in (plain, wrapped):
            torch.manual_seed(0)
            model(x).backward()
        for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
            assert torch.equal(a.grad, b.grad), name
    finally:
        ooc.unwrap(wrapped)


class ScaledBlock(nn.Module):
    """``(h, scale) -> (tanh(linear(h)) * scale, own scale)``: returns its own parameter, a leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.linear(h)) * scale, self.scale


class ScaledChain(nn.Module):
    """Four :class:`ScaledBlock` s, each scaled by the previous one's parameter; ``x (8, 16) -> loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ScaledBlock() for _ in range(4)])
        self.first_scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.first_scale
        for block in self.blocks:
            x, scale = block(x, scale)
        return x.pow(2).mean() * scale


@pytest.mark.parametrize("plan", ["keep", "recompute", "streamed"])
def test_a_block_that_returns_its_parameter_leaves_no_hook_on_it(plan: str) -> None:
    # The hook that marks a block's backward start went on every output that requires grad, the
    # returned parameter too, where it outlived the step: one more per forward, each fired in every
    # later backward (its pass kept alive, a backward's work growing with the steps taken).
    torch.manual_seed(0)
    plain = ScaledChain()
    wrapped = copy.deepcopy(plain)
    ooc.wrap(wrapped, PLANS[plan], blocks=list(wrapped.blocks), backend="cpu")
    x = torch.randn(8, 16)
    try:
        for _ in range(3):
            for model in (plain, wrapped):
                model.zero_grad(set_to_none=True)
                model(x).backward()
            for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
                assert torch.equal(a.grad, b.grad), name
        assert all(not block.scale._backward_hooks for block in wrapped.blocks)
        assert runtime_of(wrapped).steps == 3
    finally:
        ooc.unwrap(wrapped)


class RoutedBlock(nn.Module):
    """A mixture-of-experts layer that keeps its load-balancing loss on the side, as ``self.aux_loss``
    (the model sums them into its loss): ``h (8, 16) -> h + tanh(routed experts)``."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 4)
        self.experts = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])
        self.aux_loss: torch.Tensor | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.router(h), dim=-1)
        self.aux_loss = (probs.mean(0) * probs.max(-1).values.mean()).sum()
        mixed = sum(expert(h) * probs[:, k:k + 1] for k, expert in enumerate(self.experts))
        return h + torch.tanh(mixed)


@dataclasses.dataclass
class Hidden:
    """A block's output that is no pytree node: ooc sees no tensor in it."""

    h: torch.Tensor


class HiddenBlock(nn.Module):
    """``h (8, 16) -> Hidden(tanh(linear(h)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> Hidden:
        return Hidden(torch.tanh(self.linear(h)))


class Chain(nn.Module):
    """Four blocks of one kind; ``x (8, 16) -> (main loss, the blocks' aux losses summed)``."""

    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for block in self.blocks:
            x = block(x)
            x = x.h if isinstance(x, Hidden) else x
        aux = [b.aux_loss for b in self.blocks if getattr(b, "aux_loss", None) is not None]
        return x.pow(2).mean(), sum(aux) if aux else torch.zeros(())


@pytest.mark.parametrize("plan", ["keep", "streamed-keep", "streamed", "swap", "mixed"])
@pytest.mark.parametrize("case", ["aux-loss-alone", "aux-loss-first", "dataclass-output"])
def test_a_backward_that_enters_blocks_past_their_outputs(case: str, plan: str) -> None:
    # NOTE [a backward that enters a block elsewhere]: the blocks' backward started only from a hook
    # on the outputs they returned, so a backward reaching them otherwise (a load-balancing loss kept
    # on the module, outputs in a dataclass) found streamed weights still on the host and raised
    # "did not go through ooc's hooks"; swapped tensors were not prefetched, nor the end queued.
    torch.manual_seed(0)
    plain = Chain(HiddenBlock if case == "dataclass-output" else RoutedBlock)
    wrapped = copy.deepcopy(plain)
    ooc.wrap(wrapped, PLANS[plan], blocks=list(wrapped.blocks), backend="cpu")
    resident = ooc.memory_report(wrapped).param_bytes  # none of them where every block streams
    x = torch.randn(8, 16)
    try:
        for model in (plain, wrapped):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(2):
                main, aux = model(x)
                if case == "aux-loss-alone":
                    aux.backward()
                elif case == "aux-loss-first":
                    (aux * 1e3).backward(retain_graph=True)
                    main.backward()
                else:
                    main.backward()
                opt.step()
                opt.zero_grad()
        for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
            assert torch.equal(a, b), name
        assert ooc.memory_report(wrapped).param_bytes == resident  # every streamed weight is back on the host
        # Each backward's end ran (NOTE [the kept path]'s unpack enters its block too).
        assert runtime_of(wrapped).steps == 2 * (2 if case == "aux-loss-first" else 1)
    finally:
        ooc.unwrap(wrapped)


@pytest.mark.parametrize("plan", ["keep", "swap", "recompute", "streamed"])
def test_forward_mode_ad_is_refused_with_grad_and_exact_without(plan: str) -> None:
    # With grad on, the blocks' pack hooks met the dual tensors autograd saves and raised torch's
    # "Attempted to access the data pointer on an invalid python storage", which names nothing of ooc.
    torch.manual_seed(0)
    plain = GPT(NANO).eval()
    wrapped = copy.deepcopy(plain)
    ooc.wrap(wrapped, PLANS[plan], backend="cpu")
    emb = plain.wte(gpt_batch(batch=2, seq=16)[0]).detach()
    tangent = torch.randn_like(emb)

    def jvp(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autograd.forward_ad.dual_level():
            h = torch.autograd.forward_ad.make_dual(emb, tangent)
            for block in model.blocks:
                h = block(h)
            primal, out_tangent = torch.autograd.forward_ad.unpack_dual(h)
        return primal, out_tangent

    try:
        with pytest.raises(ooc.WrapError, match=r"forward-mode AD.*torch.no_grad\(\)"):
            jvp(wrapped)
        with torch.no_grad():  # what the error proposes
            for a, b in zip(jvp(plain), jvp(wrapped)):
                assert torch.equal(a, b)
    finally:
        ooc.unwrap(wrapped)


@pytest.mark.parametrize("plan", ["keep", "swap", "recompute", "streamed-keep"])
def test_disabled_saved_tensor_hooks_are_refused_with_what_to_do(plan: str) -> None:
    # Under torch.autograd.graph.disable_saved_tensors_hooks(msg), a wrapped forward raised torch's
    # RuntimeError with msg, the caller's words, naming neither ooc nor the way out; a plan keeping
    # everything needs the hooks too (NOTE [disabled saved-tensor hooks] in ooc.errors).
    torch.manual_seed(0)
    plain = GPT(NANO)
    wrapped = copy.deepcopy(plain)
    ooc.wrap(wrapped, PLANS[plan], backend="cpu")
    idx, targets = gpt_batch(batch=2, seq=16)

    def disabled() -> contextlib.AbstractContextManager:
        return torch.autograd.graph.disable_saved_tensors_hooks("no hooks in my library")

    try:
        with pytest.raises(ooc.WrapError, match=r"^block 'blocks.0' of a wrapped model ran with grad enabled inside "
                                                r"torch.autograd.graph.disable_saved_tensors_hooks \(disabled with: "
                                                r"'no hooks in my library'\).*outside that context.*ooc.unwrap\(model\)"):
            with disabled():
                wrapped(idx, targets)
        with disabled(), torch.no_grad():  # what the error proposes for a forward without a backward
            outs = []
            for model in (plain, wrapped):
                torch.manual_seed(1)  # the same dropout masks
                outs.append(model(idx, targets)[0])
            assert torch.equal(*outs)
        if plan == "recompute":
            loss = wrapped(idx, targets)[1]
            with pytest.raises(ooc.WrapError, match=r"^the backward that re-runs recomputed block blocks.3 ran inside "
                                                    r"torch.autograd.graph.disable_saved_tensors_hooks"):
                with disabled():
                    loss.backward()
            del loss
            wrapped.zero_grad(set_to_none=True)
        for model in (plain, wrapped):  # outside it, the model trains as plain PyTorch
            torch.manual_seed(2)
            model(idx, targets)[1].backward()
        for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
            assert torch.equal(a.grad, b.grad), name
    finally:
        ooc.unwrap(wrapped)


@pytest.mark.parametrize("call", ["describe", "wrap-sample", "wrap-sample-blocks"])
def test_measuring_a_sample_with_saved_tensor_hooks_disabled_is_refused(call: str) -> None:
    # describe(model, sample) and wrap(..., sample=...) measure through saved-tensor hooks: inside
    # disable_saved_tensors_hooks they raised torch's RuntimeError with the caller's message alone.
    model = GPT(NANO)
    idx, targets = gpt_batch(batch=2, seq=16)
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks in my library"):
        with pytest.raises(ooc.WrapError, match=r"inside torch.autograd.graph.disable_saved_tensors_hooks \(disabled "
                                                r"with: 'no hooks in my library'\).*Call it outside that context"):
            if call == "describe":
                ooc.describe(model, (idx, targets))
            else:
                ooc.wrap(model, budget="1MiB", sample=(idx, targets), backend="cpu",
                         blocks=list(model.blocks) if call == "wrap-sample-blocks" else None)
    assert not ooc.is_wrapped(model)


def _qat_chain() -> nn.Module:
    """Four linear+ReLU+linear blocks prepared for quantization-aware training: per-channel weight
    observers whose buffers start empty and take the channels' shape in the first forward."""
    import torch.ao.quantization as q

    model = Chain(lambda: nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)))
    for block in model.blocks:
        block.qconfig = q.get_default_qat_qconfig("fbgemm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notices
        return q.prepare_qat(model, inplace=True)


def test_a_model_whose_buffers_change_shape_in_its_forward_profiles_and_trains_as_plain() -> None:
    """``ooc.profile`` (and ``wrap(budget=..., sample=...)``) copied each buffer back into itself after
    its measurement steps and crashed with "The size of tensor a (16) must match the size of tensor
    b (0)" on a QAT model. It now leaves every buffer as it found it, shape included, and the model
    trains under the profile's plan as plain PyTorch."""
    torch.manual_seed(0)
    plain = _qat_chain()
    wrapped = copy.deepcopy(plain)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    before = [b.clone() for b in wrapped.buffers()]
    assert any(b.numel() == 0 for b in before)  # the observers' min/max, empty before the first forward
    prof = ooc.profile(wrapped, (x,), blocks=list(wrapped.blocks), codec_errors=False, reps=1,
                       loss_fn=lambda out: out[0].square().mean(), backend="cpu")
    assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(before, wrapped.buffers()))
    ooc.wrap(wrapped, ooc.Plan.uniform("recompute", len(prof), min_swap_bytes=0), blocks=list(wrapped.blocks),
             backend="cpu")
    try:
        for model in (plain, wrapped):
            model(x)[0].square().mean().backward()
        for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
            assert torch.equal(a.grad, b.grad), name
        assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), wrapped.buffers()))
    finally:
        ooc.unwrap(wrapped)


@pytest.mark.parametrize("plan", ["recompute", "mixed", "streamed"])
def test_a_batched_backward_reruns_blocks_with_dropout_as_plain(plan: str) -> None:
    """``torch.autograd.grad(..., is_grads_batched=True)`` (a vectorized jacobian) runs the backward
    under vmap, and with it a recomputed block's re-run, where dropout raised "vmap: We do not yet
    support calling random operations inside of vmap" (plain PyTorch drew its masks in the forward).
    The re-run runs unbatched, as the forward did: the gradients equal plain PyTorch's."""
    torch.manual_seed(0)
    plain = GPT(NANO)
    wrapped = copy.deepcopy(plain)
    ooc.wrap(wrapped, PLANS[plan], backend="cpu")
    idx = gpt_batch(batch=2, seq=16)[0]
    try:
        grads = []
        for model in (plain, wrapped):
            torch.manual_seed(1)  # the same dropout masks
            logits = model(idx)[0]
            directions = torch.zeros(3, *logits.shape)
            directions[0, 0, 0, 0], directions[1, 1, 5, 7], directions[2, 0, 15, 64] = 1.0, 1.0, 1.0
            params = [model.blocks[0].attn.qkv.weight, model.blocks[3].mlp.fc.weight]
            grads.append(torch.autograd.grad(logits, params, grad_outputs=directions, is_grads_batched=True))
        assert all(torch.equal(a, b) for a, b in zip(*grads))
    finally:
        ooc.unwrap(wrapped)
