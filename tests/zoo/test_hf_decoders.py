"""Hugging Face decoders called the normal way (``model(input_ids, labels=...)``, ``use_cache`` left
at its default) under recompute plans: gradients equal plain PyTorch bit for bit (issue 13)."""

from __future__ import annotations

import copy

import pytest
import torch

import ooc

transformers = pytest.importorskip("transformers")

VOCAB = 97


def _llama(attn: str) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation=attn,
    )
    return transformers.LlamaForCausalLM(config)


def _step(model: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=x, attention_mask=mask, labels=x).loss
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "padding-mask"])
def test_recompute_with_the_default_cache_equals_plain(attn: str, padded: bool) -> None:
    torch.manual_seed(0)
    plain = _llama(attn).train()
    wrapped = copy.deepcopy(plain)
    assert wrapped.config.use_cache is True  # the default that used to double the keys
    x = torch.randint(0, VOCAB, (2, 12))
    mask = None
    if padded:
        mask = torch.ones_like(x)
        mask[1, :4] = 0
    with pytest.warns(UserWarning, match="use_cache"):
        ooc.wrap(wrapped, ooc.Plan.of(["recompute", "swap", "recompute"], min_swap_bytes=4096), backend="chaos")
    try:
        for _ in range(2):
            assert torch.equal(_step(plain, x, mask), _step(wrapped, x, mask))
            for (name, p), q in zip(plain.named_parameters(), wrapped.parameters()):
                assert torch.equal(p.grad, q.grad), name
    finally:
        ooc.unwrap(wrapped)
    assert wrapped.config.use_cache is True  # restored


def test_hf_gradient_checkpointing_is_refused_with_the_fix() -> None:
    model = _llama("sdpa")
    model.gradient_checkpointing_enable()
    with pytest.raises(ooc.WrapError, match=r"gradient_checkpointing_disable\(\)"):
        ooc.wrap(model)
    assert not ooc.is_wrapped(model)
    model.gradient_checkpointing_disable()
    ooc.wrap(model)
    ooc.unwrap(model)


def test_wrap_with_a_sample_says_once_that_the_cache_is_off() -> None:
    """NOTE [caches and recompute] says so once: ``wrap(budget=..., sample=...)`` said it four times, once
    per runtime its profile installed for a measurement (and then once more for the model left wrapped);
    ``ooc.profile`` and ``ooc.plan``, which leave the model unwrapped, said it three times."""
    import warnings

    torch.manual_seed(0)
    model = _llama("sdpa").train()
    x = torch.randint(0, VOCAB, (2, 8))
    sample = {"input_ids": x, "labels": x}

    def cache_warnings(call) -> int:  # noqa: ANN001
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        return sum("use_cache" in str(w.message) for w in caught)

    assert cache_warnings(lambda: ooc.plan(model, sample, budget="1GiB")) == 0
    assert model.config.use_cache is True
    assert cache_warnings(lambda: ooc.wrap(model, budget="1GiB", sample=sample)) == 1
    try:
        assert model.config.use_cache is True  # off only inside the model's forwards
    finally:
        ooc.unwrap(model)
    assert model.config.use_cache is True


def test_save_pretrained_while_wrapped_writes_the_users_use_cache(tmp_path) -> None:  # noqa: ANN001
    """NOTE [caches and recompute]: ooc set ``use_cache=False`` on the configs from ``wrap`` to ``unwrap``,
    so ``save_pretrained`` while wrapped (``Trainer``'s checkpoints, ``trainer.save_model()``) wrote
    ``"use_cache": false``, and the model loaded back without ooc, like a deep copy for EMA, ran without its
    cache. The cache is now off only inside the wrapped model's forwards (an inner model called directly
    too, and after a forward that raised), and the configs keep the user's values in between."""
    import json
    import warnings

    torch.manual_seed(0)
    model = _llama("sdpa").train()
    seen: list[object] = []
    model.model.register_forward_pre_hook(lambda m, args: seen.append(m.config.use_cache))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ooc.wrap(model, ooc.Plan.of(["recompute", "swap", "recompute"], min_swap_bytes=0), backend="cpu")
    try:
        x = torch.randint(0, VOCAB, (2, 8))
        model(input_ids=x, labels=x).loss.backward()
        model.model(input_ids=x).last_hidden_state.sum().backward()
        with pytest.raises(IndexError):
            model(input_ids=torch.full((1, 4), VOCAB))  # a token past the embedding: the forward raises
        assert seen == [False, False, False] and model.config.use_cache is True

        def interrupt(m: torch.nn.Module, args: object) -> None:
            raise KeyboardInterrupt  # skips the forward hooks that end a forward
        handle = model.model.norm.register_forward_pre_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            model(input_ids=x)
        handle.remove()
        model(input_ids=x)  # the next forward of the model ends what the interrupted one left
        assert model.config.use_cache is True
        model.save_pretrained(tmp_path)
        assert json.loads((tmp_path / "config.json").read_text())["use_cache"] is True
        assert copy.deepcopy(model).config.use_cache is True
    finally:
        ooc.unwrap(model)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.use_cache is True
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
