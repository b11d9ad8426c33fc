"""The captured op graph of a training step (ooc.partition_capture): forward and backward ops,
bytes per node and edge, the model left untouched, and the graph partitionable."""

from __future__ import annotations

import torch
import torch.nn as nn

from ooc.partition_capture import capture
from ooc.scheduler.partition import Devices, partition


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def test_mlp_step_graph() -> None:
    model = _mlp()
    g = capture(model, torch.randn(8, 16), repeats=1)
    at = g.index
    assert g.held_bytes[at["param.0.weight"]] == 32 * 16 * 4
    assert g.held_bytes[at["input.0"]] == 8 * 16 * 4
    assert g.held_bytes[at["relu"]] == 8 * 32 * 4               # the activation backward reads
    assert "threshold_backward" in at                           # relu's backward is in the graph
    assert sum(n.startswith("mm") for n in g.names) >= 3         # and the backward matmuls
    views = [i for i, n in enumerate(g.names) if n.startswith(("t_", "view", "expand", "detach"))]
    assert views and all(g.held_bytes[i] == 0 for i in views)  # views hold no new memory
    relu_out = g.src == at["relu"]
    assert (g.edge_bytes[relu_out] == 8 * 32 * 4).sum() >= 2
    # threshold_backward reads relu's storage through detach(detach(relu)): a 0-byte edge keeps it held
    alias = relu_out & (g.dst == at["threshold_backward"])
    assert alias.sum() == 1 and g.edge_bytes[alias][0] == 0
    assert (g.time_s[[at[n] for n in ("addmm", "relu", "mm")]] > 0).all()
    assert all(p.grad is None for p in model.parameters())


def test_batchnorm_buffers_left_as_they_were() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 1))
    before = [b.clone() for b in model.buffers()]
    g = capture(model, torch.randn(4, 6), repeats=2)
    assert "buffer.1.running_mean" in g.index
    for a, b in zip(before, model.buffers()):
        assert torch.equal(a, b)


def test_captured_graph_partitions() -> None:
    g = capture(_mlp(), torch.randn(8, 16), repeats=1)
    best = partition(g, Devices.uniform(2, int(g.total_bytes())))
    assert best.fits and best.placement.device.shape == (g.n,)


class _Keywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = _mlp()

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) * scale


def test_a_mapping_sample_is_captured_as_a_dict() -> None:
    # A tokenizer's or collator's BatchEncoding is a UserDict, not a dict: it was passed as the
    # model's one positional argument (and the pytree saw no tensors in it).
    from collections import UserDict

    sample = {"x": torch.randn(8, 16), "scale": torch.full((8, 4), 2.0)}
    as_dict = capture(_Keywords(), sample, repeats=1)
    as_mapping = capture(_Keywords(), UserDict(sample), repeats=1)
    assert as_mapping.names == as_dict.names and "input.0" in as_mapping.index and "input.1" in as_mapping.index
    assert as_mapping.held_bytes[as_mapping.index["input.0"]] == 8 * 16 * 4


def test_repeats_below_one_is_refused_before_tracing() -> None:
    # repeats=0 traced the whole step and then failed in statistics.median of no samples.
    import pytest

    from ooc.errors import WrapError

    with pytest.raises(WrapError, match="repeats=0"):
        capture(_mlp(), torch.randn(8, 16), repeats=0)


def test_the_random_number_generator_is_left_as_it_was() -> None:
    # Tracing twice and timing each op drew dropout masks from the global generator: a step
    # seeded before capture drew other masks than the same step without it.
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 4))
    torch.manual_seed(7)
    capture(model, torch.randn(8, 16), repeats=2)
    after = torch.rand(4)
    torch.manual_seed(7)
    torch.randn(8, 16)
    assert torch.equal(after, torch.rand(4))
