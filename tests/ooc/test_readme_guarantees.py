"""README guarantees, each tried against inputs its other tests do not use.

"What raises, before anything changes ... Errors derive from ``ooc.OocError``"; "Gradients are bit
for bit those of plain PyTorch" on blocks called with keyword arguments only, returning tuples,
dicts or lists, sharing weights, with frozen parameters, strided inputs and other dtypes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import ooc
from ooc.models import MLPChain
from ooc.runtime import runtime_of
from tests.helpers import stable_seed


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLPChain(16, 32, 3, 4)


def _mlp_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def _mlp_step(model: nn.Module) -> None:
    x, y = _mlp_batch()
    nn.functional.cross_entropy(model(x), y).backward()


# What raises, before anything changes ------------------------------------------------------------


@pytest.mark.parametrize("planner", ["optmal", 3])
@pytest.mark.parametrize("sample", [False, True], ids=["first-step", "sample"])
def test_a_misspelt_planner_raises_in_wrap(planner: object, sample: bool) -> None:
    # Without a sample, wrap accepted any planner name: the first training step ran (every block
    # recomputed), and only its backward raised a plain ValueError, unwrapping the model.
    model = _mlp()
    kwargs = dict(sample=_mlp_batch()[0]) if sample else {}
    with pytest.raises(ooc.PlanError, match="no planner.*optimal"):
        ooc.wrap(model, budget="1MiB", planner=planner, backend="cpu", **kwargs)
    assert not ooc.is_wrapped(model)
    _mlp_step(model)


def test_ooc_plan_checks_the_planner_before_profiling(monkeypatch) -> None:
    import ooc.api

    def refuse(*_args, **_kwargs):
        raise AssertionError("profiled before the planner name was checked")

    monkeypatch.setattr(ooc.api, "measure_profile", refuse)
    with pytest.raises(ooc.PlanError, match="no planner"):
        ooc.plan(_mlp(), _mlp_batch()[0], budget="1MiB", planner="nope", backend="cpu")


@pytest.mark.parametrize("kwargs", [
    dict(budget=True), dict(budget=True, sample="x"), dict(backend="tpu"), dict(backend=3),
    dict(budget="1MiB", profile="p.json"), dict(budget="1MiB", planner=None),
], ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()))
def test_bad_wrap_arguments_raise_ooc_errors_and_leave_the_model_alone(kwargs: dict) -> None:
    # budget=True raised TypeError, an unknown backend a plain ValueError and profile="p.json" an
    # AttributeError: none of them an ooc.OocError, which the README says every error derives from.
    model = _mlp()
    if kwargs.get("sample"):
        kwargs["sample"] = _mlp_batch()[0]
    with pytest.raises(ooc.OocError):
        ooc.wrap(model, **kwargs)
    assert not ooc.is_wrapped(model)
    _mlp_step(model)


@pytest.mark.parametrize("argv", [
    ["--model", "mlp", "--batch", "0"], ["--model", "gpt:nano", "--seq", "0"],
    ["--analytic", "gpt2-xl", "--batch", "-1"], ["--analytic", "gpt2-xl", "--seq", "0"],
], ids=" ".join)
def test_cli_profile_refuses_an_empty_batch_or_sequence(argv: list[str], capsys) -> None:
    # A batch of 0 wrote a profile of 0 saved bytes (exit 0); a negative analytic batch failed with
    # "op 'layer_norm': output_bytes must be >= 0", which names no option.
    from ooc.apps.cli import main

    assert main(["profile", *argv, "--reps", "1"]) == 2
    assert f"{argv[2]} must be >= 1" in capsys.readouterr().err


# HostAdamW: "On CPU fp32 the result equals torch.optim.AdamW(fused=True) bit for bit" --------------


class _PartlyFrozen(nn.Module):
    """Four blocks; block 1's LayerNorm weight is frozen, ``spare`` is never used, block 2 is
    skipped in some steps (its parameters then get no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU()) for _ in range(4))
        self.blocks[1][1].weight.requires_grad_(False)
        self.spare = nn.Parameter(torch.randn(3))
        self.skip_block_2 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if not (self.skip_block_2 and i == 2):
                x = block(x)
        return x.pow(2).mean()


def test_a_block_with_a_frozen_weight_updates_inside_the_backward() -> None:
    # "each block's update starts as soon as its gradients are complete": the bucket of block 1,
    # whose LayerNorm weight is frozen but passed in model.parameters(), waited for that weight's
    # gradient, which never comes, so its update ran only in step().
    from ooc.optim import HostAdamW

    torch.manual_seed(0)
    model = _PartlyFrozen()
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model)
    try:
        model(torch.randn(8, 16)).backward()
        started = [opt.buckets[i].name for i in opt.uncommitted_buckets()]
        assert sorted(started) == [f"blocks.{i}" for i in range(4)]
        opt.step()
    finally:
        opt.close()


@pytest.mark.parametrize("pipeline", [False, True], ids=["step", "pipelined"])
def test_host_adamw_leaves_parameters_without_gradients_alone(pipeline: bool) -> None:
    # With masters apart from the parameters (every parameter on a GPU; the chaos backend's separate
    # memory here), each update copied the bucket's whole staging buffer into its parameters, though
    # only the updated ones had been staged: a frozen weight, or one without a gradient yet, took
    # the buffer's zeros. torch's AdamW skips a parameter whose .grad is None.
    from ooc.backend import ChaosConfig, CpuBackend
    from ooc.optim import HostAdamW

    torch.manual_seed(0)
    model = _PartlyFrozen()
    plain = _PartlyFrozen()
    plain.load_state_dict(model.state_dict())
    backend = CpuBackend(chaos=ChaosConfig(seed=3, max_delay_s=0.0005))
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model if pipeline else None,
                    pipeline=pipeline, backend=backend)
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    try:
        for step in range(4):
            for m, o in ((model, opt), (plain, reference)):
                m.skip_block_2 = step < 2
                m(torch.randn(8, 16, generator=torch.Generator().manual_seed(step))).backward()
                o.step()
                o.zero_grad()
        opt.synchronize()
        assert all("master" in s for s in opt.state.values())  # the masters are apart from the parameters
        differ = [n for (n, p), q in zip(model.named_parameters(), plain.parameters()) if not torch.equal(p, q)]
        assert differ == []
    finally:
        opt.close()
        backend.close()


# "A tensor a block saved, changed in place before the backward used it (an optimizer step between
# forward and backward), raises ooc.SavedTensorModifiedError under every policy" -----------------


@pytest.mark.parametrize("policy", ["keep", "swap"])
@pytest.mark.parametrize("params", ["resident", "streamed"])
def test_a_weight_changed_between_forward_and_backward_raises(policy: str, params: str) -> None:
    # A streamed weight is saved as a reference to the parameter (StreamedView), rebuilt from the
    # copy the backward streams in: an SGD step between forward and backward went unseen and the
    # backward used the new weights, silently; plain PyTorch raises "modified by an inplace operation".
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)])
    plan = ooc.Plan(blocks=(ooc.BlockPlan(policy, params=params),) * 3, min_swap_bytes=0)
    ooc.wrap(model, plan, blocks=list(model), backend="chaos")
    try:
        loss = model(torch.randn(8, 16)).sum()
        # A write to a streamed weight's host bytes while its copy in may still read them is a race
        # the stream-order checker raises on (StreamOrderError): let the copies end first.
        runtime_of(model).backend.synchronize()
        with torch.no_grad():
            model[1][0].weight.add_(1.0)
        with pytest.raises(ooc.SavedTensorModifiedError, match="block '1'"):
            loss.backward()
        model(torch.randn(8, 16)).sum().backward()  # the next step trains
    finally:
        ooc.unwrap(model)


class _HalvesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)  # the previous block's tanh saved x as its output
        return torch.tanh(self.linear(x))


@pytest.mark.parametrize("chaos", [False, True], ids=["cpu", "chaos"])
def test_a_swapped_output_changed_by_the_next_block_raises(chaos: bool) -> None:
    # The change came while the block's copy out could still read the bytes, and once the caller's
    # tensor died (only the swapped record held the bytes) nothing compared versions: the backward
    # ran on whichever bytes the copy read, where plain PyTorch raises. The tests' stream-order
    # checker sees the race itself (StreamOrderError at the mul_); a user's backend, like CUDA, does
    # not, so it is off here.
    from ooc.backend import ChaosConfig, CpuBackend

    torch.manual_seed(0)
    model = nn.Sequential(*[_HalvesItsInput() for _ in range(3)])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(torch.randn(8, 16) * 1.0).sum().backward()
    backend = CpuBackend(chaos=ChaosConfig(seed=1) if chaos else None, check_order=False)
    ooc.wrap(model, ooc.Plan.uniform("swap", 3, min_swap_bytes=0), blocks=list(model), backend=backend)
    try:
        loss = model(torch.randn(8, 16) * 1.0).sum()
        with pytest.raises(ooc.SavedTensorModifiedError, match="in flight"):
            loss.backward()
    finally:
        ooc.unwrap(model)
        backend.close()


class _KeepsItsActivation(nn.Module):
    """Keeps its hidden activation (as a probe or a hook capturing activations would) and saves a
    view of it for its backward: the view dies with the forward, the activation lives on."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.last = h
        half = h[:, :32]
        return torch.cat([half * half, h[:, 32:]], 1)  # saves the view ``half``


@pytest.mark.parametrize("plan", ["keep", "swap", "swap int8", "swap int4", "swap fp8"])
def test_an_activation_changed_after_the_forward_through_a_living_alias_raises(plan: str) -> None:
    # The saved tensor was a view that died with the forward; its base, which shares its version
    # counter, lived and was changed in place. Plain PyTorch raises "modified by an inplace
    # operation"; a swapped or compressed record watched only the dead view and the backward ran on
    # the values from before the change, without a word. (A recomputed block re-runs from its input,
    # which did not change, so its gradients are the forward's: nothing to refuse.)
    policy, _, codec = plan.partition(" ")
    torch.manual_seed(0)
    model = nn.Sequential(*[_KeepsItsActivation() for _ in range(3)])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss = model(torch.randn(32, 64)).sum()
        model[1].last.add_(1.0)
        loss.backward()
    block = ooc.BlockPlan(policy, codec=codec or "none")
    ooc.wrap(model, ooc.Plan.of([block] * 3, min_swap_bytes=0), blocks=list(model), backend="cpu")
    try:
        loss = model(torch.randn(32, 64)).sum()
        model[1].last.add_(1.0)
        with pytest.raises(ooc.SavedTensorModifiedError, match=r"block '1'.*modified in place after the forward"):
            loss.backward()
        model(torch.randn(32, 64)).sum().backward()  # the next step trains
    finally:
        ooc.unwrap(model)


# "Gradients are bit-for-bit those of plain PyTorch" on blocks the reference models do not have ------


class _KwargsBlock(nn.Module):
    """Called with keyword arguments only; returns ``(h, aux)``, ``{"h": h, "aux": aux}`` or a list."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.linear, self.out = nn.Linear(16, 16), out

    def forward(self, *, x: torch.Tensor, mask: torch.Tensor, scale: float = 1.0) -> object:
        h = torch.tanh(self.linear(x)) * scale * mask
        aux = (h * h).mean()
        return {"h": h, "aux": aux} if self.out == "dict" else [h, aux] if self.out == "list" else (h, aux)


class _KwargsModel(nn.Module):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_KwargsBlock(out) for _ in range(3))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        total = x.new_zeros(())
        for block in self.blocks:
            out = block(x=x, mask=mask, scale=0.5)
            x, aux = (out["h"], out["aux"]) if isinstance(out, dict) else out
            total = total + aux
        return x.sum() + total


class _TiedFrozenStrided(nn.Module):
    """Block 3 shares block 0's weight, block 1's LayerNorm is frozen, each block reads a strided and
    a transposed view of the running activation, in ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"linear": nn.Linear(16, 32), "norm": nn.LayerNorm(32)}) for _ in range(4))
        self.blocks[3]["linear"].weight = self.blocks[0]["linear"].weight
        self.blocks[1]["norm"].requires_grad_(False)
        for block in self.blocks:
            block.forward = _strided_forward.__get__(block)  # a ModuleDict has no forward of its own
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x[:, ::2], x.t())
        return x.float().pow(2).mean()


def _strided_forward(self: nn.ModuleDict, strided: torch.Tensor, transposed: torch.Tensor) -> torch.Tensor:
    return torch.relu(self["norm"](self["linear"](strided))) + transposed.t() * 0.5


def _kwargs_case(out: str):  # noqa: ANN202
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 16, generator=g), (torch.rand(8, 16, generator=g) > 0.3).float()) for _ in range(2)]
    return lambda: _KwargsModel(out), lambda m, b: m(*b), batches


def _tied_case(dtype: torch.dtype):  # noqa: ANN202
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, 32, generator=g).to(dtype) for _ in range(2)]
    return lambda: _TiedFrozenStrided(dtype), lambda m, b: m(b), batches


_PLANS = {"S": ooc.BlockPlan("swap"), "R": ooc.BlockPlan("recompute"), "r": ooc.BlockPlan("recompute", swap_input=True),
          "K": ooc.BlockPlan("keep"), "T": ooc.BlockPlan("keep", params="streamed"),
          "U": ooc.BlockPlan("swap", params="streamed"), "V": ooc.BlockPlan("recompute", params="streamed")}


@pytest.mark.parametrize("code", ["SRr", "UVT"])
@pytest.mark.parametrize("case", ["tuple", "dict", "list", "float32", "bfloat16", "float64"])
def test_unusual_blocks_train_bit_for_bit(case: str, code: str) -> None:
    from ooc.backend import ChaosConfig, CpuBackend
    from tests.helpers import train_side_by_side

    make, loss_fn, batches = _kwargs_case(case) if case in ("tuple", "dict", "list") else _tied_case(getattr(torch, case))
    plan = ooc.Plan(blocks=tuple(_PLANS[c] for c in (code + code[0])[:len(make().blocks)]), min_swap_bytes=0)
    backend = CpuBackend(chaos=ChaosConfig(seed=stable_seed(case, code), max_delay_s=0.0005))
    try:
        results = train_side_by_side(make, loss_fn, batches, lambda m: ooc.wrap(m, plan, blocks=m.blocks, backend=backend))
    finally:
        backend.close()
    assert results == [(True, True, True)] * len(batches)


# "Nothing leaked. A forward that raises ... frees its saved tensors with its graph" -------------------


class _Interruptible(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if self.fail and i == 1:
                raise KeyError("interrupted")
        return x.sum()


@pytest.mark.parametrize("how", ["first-step plan", "streamed plan"])
def test_a_first_forward_that_raises_leaves_training_exact(how: str) -> None:
    # The first forward is special: the chain's order is checked (and, planning from the first step,
    # it is measured). One that raises half-way must leave neither calls nor bytes behind.
    torch.manual_seed(0)
    model, plain = _Interruptible(), _Interruptible()
    plain.load_state_dict(model.state_dict())
    kwargs = dict(budget="1MiB") if how == "first-step plan" else dict(
        plan=ooc.Plan.of(["swap", "recompute", "keep"], min_swap_bytes=0).streaming([0, 1, 2]))
    ooc.wrap(model, backend="chaos", **kwargs)
    try:
        model.fail = True
        with pytest.raises(KeyError):
            model(torch.randn(8, 16))
        model.fail = False
        assert ooc.memory_report(model).current_bytes == 0
        for step in range(2):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            model(x).backward()
            plain(x).backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))
        assert ooc.memory_report(model).current_bytes == 0
        assert runtime_of(model).plan.name == ("optimal" if how == "first-step plan" else "custom")
    finally:
        ooc.unwrap(model)


# "the tracker's measured peak equals the prediction" on a chain with tied, frozen and strided inputs --


def _tied_profile_and_measure():  # noqa: ANN202
    """The tied model, its profile and ``measure(plan) -> MemoryReport`` of one step under ``plan``."""
    torch.manual_seed(0)
    model = _TiedFrozenStrided(torch.float32)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    prof = ooc.profile(model, (x,), loss_fn=lambda out: out, blocks=list(model.blocks), min_swap_bytes=0,
                       codec_errors=False, reps=1)

    def measure(plan: ooc.Plan) -> ooc.MemoryReport:
        ooc.wrap(model, plan, blocks=list(model.blocks), backend="cpu")
        try:
            model(x).backward()
            return ooc.memory_report(model)
        finally:
            ooc.unwrap(model)
            model.zero_grad(set_to_none=True)

    return prof, measure


def test_measured_peak_equals_prediction_with_tied_frozen_and_strided_blocks() -> None:
    import random

    from ooc.scheduler import build_schedule

    prof, measure = _tied_profile_and_measure()
    rng = random.Random(stable_seed("tied-peak"))
    mismatches = []
    for _ in range(12):
        code = "".join(rng.choice("KSRrTUV") for _ in range(4))
        plan = ooc.Plan(blocks=tuple(_PLANS[c] for c in code), min_swap_bytes=0, prefetch=rng.randint(0, 2))
        report = measure(plan)
        predicted = build_schedule(plan, prof).peak_bytes
        if (report.peak_bytes, report.current_bytes) != (predicted, 0):
            mismatches.append((code, plan.prefetch, report.peak_bytes, report.current_bytes, predicted))
    assert mismatches == []


@pytest.mark.parametrize("code", ["KKKK", "TKKT", "KTTK", "TTTT", "UVTK", "KKKT"])
def test_measured_parameter_peak_equals_prediction_with_a_weight_tied_across_blocks(code: str) -> None:
    # README (Weight streaming): "the tracker's measured parameter peak
    # (ooc.memory_report(model).param_peak_bytes) equals the prediction". Block 3 shares block 0's
    # weight: it counts once, and it stays resident whichever of the two is streamed.
    from ooc.scheduler import build_schedule

    prof, measure = _tied_profile_and_measure()
    plan = ooc.Plan(blocks=tuple(_PLANS[c] for c in code), min_swap_bytes=0)
    assert measure(plan).param_peak_bytes == build_schedule(plan, prof).param_peak_bytes


@pytest.mark.parametrize("code", ["KKKT", "TKKK", "TKKT"])
def test_a_weight_tied_between_blocks_is_on_the_device_when_either_runs(code: str) -> None:
    # README (Weight streaming): a streamed block's parameters are copied to the device before its
    # forward and backward; "between uses p is a host tensor". A weight that another block holds
    # too stays on the device (NOTE [parameters shared between blocks]): streamed with one holder,
    # it would be on the host while the other runs (on CUDA: a device mismatch).
    from ooc.runtime import weight_streamer

    torch.manual_seed(0)
    model = _TiedFrozenStrided(torch.float32)
    resident = model.blocks[0]["linear"].weight.data_ptr()
    ooc.wrap(model, ooc.Plan(blocks=tuple(_PLANS[c] for c in code), min_swap_bytes=0), blocks=list(model.blocks),
             backend="cpu")
    try:
        tied = model.blocks[0]["linear"].weight
        assert weight_streamer(model).host_copy(tied) is None
        moved = []
        for i in (0, 3):
            model.blocks[i]["linear"].register_forward_pre_hook(
                lambda _m, _a, i=i: moved.append(i) if tied.data_ptr() != resident else None)
        model(torch.randn(8, 32)).backward()
        assert moved == []
        assert weight_streamer(model).host_copy(model.blocks[0]["linear"].bias) is not None or code[0] != "T"
    finally:
        ooc.unwrap(model)


# "What raises, before anything changes: ... a torch.func transform over a wrapped model (unwrap first)" --------


_TRANSFORMS = {
    "vmap": lambda m, x: torch.func.vmap(m)(x.unsqueeze(0).expand(3, *x.shape)),
    "grad-of-input": lambda m, x: torch.func.grad(lambda x: m(x).sum())(x),
    "jacrev": lambda m, x: torch.func.jacrev(m)(x),
    "jvp": lambda m, x: torch.func.jvp(m, (x,), (torch.ones_like(x),)),
    "vjp": lambda m, x: torch.func.vjp(m, x),
}


@pytest.mark.parametrize("policy", ["keep", "swap", "recompute"])
@pytest.mark.parametrize("transform", sorted(_TRANSFORMS))
def test_every_torch_func_transform_over_a_wrapped_model_raises_a_wrap_error(transform: str, policy: str) -> None:
    # Only torch.func.grad over the parameters raised WrapError; a transform of the input failed inside
    # ooc's hooks or torch's with "Cannot access storage of BatchedTensorImpl", "Attempted to access the
    # data pointer on an invalid python storage" or "torch.func.{grad, ...} don't yet support saved tensor
    # hooks": none an ooc.OocError, none saying to unwrap.
    model = _mlp()
    ooc.wrap(model, plan=ooc.Plan.uniform(policy, 3), backend="cpu")
    try:
        with pytest.raises(ooc.WrapError, match="unwrap"):
            _TRANSFORMS[transform](model, _mlp_batch()[0])
        assert runtime_of(model).tracker.current == 0
        _mlp_step(model)  # the model is unharmed
        with torch.no_grad():  # nothing is saved without autograd: a transform may run the plain forward
            torch.func.vmap(model)(_mlp_batch()[0].unsqueeze(0))
    finally:
        ooc.unwrap(model)
    assert torch.func.jacrev(model)(_mlp_batch()[0][:2]).shape == (2, 4, 2, 16)


# "What raises, before anything changes: ... a second HostAdamW on a model that has one" -------------------


@pytest.mark.parametrize("order", ["model-then-params", "params-then-model", "params-then-params", "a-shared-weight"])
def test_a_second_host_adamw_over_the_same_parameters_is_refused(order: str) -> None:
    # Only a second HostAdamW given model= was refused: HostAdamW(model.parameters()) beside the one
    # built with model=model (or before it) took the same weights, and each step updated them twice.
    from ooc.optim import HostAdamW

    model = _mlp()
    first_model = model if order == "model-then-params" else None
    first = HostAdamW(model.parameters(), lr=1e-2, model=first_model)
    try:
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ooc.OocError, match="double update"):
            if order == "a-shared-weight":  # one weight of the first's among others
                HostAdamW([nn.Parameter(torch.zeros(3)), model.blocks[1].up.weight], lr=1e-2)
            else:
                HostAdamW(model.parameters(), lr=1e-2, model=model if order == "params-then-model" else None)
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        _mlp_step(model)
        first.step()
        first.zero_grad()
        other = HostAdamW([nn.Parameter(torch.zeros(3))], lr=1e-2)  # other parameters: no refusal
        other.close()
    finally:
        first.close()
    second = HostAdamW(model.parameters(), lr=1e-2, model=model)  # the first is closed: it no longer counts
    second.close()


# "Nothing leaked ... the tracker returns to zero"; "retain_graph=True" works as without ooc ----------------


@pytest.mark.parametrize("policy", ["keep", "swap", "recompute"])
def test_a_retained_graph_backs_twice_and_leaves_the_tracker_at_zero_once_dropped(policy: str) -> None:
    import gc

    torch.manual_seed(0)
    plain = MLPChain(64, 256, 3, 4)
    model = MLPChain(64, 256, 3, 4)
    model.load_state_dict(plain.state_dict())
    ooc.wrap(model, plan=ooc.Plan(blocks=ooc.Plan.uniform(policy, 3).blocks, min_swap_bytes=0), backend="cpu")
    try:
        x = torch.randn(32, 64)
        grads = []
        for m in (plain, model):
            loss = m(x).sum()
            loss.backward(retain_graph=True)
            loss.backward()
            grads.append([p.grad for p in m.parameters()])
            del loss
        gc.collect()
        assert all(torch.equal(a, b) for a, b in zip(*grads))
        assert runtime_of(model).tracker.current == 0
        model.zero_grad()
        _ = model(x)  # a graph dropped without a backward
        del _
        assert runtime_of(model).tracker.current == 0
    finally:
        ooc.unwrap(model)


# Checkpoints: "`ckpt.export(step, path)` writes one version's weights, into a directory's `model.safetensors`
# if `path` is one" --------------------------------------------------------------------------------------


def test_export_into_a_directory_named_with_a_trailing_slash(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    # export(step, "weights/") with no such directory wrote a file named "weights"; a file path in a
    # missing directory failed with FileNotFoundError naming ".w.safetensors.tmp", a name the caller never gave.
    from safetensors.torch import load_file

    from ooc.checkpoint import Checkpointer, CheckpointError
    from ooc.optim import HostAdamW

    monkeypatch.chdir(tmp_path)
    model = _mlp()
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model)
    ckpt = Checkpointer("ckpt", model, opt)
    try:
        _mlp_step(model)
        opt.step()
        ckpt.save(0)
        ckpt.wait()
        out = ckpt.export(0, "weights/")
        assert out == Path("weights") / "model.safetensors" and out.is_file()
        assert set(load_file(out)) == set(model.state_dict())
        with pytest.raises(CheckpointError, match="no directory.*missing"):
            ckpt.export(0, "missing/w.safetensors")
        assert not Path("missing").exists()
    finally:
        ckpt.close()
        opt.close()
