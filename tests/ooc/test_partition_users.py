"""Models a user brings to ``ooc.partition_capture`` and ``ooc.partition_run``: each captured, run
under placements over virtual CPU devices, and compared bit for bit with eager PyTorch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from ooc.partition_capture import capture_step
from ooc.partition_run import CpuLinks, run_placed
from ooc.profiler import call_model, default_loss
from ooc.scheduler.partition import Devices, Placement


def _eager(model: nn.Module, sample) -> tuple[torch.Tensor, ...]:
    loss = default_loss(call_model(model, sample))
    return (loss.detach(), *torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad]))


def _placed(step, seed: int, k: int = 3):
    """``step`` under a random placement on ``k`` virtual devices, the stream-order checker on."""
    device = np.random.default_rng(seed).integers(0, k, step.graph.n)
    links = CpuLinks(k, check_order=True)
    try:
        return run_placed(step, Placement.of("random", device, k, step.graph.n),
                          Devices.uniform(k, int(step.graph.total_bytes())), links=links)
    finally:
        links.close()


def _assert_bit_identical(run, eager) -> None:
    assert len(run.outputs) == len(eager)
    for got, want in zip(run.outputs, eager):
        assert torch.equal(got, want)


class _AllPositive(nn.Module):
    """A branch on the data, as Hugging Face's mask code takes (``(mask == 0).all()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if (x > -10).all():
            h = h.relu()
        return h * x.abs().max().item()


def test_a_branch_on_the_data_is_taken_as_this_sample_takes_it() -> None:
    # make_fx refused to read a traced tensor's value ("get value out of a tracing tensor"), so no
    # Hugging Face model could be captured at all.
    torch.manual_seed(0)
    model, x = _AllPositive(), torch.randn(4, 8)
    step = capture_step(model, x, repeats=1)
    _assert_bit_identical(_placed(step, 0), _eager(model, x))


@pytest.mark.slow  # ~7 s on 2 cores (importing transformers, two traces); the test above has the mechanism
def test_hugging_face_gpt2_with_dropout() -> None:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                             use_cache=False, bos_token_id=0, eos_token_id=0)).train()
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    sample = tf.BatchEncoding({"input_ids": ids, "labels": ids})
    torch.manual_seed(1)
    step = capture_step(model, sample, repeats=1)
    torch.manual_seed(2)
    eager = _eager(model, sample)
    torch.manual_seed(2)
    _assert_bit_identical(_placed(step, 0), eager)


@pytest.mark.slow  # ~5 s on 2 cores; test_writes_through_views_are_seen_on_every_device has the mechanism
def test_hugging_face_t5() -> None:
    """Its ``_shift_right`` writes the decoder's inputs into views of a new tensor."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, dropout_rate=0.0, use_cache=False,
        decoder_start_token_id=0, pad_token_id=0))
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    sample = {"input_ids": ids, "labels": ids}
    step = capture_step(model, sample, repeats=1)
    _assert_bit_identical(_placed(step, 0), _eager(model, sample))


class _ShiftRight(nn.Module):
    """Writes into views of a new tensor, then reads the tensor: T5's ``_shift_right`` of the labels."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        shifted[:, 0] = 3
        shifted.masked_fill_(shifted == 5, 0)
        return self.fc(self.emb(shifted))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_writes_through_views_are_seen_on_every_device(seed: int) -> None:
    # The writes into views of `shifted` were ops no later op had an edge from: on another device
    # they wrote a copy, and the reader of `shifted` saw its zeros.
    torch.manual_seed(0)
    model, ids = _ShiftRight(), torch.randint(0, 10, (2, 6), generator=torch.Generator().manual_seed(1))
    step = capture_step(model, ids, repeats=1)
    _assert_bit_identical(_placed(step, seed), _eager(model, ids))


class _RunningMean(nn.Module):
    """Updates a buffer in forward and reads it back; scales its input in place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        h = self.fc(x)
        with torch.no_grad():
            self.mean.mul_(0.5).add_(h.mean(0), alpha=0.5)
        return (h - self.mean).pow(2).mean()


def test_a_step_that_writes_its_buffers_and_input_runs_again_from_the_same_values() -> None:
    # The buffer's update was written back into the captured arguments by every run (capture's
    # timing runs included), so the placed step started from another running mean than eager's;
    # tracing scaled the caller's sample in place.
    torch.manual_seed(0)
    model, x = _RunningMean(), torch.randn(4, 8)
    sample = x.clone()
    step = capture_step(model, sample, repeats=2)
    assert torch.equal(sample, x) and not model.mean.any()
    eager = _eager(model, x.clone())
    for seed in (0, 0, 1):
        _assert_bit_identical(_placed(step, seed), eager)


class _TwoDropouts(nn.Module):
    """Two branches, each with its dropout: the second branch's is short and comes later."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.dropout(self.b(self.a(x).relu()).relu(), 0.5)
        return (h + nn.functional.dropout(self.c(x), 0.5)).sum()


def test_random_ops_draw_in_program_order_on_any_placement() -> None:
    # The second branch alone on device 1 started before the first branch's dropout on device 0:
    # it drew its mask first from the one generator, and the loss was not eager's.
    torch.manual_seed(0)
    model, x = _TwoDropouts(), torch.randn(16, 64)
    step = capture_step(model, x, repeats=1)
    graph = step.graph
    device = np.zeros(graph.n, dtype=np.int64)
    # the second branch's forward: after the first dropout's last op (mul), before the sum (add)
    device[graph.index["mul"] + 1:graph.index["add"]] = 1
    assert graph.names[graph.index["mul"] + 1:graph.index["add"]][-2:] == ("div_1", "mul_1")
    devices = Devices.uniform(2, int(graph.total_bytes()))
    torch.manual_seed(5)
    eager = _eager(model, x)
    torch.manual_seed(5)
    links = CpuLinks(2, check_order=True)
    try:
        run = run_placed(step, Placement.of("second branch apart", device, 2, graph.n), devices, links=links)
    finally:
        links.close()
    _assert_bit_identical(run, eager)


class _Spare(nn.Module):
    """A parameter the step does not use (a pooler a masked-LM loss never reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.spare = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_an_unused_parameter_gets_no_gradient_as_in_eager() -> None:
    # autograd.grad refused ("appears to not have been used in the graph"): no capture at all,
    # where eager's backward leaves the parameter's .grad None.
    torch.manual_seed(0)
    model, x = _Spare(), torch.randn(4, 8)
    step = capture_step(model, x, repeats=1)
    run = _placed(step, 0, k=2)
    loss = default_loss(model(x))
    loss.backward()
    assert len(run.outputs) == 5 and torch.equal(run.outputs[0], loss.detach())
    for got, p in zip(run.outputs[1:], model.parameters()):
        assert (got is None and p.grad is None) or torch.equal(got, p.grad)


def test_one_tensor_passed_twice_is_one_input() -> None:
    # Self-attention called as mha(x, x, x): the tensor was three placeholders, `query is key`
    # failed in the trace, and the step took the three-projection path (not eager's packed one).
    torch.manual_seed(0)
    model, x = nn.MultiheadAttention(8, 2, batch_first=True), torch.randn(2, 5, 8)
    step = capture_step(model, (x, x, x), repeats=1)
    assert sum(name.startswith("input.") for name in step.graph.names) == 1
    _assert_bit_identical(_placed(step, 0), _eager(model, (x, x, x)))


class _DropoutOfATranspose(nn.Module):
    """Dropout on a transposed tensor, as nn.TransformerEncoderLayer's after batch-first attention."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(self.fc(x).transpose(0, 1), 0.5)


def test_dropout_of_a_strided_tensor_draws_eager_s_mask() -> None:
    # Functionalized, x.bernoulli_(p) on empty_like of a transposed tensor became bernoulli(x, p):
    # a contiguous mask filled in another order, so the mask was not eager's.
    torch.manual_seed(0)
    model, x = _DropoutOfATranspose(), torch.randn(4, 6, 8)
    step = capture_step(model, x, repeats=1)
    torch.manual_seed(5)
    eager = _eager(model, x)
    torch.manual_seed(5)
    _assert_bit_identical(_placed(step, 0), eager)


class _CheckpointedDropout(nn.Module):
    """A block under torch.utils.checkpoint with dropout, as HF's gradient_checkpointing_enable()."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c, self.b = nn.Linear(8, 8), nn.Linear(8, 16), nn.Linear(16, 8)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.dropout(self.a(x).relu(), 0.5)
        return nn.functional.dropout(self.c(h), 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False))


def test_a_checkpointed_block_recomputes_eager_s_dropout_mask() -> None:
    # Checkpoint's recomputation sets the generator back to draw the block's masks again; the trace
    # kept second draws, fresh masks at run time, so the block's gradients were not eager's.
    torch.manual_seed(0)
    model, x = _CheckpointedDropout(), torch.randn(4, 8)
    step = capture_step(model, x, repeats=1)
    assert sum(name.startswith("bernoulli_at") for name in step.graph.names) == 2
    torch.manual_seed(5)
    eager = _eager(model, x)
    for seed in (0, 1):
        torch.manual_seed(5)
        _assert_bit_identical(_placed(step, seed), eager)
