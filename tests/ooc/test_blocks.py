from __future__ import annotations

import pytest
import torch.nn as nn

import ooc
from ooc.blocks import find_blocks
from ooc.models import GPT, MLPChain, ResNet


def test_gpt_layers_are_found() -> None:
    chain = find_blocks(GPT("nano"))
    assert chain.names == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")


def test_cnn_and_mlp_chains() -> None:
    assert len(find_blocks(ResNet(widths=(8, 16, 32), depth_per_stage=2))) == 6
    assert len(find_blocks(MLPChain(depth=5))) == 5


def test_longest_uniform_container_wins() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.short = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])
            self.mixed = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
            self.long = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])

    assert find_blocks(Model()).names == ("long.0", "long.1", "long.2")


def test_explicit_blocks_as_list_or_container() -> None:
    model = GPT("nano")
    chain = find_blocks(model, [model.blocks[0], model.blocks[2]])
    assert chain.names == ("blocks.0", "blocks.2")
    assert find_blocks(model, model.blocks).names == find_blocks(model).names


@pytest.mark.parametrize("blocks, message", [([], "empty"), ("x", "must be a list"), (None, None)])
def test_explicit_blocks_errors(blocks, message) -> None:
    model = GPT("nano")
    if message is None:
        return
    with pytest.raises(ooc.BlockError, match=message):
        find_blocks(model, blocks)


def test_duplicate_blocks() -> None:
    model = GPT("nano")
    with pytest.raises(ooc.BlockError, match="twice"):
        find_blocks(model, [model.blocks[0], model.blocks[0]])
