"""Models whose forwards draw random numbers other than plain dropout, or route data-dependently, trained
plain and wrapped under keep/swap/recompute mixes (chaos backend) and a random op-level plan: the loss,
every gradient and the final state_dict equal plain PyTorch bit for bit. Router jitter noise and
expert capacity (Switch Transformers), top-k routing with the router's load-balancing loss (Mixtral,
Qwen2-MoE with its shared expert), stochastic depth (timm's DropPath in a ViT, a ConvNeXt, an
EfficientNet with BatchNorm in train mode), BART with dropout everywhere. Tiny configs, random weights."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

import ooc
from ooc.blocks import find_blocks
from tests.helpers import random_selective_plan, stable_seed
from tests.zoo.models import VOCAB, Zoo, _hf_loss, _images, _t5_batch, _timm_loss, _tokens, _x, train_side_by_side


def _tf() -> Any:
    return pytest.importorskip("transformers")


def _timm() -> Any:
    return pytest.importorskip("timm")


def _no_cache(model: nn.Module) -> nn.Module:
    """An encoder-decoder compared with its cache off, as ooc runs it (tests/zoo/test_t5.py says why);
    its stacks have configs of their own."""
    for module in model.modules():
        if getattr(module, "config", None) is not None:
            module.config.use_cache = False
    return model


def _switch() -> nn.Module:
    return _no_cache(_tf().SwitchTransformersForConditionalGeneration(_tf().SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, num_experts=4,
        expert_capacity=4, router_jitter_noise=0.1, encoder_sparse_step=1, decoder_sparse_step=1, dropout_rate=0.1,
        decoder_start_token_id=0)))


def _mixtral() -> nn.Module:
    return _tf().MixtralForCausalLM(_tf().MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        router_jitter_noise=0.1, output_router_logits=True, router_aux_loss_coef=0.02))


def _qwen2_moe() -> nn.Module:
    return _tf().Qwen2MoeForCausalLM(_tf().Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64, output_router_logits=True,
        router_aux_loss_coef=0.02))


def _bart() -> nn.Module:
    return _no_cache(_tf().BartForConditionalGeneration(_tf().BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.1,
        attention_dropout=0.1, activation_dropout=0.1, decoder_start_token_id=2, pad_token_id=1)))


def _vit_drop_path() -> nn.Module:
    return _timm().create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                                depth=3, num_heads=2, num_classes=10, drop_path_rate=0.3, attn_drop_rate=0.1,
                                proj_drop_rate=0.1)


def _convnext_drop_path() -> nn.Module:
    return _timm().create_model("convnext_atto", pretrained=False, dims=(8, 16, 32, 64), depths=(1, 1, 2, 1),
                                num_classes=10, drop_path_rate=0.3)


def _efficientnet() -> nn.Module:
    return _timm().create_model("efficientnet_b0", pretrained=False, num_classes=10, drop_path_rate=0.2, drop_rate=0.2)


def _four_images(size: int) -> Callable[[int], dict[str, Any]]:
    """Four images: EfficientNet's last BatchNorm sees 2x2 maps, not the 1x1 of two images, whose
    batch statistics diverge to NaN at this learning rate (plain PyTorch alike)."""
    def batch(seed: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(4, 3, size, size, generator=g), "labels": torch.randint(0, 10, (4,), generator=g)}

    return batch


MODELS = {
    "switch": Zoo("switch", _switch, _t5_batch, _hf_loss),
    "mixtral": Zoo("mixtral", _mixtral, _tokens, _hf_loss),
    "qwen2-moe": Zoo("qwen2-moe", _qwen2_moe, _tokens, _hf_loss),
    "bart": Zoo("bart", _bart, _t5_batch, _hf_loss),
    "timm-vit-drop-path": Zoo("timm-vit-drop-path", _vit_drop_path, _images(32), _timm_loss, _x),
    "timm-convnext-drop-path": Zoo("timm-convnext-drop-path", _convnext_drop_path, _images(32), _timm_loss, _x),
    "timm-efficientnet": Zoo("timm-efficientnet", _efficientnet, _four_images(64), _timm_loss, _x),
}
MIX = [ooc.BlockPlan("recompute", swap_input=True), "swap", "keep", "recompute"]


@pytest.mark.parametrize("model", list(MODELS))
def test_mix_equals_plain(model: str) -> None:
    def wrap(m: nn.Module) -> None:
        chain = find_blocks(m)
        plan = ooc.Plan.of([MIX[i % len(MIX)] for i in range(len(chain))], min_swap_bytes=0)
        ooc.wrap(m, plan, blocks=list(chain.modules), backend="chaos")

    def nothing_left(m: nn.Module) -> None:
        assert ooc.memory_report(m).current_bytes == 0

    train_side_by_side(MODELS[model], wrap, nothing_left)


@pytest.mark.parametrize("model", ["mixtral", "timm-vit-drop-path"])
def test_a_random_op_level_plan_equals_plain(model: str) -> None:
    """Recompute caching a random set of each block's cacheable ops: the re-run skips them, and the
    router's jitter and top-k, or the drop-path draws, still repeat bit for bit."""
    zoo = MODELS[model]
    torch.manual_seed(0)
    prof = ooc.profile(zoo.build().train(), zoo.sample(zoo.batch(0)), ops=True, codec_errors=False, reps=1)
    plan = random_selective_plan(prof, random.Random(stable_seed(model, 0)), "CCcRK")
    train_side_by_side(zoo, lambda m: ooc.wrap(m, plan, backend="chaos"))
