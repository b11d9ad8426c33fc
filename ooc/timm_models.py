"""timm models under ooc: no second checkpointing.

NOTE [timm's gradient checkpointing]
timm's ``model.set_grad_checkpointing(True)`` sets ``grad_checkpointing = True`` on the model (a ViT,
a ResNet) or on its stages (ConvNeXt, Swin), and their forwards then run each block, or a run of
blocks, under ``torch.utils.checkpoint``. Under ooc, whose plan already decides which blocks are
recomputed, that is a second recompute layered under the first. With timm's default
(``use_reentrant=False``) ooc's saved-tensor hooks sit inside the checkpoint's and it re-ran nothing
more, so a run trained bit for bit; with reentrant checkpointing (``timm.layers.set_reentrant_ckpt(True)``,
older timm) a block's forward runs without grad and is run again in the backward, outside the plan:
three forwards per recomputed block and none of a kept block's activations where the plan counts
them. ooc refuses it whichever way, as it refuses Hugging Face's gradient checkpointing (NOTE
[caches and recompute] in ``ooc.hf``): at ``wrap``, and at a block's forward in training mode or
with grad enabled when it was turned on after ``wrap`` (timm, unlike Hugging Face, checkpoints in eval
mode too: a fine-tune with frozen batch norm). timm is never imported here: the flag is the attribute timm sets.
Other libraries (open_clip) and users' own models use the same name for the same switch, so any module
with ``grad_checkpointing is True`` is refused, and the message names that module's class and says how
to turn it off; it names timm only for a module defined in timm.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn

from ooc.errors import WrapError

FLAG = "grad_checkpointing"
"""The attribute timm's ``set_grad_checkpointing`` sets on a model and on its stages."""


def flag_holders(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` with a boolean ``grad_checkpointing`` (timm's models and stages), by name
    (the model itself named by its class)."""
    return [(name or type(m).__name__, m) for name, m in model.named_modules() if isinstance(getattr(m, FLAG, None), bool)]


def check_not_checkpointed(model: nn.Module, holders: Sequence[tuple[str, nn.Module]]) -> None:
    """Raise :class:`WrapError` if gradient checkpointing is on in any of ``holders``
    (``flag_holders(model)``: NOTE [timm's gradient checkpointing])."""
    for name, module in holders:
        if getattr(module, FLAG, False) is True:
            raise checkpointing_error(model, name, module)


def checkpointing_error(model: nn.Module, name: str, module: nn.Module) -> WrapError:
    """The refusal for ``module`` (``name`` in ``model``) with ``grad_checkpointing = True``: what was found
    (the module's class and the attribute) and how to turn it off; timm is named only for timm's classes."""
    cls = type(module)
    found = f"{name}.{FLAG} is True" if module is model else f"{name} ({cls.__name__}).{FLAG} is True"
    if cls.__module__.split(".")[0] == "timm":
        return WrapError(
            f"timm's gradient checkpointing is on ({found}); ooc's plan replaces it, recomputing the blocks it "
            "chooses (a second checkpoint under it runs blocks again, outside the plan). Call "
            "model.set_grad_checkpointing(False) before ooc.wrap, and leave it off while the model is wrapped"
        )
    if callable(getattr(model, "set_grad_checkpointing", None)):
        off = "call model.set_grad_checkpointing(False)"
    elif module is model:
        off = f"set model.{FLAG} = False"
    else:
        off = f"set model.get_submodule({name!r}).{FLAG} = False"
    return WrapError(
        f"gradient checkpointing is on ({found}, in {cls.__module__}.{cls.__qualname__}): ooc reads a boolean "
        f"{FLAG} as the switch that runs blocks under torch.utils.checkpoint (the convention of timm, open_clip "
        "and others), and ooc's plan replaces it (a second checkpoint under it runs blocks again, outside the plan). "
        f"Before ooc.wrap, {off}, and leave it off while the model is wrapped; if {FLAG} means something else "
        "in this class, rename the attribute"
    )
