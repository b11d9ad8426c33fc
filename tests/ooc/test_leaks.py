"""A graph dropped without its backward frees what the plan saved, and wraps cannot overlap."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef

import ooc
from ooc.models import GPT
from ooc.models.gpt import GPTConfig
from ooc.recompute import RecomputeError
from ooc.runtime import runtime_of
from tests.helpers import gpt_batch

NANO = GPTConfig(vocab_size=65, block_size=32, n_layer=3, n_head=2, n_embd=32, dropout=0.0)


class Interrupted(Exception):
    pass


def _live_storages() -> dict[int, int]:
    """Bytes of each storage that a live Python tensor views, by address. Storages, not tensor
    objects: a pooled block's Python wrapper comes and goes with its views (``view._base`` makes a
    new one when the old was collected), so the number of tensor objects depends on when the
    garbage collector last ran, while the memory they hold does not."""
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gc also finds deprecated torch objects that warn when inspected
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    storages = (t.untyped_storage() for t in tensors if not t.is_meta and not isinstance(t, FakeTensor))
    return {s.data_ptr(): s.nbytes() for s in storages if s.nbytes() > 0}


@pytest.mark.parametrize("backend", ["cpu", "chaos"])  # chaos: copies run late, still queued at the end
@pytest.mark.parametrize("policy", ["keep", "swap", "recompute"])
def test_graphs_dropped_without_backward_free_their_saved_tensors(policy: str, backend: str) -> None:
    torch.manual_seed(0)
    model = GPT(NANO)
    batch = gpt_batch(batch=2, seq=8)
    ooc.wrap(model, ooc.Plan.uniform(policy, NANO.n_layer, min_swap_bytes=1024), backend=backend)
    try:
        tracker = runtime_of(model).tracker
        model(*batch)[1].backward()  # one whole step first: the host pool holds its buffers from now on
        model.zero_grad(set_to_none=True)
        baseline = _live_storages()
        pool = runtime_of(model).pool
        pooled_bytes = pool.allocated_bytes
        assert tracker.current == 0

        def interrupt(_module, _inputs, _output) -> None:
            raise Interrupted

        handle = model.blocks[1].register_forward_hook(interrupt)  # after block 1 has saved its tensors
        for _ in range(50):
            with pytest.raises(Interrupted):
                model(*batch)
        handle.remove()
        assert tracker.current == 0
        outputs = []
        for _ in range(50):  # e.g. a validation forward without no_grad
            logits, loss = model(*batch)
            outputs.append(weakref.ref(loss))
            del logits, loss
        assert tracker.current == 0
        assert all(ref() is None for ref in outputs)
        assert pool.in_use_bytes == 0
        assert pool.allocated_bytes == pooled_bytes
        # A copy out still queued holds its source until it runs (on CUDA too: record_stream): in
        # flight, not leaked. Once the copy engines are idle, nothing of the dropped graphs may live.
        runtime_of(model).backend.synchronize()
        assert _live_storages() == baseline
        model(*batch)[1].backward()  # and training goes on as before
        assert ooc.memory_report(model).current_bytes == 0
    finally:
        ooc.unwrap(model)


def _stack() -> tuple[nn.Module, nn.Module]:
    inner = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    return inner, nn.Sequential(inner, nn.Linear(8, 1))


def test_wrapping_the_model_around_a_wrapped_module_is_refused() -> None:
    inner, outer = _stack()
    ooc.wrap(inner, backend="cpu")
    with pytest.raises(ooc.WrapError, match="already wrapped.*unwrap"):
        ooc.wrap(outer, blocks=list(inner), backend="cpu")
    assert not ooc.is_wrapped(outer)
    ooc.unwrap(inner)
    ooc.wrap(outer, blocks=list(inner), backend="cpu")
    ooc.unwrap(outer)


def test_wrapping_a_module_inside_a_wrapped_model_is_refused() -> None:
    inner, outer = _stack()
    ooc.wrap(outer, blocks=list(inner), backend="cpu")
    with pytest.raises(ooc.WrapError, match="already wrapped.*unwrap"):
        ooc.wrap(inner, backend="cpu")
    assert not ooc.is_wrapped(inner)
    ooc.unwrap(outer)


@pytest.mark.parametrize("where", ["pre-hook", "inside", "post-hook"])
@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_a_forward_that_raises_sends_the_streamed_weights_back(policy: str, where: str) -> None:
    """A forward that raises in a streamed block (in its forward, or in a hook of the caller's before
    or after it) leaves no block's weights on the device: neither the block's own, attached by ooc's
    pre-hook before the caller's ran, nor those of the next block, prefetched during its forward.
    They stayed until that block's next forward, so the next step ran with a block more than its plan
    (on a GPU: what an OOM handler that retries with a smaller batch has least to spare)."""
    torch.manual_seed(0)
    model = GPT(NANO)
    batch = gpt_batch(batch=2, seq=8)
    ooc.wrap(model, ooc.Plan.uniform(policy, NANO.n_layer).streaming(range(NANO.n_layer)), backend="cpu")
    try:
        model(*batch)[1].backward()
        model.zero_grad(set_to_none=True)
        clean = ooc.memory_report(model)

        def interrupt(*_args: object) -> None:
            raise Interrupted

        block = model.blocks[1]
        handle = {"pre-hook": lambda: block.register_forward_pre_hook(interrupt),
                  "inside": lambda: block.attn.register_forward_hook(interrupt),
                  "post-hook": lambda: block.register_forward_hook(interrupt)}[where]()
        with pytest.raises(Interrupted):
            model(*batch)
        handle.remove()
        streamer = runtime_of(model).streamer
        assert ooc.memory_report(model).param_bytes == clean.param_bytes
        assert all(e.device is None and e.param.data_ptr() == e.host.data_ptr()
                   for entries in streamer.blocks.values() for e in entries)
        model(*batch)[1].backward()  # the next step holds what a step holds
        assert ooc.memory_report(model).param_peak_bytes == clean.param_peak_bytes
    finally:
        ooc.unwrap(model)


class Stashing(nn.Module):
    """``x + fc2(softmax(fc1(x)))`` that keeps its softmax on itself (``self.probs``), as models that
    expose their attention maps for display do (a mixture of experts' ``self.aux_loss`` alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.probs: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.probs = torch.softmax(self.fc1(x), -1)
        return x + self.fc2(self.probs)


@pytest.mark.parametrize("swap_input", [False, True], ids=["recompute", "recompute+swap_input"])
def test_a_tensor_a_recomputed_block_keeps_on_itself_does_not_hold_its_frame(swap_input: bool) -> None:
    """A tensor the re-run makes that outlives it (kept by a forward hook for display, as ``block.probs``
    was before NOTE [attributes a forward sets]) holds the re-run's graph, which autograd keeps with the
    pack hook each of its saved tensors went through. That hook held the recompute frame, and the
    frame the block's input (on the device again: a swapped one was copied back for the re-run) and
    its cached outputs: until the next forward replaced it, a step's worth of inputs stayed
    alive (counted by the tracker when swapped), where plain PyTorch frees them."""
    torch.manual_seed(0)
    plain = nn.Sequential(*[Stashing() for _ in range(3)])
    wrapped = nn.Sequential(*[Stashing() for _ in range(3)])
    wrapped.load_state_dict(plain.state_dict())
    ooc.wrap(wrapped, ooc.Plan.of([ooc.BlockPlan("recompute", swap_input=swap_input)] * 3, min_swap_bytes=0),
             blocks=list(wrapped), backend="cpu")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    shown: dict[nn.Module, dict[int, torch.Tensor]] = {plain: {}, wrapped: {}}
    try:
        for model in (plain, wrapped):
            inputs: list[StorageWeakRef] = []
            handles = [b.register_forward_pre_hook(
                lambda _m, args, inputs=inputs: inputs.append(StorageWeakRef(args[0].untyped_storage()))) for b in model]
            handles += [b.fc1.register_forward_hook(lambda _m, _a, out, i=i, d=shown[model]: d.__setitem__(i, out))
                        for i, b in enumerate(model)]
            for _ in range(2):
                model(x).square().mean().backward()
            for handle in handles:
                handle.remove()
            gc.collect()
            # The inputs of the blocks after the first, made in the last forward, died with its graph.
            assert [ref.expired() for ref in inputs[-2:]] == [True, True], "wrapped" if model is wrapped else "plain"
        assert ooc.memory_report(wrapped).current_bytes == 0
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), wrapped.parameters()))
        # The hook's tensor is the re-run's, with the forward's values; a backward through it raises, as plain
        # PyTorch's, whose backward freed that graph.
        assert torch.equal(shown[plain][1], shown[wrapped][1])
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            shown[plain][1].sum().backward()
        with pytest.raises(RecomputeError, match=r"graph of block 1's re-run"):
            shown[wrapped][1].sum().backward()
        # The block's own attribute is the forward's again: a backward through it raises as plain PyTorch's.
        assert torch.equal(plain[1].probs, wrapped[1].probs)
        for model in (plain, wrapped):
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                model[1].probs.sum().backward()
    finally:
        ooc.unwrap(wrapped)
