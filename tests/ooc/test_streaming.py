"""Weight streaming: STREAMED blocks keep their parameters on the host between uses.

Training with streamed parameters equals plain PyTorch bit for bit (the chaos backend poisons
every copy destination first, so a forward or backward that reads weights before their copy in
fails), and the device-resident parameter bytes the tracker counts equal the schedule's prediction.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ooc
from ooc.blocks import find_blocks
from ooc.models import GPT
from ooc.optim import HostAdamW
from ooc.runtime import runtime_of
from ooc.scheduler.plan import Plan, PlanError, Residency
from ooc.scheduler.schedule import build_schedule
from tests.helpers import NANO_NO_DROPOUT, gpt_batch, small_resnet

POLICIES = {
    "keep": ["keep"] * 4,
    "mixed": ["swap", "recompute", "keep", "swap"],
    "recompute": ["recompute"] * 4,
}


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT("nano")


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        torch.manual_seed(step)
        loss = model(*gpt_batch(seed=step))[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("policies", POLICIES, ids=list(POLICIES))
@pytest.mark.parametrize("streamed", [(0, 1, 2, 3), (1, 2), (0, 3)], ids=["all", "middle", "ends"])
def test_streamed_training_equals_plain_pytorch(policies: str, streamed: tuple[int, ...]) -> None:
    plain = _model()
    model = copy.deepcopy(plain)
    ooc.wrap(model, Plan.of(POLICIES[policies], min_swap_bytes=4096).streaming(streamed), backend="chaos")
    expected = _train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True), 3)
    assert _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), 3) == expected
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
    ooc.unwrap(model)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))


def test_between_steps_streamed_parameters_live_on_the_host_copies() -> None:
    model = _model()
    ooc.wrap(model, Plan.uniform("keep", 4).streaming([2]), backend="cpu")
    runtime_streamer = runtime_of(model).streamer
    weight = model.blocks[2].attn.qkv.weight
    assert weight.data_ptr() == runtime_streamer.host_copy(weight).data_ptr()
    model(*gpt_batch())[1].backward()
    assert weight.data_ptr() == runtime_streamer.host_copy(weight).data_ptr()
    assert weight.grad is not None and weight.grad.shape == weight.shape
    ooc.unwrap(model)


@pytest.mark.parametrize("streamed", [(), (0,), (1, 2), (0, 3), (0, 1, 2, 3)])
@pytest.mark.parametrize("policies", POLICIES, ids=list(POLICIES))
def test_device_parameter_bytes_equal_the_prediction(streamed: tuple[int, ...], policies: str) -> None:
    model = _model()
    prof = ooc.profile(model, gpt_batch(), min_swap_bytes=4096)
    plan = Plan.of(POLICIES[policies], min_swap_bytes=4096).streaming(streamed)
    ooc.wrap(model, plan, backend="chaos")
    for step in range(2):
        model(*gpt_batch(seed=step))[1].backward()
    measured = ooc.memory_report(model).param_peak_bytes
    ooc.unwrap(model)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    predicted = build_schedule(plan, prof).param_peak_bytes
    assert measured == predicted
    if len(streamed) == 4:  # two blocks at a time (the one running and the next one arriving)
        assert measured == total - 2 * prof.blocks[0].param_bytes


def test_streamed_with_the_pipelined_host_optimizer() -> None:
    plain = _model()
    model = copy.deepcopy(plain)
    ooc.wrap(model, Plan.of(POLICIES["mixed"], min_swap_bytes=4096).streaming([0, 1, 2, 3]), backend="chaos")
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model)
    expected = _train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, fused=True), 4)
    assert _train(model, opt, 4) == expected
    opt.synchronize()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
    opt.close()
    ooc.unwrap(model)


def test_inference_streams_too() -> None:
    plain = _model().eval()
    model = copy.deepcopy(plain)
    ooc.wrap(model, Plan.uniform("keep", 4).streaming([0, 1, 2, 3]), backend="chaos")
    with torch.no_grad():
        assert torch.equal(model(gpt_batch()[0])[0], plain(gpt_batch()[0])[0])
    ooc.unwrap(model)


def test_plan_json_keeps_residency() -> None:
    plan = Plan.of(["keep", "swap"]).streaming([1])
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.blocks[1].params is Residency.STREAMED
    assert "params streamed" in plan.table()
    with pytest.raises(PlanError, match="not in a plan of 2 blocks"):
        plan.streaming([5])


def test_streamed_parameters_keep_their_memory_layout() -> None:
    """NOTE [streamed layouts]: a channels_last convolution weight stays channels_last on the host,
    in its block's forward, in its gradient and after unwrap (it used to turn contiguous)."""
    torch.manual_seed(0)
    model = small_resnet().to(memory_format=torch.channels_last)
    chain = find_blocks(model)
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    layouts = [w.stride() for w in weights]
    seen = []
    for block in chain.modules:
        block.register_forward_pre_hook(lambda b, _args: seen.extend(
            m.weight.stride() for m in b.modules() if isinstance(m, torch.nn.Conv2d)))
    ooc.wrap(model, Plan.uniform("keep", len(chain)).streaming(range(len(chain))), backend="chaos")
    try:
        assert [w.stride() for w in weights] == layouts
        x = torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last)
        torch.nn.functional.cross_entropy(model(x), torch.tensor([1, 2])).backward()
        in_blocks = [w.stride() for b in chain.modules for w in (m.weight for m in b.modules()
                                                                   if isinstance(m, torch.nn.Conv2d))]
        assert seen == in_blocks
        assert [w.grad.stride() for w in weights] == layouts
    finally:
        ooc.unwrap(model)
    assert [w.stride() for w in weights] == layouts


def _scaled_data(model: torch.nn.Module) -> None:
    for p in model.blocks[1].parameters():
        p.data = p.data * 1.5  # an old idiom for a weight clamp, a pretrained copy, a rescale


def test_data_replaced_after_wrap_is_what_trains_and_what_unwrap_leaves() -> None:
    """NOTE [data replaced outside ooc]: the stream-in used to copy the old host copy back in, so the
    replacement was ignored without a word (and ooc.unwrap restored the old weights)."""
    plain = GPT(NANO_NO_DROPOUT)
    model = copy.deepcopy(plain)
    ooc.wrap(model, Plan.uniform("keep", 4).streaming([1, 2]), backend="chaos")
    try:
        model(*gpt_batch())[1].backward()
        for m in (plain, model):
            m.zero_grad(set_to_none=True)
            _scaled_data(m)
            m(*gpt_batch(seed=1))[1].backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters()))
        _scaled_data(plain)
        _scaled_data(model)
    finally:
        ooc.unwrap(model)
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), model.parameters()))


def test_a_dtype_changed_after_wrap_is_refused_and_unwrap_keeps_it() -> None:
    model = GPT(NANO_NO_DROPOUT)
    expected = copy.deepcopy(model).double()
    ooc.wrap(model, Plan.uniform("keep", 4).streaming([1, 2]), backend="chaos")
    try:
        model(*gpt_batch())[1].backward()
        model.zero_grad(set_to_none=True)
        model.double()  # assigns every parameter's .data
        with pytest.raises(ooc.WrapError, match=r"blocks\.1\..* replaced after ooc\.wrap.*ooc\.unwrap\(model\)"):
            model(*gpt_batch())
    finally:
        ooc.unwrap(model)
    assert all(p.dtype == torch.float64 and torch.equal(p, q) for p, q in zip(model.parameters(), expected.parameters()))


def _optimizer_in_backward(model: torch.nn.Module) -> None:
    """PyTorch's tutorial "How to save memory by fusing the optimizer step into the backward pass"."""
    optimizers = {p: torch.optim.Adam([p], lr=1e-2, foreach=False) for p in model.parameters()}

    def step(p: torch.nn.Parameter) -> None:
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)


def _clamp_before_each_block(model: torch.nn.Module) -> None:
    def clamp(block: torch.nn.Module, _args: tuple) -> None:
        with torch.no_grad():
            for p in block.parameters():
                p.clamp_(-0.05, 0.05)

    for block in model.blocks:
        block.register_forward_pre_hook(clamp)


@pytest.mark.parametrize("when", ["before", "after"], ids=["hooks-before-wrap", "hooks-after-wrap"])
@pytest.mark.parametrize("change", [_optimizer_in_backward, _clamp_before_each_block], ids=["optimizer-in-backward",
                                                                                             "clamp-in-pre-hook"])
@pytest.mark.parametrize("policies", ["keep", "mixed"])
def test_weights_changed_in_place_around_a_stream_in_are_kept(change, when: str, policies: str) -> None:  # noqa: ANN001
    """NOTE [weights changed around a stream-in]: an optimizer step in a gradient hook changed the
    device copy, which was dropped; a pre-hook's clamp came after the copy in had started."""
    plain = _model()
    model = copy.deepcopy(plain)
    change(plain)
    if when == "before":
        change(model)
    ooc.wrap(model, Plan.of(POLICIES[policies], min_swap_bytes=4096).streaming([0, 1, 2, 3]), backend="chaos")
    if when == "after":
        change(model)
    sgd = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, model)]
    try:
        for step in range(3):
            for m, opt in zip((plain, model), sgd):
                torch.manual_seed(step)
                m(*gpt_batch(seed=step))[1].backward()
                opt.step()  # a no-op where the hook took the gradients
                opt.zero_grad()
            assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), model.parameters())), step
    finally:
        ooc.unwrap(model)
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), model.parameters()))


def _halve_the_next_blocks_data(model: torch.nn.Module) -> None:
    def halve(_block: torch.nn.Module, _args: tuple, _out: object) -> None:
        for p in model.blocks[2].parameters():
            p.data = p.data * 0.5  # after block 2's copy in was issued (one block ahead)

    model.blocks[1].register_forward_hook(halve)


def test_data_replaced_between_a_stream_in_and_its_block_is_copied_in() -> None:
    """NOTE [weights changed around a stream-in]: block 2 ran on the copy issued before the change."""
    plain = _model()
    model = copy.deepcopy(plain)
    _halve_the_next_blocks_data(plain)
    ooc.wrap(model, Plan.of(POLICIES["mixed"], min_swap_bytes=4096).streaming([0, 1, 2, 3]), backend="chaos")
    _halve_the_next_blocks_data(model)
    try:
        for step in range(2):
            for m in (plain, model):
                m.zero_grad(set_to_none=True)
                torch.manual_seed(step)
                m(*gpt_batch(seed=step))[1].backward()
            assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters())), step
    finally:
        ooc.unwrap(model)
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), model.parameters()))
