"""``transformers.Trainer`` on an ooc-wrapped model, with ``HostAdamW`` as its optimizer.

A tiny Llama built from a config (nothing is downloaded) trains a few steps on random tokens, on the
CPU. With a real checkpoint, load it with ``from_pretrained`` and put it on the GPU first; the rest
stays as it is::

    python examples/hf_trainer.py
"""

from __future__ import annotations

import tempfile
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import ooc

VOCAB = 97


def dataset(n: int = 16, seq: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        x = torch.randint(1, VOCAB, (seq,), generator=g)
        rows.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x})
    return rows


def train(steps: int = 4, wrapped: bool = True) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``steps`` steps; return the logged losses and the final weights. ``wrapped=False``
    trains the same model plain, with ``torch.optim.AdamW(fused=True)``, for comparison."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    if wrapped:
        # min_swap_bytes=0: this toy model's activations are a few KiB each, below the default threshold
        # (256 KiB; a swapped block leaves smaller tensors on the device, each copy costing ~10 us), so
        # the "swap" block would move nothing. A real model's MB-sized activations need no such setting.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*use_cache.*")  # ooc turns HF's cache off while wrapped
            ooc.wrap(model, ooc.Plan.of(["recompute", "swap", "keep", "recompute"], min_swap_bytes=0))
        # Clipping needs every gradient, so HostAdamW does it (Trainer's own clipping is off below).
        optimizer = ooc.optim.HostAdamW(model.parameters(), lr=1e-3, model=model, max_grad_norm=1.0)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / (2 * steps))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=4, logging_steps=1, report_to="none",
            save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
            max_grad_norm=0.0 if wrapped else 1.0,  # wrapped: HostAdamW clips
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset(), optimizers=(optimizer, scheduler))
        trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if wrapped:
        ooc.unwrap(model)
    return losses, weights


if __name__ == "__main__":
    losses, _ = train()
    print("losses:", " ".join(f"{loss:.4f}" for loss in losses))
