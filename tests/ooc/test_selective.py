"""Selective recompute (issue 15, the runtime side): the op-level profile."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ooc
from ooc.models import GPT, ResNet
from tests.helpers import NANO, gpt_batch


def _cnn() -> nn.Module:
    return ResNet(widths=(8, 16), depth_per_stage=2)


def _cnn_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)


@pytest.fixture(scope="module")
def gpt_profile():
    torch.manual_seed(0)
    return ooc.profile(GPT(NANO), gpt_batch(), ops=True, codec_errors=False, min_swap_bytes=1024)


@pytest.fixture(scope="module")
def cnn_profile():
    torch.manual_seed(0)
    x, y = _cnn_batch()
    return ooc.profile(_cnn(), (x,), loss_fn=lambda out: F.cross_entropy(out, y), ops=True, codec_errors=False,
                       min_swap_bytes=1024)


def _saved_outside_ops(model: nn.Module, blocks: list[nn.Module], call) -> list[int]:  # noqa: ANN001
    """Per block, bytes of the storages its forward saves that no op of the block made (its inputs),
    found without ooc: plain PyTorch with a pack hook that records every saved storage."""
    result = [0] * len(blocks)
    state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    originals = [b.forward for b in blocks]

    def measured(i: int):  # noqa: ANN202
        def forward(*args):  # noqa: ANN002, ANN202
            inputs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in args if isinstance(t, torch.Tensor)}
            seen: dict[int, int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                ptr = t.untyped_storage().data_ptr()
                if ptr in inputs and ptr not in state:
                    seen[ptr] = inputs[ptr]
                return t.detach()

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = originals[i](*args)
            result[i] = sum(seen.values())
            return out

        return forward

    try:
        for i, b in enumerate(blocks):
            b.forward = measured(i)
        call()
    finally:
        for b in blocks:
            del b.forward
    return result


# -- the op-level profile -------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["gpt", "cnn"])
def test_every_saved_byte_is_an_op_output_or_an_input(which: str, gpt_profile, cnn_profile) -> None:
    torch.manual_seed(0)
    if which == "gpt":
        model, prof, batch = GPT(NANO), gpt_profile, gpt_batch()
        blocks, call = list(model.blocks), lambda: model(*batch)
    else:
        model, prof, (x, _) = _cnn(), cnn_profile, _cnn_batch()
        blocks, call = list(model.blocks), lambda: model(x)
    inputs = _saved_outside_ops(model, blocks, call)
    for block, outside in zip(prof.blocks, inputs):
        assert block.ops, block.name
        assert sum(op.saved_bytes for op in block.ops) == block.saved_bytes - outside, block.name
        assert outside > 0  # the check above must tell the two apart: each block saves its input


def test_the_op_sequence_is_the_same_in_every_profile(gpt_profile) -> None:
    torch.manual_seed(0)
    again = ooc.profile(GPT(NANO), gpt_batch(), ops=True, codec_errors=False, reps=1, min_swap_bytes=1024)
    for a, b in zip(gpt_profile.blocks, again.blocks):
        assert [(o.name, o.output_bytes, o.saved_bytes, o.cacheable) for o in a.ops] == \
               [(o.name, o.output_bytes, o.saved_bytes, o.cacheable) for o in b.ops]
    plain = ooc.profile(GPT(NANO), gpt_batch(), codec_errors=False, reps=1, min_swap_bytes=1024)
    assert all(b.ops == () for b in plain.blocks)  # opt-in


def test_what_is_cacheable(gpt_profile) -> None:
    ops = gpt_profile.blocks[1].ops
    by_name: dict[str, set[bool]] = {}
    for op in ops:
        by_name.setdefault(op.name, set()).add(op.cacheable)
    assert by_name["aten.addmm.default"] == {True} and by_name["aten.bmm.default"] == {True}
    assert by_name["aten.bernoulli_.float"] == {False}  # random and in place
    assert by_name["aten.view.default"] == {False} and by_name["aten.transpose.int"] == {False}  # views
    assert by_name["aten.empty_like.default"] == {False}  # dropout's mask: filled in place afterwards
    assert all(op.output_bytes == 0 for op in ops if op.name in ("aten.view.default", "aten.div_.Scalar"))


def test_attention_without_dropout_is_cacheable_and_draws_nothing() -> None:
    from ooc.op_profile import OpRecorder, why_not_cacheable

    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    before = torch.get_rng_state()
    recorder = OpRecorder(q.device)
    with recorder:
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert torch.equal(before, torch.get_rng_state())
    fused = [k for k, name in enumerate(recorder.names) if "scaled_dot_product" in name]
    assert fused and all(recorder.why_not[k] is None for k in fused), recorder.names
    # The same op asked for dropout draws numbers (tagged nondeterministic_seeded): never cached.
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert "random" in why_not_cacheable(op, (q, q, q, 0.5, True), {}, (out, out))
    assert why_not_cacheable(op, (q, q, q), {"dropout_p": 0.0}, (out, out)) is None
    assert "random" in why_not_cacheable(op, (q, q, q), {"dropout_p": 0.1}, (out, out))
