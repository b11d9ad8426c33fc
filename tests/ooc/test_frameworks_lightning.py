"""Lightning with HostAdamW, where Lightning handles the optimizer in ways a plain loop does not."""

from __future__ import annotations

import warnings
from types import ModuleType

import pytest
import torch

from tests.helpers import load_example

pytest.importorskip("lightning")



def _moved_elsewhere(value: object, device: object) -> object:
    """What Lightning's move of a state tensor to the GPU does, seen from the optimizer: a new tensor that is not a
    host fp32 tensor (a CPU-only stand-in: float64 on the host)."""
    return value.to(torch.float64) if isinstance(value, torch.Tensor) else value


def test_the_optimizer_state_lightning_moves_to_the_device_stays_on_the_host(monkeypatch) -> None:
    """NOTE [host state stays on the host]: Lightning's ``fit()`` moves every optimizer's state to the
    training device (``_optimizer_to_device``, also after restoring a checkpoint). HostAdamW's fp32
    moments and masters then left the host, and the host update failed on tensors of two kinds; now
    they are copied back into the host tensors, and training equals plain AdamW's."""
    import lightning.fabric.utilities.optimizer as lightning_optimizer

    example = load_example("lightning_hostadamw")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on dataloader workers and loggers
        plain = example.train(wrapped=False)
        monkeypatch.setattr(lightning_optimizer, "move_data_to_device", _moved_elsewhere)
        wrapped = example.train(wrapped=True)
    assert wrapped[0] == plain[0]
    assert all(torch.equal(wrapped[1][k], plain[1][k]) for k in plain[1])


def _fit(module: torch.nn.Module, steps: int = 2) -> object:
    """A new Lightning Trainer's ``fit`` on 8-row batches of random data; return the trainer."""
    import lightning as L

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8 * steps, 16, generator=g), torch.randint(0, 10, (8 * steps,), generator=g))
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on dataloader workers
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    return trainer


def test_a_second_fit_says_how_to_close_the_optimizer_lightning_keeps() -> None:
    """Lightning keeps the last ``fit()``'s (or ``Tuner.lr_find()``'s) optimizers in ``trainer.optimizers``
    while the next ``fit()`` calls ``configure_optimizers``: the second HostAdamW on the model is refused
    (two would both update it), and the refusal said only to close the first, which Lightning built
    and holds. It now says where it is; closed there, the next fit trains."""
    import ooc

    module = load_example("lightning_hostadamw").Classifier(wrapped=True)
    first = _fit(module)
    with pytest.raises(ooc.OocError, match=r"for opt in trainer\.optimizers: opt\.close\(\)"):
        _fit(module)
    for opt in first.optimizers:  # what the refusal advises
        opt.close()
    second = _fit(module)
    second.optimizers[0].synchronize()  # the last step's updates run on after step() returns (pipelined)
    assert float(second.optimizers[0].state[module.net.head.weight]["step"]) == 2
    second.optimizers[0].close()
    ooc.unwrap(module.net)


def _loss_scaled_classifier(example: ModuleType, *, loss_scale: bool, scales_in_backward: bool) -> object:
    """The example's module with HostAdamW (``loss_scale=LossScale()`` if ``loss_scale``); with
    ``scales_in_backward``, its ``backward`` hook runs the backward on ``opt.scale(loss)``."""
    import ooc

    class Scaled(example.Classifier):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return ooc.optim.HostAdamW(self.parameters(), lr=1e-2, model=self.net,
                                       loss_scale=ooc.optim.LossScale() if loss_scale else None)

        def backward(self, loss: torch.Tensor, *args: object, **kwargs: object) -> None:
            if scales_in_backward:
                loss = self.optimizers().optimizer.scale(loss)
            loss.backward(*args, **kwargs)

    torch.manual_seed(0)
    return Scaled(wrapped=True)


def test_a_loss_scale_that_lightning_backward_never_applied_is_refused() -> None:
    """NOTE [a loss scale no backward used]: Lightning runs the backward on the loss ``training_step``
    returns, so a HostAdamW built with ``loss_scale=`` never scaled it, and ``step()`` divided the
    gradients by the scale (65536) without a word. ``step()`` now refuses, saying to scale the loss in
    ``LightningModule.backward``; done so, the run equals the one without a loss scale bit for bit (a
    power-of-two scale is exact in fp32)."""
    import ooc

    example = load_example("lightning_hostadamw")
    unscaled = _loss_scaled_classifier(example, loss_scale=True, scales_in_backward=False)
    with pytest.raises(ooc.OocError, match=r"no opt\.scale\(loss\).*override LightningModule\.backward"):
        _fit(unscaled, steps=2)
    unscaled.trainer.optimizers[0].close()
    ooc.unwrap(unscaled.net)

    weights = []
    for loss_scale in (True, False):
        module = _loss_scaled_classifier(example, loss_scale=loss_scale, scales_in_backward=loss_scale)
        trainer = _fit(module, steps=3)
        trainer.optimizers[0].close()
        weights.append({k: v.detach().clone() for k, v in module.net.state_dict().items()})
        ooc.unwrap(module.net)
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[1])
