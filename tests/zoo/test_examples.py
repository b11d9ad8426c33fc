"""The examples in examples/ run, and train exactly as plain PyTorch does: ``transformers.Trainer``
and a Lightning ``LightningModule`` with ``HostAdamW`` on an ooc-wrapped model give the losses and
final weights of the same run with ``torch.optim.AdamW(fused=True)`` on the plain model, bit for
bit (HostAdamW's update is that kernel; the wraps keep, swap and recompute)."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers import load_example


def _same(a: tuple[list[float], dict[str, torch.Tensor]], b: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    assert a[0] == b[0] and len(a[0]) == 4
    assert a[1].keys() == b[1].keys()
    differ = [k for k in a[1] if not torch.equal(a[1][k], b[1][k])]
    assert not differ, f"weights differ: {differ[:4]}"


def test_hf_trainer_with_host_adamw() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # Trainer needs it
    example = load_example("hf_trainer")
    _same(example.train(wrapped=True), example.train(wrapped=False))


def test_lightning_with_host_adamw() -> None:
    pytest.importorskip("lightning")
    example = load_example("lightning_hostadamw")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on dataloader workers and loggers
        _same(example.train(wrapped=True), example.train(wrapped=False))


@pytest.mark.parametrize("name", ["hf_trainer", "lightning_hostadamw"])
def test_the_examples_swap_block_moves_its_activations(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The examples plan a "swap" block: it moves its saved activations to the host. Their toy
    models' tensors are a few KiB each, below the default ``min_swap_bytes`` (256 KiB), so a plan
    left at the default kept them all on the device and swapped nothing while the plan said swap."""
    pytest.importorskip("transformers" if name == "hf_trainer" else "lightning")
    if name == "hf_trainer":
        pytest.importorskip("accelerate")
    import ooc

    example = load_example(name)
    moved = []
    unwrap = ooc.unwrap

    def report_then_unwrap(model: torch.nn.Module) -> None:
        moved.append(ooc.memory_report(model).swapped_out_bytes)
        unwrap(model)

    monkeypatch.setattr(ooc, "unwrap", report_then_unwrap)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on dataloader workers and loggers
        example.train(wrapped=True)
    assert len(moved) == 1 and moved[0] > 0
