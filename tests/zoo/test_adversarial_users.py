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


def test_autocast_training_planned_without_autocast_says_it_went_over_the_budget() -> None:
    """NOTE [a plan is for the batch it measured] in ooc.runtime: ``wrap(budget=..., sample=x)`` profiled
    timm's ResNet-18 without autocast, then trained under CPU bf16 autocast, whose low-precision copies of
    the weights each block saves: 18.5 MiB on the device against a plan for 2 MiB, without a word. It says
    so, naming autocast (wrapped under the training forward's autocast, the plan fits)."""
    import warnings

    from ooc.runtime import BudgetExceededWarning

    zoo = MODELS["timm-resnet18"]
    batch = zoo.batch(0)

    def step(model: nn.Module) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = zoo.loss(model, batch)
            loss.backward()
        return [str(w.message) for w in caught if issubclass(w.category, BudgetExceededWarning)]

    torch.manual_seed(0)
    model = zoo.build().train()
    ooc.wrap(model, budget="2MiB", sample=zoo.sample(batch))
    try:
        said = step(model)
        assert ooc.memory_report(model).peak_bytes > 8 * 2**20
        assert len(said) == 1 and "torch.autocast that the profile ran without" in said[0]
    finally:
        ooc.unwrap(model)


def test_a_data_loaders_pair_as_the_sample_says_how_the_model_was_called() -> None:
    """``ooc.wrap(vit, budget=..., sample=(images, labels))``: the pair became the forward's two arguments,
    and the error came from inside timm ("Expected attn_mask dtype to be bool or float ..."), with nothing
    on what ooc had done. The model's own error stays; a note says how ooc called it and what to pass."""
    zoo = MODELS["timm-vit"]
    batch = zoo.batch(0)
    model = zoo.build().train()
    with pytest.raises(RuntimeError, match="attn_mask") as raised:
        ooc.wrap(model, budget="1MiB", sample=(batch["x"], batch["labels"]))
    assert raised.value.__notes__ == [
        "ooc called VisionTransformer(*sample) with 2 argument(s) Tensor(2, 3, 32, 32), Tensor(2,). A sample is one "
        "input as the model itself takes it: a tuple or list is its positional arguments, a mapping its keywords; for "
        "a data loader's (inputs, labels) pair pass sample=inputs"]
    assert not ooc.is_wrapped(model)
    with pytest.raises(TypeError, match="unexpected keyword") as raised:
        ooc.describe(model, {"images": batch["x"]})
    assert raised.value.__notes__[0].startswith("ooc called VisionTransformer(**sample) with keywords images=Tensor(2, 3, 32, 32).")
    ooc.wrap(model, budget="1MiB", sample=batch["x"])
    ooc.unwrap(model)


def test_clip_whose_towers_run_in_another_order_than_declared_trains_from_a_sample() -> None:
    """NOTE [containers in run order] in ooc.blocks: CLIP declares ``text_model`` before ``vision_model``
    and encodes the image first. ooc chained both towers' ``CLIPEncoderLayer`` stacks in declaration
    order, and ``wrap(budget=..., sample=batch)`` raised BlockError ("not in chain order") at the first
    step, though the sample had shown the order. With a sample the chain takes the order it ran in."""
    transformers = pytest.importorskip("transformers")
    config = transformers.CLIPConfig(
        text_config={"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "max_position_embeddings": 16},
        vision_config={"image_size": 16, "patch_size": 8, "hidden_size": 16, "intermediate_size": 32,
                       "num_hidden_layers": 2, "num_attention_heads": 2},
        projection_dim=8)

    def batch(seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        return {"input_ids": torch.randint(1, 64, (2, 8), generator=g), "pixel_values": torch.randn(2, 3, 16, 16, generator=g),
                "return_loss": True}

    torch.manual_seed(0)
    plain = transformers.CLIPModel(config).train()
    model = copy.deepcopy(plain)
    report = ooc.describe(model, batch(0))
    assert report.chosen.containers == ("vision_model.encoder.layers", "text_model.encoder.layers")
    ooc.wrap(model, budget="1GiB", sample=batch(0))
    try:
        assert ooc.runtime.runtime_of(model).chain.names[:2] == ("vision_model.encoder.layers.0", "vision_model.encoder.layers.1")
        for seed in range(2):
            for m in (plain, model):
                m.zero_grad(set_to_none=True)
                torch.manual_seed(seed)
                m(**batch(seed)).loss.backward()
            for (name, p), q in zip(plain.named_parameters(), model.parameters()):
                assert torch.equal(p.grad, q.grad), name
    finally:
        ooc.unwrap(model)


def test_a_real_timm_model_with_grad_checkpointing_is_refused() -> None:
    """A real timm ViT: its own grad checkpointing under ooc's recompute is refused, at wrap and after it
    (tests/ooc/test_adversarial_drop_in.py has the timm-style stand-ins)."""
    import timm  # the zoo installs the torchvision stub timm imports (tests/zoo/conftest.py)

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                              depth=2, num_heads=2, num_classes=10).train()
    model.set_grad_checkpointing(True)
    with pytest.raises(ooc.WrapError, match="timm's gradient checkpointing is on"):
        ooc.wrap(model, backend="cpu")
    model.set_grad_checkpointing(False)
    ooc.wrap(model, backend="cpu")
    try:
        model.set_grad_checkpointing(True)
        with pytest.raises(ooc.WrapError, match="timm's gradient checkpointing is on"):
            model(torch.randn(2, 3, 32, 32)).sum().backward()
    finally:
        ooc.unwrap(model)
