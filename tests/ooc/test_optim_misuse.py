"""HostAdamW's state machine off the happy path (issue 12): each misuse is either correct or a clear
error or warning, never a silently wrong or stuck optimizer (NOTE [a step is a transaction] in
ooc.optim.pipeline)."""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch

import ooc
from ooc.backend import ChaosConfig, CpuBackend
from ooc.errors import OocError
from ooc.models import GPT
from ooc.optim import HostAdamW
from ooc.optim.pipeline import PipelineError, UncommittedStepWarning
from tests.helpers import gpt_batch


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT("nano")  # 4 blocks


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int = 0) -> None:
    torch.manual_seed(seed)  # dropout
    model(*gpt_batch(seed=seed))[1].backward()
    opt.step()
    opt.zero_grad()


def _fail_once_in_backward(module: torch.nn.Module) -> None:
    """The next backward raises when it reaches ``module``'s output (as a failing hook or Ctrl-C)."""
    def forward_hook(_m, _args, out):  # noqa: ANN001, ANN202
        handle.remove()

        def boom(_grad: torch.Tensor) -> None:
            raise RuntimeError("interrupted")

        out.register_hook(boom)

    handle = module.register_forward_hook(forward_hook)


@pytest.mark.parametrize("reset_by", ["zero_grad", "forward"])
def test_an_interrupted_backward_resets_with_a_warning_and_the_next_step_works(reset_by: str) -> None:
    model = _model()
    before = copy.deepcopy(model)
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model)
    try:
        _fail_once_in_backward(model.blocks[2])
        with pytest.raises(RuntimeError, match="interrupted"):
            model(*gpt_batch())[1].backward()
        with pytest.warns(UncommittedStepWarning, match=r"blocks\.3.*blocks\.0"):
            if reset_by == "zero_grad":
                opt.zero_grad()
            else:
                model(*gpt_batch(seed=1))
        opt.synchronize()
        # What the warning says: the bucket launched before the interruption took its update, the
        # blocks below it did not.
        assert not torch.equal(model.blocks[3].mlp.fc.weight, before.blocks[3].mlp.fc.weight)
        assert torch.equal(model.blocks[0].mlp.fc.weight, before.blocks[0].mlp.fc.weight)
        opt.zero_grad()
        for seed in range(2):
            _step(model, opt, seed)  # the retry works, step after step
        opt.synchronize()
        assert not torch.equal(model.blocks[0].mlp.fc.weight, before.blocks[0].mlp.fc.weight)
    finally:
        opt.close()


def test_step_after_an_interrupted_backward_is_a_clear_error() -> None:
    model = _model()
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model)
    try:
        _fail_once_in_backward(model.blocks[2])
        with pytest.raises(RuntimeError, match="interrupted"):
            model(*gpt_batch())[1].backward()
        with pytest.raises(PipelineError, match="did not finish"):
            opt.step()
    finally:
        opt.close()


def test_backward_without_step_is_reported_at_zero_grad() -> None:
    """Gradient inspection: the pipelined updates ran in the backward; zero_grad says so plainly."""
    model = _model()
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model)
    try:
        model(*gpt_batch())[1].backward()
        with pytest.warns(UncommittedStepWarning, match="pipeline=False"):
            opt.zero_grad()
        _step(model, opt)  # and the optimizer goes on
    finally:
        opt.close()


def test_a_weight_tied_across_recomputed_blocks_is_updated_once() -> None:
    """Each recomputed block runs its own backward, so the tied weight's gradient arrives in two parts;
    its bucket must wait for both (bit for bit against fused AdamW on the same tied model)."""
    plain = _model()
    plain.blocks[3].mlp.fc.weight = plain.blocks[1].mlp.fc.weight
    model = copy.deepcopy(plain)
    assert model.blocks[3].mlp.fc.weight is model.blocks[1].mlp.fc.weight
    ooc.wrap(model, ooc.scheduler.Plan.of(["recompute"] * 4))
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    try:
        for seed in range(3):
            _step(model, opt, seed)
            _step(plain, ref, seed)
        opt.synchronize()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
    finally:
        opt.close()
        ooc.unwrap(model)


def test_add_param_group_is_refused() -> None:
    model = _model()
    opt = HostAdamW(list(model.blocks.parameters()), lr=1e-2, model=model)
    try:
        with pytest.raises(OocError, match="add_param_group"):
            opt.add_param_group({"params": list(model.lm_head.parameters())})
        assert len(opt.param_groups) == 1
    finally:
        opt.close()


def test_a_second_optimizer_on_the_same_model_is_refused_until_the_first_is_gone() -> None:
    model = _model()
    first = HostAdamW(model.parameters(), lr=1e-2, model=model)
    with pytest.raises(OocError, match="already"):
        HostAdamW(model.parameters(), lr=1e-2, model=model)
    first.close()
    second = HostAdamW(model.parameters(), lr=1e-2, model=model)
    del second
    gc.collect()
    third = HostAdamW(model.parameters(), lr=1e-2, model=model)
    third.close()


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_step_on_a_closed_optimizer_is_refused(pipeline: bool) -> None:
    """``close()`` makes the optimizer unusable; its ``step()`` returned as if it had updated, and training
    went on with weights that never moved (a framework that still holds a closed optimizer steps it)."""
    model = _model()
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, pipeline=pipeline)
    _step(model, opt)
    opt.close()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(*gpt_batch(seed=1))[1].backward()
    with pytest.raises(OocError, match="closed"):
        opt.step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("change", ["dtype", "delayed_update", "accumulate"])
def test_loading_a_checkpoint_made_with_other_options_is_refused_up_front(change: str) -> None:
    """dtypes and delayed_update shape the host state, so a mismatch is refused; accumulate does not
    (a resume may change it, e.g. on fewer ranks), so that checkpoint loads."""
    model = _model()
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model)
    _step(model, opt)
    saved = opt.state_dict()
    opt.close()
    other = _model()
    kwargs: dict = {}
    if change == "dtype":
        other.to(torch.bfloat16)
    elif change == "delayed_update":
        kwargs["delayed_update"] = True
    else:
        kwargs["accumulate"] = 2
    opt2 = HostAdamW(other.parameters(), lr=1e-2, model=other, **kwargs)
    try:
        if change == "accumulate":
            opt2.load_state_dict(saved)
            assert all(torch.equal(a, b) for a, b in zip(saved["state"][0].values(), opt2.state_dict()["state"][0].values()))
        else:
            with pytest.raises(OocError, match=change):
                opt2.load_state_dict(saved)
    finally:
        opt2.close()


class _BlockTwice(torch.nn.Module):
    """A chain whose middle block runs twice per forward, each call checkpointed (reentrant: each
    call's backward is its own, so the block's gradients arrive in two parts)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        for i in (0, 1, 1, 2):
            x = torch.utils.checkpoint.checkpoint(self.blocks[i], x, use_reentrant=True)
        return self.head(x).square().mean()


def test_a_block_called_twice_is_updated_once_with_its_whole_gradient() -> None:
    plain = _BlockTwice()
    model = copy.deepcopy(plain)
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    try:
        for seed in range(3):
            for m, o in ((model, opt), (plain, ref)):
                m(torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))).backward()
                o.step()
                o.zero_grad()
        opt.synchronize()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
    finally:
        opt.close()


def test_clipping_holds_every_update_so_an_unfinished_step_is_rolled_back() -> None:
    """With max_grad_norm nothing is applied before step(): zero_grad() undoes the step whole."""
    model = _model()
    before = copy.deepcopy(model)
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, max_grad_norm=1.0)
    try:
        _fail_once_in_backward(model.blocks[2])
        with pytest.raises(RuntimeError, match="interrupted"):
            model(*gpt_batch())[1].backward()
        opt.zero_grad()
        model(*gpt_batch())[1].backward()
        opt.zero_grad()
        opt.synchronize()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before.parameters()))
        _step(model, opt)
        opt.synchronize()
        assert not torch.equal(model.blocks[0].mlp.fc.weight, before.blocks[0].mlp.fc.weight)
    finally:
        opt.close()


def test_a_gradient_arriving_in_parts_unforeseen_is_an_error_that_says_so(monkeypatch) -> None:
    """Where the parts were not foreseen (here: the block-call count switched off), the error names
    the real cause, not gradient accumulation, and the bucket waits for the backward's end afterwards."""
    monkeypatch.setattr("ooc.optim.pipeline.UpdatePipeline.before_block_forward",
                        lambda self, index: self.gate((index,)))
    model = _BlockTwice()
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model)
    try:
        with pytest.raises(PipelineError, match="second gradient in the same backward") as info:
            model(torch.randn(4, 8)).backward()
        assert "accumulate" not in str(info.value)
        assert opt._pipeline.status[next(b.index for b in opt.buckets if b.name == "blocks.1")].at_end
    finally:
        opt.close()


def test_updates_start_in_the_backward_whatever_the_output_container() -> None:
    """The backward is watched through the model's outputs: a dict of them works too."""
    class DictOut(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = _BlockTwice()

        def forward(self, x: torch.Tensor) -> dict:
            return {"loss": self.inner(x), "extra": [x]}

    model = DictOut()
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model)
    try:
        model(torch.randn(4, 8))["loss"].backward()
        assert opt._pipeline.backwards == 1
        assert any(s.launched for s in opt._pipeline.status)
        opt.step()
    finally:
        opt.close()


def _interrupted_then_trained(backend: CpuBackend) -> list[torch.Tensor]:
    model = _model()
    ooc.wrap(model, ooc.scheduler.Plan.of(["swap", "recompute", "keep", "swap"], min_swap_bytes=4096), backend=backend)
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, backend=backend)
    try:
        _fail_once_in_backward(model.blocks[1])
        with pytest.raises(RuntimeError, match="interrupted"):
            model(*gpt_batch())[1].backward()
        with pytest.warns(UncommittedStepWarning):
            opt.zero_grad()
        for seed in range(3):
            _step(model, opt, seed)
        opt.synchronize()
        return [p.detach().clone() for p in model.parameters()]
    finally:
        opt.close()
        ooc.unwrap(model)


def test_after_a_reset_the_forward_gate_still_orders_the_weights() -> None:
    """The chaos backend delays copies and poisons their destinations first: a forward that read
    weights before the half step's copies landed would differ from the plain CPU run."""
    chaos = CpuBackend(chaos=ChaosConfig(seed=5, max_delay_s=0.002))
    try:
        assert all(torch.equal(a, b) for a, b in zip(_interrupted_then_trained(CpuBackend()),
                                                     _interrupted_then_trained(chaos)))
    finally:
        chaos.close()


def test_a_forward_between_backward_and_step_warns_that_it_reads_the_new_weights() -> None:
    model = _model()
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model)
    try:
        model(*gpt_batch())[1].backward()
        with pytest.warns(UncommittedStepWarning, match="reads their new weights"), torch.no_grad():
            model(*gpt_batch(seed=1))
        opt.step()
        opt.zero_grad()
        _step(model, opt, 1)  # no warning on the ordinary path: the step committed
    finally:
        opt.close()


def _run(backend_name: str, seeds: range, *, rollback: bool = False, uncommitted: str | None = None) -> list[torch.Tensor]:
    """Steps on ``seeds``; with ``uncommitted``, first a step that no step() commits."""
    model = _model()
    backend = CpuBackend(chaos=ChaosConfig(seed=3, max_delay_s=0.002)) if backend_name == "chaos" else CpuBackend()
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, backend=backend, rollback=rollback)
    try:
        for i, seed in enumerate(seeds):
            if i == 1 and uncommitted is not None:
                if uncommitted == "interrupted":
                    _fail_once_in_backward(model.blocks[1])
                    with pytest.raises(RuntimeError, match="interrupted"):
                        model(*gpt_batch(seed=99))[1].backward()
                else:
                    model(*gpt_batch(seed=99))[1].backward()  # gradient inspection
                opt.zero_grad()
            _step(model, opt, seed)
        opt.synchronize()
        return [p.detach().clone() for p in model.parameters()]
    finally:
        opt.close()
        backend.close()


@pytest.mark.parametrize("uncommitted", ["interrupted", "inspected"])
@pytest.mark.parametrize("backend", ["cpu", "chaos"])
def test_rollback_undoes_an_uncommitted_step_whole(backend: str, uncommitted: str) -> None:
    """With rollback=True the step no step() committed leaves no trace: the run equals one without it,
    bit for bit (on the CPU the parameters are their own masters; under chaos the weights are copied)."""
    expected = _run(backend, range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncommittedStepWarning)  # undone: nothing to warn about
        got = _run(backend, range(3), rollback=True, uncommitted=uncommitted)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_without_rollback_the_uncommitted_step_stays() -> None:
    """The test above can fail: without rollback the uncommitted update remains."""
    with pytest.warns(UncommittedStepWarning):
        got = _run("cpu", range(3), uncommitted="inspected")
    assert not all(torch.equal(a, b) for a, b in zip(got, _run("cpu", range(3))))


def test_rollback_with_delayed_update_is_refused() -> None:
    model = _model()
    with pytest.raises(ValueError, match="rollback=True cannot be combined with delayed_update"):
        HostAdamW(model.parameters(), model=model, rollback=True, delayed_update=True)
