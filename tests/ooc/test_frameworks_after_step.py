"""Framework hooks that run right after ``step()`` and read or write ``model.parameters()`` themselves,
and a framework's save of the final weights (NOTE [a framework's hooks after step()] in
ooc.optim.frameworks).

A pipelined HostAdamW's ``step()`` returns before the updates of the buckets launched last (the first
blocks', whose gradients come last) have landed. Each test slows every host update a little (a stage
listener that sleeps before UPDATE), as a real model's host updates outlast the framework's few
milliseconds between ``step()`` and its hooks, so that a hook racing them loses every time, and compares
with the same run under ``torch.optim.AdamW(fused=True)``, which HostAdamW equals bit for bit on the CPU
in fp32.
"""

from __future__ import annotations

import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ooc
from ooc.models import GPT
from ooc.optim.stages import Stage
from tests.helpers import gpt_batch, lm_rows, load_example

VOCAB = 97
_SLOW_S = 0.02
"""How long each bucket's host update is held back (longer than a framework's gap after ``step()``)."""


def _slowed(opt: ooc.optim.HostAdamW) -> ooc.optim.HostAdamW:
    """``opt`` with every bucket's UPDATE held back by :data:`_SLOW_S` (a listener at the end of EXCHANGE,
    which comes just before it on the host threads: NOTE [stage listeners] in ooc.optim.stages)."""
    opt.stage_listeners.append(lambda _bucket, stage: time.sleep(_SLOW_S) if stage is Stage.EXCHANGE else None)
    return opt


class _Ema:
    """An exponential moving average of a model's parameters, as EMA callbacks keep one: fp32 copies
    updated in place by ``shadow = decay * shadow + (1 - decay) * param`` from ``model.parameters()``."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.shadow: list[torch.Tensor] | None = None

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        params = [p.detach().float() for p in model.parameters()]
        if self.shadow is None:
            self.shadow = [p.clone() for p in params]
            return
        for s, p in zip(self.shadow, params):
            s.mul_(self.decay).add_(p, alpha=1 - self.decay)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# transformers.Trainer -------------------------------------------------------------------------------


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                      use_cache=False))


def _trainer(model: torch.nn.Module, opt: torch.optim.Optimizer, out: str, callbacks: list,
             save_steps: int | None = None) -> Any:
    """Four steps of Trainer on ``model`` with ``opt``, dropout on, the linear schedule, no clipping; a
    checkpoint into ``out`` every ``save_steps`` steps if given."""
    from transformers import Trainer, TrainingArguments

    saves = {"save_strategy": "steps", "save_steps": save_steps} if save_steps else {"save_strategy": "no"}
    args = TrainingArguments(output_dir=out, max_steps=4, per_device_train_batch_size=4, logging_steps=1,
                             report_to="none", use_cpu=True, seed=0, max_grad_norm=0.0, **saves)
    return Trainer(model=model, args=args, train_dataset=lm_rows(16, VOCAB), optimizers=(opt, None),
                   callbacks=callbacks)


def _hf_ema(host: bool) -> list[torch.Tensor]:
    """The EMA a Trainer callback keeps in ``on_step_end`` over four steps (``host``: of a pipelined
    HostAdamW, else of ``torch.optim.AdamW(fused=True)``)."""
    from transformers import TrainerCallback

    class EmaCallback(TrainerCallback):
        def __init__(self) -> None:
            self.ema = _Ema()

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            self.ema.update(model)

    model = _gpt2()
    opt = _slowed(ooc.optim.HostAdamW(model.parameters(), lr=1e-2, model=model)) if host \
        else torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    callback = EmaCallback()
    try:
        with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _trainer(model, opt, out, [callback]).train()
    finally:
        if host:
            opt.close()
    return callback.ema.shadow


def test_an_ema_in_a_trainer_callbacks_on_step_end_reads_the_updated_weights() -> None:
    """Trainer calls ``on_step_end`` right after ``optimizer.step()`` (and the scheduler and zero_grad):
    an EMA there read the first blocks' and the embeddings' weights before their update, and averaged
    weights no AdamW run ever held. ``step()`` called through accelerate's optimizer wrapper now returns
    with its updates in: the EMA equals AdamW's bit for bit."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    assert _equal(_hf_ema(host=True), _hf_ema(host=False))


def test_trainer_save_model_after_train_saves_the_last_delayed_update(tmp_path: Path) -> None:
    """NOTE [the last delayed update at a framework's final save]: with ``delayed_update`` the
    parameters lag the masters by one update until ``close()``, and ``trainer.save_model()`` after
    ``train()`` saved the weights one update behind. A save after training (``Trainer.is_in_train``
    False) now puts the last update in first: it saves what ``close()`` gives."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from safetensors.torch import load_file

    model = _gpt2()
    opt = ooc.optim.HostAdamW(model.parameters(), lr=1e-2, model=model, delayed_update=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = _trainer(model, opt, str(tmp_path / "out"), [])
            trainer.train()
            trainer.save_model(str(tmp_path / "final"))
        saved = load_file(tmp_path / "final" / "model.safetensors")
    finally:
        opt.close()
    newest = model.state_dict()
    assert saved.keys() and all(torch.equal(saved[k], newest[k]) for k in saved)


def test_trainer_checkpoints_during_training_keep_the_delayed_lag(tmp_path: Path) -> None:
    """The checkpoints Trainer saves while it trains (``save_steps``) keep the parameters' lag behind the
    masters (the next forward reads the older weights), so a resume from them goes on bit for bit: only a
    save after training puts the last update in."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    lagging: dict[str, torch.Tensor] = {}

    class Snapshot(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            if state.global_step == 2:
                lagging.update({k: v.detach().clone() for k, v in model.named_parameters()})

    model = _gpt2()
    opt = ooc.optim.HostAdamW(model.parameters(), lr=1e-2, model=model, delayed_update=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _trainer(model, opt, str(tmp_path), [Snapshot()], save_steps=2).train()
    finally:
        opt.close()
    saved = load_file(tmp_path / "checkpoint-2" / "model.safetensors")
    assert lagging and all(torch.equal(saved[k], lagging[k]) for k in lagging if k in saved)


def _hf_delayed(backend: ooc.backend.Backend | None, out: str) -> tuple[list[torch.Tensor], list[tuple]]:
    """Four Trainer steps of a delayed-update HostAdamW on ``backend``: the masters, and the logged
    (loss, grad_norm) of each step."""
    model = _gpt2()
    opt = ooc.optim.HostAdamW(model.parameters(), lr=1e-2, model=model, delayed_update=True, backend=backend)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = _trainer(model, opt, out, [])
            trainer.train()
        opt.synchronize()
        masters = [opt.state[p]["master"].clone() for p in model.parameters()]
    finally:
        opt.close()
    logged = [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "grad_norm" in e]
    return masters, logged


def test_trainer_grad_norm_logging_waits_for_the_delayed_copies_out(tmp_path: Path) -> None:
    """Trainer logs the gradient norm with ``clip_grad_norm_(params, inf)`` after each backward (with its
    ``max_grad_norm=0`` too): an in-place multiply by 1 of gradients that the delayed update's copies out
    (the parameters are not their own masters there) may still read. It raised StreamOrderError, now and
    then on the plain CPU backend and every time with the copies late (chaos); the compute after the
    backward now waits for those copies (NOTE [gradients written after the backward] in
    ooc.optim.pipeline), and the late copies change nothing: the same masters and logs, bit for bit."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from ooc.backend import ChaosConfig, CpuBackend

    chaos = CpuBackend(chaos=ChaosConfig(seed=3, max_delay_s=0.02), check_order=True)
    try:
        late = _hf_delayed(chaos, str(tmp_path / "chaos"))
    finally:
        chaos.close()
    plain = _hf_delayed(None, str(tmp_path / "plain"))
    assert len(plain[1]) == 4 and late[1] == plain[1]
    assert _equal(late[0], plain[0])


# Lightning ------------------------------------------------------------------------------------------


def _lightning_fit(module: Any, callbacks: list, *, steps: int | None = None, epochs: int | None = None,
                   batches: int = 4) -> Any:
    """A Lightning Trainer's ``fit`` on ``batches`` 8-row batches of random data per epoch."""
    import lightning as L

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8 * batches, 16, generator=g),
                                          torch.randint(0, 10, (8 * batches,), generator=g))
    checkpointing = any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks)
    trainer = L.Trainer(max_steps=steps or -1, max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=checkpointing, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on dataloader workers
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    return trainer


def _classifier(host: bool, *, manual: bool = False) -> Any:
    """The Lightning example's classifier, unwrapped, with a pipelined HostAdamW (slowed) or AdamW(fused);
    ``manual``: under manual optimization, its ``training_step`` calling ``backward`` and ``step()`` itself."""
    example = load_example("lightning_hostadamw")

    class Classifier(example.Classifier):
        def __init__(self) -> None:
            super().__init__(wrapped=False)
            self.automatic_optimization = not manual

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            if manual:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()  # Lightning's wrapper passes HostAdamW a no-op closure
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if host:
                return _slowed(ooc.optim.HostAdamW(self.parameters(), lr=1e-2, model=self.net))
            return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)

    torch.manual_seed(0)
    return Classifier()


def _close(trainer: Any) -> None:
    """Close the HostAdamW a Lightning trainer holds (one live HostAdamW per model)."""
    for opt in trainer.optimizers:
        if isinstance(opt, ooc.optim.HostAdamW):
            opt.close()


def _lightning_ema(host: bool, manual: bool) -> list[torch.Tensor]:
    import lightning as L

    class EmaCallback(L.Callback):
        def __init__(self) -> None:
            self.ema = _Ema()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.ema.update(pl_module.net)

    callback = EmaCallback()
    _close(_lightning_fit(_classifier(host, manual=manual), [callback], steps=4))
    return callback.ema.shadow


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_an_ema_in_lightnings_on_train_batch_end_reads_the_updated_weights(manual: bool) -> None:
    """Lightning calls ``on_train_batch_end`` right after the step (``optimizer.step(closure)``, or the
    training step that called ``step()`` itself under manual optimization): an EMA there read the first
    blocks' weights before their update. ``step()`` given a closure (Lightning passes one on every step,
    a no-op one under manual optimization) now returns with its updates in: the EMA equals AdamW's bit
    for bit."""
    pytest.importorskip("lightning")
    assert _equal(_lightning_ema(host=True, manual=manual), _lightning_ema(host=False, manual=manual))


def _swa(host: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Three epochs of four steps under Lightning's StochasticWeightAveraging from the second epoch;
    return the averaged model's parameters and the module's final weights (SWA writes the average into
    them at the end of training)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    swa = StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1, annealing_epochs=1)
    module = _classifier(host)
    _close(_lightning_fit(module, [swa], epochs=3))
    averaged = [p.detach().clone() for p in swa._average_model.net.parameters()]
    return averaged, {k: v.detach().clone() for k, v in module.net.state_dict().items()}


def test_lightnings_stochastic_weight_averaging_averages_and_writes_the_updated_weights() -> None:
    """Lightning's ``StochasticWeightAveraging`` averages ``pl_module``'s parameters at each epoch's end,
    right after the epoch's last ``step()``, and writes the average into them at the end of training: it
    averaged the first blocks' weights before their update, and the last update landed over the written
    average. Both now equal AdamW's run bit for bit."""
    pytest.importorskip("lightning")
    host, plain = _swa(host=True), _swa(host=False)
    assert _equal(host[0], plain[0])
    assert all(torch.equal(host[1][k], plain[1][k]) for k in plain[1])


def _nano() -> GPT:
    torch.manual_seed(0)
    return GPT("nano")  # 4 blocks, dropout on


def _post_hook_ema(host: bool) -> list[torch.Tensor]:
    """The EMA a step post-hook keeps over four steps of a plain loop on a nano GPT."""
    model = _nano()
    opt = _slowed(ooc.optim.HostAdamW(model.parameters(), lr=1e-2, model=model)) if host \
        else torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ema = _Ema()
    opt.register_step_post_hook(lambda _opt, _args, _kwargs: ema.update(model))
    try:
        for step in range(4):
            torch.manual_seed(step)  # dropout's masks, the same in both runs
            model(*gpt_batch(seed=step))[1].backward()
            opt.step()
            opt.zero_grad()
    finally:
        if host:
            opt.close()
    return ema.shadow


def test_an_ema_in_a_step_post_hook_reads_the_updated_weights() -> None:
    """torch's ``Optimizer`` wrapper calls step post-hooks (``register_step_post_hook``) as ``step()``
    returns: an EMA there read the first blocks' weights before their update. ``step()`` with post-hooks
    registered now returns with its updates in: the EMA equals AdamW's bit for bit."""
    assert _equal(_post_hook_ema(host=True), _post_hook_ema(host=False))


def test_a_plain_loops_step_still_returns_before_the_last_updates() -> None:
    """The wait is for frameworks and post-hooks only: a plain loop's ``step()`` (no closure, no post-hook,
    not through accelerate; an LR scheduler registers no post-hook) still returns with the last buckets'
    updates running, so they overlap whatever the loop does before its next forward (which waits for
    them at its gates)."""
    model = _nano()
    opt = ooc.optim.HostAdamW(model.parameters(), lr=1e-2, model=model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    go = threading.Event()
    # Each UPDATE waits for the test (a step() that waited for them would fail after the timeout).
    opt.stage_listeners.append(lambda _bucket, stage: go.wait(5.0) if stage is Stage.EXCHANGE else None)
    try:
        model(*gpt_batch())[1].backward()
        before = model.wpe.weight.detach().clone()  # outside the chain: its gradient comes last
        opt.step()
        assert torch.equal(model.wpe.weight, before)
        scheduler.step()
        go.set()
        opt.synchronize()
        assert not torch.equal(model.wpe.weight, before)
    finally:
        go.set()
        opt.close()


def test_lightning_save_checkpoint_after_fit_saves_the_last_delayed_update(tmp_path: Path) -> None:
    """NOTE [the last delayed update at a framework's final save]: Lightning's ``trainer.save_checkpoint``
    after ``fit()`` (its state ``finished``) saves what ``close()`` gives, not the weights one update
    behind."""
    pytest.importorskip("lightning")
    example = load_example("lightning_hostadamw")

    class Classifier(example.Classifier):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return ooc.optim.HostAdamW(self.parameters(), lr=1e-2, model=self.net, delayed_update=True)

    torch.manual_seed(0)
    module = Classifier(wrapped=False)
    trainer = _lightning_fit(module, [], steps=4)
    try:
        trainer.save_checkpoint(tmp_path / "final.ckpt")
    finally:
        _close(trainer)
    saved = torch.load(tmp_path / "final.ckpt", weights_only=False)["state_dict"]
    newest = module.state_dict()
    assert saved.keys() and all(torch.equal(saved[k], newest[k]) for k in saved)


def test_lightning_checkpoints_during_fit_keep_the_delayed_lag(tmp_path: Path) -> None:
    """``ModelCheckpoint``'s saves while Lightning trains (its state running, not ``finished``) keep the
    parameters' lag behind the masters, as Trainer's ``save_steps`` do: only a save after ``fit()``
    puts the last update in."""
    pytest.importorskip("lightning")
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    example = load_example("lightning_hostadamw")
    lagging: dict[str, torch.Tensor] = {}

    class Classifier(example.Classifier):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return ooc.optim.HostAdamW(self.parameters(), lr=1e-2, model=self.net, delayed_update=True)

    class Snapshot(L.Callback):  # Lightning runs ModelCheckpoint after the other callbacks
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == 2:
                lagging.update({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    torch.manual_seed(0)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = _lightning_fit(Classifier(wrapped=False), [Snapshot(), checkpoints], steps=4)
    _close(trainer)
    saved = torch.load(tmp_path / "step=2.ckpt", weights_only=False)["state_dict"]
    assert lagging and all(torch.equal(saved[k], lagging[k]) for k in lagging)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_trainer_evaluate_after_train_evaluates_the_last_delayed_update(tmp_path: Path) -> None:
    """NOTE [the last delayed update at a framework's final save], for evaluations: with ``delayed_update``
    ``trainer.evaluate()`` after ``train()`` evaluated the weights one update behind, and the
    ``save_model()`` after it (which puts the last update in) saved other weights than the metrics were
    of. Its forwards now put the update in first, and evaluate what ``close()`` gives; the evaluations
    while Trainer trains (``eval_steps``) keep the lag, reading the weights its training step left."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import TrainerCallback

    seen: dict[str, dict[str, torch.Tensor]] = {}

    class Snapshot(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            if state.global_step == 2:
                seen["stepped"] = _weights(model)

    def evaluated(m: torch.nn.Module, args: Any) -> None:
        """The weights each evaluation's forward reads (after HostAdamW's own pre-hook)."""
        if not torch.is_grad_enabled():
            seen.setdefault(f"eval{len(seen)}", _weights(m))

    model = _gpt2()
    opt = ooc.optim.HostAdamW(model.parameters(), lr=1e-2, model=model, delayed_update=True)
    model.register_forward_pre_hook(evaluated)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = _trainer(model, opt, str(tmp_path), [Snapshot()])
            trainer.args.eval_strategy, trainer.args.eval_steps = "steps", 2
            trainer.eval_dataset = lm_rows(4, VOCAB)
            trainer.train()
            assert sorted(seen) == ["eval1", "eval2", "stepped"]  # at steps 2 and 4, in training
            after = trainer.evaluate()["eval_loss"]
    finally:
        opt.close()
    assert all(torch.equal(seen["eval1"][k], v) for k, v in seen["stepped"].items())
    final = _weights(model)
    assert all(torch.equal(seen["eval3"][k], v) for k, v in final.items())
    assert not all(torch.equal(seen["eval2"][k], v) for k, v in final.items())  # the lag was there
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert after == trainer.evaluate()["eval_loss"]  # the loss of the weights save_model() saves


def test_lightning_validate_after_fit_validates_the_last_delayed_update() -> None:
    """Lightning's ``trainer.validate()`` after ``fit()`` (its stage ``validate``) with ``delayed_update``
    validated the weights one update behind; it now reads what ``close()`` gives. The validation inside
    ``fit()`` keeps the lag."""
    pytest.importorskip("lightning")
    import lightning as L

    example = load_example("lightning_hostadamw")
    seen: list[dict[str, torch.Tensor]] = []
    stepped: list[dict[str, torch.Tensor]] = []

    class Classifier(example.Classifier):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.net(batch[0])
            seen.append(_weights(self.net))  # what the forward read

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            stepped.append(_weights(self.net))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return ooc.optim.HostAdamW(self.parameters(), lr=1e-2, model=self.net, delayed_update=True)

    torch.manual_seed(0)
    module = Classifier(wrapped=False)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 16, generator=g), torch.randint(0, 10, (32,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    trainer = L.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        val_check_interval=2, limit_val_batches=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on dataloader workers
        trainer.fit(module, loader, loader)
        assert len(seen) == 2  # after steps 2 and 4, inside fit()
        trainer.validate(module, loader)
    _close(trainer)
    final = _weights(module.net)
    assert all(torch.equal(seen[0][k], v) for k, v in stepped[1].items())
    assert not all(torch.equal(seen[1][k], v) for k, v in final.items())  # the lag was there
    assert all(torch.equal(seen[2][k], v) for k, v in final.items())
