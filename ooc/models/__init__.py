"""Reference models: a GPT (nanoGPT configs), a ResNet-style CNN with BatchNorm, an MLP chain."""

from ooc.models.cnn import BasicBlock, ResNet
from ooc.models.gpt import GPT, GPT_PRESETS, GPTConfig
from ooc.models.mlp import MLPBlock, MLPChain

__all__ = ["GPT", "GPT_PRESETS", "BasicBlock", "GPTConfig", "MLPBlock", "MLPChain", "ResNet"]
