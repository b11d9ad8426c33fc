"""Training code ooc's authors did not write, on zoo models: each case trains plain and wrapped side
by side and holds the loss and every gradient equal bit for bit (tests/zoo/models.py)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

import ooc
from ooc.blocks import find_blocks
from tests.zoo.models import MODELS, train_side_by_side


def test_a_channels_last_cnn_with_streamed_weights_equals_plain() -> None:
    """NOTE [streamed layouts] in ooc.streaming: the streamed weights were made contiguous, so the
    convolutions ran other kernels (timm's ResNet-18 at 32x32: two BatchNorm weight gradients off by
    up to 7e-7)."""
    resnet = MODELS["timm-resnet18"]
    zoo = dataclasses.replace(resnet, build=lambda: resnet.build().to(memory_format=torch.channels_last))

    def wrap(m: nn.Module) -> None:
        n = len(find_blocks(m))
        plan = ooc.Plan.of((["swap", "recompute", "keep"] * n)[:n], min_swap_bytes=4096)
        ooc.wrap(m, plan.streaming(range(n)), backend="chaos")

    train_side_by_side(zoo, wrap)


@pytest.mark.parametrize("model", ["llama-sdpa", "bert"])
def test_a_tokenizers_batch_encoding_is_a_sample(model: str) -> None:
    """A tokenizer's or collator's output, ``transformers.BatchEncoding``, is a Mapping but not a
    dict: ooc called ``model(batch)`` on it, and every entry point that takes a sample failed inside
    the model's embedding (``describe``, ``plan``, ``wrap(budget=..., sample=...)``)."""
    transformers = pytest.importorskip("transformers")
    zoo = MODELS[model]
    sample = transformers.BatchEncoding(zoo.batch(0))
    assert not isinstance(sample, dict)

    def wrap(m: nn.Module) -> None:
        saved = ooc.describe(copy.deepcopy(m), sample).saved_bytes
        ooc.wrap(m, budget=3 * saved // 4, sample=sample, backend="chaos")

    train_side_by_side(dataclasses.replace(zoo, batch=lambda seed: transformers.BatchEncoding(zoo.batch(seed))), wrap)
