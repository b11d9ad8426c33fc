"""Checkpoints and resume inside the frameworks: ``transformers.Trainer``'s own checkpoints
(``save_steps``, ``resume_from_checkpoint``), Lightning's ``ModelCheckpoint`` and ``fit(ckpt_path=...)``,
and :class:`ooc.checkpoint.Checkpointer` saved from a framework's hook."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ooc
from ooc.checkpoint import Checkpointer, CheckpointError
from tests.helpers import lm_rows, load_example

VOCAB = 97


def _gpt2() -> torch.nn.Module:
    """A tiny GPT-2, wrapped."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, use_cache=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ooc.wrap(model, ooc.Plan.of(["recompute", "swap"], min_swap_bytes=0), backend="cpu")
    return model


def _hf_run(out: str, options: dict[str, Any], accumulation: int, resume: str | None = None,
            callbacks: list | None = None) -> tuple[dict, dict]:
    """Six steps of a tiny wrapped GPT-2 under ``transformers.Trainer`` with a pipelined HostAdamW
    (``options``), a checkpoint every 2 steps into ``out``, dropout on, the linear schedule; 20 rows
    in batches of 4, so with ``accumulation=2`` each epoch ends on a window of one batch. Return the
    logged losses by step and the final weights."""
    from transformers import Trainer, TrainingArguments

    model = _gpt2()
    opt = ooc.optim.HostAdamW(model.parameters(), lr=1e-2, model=model, **options)
    args = TrainingArguments(output_dir=out, max_steps=6, per_device_train_batch_size=4, logging_steps=1,
                             report_to="none", save_strategy="steps", save_steps=2, use_cpu=True, seed=0,
                             gradient_accumulation_steps=accumulation, max_grad_norm=0.0)
    trainer = Trainer(model=model, args=args, train_dataset=lm_rows(20, VOCAB), optimizers=(opt, None),
                      callbacks=callbacks)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train(resume_from_checkpoint=resume)
        losses = {row["step"]: row["loss"] for row in trainer.state.log_history if "loss" in row}
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        opt.close()
        ooc.unwrap(model)
    return losses, weights


@pytest.mark.parametrize(("options", "accumulation"), [
    pytest.param({}, 1, id="pipelined"),
    pytest.param({"accumulate": 2, "max_grad_norm": 1.0}, 2, id="accumulate-clipped"),
])
def test_trainer_resumes_from_its_own_checkpoint_bit_for_bit(tmp_path: Path, options: dict, accumulation: int) -> None:
    """Trainer saves ``optimizer.state_dict()`` with ``torch.save`` and the weights as safetensors, and
    resumes by loading the weights into the model built with its HostAdamW, then the optimizer, the
    scheduler and the RNG states: the run resumed from step 4 (an epoch ends at step 3 on a window of
    one batch) logs the losses and ends on the weights of the run that never stopped."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    full = _hf_run(str(tmp_path / "run"), options, accumulation)
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    resumed = _hf_run(str(tmp_path / "run"), options, accumulation, resume=str(tmp_path / "run" / "checkpoint-4"))
    assert resumed[0] == full[0] and len(full[0]) == 6
    assert all(torch.equal(resumed[1][k], full[1][k]) for k in full[1])


def test_a_checkpointer_saved_from_a_trainer_callback_holds_the_trainers_checkpoint(tmp_path: Path) -> None:
    """A Checkpointer saved from ``on_step_end`` (after Trainer's ``optimizer.step()``, which returns with
    the pipelined HostAdamW's updates in under Trainer: NOTE [a framework's hooks after step()] in
    ooc.optim.frameworks; the next step's updates start while the writer writes) holds at each step what
    Trainer's own checkpoint holds: the weights and every moment, bit for bit."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    class SaveEachStep(TrainerCallback):
        ckpt: Checkpointer | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                           **kwargs: Any) -> None:
            self.ckpt = Checkpointer(tmp_path / "ooc", model, getattr(optimizer, "optimizer", optimizer), keep=None)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.ckpt.save(state.global_step)

    saver = SaveEachStep()
    _hf_run(str(tmp_path / "hf"), {}, 1, callbacks=[saver])
    saver.ckpt.close()
    for step in (2, 4):
        model = _gpt2()
        opt = ooc.optim.HostAdamW(model.parameters(), lr=1e-2, model=model)
        ckpt = Checkpointer(tmp_path / "ooc", model, opt)
        try:
            ckpt.restore(step)
            theirs = load_file(tmp_path / "hf" / f"checkpoint-{step}" / "model.safetensors")
            ours = model.state_dict()
            assert all(torch.equal(theirs[k], ours[k]) for k in theirs)
            their_state = torch.load(tmp_path / "hf" / f"checkpoint-{step}" / "optimizer.pt", weights_only=True)["state"]
            our_state = opt.state_dict()["state"]
            assert sorted(their_state) == sorted(our_state)
            assert all(torch.equal(their_state[i][k], our_state[i][k]) for i in their_state for k in ("exp_avg", "exp_avg_sq", "step"))
        finally:
            ckpt.close()
            opt.close()
            ooc.unwrap(model)


def test_a_checkpointer_given_trainers_optimizer_wrapper_refuses_a_save_inside_the_step(tmp_path: Path) -> None:
    """Trainer hands its callbacks the optimizer in accelerate's ``AcceleratedOptimizer``, which forwards
    ``state_dict`` but no other attribute: a Checkpointer made with it as it came saw no HostAdamW, and a
    save from ``on_pre_optimizer_step`` (after the backward, before ``step()``) wrote a version holding
    the updates the backward had started, half a step, without a word (NOTE [a version holds committed
    steps]). The Checkpointer now takes the HostAdamW inside, and refuses that save as it does
    unwrapped."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import TrainerCallback

    class SaveInsideTheStep(TrainerCallback):
        ckpt: Checkpointer | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                           **kwargs: Any) -> None:
            assert type(optimizer).__name__ == "AcceleratedOptimizer"
            self.ckpt = Checkpointer(tmp_path / "ooc", model, optimizer)

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.ckpt.save(state.global_step + 1)

    saver = SaveInsideTheStep()
    with pytest.raises(CheckpointError, match=r"save\(\) between a backward and step\(\)"):
        _hf_run(str(tmp_path / "hf"), {}, 1, callbacks=[saver])
    saver.ckpt.close()
    assert not (tmp_path / "ooc" / "step-000000001").exists()


def _fit(module: Any, callbacks: list, steps: int = 6, ckpt_path: str | None = None) -> Any:
    """``fit`` on 3 batches of 8 random rows per epoch; return the Lightning trainer."""
    import lightning as L

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(24, 16, generator=g), torch.randint(0, 10, (24,), generator=g))
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, callbacks=callbacks,
                        enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on dataloader workers
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
    return trainer


def _lightning_run(directory: Path, ckpt_path: str | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    module = load_example("lightning_hostadamw").Classifier(wrapped=True)
    trainer = _fit(module, [ModelCheckpoint(dirpath=directory, every_n_train_steps=3, save_top_k=-1)], ckpt_path=ckpt_path)
    try:
        weights = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    finally:
        trainer.optimizers[0].close()
        ooc.unwrap(module.net)
    return module.losses, weights


def test_lightning_resumes_from_model_checkpoint_bit_for_bit(tmp_path: Path) -> None:
    """Lightning's ``ModelCheckpoint`` saves ``optimizer.state_dict()`` in its ``.ckpt``; ``fit(ckpt_path=...)``
    loads it into the new HostAdamW and moves the state to the device: the resumed run's losses and
    final weights are those of the run that never stopped."""
    pytest.importorskip("lightning")
    full = _lightning_run(tmp_path)
    resumed = _lightning_run(tmp_path, ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"))
    assert resumed[0] == full[0][3:] and len(full[0]) == 6
    assert all(torch.equal(resumed[1][k], full[1][k]) for k in full[1])


def _checkpointer_beside_model_checkpoint(directory: Path, guarded: bool) -> Any:
    """A Lightning Callback that saves a Checkpointer version whenever Lightning saves a checkpoint
    (``on_save_checkpoint``), beside ``ModelCheckpoint(save_last=True)``, which writes two files at each
    step it saves (so the hook runs twice there); ``guarded``: the save is skipped at the step saved last."""
    import lightning as L

    class SaveWithLightning(L.Callback):
        def __init__(self) -> None:
            self.ckpt: Checkpointer | None = None
            self.last: int | None = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.ckpt = Checkpointer(directory / "ooc", pl_module.net, trainer.optimizers[0])

        def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
            if guarded and trainer.global_step == self.last:
                return
            self.ckpt.save(trainer.global_step)
            self.last = trainer.global_step

    return SaveWithLightning()


def test_a_second_save_at_one_step_from_a_lightning_hook_says_so(tmp_path: Path) -> None:
    """``ModelCheckpoint(save_last=True)`` calls ``on_save_checkpoint`` twice at each step it saves: the
    second ``Checkpointer.save`` at that step was refused as if the run branched from an older
    version ("to branch from an older version, restore it and save into a new directory ... or
    remove the versions"), which it did not. It now says the step was saved already and how to save
    once per step; with that guard the versions are Lightning's steps, and the last one restores the
    weights and optimizer state Lightning ended with."""
    pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    module = load_example("lightning_hostadamw").Classifier(wrapped=True)
    saver = _checkpointer_beside_model_checkpoint(tmp_path, guarded=False)
    with pytest.raises(CheckpointError, match=r"step-000000003 is already committed: save\(3\) was called again at "
                                              r"the step of this Checkpointer's last version.*if step != last") as refused:
        _fit(module, [ModelCheckpoint(dirpath=tmp_path / "l", every_n_train_steps=3, save_last=True), saver])
    assert "branch" not in str(refused.value)
    saver.ckpt.close()
    for opt in module.trainer.optimizers:
        opt.close()
    ooc.unwrap(module.net)

    torch.manual_seed(0)
    module = load_example("lightning_hostadamw").Classifier(wrapped=True)
    saver = _checkpointer_beside_model_checkpoint(tmp_path / "guarded", guarded=True)
    trainer = _fit(module, [ModelCheckpoint(dirpath=tmp_path / "guarded" / "l", every_n_train_steps=3, save_last=True), saver])
    opt = trainer.optimizers[0]
    try:
        saver.ckpt.wait()
        assert [v.step for v in saver.ckpt.versions()] == [3, 6]
        weights = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
        moments = {name: opt.state[p]["exp_avg"].clone() for name, p in module.net.named_parameters()}
    finally:
        saver.ckpt.close()
        opt.close()
        ooc.unwrap(module.net)
    fresh = load_example("lightning_hostadamw").Classifier(wrapped=True)
    fresh_opt = ooc.optim.HostAdamW(fresh.parameters(), lr=1e-2, model=fresh.net)
    restorer = Checkpointer(tmp_path / "guarded" / "ooc", fresh.net, fresh_opt)
    try:
        assert restorer.restore().step == 6
        assert all(torch.equal(v, weights[k]) for k, v in fresh.net.state_dict().items())
        assert all(torch.equal(fresh_opt.state[p]["exp_avg"], moments[name]) for name, p in fresh.net.named_parameters())
    finally:
        restorer.close()
        fresh_opt.close()
        ooc.unwrap(fresh.net)


def test_a_checkpointer_saved_from_lightnings_on_train_batch_end_holds_model_checkpoints_state(tmp_path: Path) -> None:
    """A Checkpointer saved from a Lightning callback's ``on_train_batch_end`` at every step (the README's
    recipe) holds at step 3 what ``ModelCheckpoint``, saving at the same hook after it, holds: the weights
    and every moment, bit for bit."""
    pytest.importorskip("lightning")
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class EachStep(L.Callback):
        ckpt: Checkpointer | None = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.ckpt = Checkpointer(tmp_path / "ooc", pl_module.net, trainer.optimizers[0], keep=None)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.ckpt.save(trainer.global_step)

    torch.manual_seed(0)
    module = load_example("lightning_hostadamw").Classifier(wrapped=True)
    saver = EachStep()
    trainer = _fit(module, [ModelCheckpoint(dirpath=tmp_path / "l", every_n_train_steps=3, save_top_k=-1), saver], steps=4)
    saver.ckpt.close()
    trainer.optimizers[0].close()
    ooc.unwrap(module.net)
    fresh = load_example("lightning_hostadamw").Classifier(wrapped=True)
    opt = ooc.optim.HostAdamW(fresh.parameters(), lr=1e-2, model=fresh.net)
    restorer = Checkpointer(tmp_path / "ooc", fresh.net, opt)
    try:
        restorer.restore(3)
        theirs = torch.load(tmp_path / "l" / "epoch=0-step=3.ckpt", weights_only=False)
        assert all(torch.equal(theirs["state_dict"][f"net.{k}"], v) for k, v in fresh.net.state_dict().items())
        their_state, our_state = theirs["optimizer_states"][0]["state"], opt.state_dict()["state"]
        assert sorted(their_state) == sorted(our_state)
        assert all(torch.equal(their_state[i][k], our_state[i][k]) for i in their_state for k in ("exp_avg", "exp_avg_sq", "step"))
    finally:
        restorer.close()
        opt.close()
        ooc.unwrap(fresh.net)
