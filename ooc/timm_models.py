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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn

from ooc.errors import WrapError

FLAG = "grad_checkpointing"
"""The attribute timm's ``set_grad_checkpointing`` sets on a model and on its stages."""


def flag_holders(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` with a boolean ``grad_checkpointing`` (timm's models and stages), by name."""
    return [(name or type(m).__name__, m) for name, m in model.named_modules() if isinstance(getattr(m, FLAG, None), bool)]


def check_not_checkpointed(holders: Sequence[tuple[str, nn.Module]]) -> None:
    """Raise :class:`WrapError` if timm's gradient checkpointing is on in any of ``holders``
    (``flag_holders``: NOTE [timm's gradient checkpointing])."""
    for name, module in holders:
        if getattr(module, FLAG, False) is True:
            raise WrapError(
                f"timm's gradient checkpointing is on ({name}.{FLAG}); ooc's plan replaces it, recomputing the "
                "blocks it chooses (a second checkpoint under it runs blocks again, outside the plan). Call "
                "model.set_grad_checkpointing(False) before ooc.wrap, and leave it off while the model is wrapped"
            )
