"""transformers.Trainer building HostAdamW itself, as it builds optimizers from a class and keyword arguments."""

from __future__ import annotations

import contextlib
import tempfile
import warnings
from collections.abc import Iterator

import pytest
import torch

import ooc

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer needs it
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from tests.helpers import lm_rows  # noqa: E402

VOCAB = 97


def _train(optimizer: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Four steps of a tiny GPT-2 under Trainer (its linear schedule, norm clipping at 1.0, dropout on):
    ``"cls"``, wrapped, with Trainer building HostAdamW from ``optimizer_cls_and_kwargs``;
    ``"plain"``, unwrapped, with ``torch.optim.AdamW(fused=True)`` and Trainer's own clipping."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, use_cache=False))
    kwargs: dict = {}
    if optimizer == "cls":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ooc.wrap(model, ooc.Plan.of(["recompute", "swap"], min_swap_bytes=0), backend="cpu")  # tiny tensors swap too
        kwargs["optimizer_cls_and_kwargs"] = (ooc.optim.HostAdamW, {"model": model, "lr": 1e-3, "max_grad_norm": 1.0})
    else:
        kwargs["optimizers"] = (torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), None)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=4, per_device_train_batch_size=4, logging_steps=1,
                                 report_to="none", save_strategy="no", use_cpu=True, seed=0,
                                 max_grad_norm=0.0 if optimizer == "cls" else 1.0)
        trainer = Trainer(model=model, args=args, train_dataset=lm_rows(16, VOCAB), **kwargs)
        trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if optimizer == "cls":
        getattr(trainer.optimizer, "optimizer", trainer.optimizer).close()  # under accelerate's wrapper
        ooc.unwrap(model)
    return losses, weights


def test_trainer_builds_host_adamw_from_optimizer_cls_and_kwargs() -> None:
    """Trainer's ``optimizer_cls_and_kwargs=(HostAdamW, {"model": model, ...})`` passes the model in place of
    the parameters (its convention for optimizers that need the model). HostAdamW took it for an
    iterable of parameters and failed with "object is not iterable"; now a module there is the model
    and its parameters, and training equals the plain run's."""
    wrapped, plain = _train("cls"), _train("plain")
    assert wrapped[0] == plain[0] and len(wrapped[0]) == 4
    assert all(torch.equal(wrapped[1][k], plain[1][k]) for k in plain[1])


def test_accelerate_prepare_moves_no_host_state_to_the_device(monkeypatch) -> None:  # noqa: ANN001
    """accelerate's prepare (Trainer calls it) sends the optimizer's whole state_dict() to the device
    and loads it back: a fresh HostAdamW's holds no tensors (NOTE [a fresh state is not saved])."""
    import accelerate.optimizer

    sent: list[int] = []

    def move_to_device(state, device):  # noqa: ANN001, ANN202 - records what the real one would move
        sent.extend(t.numel() * t.element_size() for s in state["state"].values() for t in s.values()
                    if isinstance(t, torch.Tensor))
        return state

    monkeypatch.setattr(accelerate.optimizer, "move_to_device", move_to_device)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32))
    opt = ooc.optim.HostAdamW(model.parameters(), lr=1e-3, model=model)
    try:
        prepared = accelerate.Accelerator(cpu=True).prepare(opt)
        assert prepared.device_placement and sent == []
        assert all(float(opt.state[p]["step"]) == 0 and "exp_avg" in opt.state[p] for p in model.parameters())
    finally:
        opt.close()


def test_a_framework_accumulating_more_than_host_adamw_is_told_which_settings_differ() -> None:
    """Trainer's ``gradient_accumulation_steps=4`` with ``HostAdamW(accumulate=2)``: the third backward
    found its buckets updated already, and the refusal said to build HostAdamW with ``accumulate=k``,
    which the user had done; it now counts the backward passes, names the ``accumulate`` it was built
    with and the framework settings it must equal."""
    from ooc.optim.pipeline import PipelineError

    with _trainer_under_accumulate_2(4, steps=1, rows=16) as trainer, pytest.raises(
            PipelineError, match=r"backward pass 3 since the last step\(\), but "
                                 r"HostAdamW\(accumulate=2\) updates after backward pass 2.*"
                                 r"Trainer's gradient_accumulation_steps, Lightning's "
                                 r"accumulate_grad_batches"):
        trainer.train()


@contextlib.contextmanager
def _trainer_under_accumulate_2(accumulation: int, *, steps: int, rows: int) -> Iterator[Trainer]:
    """Trainer for ``steps`` steps with ``gradient_accumulation_steps=accumulation`` on a wrapped GPT-2
    with ``HostAdamW(accumulate=2)``, ``rows`` rows in batches of 4; closed and unwrapped after."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, use_cache=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ooc.wrap(model, ooc.Plan.of(["recompute", "swap"], min_swap_bytes=0), backend="cpu")
    opt = ooc.optim.HostAdamW(model.parameters(), lr=1e-3, model=model, accumulate=2)
    try:
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=4, report_to="none",
                                     save_strategy="no", use_cpu=True, seed=0, max_grad_norm=0.0,
                                     gradient_accumulation_steps=accumulation, disable_tqdm=True)
            yield Trainer(model=model, args=args, train_dataset=lm_rows(rows, VOCAB), optimizers=(opt, None))
    finally:
        opt.close()
        ooc.unwrap(model)


def _accumulating_run(accumulation: int) -> list[str]:
    """Six steps of Trainer with ``gradient_accumulation_steps=accumulation`` on a wrapped GPT-2 with
    ``HostAdamW(accumulate=2)``, 20 rows in batches of 4 (with 2, an epoch ends on a window of one
    batch); return the messages of the warnings about accumulate."""
    with _trainer_under_accumulate_2(accumulation, steps=6, rows=20) as trainer, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return [str(w.message) for w in caught if "accumulate=" in str(w.message)]


def test_a_framework_stepping_every_batch_under_accumulate_is_told() -> None:
    """``HostAdamW(accumulate=2)`` under Trainer's default ``gradient_accumulation_steps=1``: every
    ``step()`` came after one backward, so training ran without the accumulation the user asked of
    HostAdamW (and each update waited for ``step()``), without a word. Two short windows in a row now
    warn once, naming the settings; an epoch ending on a shorter window (Trainer's own accumulation of
    2 over 5 batches) does not."""
    told = _accumulating_run(1)
    assert len(told) == 1 and "step() came after 1 backward pass(es), twice in a row, but " \
        "HostAdamW(accumulate=2)" in told[0] and "gradient_accumulation_steps" in told[0]
    assert _accumulating_run(2) == []
