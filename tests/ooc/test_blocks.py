from __future__ import annotations

import copy

import pytest
import torch
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


class _Unit(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.fc(x))


def test_parameterless_list_beside_the_layers_is_not_the_chain() -> None:
    """Issue 12: 5 ReLUs declared beside 3 real layers were taken for the chain (peak 0, nothing planned)."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
            self.acts = nn.ModuleList([nn.ReLU() for _ in range(5)])

        def forward(self, x):
            for layer, act in zip(self.layers, self.acts):
                x = act(layer(x))
            return x

    assert find_blocks(Model()).names == ("layers.0", "layers.1", "layers.2")


class _NeverRuns(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.unused = nn.ModuleList([_Unit() for _ in range(3)])

    def forward(self, x):
        return self.stem(x)


def test_a_chain_that_never_runs_is_refused_and_the_model_left_plain() -> None:
    model = _NeverRuns()
    ooc.wrap(model, ooc.Plan.of(["recompute"] * 3))
    with pytest.raises(ooc.BlockError, match="none of the 3 blocks"):
        model(torch.randn(2, 4))
    assert not ooc.is_wrapped(model)
    model(torch.randn(2, 4)).sum().backward()  # trainable as plain PyTorch
    assert model.stem.weight.grad is not None


def test_a_chain_that_never_runs_is_refused_by_wrap_with_a_sample() -> None:
    model = _NeverRuns()
    with pytest.raises(ooc.BlockError, match="ran in the model's forward"):
        ooc.wrap(model, budget="1MiB", sample=torch.randn(2, 4))
    assert not ooc.is_wrapped(model)


def test_a_block_called_twice_is_refused() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([_Unit() for _ in range(2)])

        def forward(self, x):
            return self.blocks[1](self.blocks[0](self.blocks[0](x)))

    model = Twice()
    ooc.wrap(model)
    with pytest.raises(ooc.BlockError, match="more than once"):
        model(torch.randn(2, 4))
    assert not ooc.is_wrapped(model)


def test_the_check_runs_on_the_first_training_forward_only() -> None:
    class Partial(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([_Unit() for _ in range(3)])

        def forward(self, x, depth: int = 3):
            for block in self.blocks[:depth]:
                x = block(x)
            return x

    model = Partial()
    ooc.wrap(model)
    with torch.no_grad():
        model(torch.randn(2, 4), depth=1)  # inference is not checked
    model(torch.randn(2, 4)).sum().backward()
    assert ooc.is_wrapped(model)
    ooc.unwrap(model)


def test_stages_are_concatenated_into_one_chain() -> None:
    """Issue 13: a ResNet's stages (layer1 ... layer4) are one chain, not the first stage alone."""

    class Staged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(4, 4)
            self.layer1 = nn.Sequential(_Unit(), _Unit())
            self.layer2 = nn.Sequential(_Unit(), _Unit())
            self.layer3 = nn.Sequential(_Unit())
            self.head = nn.Linear(4, 2)

    assert find_blocks(Staged()).names == ("layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer3.0")


def test_two_stacks_are_one_chain_in_module_order() -> None:
    """Issue 13: T5's encoder.block and decoder.block form one chain (the decoder's backward runs first)."""

    class Stack(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.block = nn.ModuleList([_Unit() for _ in range(n)])

    class EncoderDecoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Embedding(10, 4)
            self.encoder = Stack(2)
            self.decoder = Stack(3)
            self.lm_head = nn.Linear(4, 10)

    names = find_blocks(EncoderDecoder()).names
    assert names == ("encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1", "decoder.block.2")


def test_blocks_nested_in_stages_win_when_they_hold_the_parameters() -> None:
    """ConvNeXt: ``stages.i.blocks`` (many fine blocks) over ``stages`` (four coarse ones)."""

    class Stage(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.downsample = nn.Identity()
            self.blocks = nn.Sequential(*[_Unit() for _ in range(n)])

    class ConvNeXtLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stages = nn.Sequential(Stage(2), Stage(2), Stage(3))

    chain = find_blocks(ConvNeXtLike())
    assert len(chain) == 7 and chain.names[0] == "stages.0.blocks.0" and chain.names[-1] == "stages.2.blocks.2"


def test_experts_inside_layers_are_not_the_chain() -> None:
    """Mixture of experts: the layers run in sequence, the experts inside each one do not."""

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.Linear(4, 4)
            self.experts = nn.ModuleList([nn.Linear(4, 16) for _ in range(8)])  # most of the parameters

    class MoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Layer() for _ in range(2)])

    assert find_blocks(MoE()).names == ("layers.0", "layers.1")


def test_nested_explicit_blocks_are_refused() -> None:
    model = GPT("nano")
    with pytest.raises(ooc.BlockError, match="inside block"):
        find_blocks(model, [model.blocks[0], model.blocks[0].attn])


def test_describe_reports_each_chain_with_its_shares() -> None:
    class Staged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(4, 4)
            self.layer1 = nn.Sequential(_Unit(), _Unit())
            self.layer2 = nn.Sequential(_Unit())

        def forward(self, x):
            return self.layer2(self.layer1(torch.tanh(self.stem(x))))

    model = Staged()
    report = ooc.describe(model, torch.randn(3, 4))
    chosen = report.chosen
    # With a sample, the stem that runs before layer1 joins the chain (NOTE [the stem joins the chain]).
    assert chosen.containers == ("stem", "layer1", "layer2") and chosen.blocks == 4
    assert chosen.param_share == pytest.approx(1.0)
    # Storages saved, each (3, 4) fp32 = 48 bytes: the stem's Linear saves x, tanh its output; each
    # unit's fc saves its input (the previous output, counted where it was first saved) and relu
    # its output. So 1 outside the chain (tanh runs between the stem and layer1), 4 inside.
    assert report.saved_bytes == 48 * 5
    assert chosen.saved_share == pytest.approx(4 / 5)
    assert "stem + layer1 + layer2" in str(report)
    without_sample = ooc.describe(model).chosen
    assert without_sample.containers == ("layer1", "layer2") and without_sample.saved_share is None


def test_describe_of_a_wrapped_model_stars_the_chain_it_runs() -> None:
    """Wrapped with a sample, a ResNet runs its stem as the chain's first block; ``describe(model)``
    starred the chain a wrap without a sample would find (the blocks alone), beside the one running."""
    model = ResNet(widths=(8, 16, 32), depth_per_stage=2)
    sample = torch.randn(2, 3, 16, 16)
    plain = ooc.describe(model, sample).chosen
    assert plain.containers == ("stem", "blocks")
    ooc.wrap(model, budget="1GiB", sample=sample)
    try:
        report = ooc.describe(model)
        assert report.chosen.containers == ("stem", "blocks") and report.chosen.blocks == plain.blocks
        assert report.chosen.blocks == len(ooc.runtime.runtime_of(model).chain)
        assert [c.containers for c in report.chains if not c.chosen] == [("blocks",)]
    finally:
        ooc.unwrap(model)
    ooc.wrap(model, blocks=list(model.blocks)[1:])
    try:
        assert ooc.describe(model).chosen.containers == ("blocks=",)
    finally:
        ooc.unwrap(model)


def test_describe_with_a_sample_refuses_a_wrapped_model() -> None:
    """A wrapped block saves through ooc's hooks, which describe's measurement does not see: on a wrapped
    GPT it reported the chain's share of the saved bytes as 0.0%, and a forward through the runtime,
    the first step wrap(budget=...) measures. Without a sample it still describes the chain."""
    model = GPT("nano")
    sample = torch.randint(0, 57, (2, 8))
    plain = ooc.describe(model, sample).chosen.saved_share
    assert plain is not None and plain > 0.5
    ooc.wrap(model, budget="1MiB")
    try:
        with pytest.raises(ooc.WrapError, match="already wrapped.*unwrap"):
            ooc.describe(model, sample)
        with pytest.raises(ooc.WrapError, match="inside a model"):
            ooc.describe(model.blocks[0], torch.randn(2, 8, model.config.n_embd))
        assert ooc.describe(model).chosen.blocks == 4
    finally:
        ooc.unwrap(model)
    assert ooc.describe(model, sample).chosen.saved_share == pytest.approx(plain)


class _RootBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class _RootList(nn.ModuleList):
    """The model is itself the container of its blocks (its name: ""); ``reverse`` runs them last first."""

    def __init__(self, reverse: bool) -> None:
        super().__init__([_RootBlock() for _ in range(4)])
        self.reverse = reverse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in reversed(self) if self.reverse else self:
            x = block(x)
        return x


@pytest.mark.parametrize("reverse", [False, True], ids=["declared-order", "reversed"])
def test_a_model_that_is_its_blocks_container_wraps_from_a_sample(reverse: bool) -> None:
    """A ModuleList model holding its blocks itself: the stem's search looked for the container ("")
    among its siblings, and the run-order one for block names under "." (ValueError both, from
    ``wrap(budget=..., sample=...)``); it trains as plain PyTorch."""
    torch.manual_seed(0)
    model = _RootList(reverse)
    plain = copy.deepcopy(model)
    x = torch.randn(2, 8)
    ooc.wrap(model, budget="1MiB", sample=x)
    model(x).sum().backward()
    plain(x).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))
