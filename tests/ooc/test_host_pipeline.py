"""HostAdamW's per-block pipeline: updates start in the backward, forwards wait for their weights.

Every comparison is bit for bit against torch's fused AdamW, run the plain way on a copy of the
model, so a missing wait (the chaos backend poisons copy destinations with NaN first) or a stale
weight fails.
"""

from __future__ import annotations

import copy
import threading
import time
import warnings

import pytest
import torch

import ooc
from ooc.backend import ChaosConfig, CpuBackend
from ooc.models import GPT
from ooc.optim import HostAdamW, Stage
from ooc.optim.pipeline import PipelineError, UncommittedStepWarning
from tests.helpers import gpt_batch

STEPS = 4
MIXED = ooc.scheduler.Plan.of(["swap", "recompute", "keep", "swap"], min_swap_bytes=4096)


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT("nano")  # 4 blocks


def _train(model: GPT, opt: torch.optim.Optimizer, steps: int, *, accumulate: int = 1,
           clip: float | None = None) -> list[float]:
    """``steps`` steps of ``accumulate`` seeded micro-batches each; the loss of every micro-batch."""
    losses = []
    for step in range(steps):
        for micro in range(accumulate):
            torch.manual_seed(step * 10 + micro)
            loss = model(*gpt_batch(seed=step * 10 + micro))[1]
            loss.backward()
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses


def _reference(model: GPT, steps: int = STEPS, *, accumulate: int = 1, clip: float | None = None) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    return _train(model, opt, steps, accumulate=accumulate, clip=clip)


def _pipelined(model: GPT, opt: HostAdamW, steps: int = STEPS, *, accumulate: int = 1) -> list[float]:
    losses = _train(model, opt, steps, accumulate=accumulate)
    opt.synchronize()
    return losses


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("backend", ["cpu", "chaos"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "wrapped"])
def test_pipelined_updates_equal_fused_adamw(backend: str, wrapped: bool) -> None:
    plain = _model()
    model = copy.deepcopy(plain)
    backend_obj = CpuBackend(chaos=ChaosConfig(seed=3, max_delay_s=0.002)) if backend == "chaos" else CpuBackend()
    if wrapped:
        ooc.wrap(model, MIXED, backend=backend_obj)
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, backend=backend_obj)
    try:
        assert _pipelined(model, opt) == _reference(plain)
        assert _same_weights(model, plain)
        if backend == "chaos":
            assert all("master" in s for s in opt.state.values())  # the copies really ran
    finally:
        opt.close()
        if wrapped:
            ooc.unwrap(model)
        backend_obj.close()


def test_without_the_forward_gate_the_chaos_run_differs(monkeypatch) -> None:
    """The chaos test above can fail: skip the gate and forwards read weights mid-copy."""
    monkeypatch.setattr("ooc.optim.pipeline.UpdatePipeline.gate", lambda self, indices: None)
    plain = _model()
    model = copy.deepcopy(plain)
    # The stream-order checker would catch the missing gate first; this test shows chaos alone does.
    backend = CpuBackend(chaos=ChaosConfig(seed=3, max_delay_s=0.02), check_order=False)
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, backend=backend)
    try:
        losses = _pipelined(model, opt, steps=3)
    finally:
        opt.close()
        backend.close()
    assert losses != _reference(plain, steps=3)


def test_block_updates_start_inside_the_backward() -> None:
    model = _model()
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model)
    launched_during_backward = []
    original = opt._pipeline.launch

    def spy(index: int) -> None:
        launched_during_backward.append(opt._buckets[index].name)
        original(index)

    opt._pipeline.launch = spy
    model(*gpt_batch())[1].backward()
    in_backward = list(launched_during_backward)
    opt.step()
    opt.close()
    # Every block and every module outside the chain had its update started by its own gradient hook.
    assert in_backward[:5] == ["ln_f", "blocks.3", "blocks.2", "blocks.1", "blocks.0"]
    assert len(in_backward) == len(opt._buckets)


def test_gradient_accumulation() -> None:
    plain = _model()
    model = copy.deepcopy(plain)
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, accumulate=2)
    try:
        assert _pipelined(model, opt, accumulate=2) == _reference(plain, accumulate=2)
        assert _same_weights(model, plain)
    finally:
        opt.close()


def test_a_second_backward_without_accumulate_is_an_error() -> None:
    model = _model()
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model)
    model(*gpt_batch())[1].backward()
    with pytest.warns(UncommittedStepWarning, match="between the backward and step"):
        loss = model(*gpt_batch(seed=1))[1]
    with pytest.raises(PipelineError, match="accumulate=k"):
        loss.backward()
    opt.close()


def test_clipping_by_global_norm_equals_clip_grad_norm() -> None:
    plain = _model()
    model = copy.deepcopy(plain)
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, max_grad_norm=0.5)
    try:
        assert _pipelined(model, opt) == _reference(plain, clip=0.5)
        assert _same_weights(model, plain)
    finally:
        opt.close()


def _decay_groups(model: torch.nn.Module) -> list[dict]:
    """transformers.Trainer's groups: weight decay for the matrices, none for norms and biases (the
    parameters in another order than the model's)."""
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 5e-3}]


def test_clipping_with_parameter_groups_equals_clip_grad_norm_over_the_model() -> None:
    """The global norm sums the parameters' norms in the model's order, as ``clip_grad_norm_(model.parameters())``
    (transformers.Trainer, accelerate, the usual loop) does; it used to take the optimizer's order,
    which parameter groups change, and the weights drifted from the loop's by rounding."""
    plain = _model()
    model = copy.deepcopy(plain)
    opt = HostAdamW(_decay_groups(model), lr=1e-2, model=model, max_grad_norm=0.5)
    try:
        losses = _pipelined(model, opt, steps=6)
        expected = _train(plain, torch.optim.AdamW(_decay_groups(plain), lr=1e-2, fused=True), 6, clip=0.5)
        assert losses == expected
        assert _same_weights(model, plain)
    finally:
        opt.close()


def test_delayed_update_applies_each_gradient_one_step_late() -> None:
    """DPU: step s runs on the weights after the gradients of step s-2, i.e. one update stale."""
    plain = _model()
    model = copy.deepcopy(plain)
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, delayed_update=True)
    losses = _pipelined(model, opt)
    opt.close()
    master = copy.deepcopy(plain)  # the weights the host optimizer holds
    ref_opt = torch.optim.AdamW(master.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    expected = []
    for step in range(STEPS):
        torch.manual_seed(step * 10)
        loss = plain(*gpt_batch(seed=step * 10))[1]
        loss.backward()
        expected.append(loss.item())
        for m, p in zip(master.parameters(), plain.parameters()):
            m.grad = p.grad
        with torch.no_grad():  # the device takes the previous update, then the host applies this one
            for p, m in zip(plain.parameters(), master.parameters()):
                p.copy_(m)
        ref_opt.step()
        plain.zero_grad()
    assert losses == expected
    assert losses[1] != _reference(_model(), steps=2)[1]  # step 1 really ran on the initial weights
    assert _same_weights(model, master)  # close() put the last update in (NOTE [the last delayed update at the end])


@pytest.mark.parametrize("case", [dict(), dict(dtype=torch.bfloat16), dict(device_params_below=1000),
                                  dict(backend="chaos"), dict(backend="chaos", streamed=True),
                                  dict(backend="chaos", streamed=True, unwrap_first=True)],
                         ids=["fp32", "bf16", "small-on-device", "chaos", "streamed", "streamed-unwrapped-first"])
def test_delayed_update_close_puts_the_last_update_into_the_model(case: dict) -> None:
    """With ``delayed_update`` the parameters lag the masters by one update on purpose, and
    ``synchronize()`` keeps that lag (the next forward still runs on the older weights); ``close()``
    ends training, so the model then holds the newest weights, those of the last ``step()``: its
    ``state_dict()``, a ``torch.save`` or HF's ``save_pretrained`` used to miss that update. Also after
    ``ooc.unwrap`` first, which brings streamed weights back to the device: the copies went into the
    streamer's host copies, which the model no longer reads."""
    case = dict(case)
    dtype = case.pop("dtype", torch.float32)
    streamed = case.pop("streamed", False)
    unwrap_first = case.pop("unwrap_first", False)
    if case.pop("backend", None) == "chaos":
        case["backend"] = CpuBackend(chaos=ChaosConfig(seed=5, max_delay_s=0.002))
    model = _model().to(dtype)
    if streamed:  # the new weights go into each parameter's host copy
        ooc.wrap(model, ooc.scheduler.Plan.uniform("keep", 4).streaming([0, 1, 2, 3]), backend=case["backend"])
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, delayed_update=True, **case)
    _pipelined(model, opt)
    newest = [opt.state[p]["master"].to(dtype) if "master" in opt.state[p] else p.detach().clone()
              for p in model.parameters()]
    if not streamed:  # a streamed model's parameters are its device copies, not its weights
        assert not all(torch.equal(p, n) for p, n in zip(model.parameters(), newest))  # synchronize() kept the lag
    if unwrap_first:
        ooc.unwrap(model)
    opt.close()
    if streamed and not unwrap_first:
        ooc.unwrap(model)
    for (name, p), n in zip(model.named_parameters(), newest):
        assert torch.equal(p, n), name


def test_small_parameters_may_stay_on_the_device() -> None:
    plain = _model()
    model = copy.deepcopy(plain)
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, device_params_below=1000)
    try:
        assert _pipelined(model, opt) == _reference(plain)
        assert _same_weights(model, plain)
        small = [p for p in model.parameters() if p.numel() < 1000]
        assert small and all(id(p) not in {id(q) for b in opt._buckets for q in b.params} for p in small)
    finally:
        opt.close()


@pytest.mark.parametrize("options", [dict(backend="chaos"), dict(delayed_update=True)], ids=["chaos", "delayed"])
def test_state_dict_round_trip_resumes_identically(options: dict) -> None:
    """Delayed: the loaded masters hold the update the weights (as a checkpoint saves them, one
    update behind) have not taken yet; it lands at the next step."""
    a = _model()
    opt_a = HostAdamW(a.parameters(), lr=1e-2, model=a, **options)
    _pipelined(a, opt_a, steps=2)
    b = copy.deepcopy(a)
    opt_b = HostAdamW(b.parameters(), lr=1e-2, model=b, **options)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    assert _pipelined(a, opt_a, steps=3) == _pipelined(b, opt_b, steps=3)
    assert _same_weights(a, b)
    opt_a.close()
    opt_b.close()


def test_lr_scheduler_changes_apply_from_the_next_step() -> None:
    plain = _model()
    model = copy.deepcopy(plain)
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ref)]
    for step in range(3):
        for m, o, s in ((model, opt, scheds[0]), (plain, ref, scheds[1])):
            torch.manual_seed(step)  # the same dropout masks
            m(*gpt_batch(seed=step))[1].backward()
            o.step()
            o.zero_grad()
            s.step()
    opt.synchronize()
    opt.close()
    assert _same_weights(model, plain)


def test_model_state_dict_waits_for_the_updates() -> None:
    plain = _model()
    model = copy.deepcopy(plain)
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, backend=CpuBackend(chaos=ChaosConfig(max_delay_s=0.01)))
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    for m, o in ((model, opt), (plain, ref)):
        torch.manual_seed(0)
        m(*gpt_batch())[1].backward()
        o.step()
    saved = model.state_dict()  # no synchronize(): the state_dict hook waits
    opt.close()
    assert all(torch.equal(saved[k], v) for k, v in plain.state_dict().items())


def test_the_host_threads_stop_before_the_interpreter_when_a_script_ends_with_the_optimizer_open(
        tmp_path) -> None:  # noqa: ANN001
    """NOTE [threads stop at exit]: a script that raised with a HostAdamW open left its threads to
    the interpreter's teardown, and the process died with SIGABRT about one time in eight. Now they
    have stopped by the time the script's own atexit handlers run (registered first, run last)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "script.py"
    script.write_text(
        "import atexit, threading\n"
        "def report():\n"
        "    alive = [t.name for t in threading.enumerate() if t.name.startswith('ooc-')]\n"
        "    print('alive at exit:', alive, flush=True)\n"
        "atexit.register(report)\n"
        "from tests.helpers import gpt_batch\n"
        "from tests.ooc.test_host_pipeline import _model\n"
        "from ooc.optim import HostAdamW\n"
        "model = _model()\n"
        "opt = HostAdamW(model.parameters(), lr=1e-2, model=model)\n"
        "model(*gpt_batch(seed=0))[1].backward()\n"
        "opt.step()\n"
        "raise SystemExit(3)\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(script)], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 3, done.stderr[-2000:]
    assert "alive at exit: []" in done.stdout, done.stdout


def test_a_copy_out_listener_that_raises_stops_the_optimizer_instead_of_hanging() -> None:
    """NOTE [stage listeners]: a listener that raises stops the optimizer like any failed stage.
    One raising at COPY_OUT (on the training thread, in the backward) left its bucket waiting for a
    job that never came: the next step() or synchronize() hung forever."""
    model = _model()
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model)

    def fails(_bucket: int, stage: Stage) -> None:
        if stage is Stage.COPY_OUT:
            raise RuntimeError("listener failed")

    opt.stage_listeners.append(fails)
    errors: list[BaseException] = []

    def run() -> None:
        with pytest.raises(RuntimeError, match="listener failed"):
            model(*gpt_batch(seed=0))[1].backward()
        try:
            opt.synchronize()
        except BaseException as exc:  # noqa: BLE001 - checked on the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    try:
        assert not thread.is_alive(), "synchronize() hung after a listener raised"
        assert len(errors) == 1 and isinstance(errors[0], PipelineError) and "listener failed" in str(errors[0])
    finally:
        opt.close()


@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed"])
def test_stage_listeners_see_every_stage_of_every_bucket_in_order(delayed: bool) -> None:
    """NOTE [stage listeners]: each listener call names its bucket and stage, on the thread that ran
    the stage; per bucket the stages of one step come in order and before the next step's."""
    model = _model()
    backend = CpuBackend(chaos=ChaosConfig(seed=1, max_delay_s=0.001))  # not own-master: real copies
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, backend=backend, delayed_update=delayed)
    seen: list[tuple[int, Stage, str]] = []
    opt.stage_listeners.append(lambda bucket, stage: seen.append((bucket, stage, threading.current_thread().name)))
    try:
        _pipelined(model, opt, steps=3)
    finally:
        opt.close()
        backend.close()
    thread_of = {Stage.COPY_OUT: "MainThread", Stage.EXCHANGE: "ooc-exchange", Stage.UPDATE: "ooc-host-update",
                 Stage.COPY_IN: "MainThread" if delayed else "ooc-host-update"}
    assert all(thread == thread_of[stage] for _, stage, thread in seen)
    one_step = [Stage.COPY_OUT, Stage.EXCHANGE, Stage.UPDATE, Stage.COPY_IN]
    # Delayed: a step's weights go in when the bucket launches in the next step, the last step's at close().
    expected = one_step[:3] + [Stage.COPY_IN, *one_step[:3]] * 2 + [Stage.COPY_IN] if delayed else one_step * 3
    assert len(opt.buckets) == 7
    for index in range(len(opt.buckets)):
        assert [stage for bucket, stage, _ in seen if bucket == index] == expected


def test_pipeline_false_keeps_the_buckets_and_updates_in_step() -> None:
    plain = _model()
    model = copy.deepcopy(plain)
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, pipeline=False)
    in_step: list[bool] = []
    stages: list[tuple[Stage, bool]] = []
    opt.stage_listeners.append(lambda bucket, stage: stages.append((stage, bool(in_step))))
    step = opt.step

    def spy() -> None:
        in_step.append(True)
        step()
        in_step.pop()

    opt.step = spy
    try:
        assert _train(model, opt, STEPS) == _reference(plain)
        assert _same_weights(model, plain)
    finally:
        opt.close()
    assert len(opt.buckets) == 7  # the model's blocks and the modules outside them
    one_bucket = [Stage.COPY_OUT, Stage.EXCHANGE, Stage.UPDATE, Stage.COPY_IN]
    assert [stage for stage, _ in stages] == one_bucket * len(opt.buckets) * STEPS
    assert all(during_step for _, during_step in stages)  # nothing started in the backward


def test_pipeline_takes_a_bool_and_the_module_goes_to_model() -> None:
    model = _model()
    with pytest.raises(TypeError, match="model="):
        HostAdamW(model.parameters(), pipeline=model)
    with pytest.raises(TypeError, match="model must be the nn.Module"):
        HostAdamW(model.parameters(), model=[model])


def test_with_clipping_a_forward_before_step_sees_the_old_weights_and_does_not_wait() -> None:
    """Clipping holds every update until ``step()`` (NOTE [clipping stalls the pipeline]): a forward
    (an evaluation, say) or ``state_dict()`` between a backward and its ``step()`` waited for those
    held updates, forever. They have not touched the weights: both go on, seeing the old ones, and
    the step then updates as usual."""
    model = _model()
    before = copy.deepcopy(model.state_dict())
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, max_grad_norm=1.0)
    x, y = gpt_batch()
    seen: dict[str, object] = {}

    def between() -> None:
        model(x, y)[1].backward()
        with torch.no_grad():
            seen["loss"] = model(x, y)[1]
        seen["state"] = model.state_dict()

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UncommittedStepWarning)  # it reads the old weights, as plain PyTorch
            worker = threading.Thread(target=between, daemon=True)
            worker.start()
            worker.join(60)
        assert not worker.is_alive(), "a forward after a backward without step() hung"
        assert "loss" in seen, "the forward raised"
        assert all(torch.equal(v, before[k]) for k, v in seen["state"].items())
        opt.step()
        opt.synchronize()
        assert not all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    finally:
        opt.close()


def _train_evaluating(model: GPT, opt: torch.optim.Optimizer, steps: int, *, accumulate: int = 1,
                      clip: float | None = None, evaluate: bool = True, skip: int = -1) -> list[float]:
    """As :func:`_train`, with a forward under no_grad after every backward (an evaluation before
    ``step()``), whose loss is read only at the end: nothing syncs the compute stream before
    ``step()``. Step ``skip`` calls ``zero_grad()`` without ``step()``."""
    losses, evaluated = [], []
    for step in range(steps):
        for micro in range(accumulate):
            torch.manual_seed(step * 10 + micro)  # dropout: the evaluations draw from the generator too
            loss = model(*gpt_batch(seed=step * 10 + micro))[1]
            loss.backward()
            losses.append(loss.item())
            if evaluate:
                with torch.no_grad():
                    evaluated.append(model(*gpt_batch(seed=99))[1])
        if clip is not None and not isinstance(opt, HostAdamW):
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if step != skip:
            opt.step()
        opt.zero_grad()
    return losses + [t.item() for t in evaluated]


@pytest.mark.parametrize("case", [dict(), dict(accumulate=2, rollback=True), dict(wrap=True, skip=1),
                                  dict(delayed_update=True)], ids=["plain", "accumulate-rollback", "wrapped-skip", "delayed"])
def test_with_clipping_a_forward_before_step_is_ordered_before_the_update(case: dict) -> None:
    """NOTE [reads of held weights]: a forward between a backward and ``step()`` reads the weights
    that the update held for clipping overwrites once ``step()`` releases it. The stream-order
    checker raised (the copies in waited on no event after that forward's reads: on a GPU they
    could overwrite weights its queued kernels still read). Now training equals plain PyTorch's
    (delayed: the same run without the forwards)."""
    case = dict(case)
    accumulate, wrap, skip = case.pop("accumulate", 1), case.pop("wrap", False), case.pop("skip", -1)
    runs = []
    for evaluate in (True, False):
        model = _model()
        backend = CpuBackend(chaos=ChaosConfig(seed=3, max_delay_s=0.01), check_order=True)
        if wrap:
            ooc.wrap(model, MIXED, backend=backend)
        opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, backend=backend,
                        max_grad_norm=0.5, accumulate=accumulate, **case)
        try:
            runs.append((_train_evaluating(model, opt, 3, accumulate=accumulate, evaluate=evaluate, skip=skip), model))
            opt.synchronize()
        finally:
            opt.close()
            if wrap:
                ooc.unwrap(model)
            backend.close()
        if not case.get("delayed_update"):
            break
    (losses, model), *rest = runs
    if rest:
        assert losses[:3] == rest[0][0]
        assert _same_weights(model, rest[0][1])
        return
    plain = _model()
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    assert losses == _train_evaluating(plain, reference, 3, accumulate=accumulate, clip=0.5, skip=skip)
    assert _same_weights(model, plain)


@pytest.mark.parametrize("backend", ["cpu", "chaos"])
def test_clipping_with_small_parameters_on_the_device_equals_clip_grad_norm(backend: str) -> None:
    """``device_params_below`` with ``max_grad_norm``: the global norm left out the device-kept
    parameters' gradients and ``step()`` updated them unclipped. Their norms now count at their
    places and the factor scales them too, as ``clip_grad_norm_`` over every parameter."""
    plain = _model()
    model = copy.deepcopy(plain)
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, device_params_below=1000,
                    max_grad_norm=0.5, backend=backend)
    try:
        assert _pipelined(model, opt, steps=3) == _reference(plain, steps=3, clip=0.5)
        assert _same_weights(model, plain)
    finally:
        opt.close()


class _CountedClears(threading.Event):
    """A ``threading.Event`` that sets ``go`` at its second ``clear()``, or when waited on before
    it (someone waits for what the first clear announced)."""

    def __init__(self) -> None:
        super().__init__()
        self.set()
        self.clears = 0
        self.go = threading.Event()

    def clear(self) -> None:
        super().clear()
        self.clears += 1
        if self.clears == 2:
            self.go.set()

    def wait(self, timeout: float | None = None) -> bool:
        if self.clears == 1:
            self.go.set()
        return super().wait(timeout)


def test_clipping_with_small_parameters_after_a_step_without_gradients_waits_for_the_last_clip() -> None:
    """A step without any gradient (a skipped batch) does not wait for its clip factor; the next
    step's ``finish_step`` then cleared the clip's event and set its device-kept norms before the
    update thread had handled the first step's end: that set the event with the first step's factor
    (none), and ``step()`` updated the device-kept parameters unclipped. Here the update thread is
    made late on purpose: the first step's end until the second step clears the event (or waits
    for the first clip), the second step's by half a second."""
    plain = _model()
    model = copy.deepcopy(plain)
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, device_params_below=1000,
                    max_grad_norm=0.5)
    pipe = opt._pipeline
    pipe._clipped = clears = _CountedClears()
    real_clip = pipe.stages.clip

    def late_clip(jobs, others=None):  # noqa: ANN001, ANN202
        if clears.clears == 1:
            clears.go.wait(60)
        elif clears.clears == 2:
            time.sleep(0.5)
        return real_clip(jobs, others)

    pipe.stages.clip = late_clip
    try:
        opt.step()  # no gradient at all
        assert _pipelined(model, opt, steps=2) == _reference(plain, steps=2, clip=0.5)
        assert _same_weights(model, plain)
    finally:
        opt.close()


def test_clipping_step_retried_after_it_raised_before_any_launch() -> None:
    """A ``step()`` that raised before it launched anything (an LR scheduler left ``lr=None``)
    never queued its end, so no clip came for it; fixed and called again, ``step()`` must not wait
    for that clip, and the step equals ``clip_grad_norm_`` and AdamW's."""
    plain = _model()
    model = copy.deepcopy(plain)
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, pipeline=False,
                    device_params_below=1000, max_grad_norm=0.5)
    done = threading.Event()

    def train() -> None:
        torch.manual_seed(0)
        model(*gpt_batch(seed=0))[1].backward()
        opt.param_groups[0]["lr"] = None
        with pytest.raises(TypeError):
            opt.step()
        opt.param_groups[0]["lr"] = 1e-2
        opt.step()
        done.set()

    try:
        worker = threading.Thread(target=train, daemon=True)
        worker.start()
        worker.join(60)
        assert done.is_set(), "step() after a step() that raised hung (or raised)"
    finally:
        opt.close()
    _reference(plain, steps=1, clip=0.5)
    assert _same_weights(model, plain)


def _warmup(model: GPT, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    """build-nanogpt's loop: the learning rate of each step set between ``backward()`` and ``step()``."""
    losses = []
    for step in range(steps):
        torch.manual_seed(step)  # dropout
        loss = model(*gpt_batch(seed=step))[1]
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = 1e-2 * (step + 1) / steps
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("options", [{}, {"max_grad_norm": 1.0}], ids=["pipelined", "clipped"])
def test_a_learning_rate_set_between_backward_and_step_is_refused(options: dict) -> None:
    """NOTE [settings read in the backward]: a bucket launched in the backward takes its learning rate
    there, so a loop that sets it right before ``step()`` had the host updates use the previous step's
    (and the parameters kept on the device the new one), without a word. ``step()`` now refuses the
    change and resets the step; with ``pipeline=False``, which reads it in ``step()``, the loop equals
    torch's fused AdamW."""
    model = _model()
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, device_params_below=1000, **options)
    try:
        with pytest.raises(PipelineError, match=r"lr, betas, eps or weight_decay changed between the backward and "
                                                r"step\(\).*pipeline=False"):
            _warmup(model, opt, 2)
    finally:
        opt.close()
    plain = _model()
    model = copy.deepcopy(plain)
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, device_params_below=1000, pipeline=False)
    try:
        losses = _warmup(model, opt, 3)
        opt.synchronize()
    finally:
        opt.close()
    assert losses == _warmup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, fused=True), 3)
    assert _same_weights(model, plain)
