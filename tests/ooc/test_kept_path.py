"""A KEEP block's own hook pair (NOTE [the kept path] in ooc.runtime) counts, checks and returns what
the general pack and unpack do: the same memory report step by step, the same gradients, and the
same refusal of a saved tensor changed in place."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ooc
from ooc import runtime
from ooc.models import GPT
from tests.helpers import gpt_batch
from tests.ooc.test_shared_storages import MODELS as SHARING_MODELS


def _general_pair(self, block):  # noqa: ANN001, ANN202
    return self.versioned(block, self.pack_hook(block, swap=False, what="save")), self.unpack


def _gpt():
    torch.manual_seed(0)
    model = GPT("nano")
    batch = gpt_batch(batch=2, seq=16)
    return model, batch, lambda out: out[1], list(model.blocks)


def _hf_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (2, 16))
    return model, (ids,), lambda out: out.logits.float().square().mean(), None


MODELS = {"gpt": _gpt, "hf-gpt2": _hf_gpt2, **{f"sharing-{k}": v for k, v in SHARING_MODELS.items()}}


def _kinds(n: int) -> dict[str, ooc.Plan]:
    mixed = [ooc.BlockPlan(("keep", "swap", "keep", "recompute")[i % 4]) for i in range(n)]
    return {"keep-all": ooc.Plan.uniform("keep", n, min_swap_bytes=0), "mixed": ooc.Plan(blocks=tuple(mixed), min_swap_bytes=0)}


def _run(name: str, plan_kind: str):
    """Reports after two steps and after a forward dropped without backward, and the gradients."""
    model, sample, loss_fn, blocks = MODELS[name]()
    model.train()
    kwargs = {} if blocks is None else {"blocks": blocks}
    ooc.wrap(model, _kinds(len(blocks) if blocks is not None else model.config.n_layer)[plan_kind], backend="chaos", **kwargs)
    try:
        reports, grads = [], []
        for step in range(2):
            torch.manual_seed(step)
            model.zero_grad(set_to_none=True)
            loss_fn(model(*sample)).backward()
            reports.append(ooc.memory_report(model))
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        loss_fn(model(*sample))  # dropped: its kept bytes go with its graph
        reports.append(ooc.memory_report(model))
        return [(r.current_bytes, r.peak_bytes, r.max_peak_bytes, r.block_peak_bytes) for r in reports], grads
    finally:
        ooc.unwrap(model)


@pytest.mark.parametrize("plan_kind", ["keep-all", "mixed"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_kept_path_counts_as_the_general_pack_does(name: str, plan_kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kept_reports, kept_grads = _run(name, plan_kind)
    monkeypatch.setattr(runtime._Pass, "keep_hooks", _general_pair)
    general_reports, general_grads = _run(name, plan_kind)
    assert kept_reports == general_reports
    assert kept_reports[0][1] > 0  # something was kept and counted
    assert kept_reports[-1][0] == 0  # the dropped graph's bytes went with it
    for a, b in zip(kept_grads, general_grads):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


class _ScalesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
        return x * self.weight * data  # saves data, which needs no gradient: a leaf without grad_fn


class _TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_ScalesItsInput(), _ScalesItsInput()])

    def forward(self, x: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, data)
        return x.sum()


@pytest.mark.parametrize("changed", ["activation", "leaf input", "weight"])
def test_a_tensor_a_kept_block_saved_and_changed_in_place_raises(changed: str) -> None:
    torch.manual_seed(0)
    model = _TwoBlocks()
    x, data = torch.randn(8, requires_grad=True), torch.randn(8)
    plain = model(x * 1, data)
    with torch.no_grad():
        data.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        plain.backward()  # what plain PyTorch does with the leaf input: ooc must not do less
    ooc.wrap(model, ooc.Plan.uniform("keep", 2, min_swap_bytes=0), blocks=list(model.blocks), backend="chaos")
    try:
        hidden = x * 1
        loss = model(hidden, data)
        with torch.no_grad():
            {"activation": hidden, "leaf input": data, "weight": model.blocks[1].weight}[changed].add_(1.0)
        with pytest.raises(ooc.SavedTensorModifiedError, match="block '"):
            loss.backward()
        model.zero_grad(set_to_none=True)
        model(x * 1, data).backward()  # the next step trains
        assert model.blocks[0].weight.grad is not None
    finally:
        ooc.unwrap(model)


class _Remasked(nn.Module):
    """Saves a tensor made without grad, changes it in place, saves it again: ``fc2(fc(x) * m * 3)``
    with ``m`` scaled in place between the two products (each saves ``m``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = (torch.arange(6) % 2).float().expand(5, 6).contiguous()
        h = self.fc(x) * m
        m.mul_(3.0)
        return self.fc2(h * m)


@pytest.mark.parametrize("plan", ["keep", "streamed keep"])
def test_a_tensor_saved_twice_around_an_in_place_change_raises(plan: str) -> None:
    """A tensor without a ``grad_fn`` is kept as itself (NOTE [kept tensors are detached] in ooc.saved),
    so its two saves were one entry of the version table, which the second save overwrote: the first
    product's backward read the changed ``m`` without a word (wrong gradients), where plain PyTorch
    raises. Each save now keeps its own version (the general pair, under streamed weights, likewise)."""
    torch.manual_seed(0)
    model = nn.Sequential(_Remasked(), _Remasked())
    x = torch.randn(5, 6)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).sum().backward()
    keep = ooc.Plan.uniform("keep", 2, min_swap_bytes=0)
    ooc.wrap(model, keep if plan == "keep" else keep.streaming(range(2)), blocks=list(model), backend="cpu")
    try:
        with pytest.raises(ooc.SavedTensorModifiedError, match=r"block '1' saved for its backward \(shape \(5, 6\)\)"):
            model(x).sum().backward()
    finally:
        ooc.unwrap(model)
