"""Analytic profiles: per-block FLOPs and bytes through a roofline on a hardware preset, for models
too large to measure here.

Times are ``max(flops / (flops_peak * MATMUL_EFFICIENCY), bytes / (memory_bw * MEMORY_EFFICIENCY))``;
the backward costs twice the forward's FLOPs. Saved-activation bytes follow Korthikanti et al.
(2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 1): per layer
``s*b*h*(34 + 5*a*s/h)`` bytes with 16-bit activations and attention scores materialised, as ooc's
reference GPT does. CNN blocks count the feature maps each layer saves, in fp32 as in KARMA's runs.
"""

from __future__ import annotations

from ooc.scheduler.hardware import Hardware
from ooc.scheduler.profile import BlockProfile, Profile

MATMUL_EFFICIENCY = 0.6
"""Share of dense peak reached by large GEMMs (~60% MFU is typical of well-tuned training)."""
MEMORY_EFFICIENCY = 0.8


def _time(flops: float, nbytes: float, hw: Hardware) -> float:
    return max(flops / (hw.flops * MATMUL_EFFICIENCY), nbytes / (hw.memory_bytes_per_s * MEMORY_EFFICIENCY))


def transformer(
    *,
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    seq: int,
    batch: int,
    vocab: int,
    hardware: Hardware,
    bytes_per_value: int = 2,
) -> Profile:
    """A decoder-only transformer with a 4x MLP."""
    s, b, h, a = seq, batch, hidden, heads
    saved = int(s * b * h * (34 + 5 * a * s / h))
    matmul_flops = 24 * b * s * h * h + 4 * b * s * s * h
    params = 12 * h * h + 13 * h
    traffic = 2 * saved + params * bytes_per_value
    fwd = _time(matmul_flops, traffic, hardware)
    x = s * b * h * bytes_per_value
    block = BlockProfile(
        name="layer", forward_s=fwd, backward_s=2 * fwd, saved_bytes=saved, swappable_bytes=saved,
        input_bytes=x, input_swappable_bytes=x, output_bytes=x, param_bytes=params * bytes_per_value,
        grad_bytes=params * bytes_per_value, swappable_storages=20, input_swappable_storages=1,
    )
    head_flops = 2 * b * s * h * vocab
    outside = _time(3 * head_flops, 3 * b * s * vocab * bytes_per_value, hardware)
    return Profile(
        blocks=tuple(BlockProfile(**{**block.__dict__, "name": f"layers.{i}"}) for i in range(layers)),
        outside_forward_s=outside,
        outside_param_bytes=(2 * vocab * h + 2 * h) * bytes_per_value,  # embedding, untied head, final norm
        model=name,
        source=f"analytic on {hardware.name}",
        machine={"hardware": hardware.name},
        notes=f"seq {seq}, micro-batch {batch}, {bytes_per_value}-byte activations; roofline at "
        f"{MATMUL_EFFICIENCY:.0%} of peak FLOP/s; saved bytes per Korthikanti et al. 2022",
    )


def _conv_block(name: str, b: int, maps: list[tuple[int, int]], flops: float, params: int, hw: Hardware, in_elems: int) -> BlockProfile:
    """``maps``: (channels, spatial size) of each saved fp32 feature map."""
    saved = sum(b * c * hw_ * hw_ * 4 for c, hw_ in maps)
    fwd = _time(flops, 2 * saved + params * 4, hw)
    x = b * in_elems * 4
    return BlockProfile(name, fwd, 2 * fwd, saved, saved, x, x, x, params * 4, params * 4,
                        swappable_storages=len(maps), input_swappable_storages=1)


def wide_resnet(*, depth: int = 28, width: int = 10, batch: int, hardware: Hardware) -> Profile:
    """WRN-depth-width on 32x32 inputs (pre-activation basic blocks, 3 groups)."""
    per_group = (depth - 4) // 6
    blocks = []
    c_in, size = 16, 32
    for g, c in enumerate((16 * width, 32 * width, 64 * width)):
        for k in range(per_group):
            stride = 2 if g > 0 and k == 0 else 1
            out = size // stride
            # BN+ReLU on the input, conv, BN+ReLU, conv: input, bn1 out, relu1 out, conv1 out, bn2 out, relu2 out
            maps = [(c_in, size), (c_in, size), (c_in, size), (c, out), (c, out), (c, out)]
            flops = 2 * batch * out * out * 9 * (c_in * c + c * c)
            params = 9 * (c_in * c + c * c) + (c_in * c if c_in != c else 0)
            blocks.append(_conv_block(f"group{g}.{k}", batch, maps, flops, params, hardware, c_in * size * size))
            c_in, size = c, out
    return Profile(tuple(blocks), outside_forward_s=blocks[0].forward_s * 0.1, model=f"wrn-{depth}-{width}",
                   source=f"analytic on {hardware.name}", machine={"hardware": hardware.name},
                   notes=f"batch {batch}, 32x32, fp32; roofline at {MATMUL_EFFICIENCY:.0%} of peak FLOP/s")


def preact_resnet_bottleneck(*, depth: int = 1001, batch: int, hardware: Hardware) -> Profile:
    """Pre-activation bottleneck ResNet for 32x32 inputs (ResNet-1001: 3 stages of 111 blocks)."""
    per_stage = (depth - 2) // 9
    blocks = []
    c_in, size = 16, 32
    for stage, mid in enumerate((16, 32, 64)):
        c = 4 * mid
        for k in range(per_stage):
            stride = 2 if stage > 0 and k == 0 else 1
            out = size // stride
            maps = [(c_in, size), (c_in, size), (mid, size), (mid, size), (mid, out), (mid, out), (mid, out), (c, out)]
            flops = 2 * batch * (size * size * c_in * mid + out * out * 9 * mid * mid + out * out * mid * c)
            params = c_in * mid + 9 * mid * mid + mid * c + (c_in * c if c_in != c else 0)
            blocks.append(_conv_block(f"stage{stage}.{k}", batch, maps, flops, params, hardware, c_in * size * size))
            c_in, size = c, out
    return Profile(tuple(blocks), outside_forward_s=blocks[0].forward_s * 0.1, model=f"resnet-{depth}",
                   source=f"analytic on {hardware.name}", machine={"hardware": hardware.name},
                   notes=f"batch {batch}, 32x32, fp32; roofline at {MATMUL_EFFICIENCY:.0%} of peak FLOP/s")


def gpt2_xl(seq: int, batch: int, hardware: Hardware) -> Profile:
    return transformer(name=f"gpt2-xl-s{seq}", layers=48, hidden=1600, heads=25, seq=seq, batch=batch, vocab=50304, hardware=hardware)


def decoder_7b(seq: int, batch: int, hardware: Hardware) -> Profile:
    """A LLaMA-7B-shaped decoder (32 layers, 4096 wide, 32 heads); GPT-style 4x MLP for the bytes."""
    return transformer(name=f"decoder-7b-s{seq}", layers=32, hidden=4096, heads=32, seq=seq, batch=batch, vocab=32000, hardware=hardware)


ANALYTIC = {
    "gpt2-xl": gpt2_xl,
    "decoder-7b": decoder_7b,
}
