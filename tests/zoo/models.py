"""The zoo: tiny versions of the models people train, built from configs (nothing is downloaded).

Each entry builds a model and one batch, and says how to get the loss from them. Sizes are the
smallest that keep each model's structure (several blocks per stack or stage, padding masks,
grouped-query attention, BatchNorm at 1x1 spatial maps).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn

import ooc

VOCAB = 97
SEQ = 12
STEPS = 3


@dataclass(frozen=True)
class Zoo:
    """One zoo model: ``build()`` a fresh model, ``batch(seed)`` one batch (a dict),
    ``loss(model, batch)`` the scalar loss, ``sample(batch)`` what the model itself takes (for
    ``ooc.describe`` and ``ooc.wrap(sample=...)``)."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], dict[str, Any]]
    loss: Callable[[nn.Module, dict[str, Any]], torch.Tensor]
    sample: Callable[[dict[str, Any]], Any] = lambda batch: batch


def _transformers() -> Any:
    return pytest.importorskip("transformers")


def _timm() -> Any:
    return pytest.importorskip("timm")


def _tokens(seed: int, padded: bool = True) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones_like(x)
    if padded:
        mask[1, :4] = 0  # left padding on the second row
    return {"input_ids": x, "attention_mask": mask, "labels": x}


def _t5_batch(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones_like(x)
    mask[1, -3:] = 0  # right padding on the encoder side
    labels = torch.randint(1, VOCAB, (2, 7), generator=g)
    return {"input_ids": x, "attention_mask": mask, "labels": labels}


def _images(size: int, classes: int = 10, key: str = "x") -> Callable[[int], dict[str, Any]]:
    def batch(seed: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        return {key: torch.randn(2, 3, size, size, generator=g), "labels": torch.randint(0, classes, (2,), generator=g)}

    return batch


def _hf_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    return model(**batch).loss


def _timm_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["x"]), batch["labels"])


def _x(batch: dict[str, Any]) -> torch.Tensor:
    return batch["x"]


def _decoder(kind: str, attn: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        tf = _transformers()
        common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, max_position_embeddings=64, attn_implementation=attn)
        if kind == "llama":
            return tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, **common))
        if kind == "mistral":
            return tf.MistralForCausalLM(tf.MistralConfig(num_key_value_heads=2, sliding_window=8, **common))
        if kind == "qwen2":
            return tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, **common))
        if kind == "gpt_neox":
            return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(rotary_pct=0.5, attention_dropout=0.1, hidden_dropout=0.1,
                                                          **common))
        raise ValueError(kind)

    return build


def _bert() -> nn.Module:
    tf = _transformers()
    return tf.BertForMaskedLM(tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                            intermediate_size=64, max_position_embeddings=64))


def _t5() -> nn.Module:
    tf = _transformers()
    return tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                     num_decoder_layers=2, num_heads=4, decoder_start_token_id=0))


def _hf_vit() -> nn.Module:
    tf = _transformers()
    return tf.ViTForImageClassification(tf.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=3,
                                                     num_attention_heads=4, intermediate_size=64, num_labels=10))


def _timm_vit() -> nn.Module:
    return _timm().create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                                depth=3, num_heads=2, num_classes=10)


def _timm_resnet() -> nn.Module:
    return _timm().create_model("resnet18", pretrained=False, num_classes=10)


def _timm_convnext() -> nn.Module:
    return _timm().create_model("convnext_atto", pretrained=False, dims=(8, 16, 32, 64), depths=(1, 1, 2, 1),
                                num_classes=10)


MODELS: dict[str, Zoo] = {
    **{f"{kind}-{attn}": Zoo(f"{kind}-{attn}", _decoder(kind, attn), _tokens, _hf_loss)
       for kind in ("llama", "mistral", "qwen2", "gpt_neox") for attn in ("eager", "sdpa")},
    "bert": Zoo("bert", _bert, _tokens, _hf_loss),
    "t5": Zoo("t5", _t5, _t5_batch, _hf_loss),
    "hf-vit": Zoo("hf-vit", _hf_vit, _images(16, key="pixel_values"), _hf_loss),
    "timm-vit": Zoo("timm-vit", _timm_vit, _images(32), _timm_loss, _x),
    "timm-resnet18": Zoo("timm-resnet18", _timm_resnet, _images(32), _timm_loss, _x),
    "timm-convnext": Zoo("timm-convnext", _timm_convnext, _images(32), _timm_loss, _x),
}


def train_side_by_side(zoo: Zoo, wrap: Callable[[nn.Module], None],
                       check: Callable[[nn.Module], None] | None = None) -> None:
    """Train a plain model and a wrapped copy; assert each step's loss and gradients and the final
    state_dict equal bit for bit."""
    torch.manual_seed(0)
    plain = zoo.build().train()
    wrapped = copy.deepcopy(plain)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*use_cache.*")
        wrap(wrapped)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, wrapped)]
    try:
        for step in range(STEPS):
            batch = zoo.batch(step)
            losses = []
            for model, opt in zip((plain, wrapped), opts):
                opt.zero_grad(set_to_none=True)
                torch.manual_seed(100 + step)  # the same dropout masks for both
                loss = zoo.loss(model, batch)
                loss.backward()
                losses.append(loss.detach())
            assert torch.equal(losses[0], losses[1]), f"step {step}: loss {losses[0].item()} != {losses[1].item()}"
            for (name, p), q in zip(plain.named_parameters(), wrapped.parameters()):
                same = (p.grad is None and q.grad is None) or (
                    p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad))
                assert same, f"step {step}: the gradient of {name} differs"
            for opt in opts:
                opt.step()
        if check is not None:
            check(wrapped)  # still wrapped, after the last step
    finally:
        ooc.unwrap(wrapped)
    theirs = wrapped.state_dict()
    for name, tensor in plain.state_dict().items():
        same = torch.equal(tensor, theirs[name])
        assert same, f"state_dict[{name}] differs after {STEPS} steps"
