"""Compressed swaps on a Hugging Face decoder whose batch has padding: sdpa attention saves the additive
attention mask, which holds -inf by design, and int8 cannot encode it. The error used to blame the
loss scale alone; it now names the mask and what to do, the eager attention that saves no mask trains,
and nothing stays counted once the failed step's graph is dropped."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import ooc
from ooc.saved import NonFiniteActivationError
from tests.zoo.models import MODELS

pytest.importorskip("transformers")


def _wrapped(attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = MODELS[f"llama-{attn}"].build().train()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*use_cache.*")
        ooc.wrap(model, ooc.Plan.of([ooc.BlockPlan("swap", codec="int8")] * 3, min_swap_bytes=0), backend="cpu")
    return model


def test_an_sdpa_padding_mask_under_int8_names_the_mask_and_the_fix() -> None:
    model = _wrapped("sdpa")
    batch = MODELS["llama-sdpa"].batch(0)  # row 1 is left-padded: sdpa gets (and saves) a -inf mask
    try:
        loss = model(**batch).loss
        with pytest.raises(NonFiniteActivationError, match=r"attention mask.*attn_implementation='eager'"):
            loss.backward()
        del loss
        gc.collect()
        assert ooc.memory_report(model).current_bytes == 0
    finally:
        ooc.unwrap(model)


def test_eager_attention_with_padding_trains_under_int8() -> None:
    model = _wrapped("eager")
    try:
        for step in range(2):
            model(**MODELS["llama-eager"].batch(step)).loss.backward()
        assert ooc.memory_report(model).current_bytes == 0
    finally:
        ooc.unwrap(model)
