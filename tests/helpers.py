"""Shared helpers: train a wrapped model and a plain copy side by side and compare bit for bit."""

from __future__ import annotations

import copy
import functools
import importlib.util
import random
import zlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn as nn

import ooc
from ooc.models import ResNet
from ooc.models.gpt import GPTConfig

# The nano GPT most runtime tests train: 4 blocks, 32 wide, 65 tokens (tiny-Shakespeare's alphabet).
NANO = GPTConfig(vocab_size=65, block_size=32, n_layer=4, n_head=2, n_embd=32, dropout=0.1)
# The same without dropout, for tests that compare outputs of separate forwards.
NANO_NO_DROPOUT = replace(NANO, dropout=0.0)
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def stable_seed(*parts: object) -> int:
    """A seed in [0, 1000) from ``parts``, the same in every process (``hash()`` of a string is salted
    per process, so a failure seeded by it could not be replayed). Put it in the failure message."""
    return zlib.crc32(repr(parts).encode()) % 1000


def gpt_batch(vocab: int = 65, batch: int = 4, seq: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (batch, seq), generator=g)
    return x, torch.roll(x, -1, dims=1)


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module, loaded afresh (its training functions and classes)."""
    spec = importlib.util.spec_from_file_location(f"ooc_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lm_rows(n: int, vocab: int, seq: int = 16) -> list[dict[str, torch.Tensor]]:
    """``n`` causal-LM rows for an HF ``Trainer`` dataset: random tokens in [1, vocab), an all-ones
    attention mask, labels equal to the inputs; (seq,) each, the same for every call."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        x = torch.randint(1, vocab, (seq,), generator=g)
        rows.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x})
    return rows


def gpt_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(*batch)[1]


def ce_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def train_side_by_side(
    make_model: Callable[[], nn.Module],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batches: list[Any],
    wrap: Callable[[nn.Module], nn.Module],
) -> list[tuple[bool, bool, bool]]:
    """Per step: (losses equal, all grads equal, all buffers equal), bit for bit."""
    torch.manual_seed(1234)
    plain = make_model()
    wrapped = copy.deepcopy(plain)
    wrap(wrapped)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt_wrapped = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    results = []
    try:
        for step, batch in enumerate(batches):
            losses = []
            for model, opt in ((plain, opt_plain), (wrapped, opt_wrapped)):
                opt.zero_grad(set_to_none=True)
                torch.manual_seed(step)  # same dropout masks for both
                loss = loss_fn(model, batch)
                loss.backward()
                losses.append(loss.detach())
            grads_equal = all(
                (a.grad is None and b.grad is None) or (a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad))
                for a, b in zip(plain.parameters(), wrapped.parameters())
            )
            buffers_equal = all(torch.equal(a, b) for a, b in zip(plain.buffers(), wrapped.buffers()))
            results.append((torch.equal(losses[0], losses[1]), grads_equal, buffers_equal))
            opt_plain.step()
            opt_wrapped.step()
    finally:
        if ooc.is_wrapped(wrapped):
            ooc.unwrap(wrapped)
    return results


def tiny_llama(attn: str) -> nn.Module:
    """A 3-layer HF Llama in training mode (grouped-query attention, rotary embeddings, decoder
    layers called with keyword arguments), vocabulary 97; needs transformers."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation=attn, use_cache=False)
    return transformers.LlamaForCausalLM(config).train()


def tiny_llama_op_profile(attn: str) -> tuple[Callable[[], nn.Module], torch.Tensor, ooc.scheduler.Profile]:
    """``tiny_llama`` with ``attn`` attention: its factory, a 2 x 12 batch of token ids (the same
    every call), and the op-level profile of a model it makes, seeded, on that batch as its labels
    too; needs transformers."""
    make = functools.partial(tiny_llama, attn)
    x = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    prof = ooc.profile(make(), {"input_ids": x, "labels": x}, ops=True, codec_errors=False, reps=1)
    return make, x, prof


def small_resnet() -> nn.Module:
    """A ResNet of two stages (8 and 16 channels) of two blocks each, for 16x16 images, 10 classes."""
    return ResNet(widths=(8, 16), depth_per_stage=2)


def image_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Four 3x16x16 images and their labels (10 classes), the same every call."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)


def image_op_profile(model: nn.Module) -> ooc.scheduler.Profile:
    """``model``'s op-level profile on :func:`image_batch` with a cross-entropy loss."""
    torch.manual_seed(0)
    x, y = image_batch()
    return ooc.profile(model, (x,), loss_fn=lambda out: nn.functional.cross_entropy(out, y), ops=True,
                       codec_errors=False, min_swap_bytes=1024)


def random_cached_plan(prof, rng) -> "ooc.Plan":  # noqa: ANN001
    """Every block of ``prof`` recomputed, caching a random non-empty set of its cacheable ops."""
    import ooc

    blocks = []
    for block in prof.blocks:
        cacheable = [k for k, op in enumerate(block.ops) if op.cacheable]
        blocks.append(ooc.BlockPlan("recompute", cached_ops=tuple(sorted(rng.sample(cacheable, rng.randint(1, len(cacheable)))))))
    return ooc.Plan(blocks=tuple(blocks), min_swap_bytes=prof.min_swap_bytes)


def random_selective_plan(prof, rng: random.Random, letters: str = "CRrKS") -> ooc.Plan:  # noqa: ANN001
    """Per block a random policy, at least one ``C``: recompute with a random subset of the cacheable
    ops (``c``: with its input swapped)."""
    blocks: list[ooc.BlockPlan] = []
    while not any(b.cached_ops for b in blocks):
        blocks = [random_selective_block(block, rng, letters) for block in prof.blocks]
    return ooc.Plan(blocks=tuple(blocks), min_swap_bytes=prof.min_swap_bytes)


def random_selective_block(block, rng: random.Random, letters: str) -> ooc.BlockPlan:  # noqa: ANN001
    letter = rng.choice(letters)
    if letter in "Cc":
        cacheable = [k for k, op in enumerate(block.ops) if op.cacheable]
        cached = tuple(sorted(rng.sample(cacheable, rng.randint(1, len(cacheable)))))
        return ooc.BlockPlan("recompute", cached_ops=cached, swap_input=letter == "c")
    return {"R": ooc.BlockPlan("recompute"), "r": ooc.BlockPlan("recompute", swap_input=True),
            "K": ooc.BlockPlan("keep"), "S": ooc.BlockPlan("swap")}[letter]


def expected_selective_peak(prof, plan: ooc.Plan) -> tuple[int, list[int]]:  # noqa: ANN001
    """The rule the planner models, for plans of keep and (selective) recompute blocks: between its
    forward and its backward a block holds its saved bytes (keep) or its input plus its cached
    storages (recompute); at its backward a recompute block adds what its re-run saves, less the
    cached storages autograd saves again. Returns (bytes held after the forward, per-block peaks)."""
    held, at_backward = [], []
    for block, decision in zip(prof.blocks, plan.blocks):
        if decision.policy is ooc.Policy.KEEP:
            held.append(block.saved_bytes)
            at_backward.append(block.saved_bytes)
        else:
            cached = [block.ops[k] for k in decision.cached_ops]
            held.append(block.input_bytes + sum(op.output_bytes for op in cached))
            at_backward.append(held[-1] + block.saved_bytes - sum(op.saved_bytes for op in cached))
    return sum(held), [sum(held[:b]) + at_backward[b] for b in range(len(held))]


def check_selective_step_memory(model: nn.Module, prof, plan: ooc.Plan, batch: Any, backend: Any,  # noqa: ANN001
                                log: list | None = None) -> ooc.MemoryReport:
    """Wrap ``model`` with ``plan`` (made over ``prof``) on ``backend``, run one :func:`gpt_loss` step
    on ``batch``, and check the tracker against the planner's rule (:func:`expected_selective_peak`):
    the bytes held after the forward, the peak, nothing held after the backward. ``log``: a list that
    receives the tracker's log. Returns the step's memory report."""
    from ooc.runtime import runtime_of

    after_forward, at_backward = expected_selective_peak(prof, plan)
    ooc.wrap(model, plan, backend=backend)
    try:
        if log is not None:
            runtime_of(model).tracker.log = log
        loss = gpt_loss(model, batch)
        assert ooc.memory_report(model).current_bytes == after_forward
        loss.backward()
        report = ooc.memory_report(model)
    finally:
        ooc.unwrap(model)
    assert report.peak_bytes == max(after_forward, *at_backward), plan
    assert report.current_bytes == 0
    return report
