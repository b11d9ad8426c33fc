"""Analytic profiles: per-block FLOPs and bytes through a roofline on a hardware preset, for models
too large to measure here.

Times are ``max(flops / (flops_peak * MATMUL_EFFICIENCY), bytes / (memory_bw * MEMORY_EFFICIENCY))``;
the backward costs twice the forward's FLOPs. Saved-activation bytes follow Korthikanti et al.
(2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 1): per layer
``s*b*h*(34 + 5*a*s/h)`` bytes with 16-bit activations and attention scores materialised, as ooc's
reference GPT does. CNN blocks count the feature maps each layer saves, in fp32 as in KARMA's runs.
Each block records that dtype (``BlockProfile.activation_dtype``: 2-byte activations as
``bfloat16``) and what each codec makes of its storages (NOTE [analytic codec bytes]).

NOTE [analytic ops]
Each block also carries its forward op by op (``BlockProfile.ops``, NOTE [op-level profile] in
``ooc.scheduler.profile``): layer norms, matmuls, attention (scores, softmax, dropout, scores x V;
or one fused flash-attention op), dropouts, GELU, residual adds; convolutions, batch norms and
ReLUs for the CNNs. Each op's raw time is the same roofline on its own FLOPs and bytes (inputs read,
outputs and weights written/read); the raw times are then scaled by one factor per block so that
they add up to the block's ``forward_s`` (the block-level roofline, unchanged). An op's
``saved_bytes`` is the part of its output that autograd saves (Korthikanti's terms, each given to
the op that produces the tensor); the block's input, which its first op saves, is not an op's
output, so ``sum(op.saved_bytes) + input_bytes == saved_bytes`` for every analytic block. The ops
after the block's last save are not ``replayed`` (NOTE [a re-run stops at the last save]): a
transformer block's last residual add, a CNN block's last convolution and add. Dropouts
(and a flash attention that applies dropout inside) draw random numbers: not cacheable. Nor is the
residual add that makes the block's output: that storage is the next block's input, so holding it
as a cached output would count it in two blocks (and the re-run's output is discarded anyway).

NOTE [analytic codec bytes]
A compressed swap encodes each floating-point storage into codes plus one fp32 scale per 64 values
and moves every other storage as it is (``ooc.scheduler.codecs``). Each op lists the storages it
saves with their dtypes, and each block records, per codec, what the profiler would count of a run
(``BlockProfile.compressed``: the swapped bytes and the largest storage's codes, decoded as the
block's backward starts): a transformer's activations in its ``bytes_per_value`` dtype (int8 keeps
0.531 of bf16's bytes, 0.266 of fp32's: the codes shrink with the input, the scales do not), its
1-byte dropout masks as they are, flash attention's fp32 softmax statistics at fp32's ratio; a
CNN's fp32 feature maps. On GPT-2 XL at s1024, int8 keeps 0.605 of a block's saved bytes (16% of
them are masks). Charged fp32's nominal ratio on everything, as these profiles were before they
recorded this, the planner counted under half the bytes a run moves.
"""

from __future__ import annotations

from ooc.scheduler.codecs import CODECS, swapped_sizes
from ooc.scheduler.hardware import Hardware
from ooc.scheduler.profile import BlockProfile, OpProfile, Profile

MATMUL_EFFICIENCY = 0.6
"""Share of dense peak reached by large GEMMs (~60% MFU is typical of well-tuned training)."""
MEMORY_EFFICIENCY = 0.8

ACTIVATION_DTYPE = {2: "bfloat16", 4: "float32"}
"""The dtype a transformer's ``bytes_per_value`` names (``BlockProfile.activation_dtype``); fp16
would take the same bytes under every codec as bf16."""


def _time(flops: float, nbytes: float, hw: Hardware) -> float:
    return max(flops / (hw.flops * MATMUL_EFFICIENCY), nbytes / (hw.memory_bytes_per_s * MEMORY_EFFICIENCY))


_Storage = tuple[int, str]
"""(bytes, dtype) of one storage an op saves."""
_RawOp = tuple[str, float, float, int, tuple[_Storage, ...], bool]
"""(name, flops, bytes read + written, output bytes, the storages of it autograd saves, cacheable)."""


def _ops(raw: list[_RawOp], reads: list[tuple[int, ...]], forward_s: float, hw: Hardware) -> tuple[OpProfile, ...]:
    """The ops with roofline times scaled to add up to ``forward_s`` (NOTE [analytic ops]);
    ``reads``: per op, the earlier ops whose outputs it reads (``OpProfile.reads``)."""
    times = [_time(flops, nbytes, hw) for _, flops, nbytes, _, _, _ in raw]
    scale = forward_s / sum(times)
    # A re-run stops at the block's last save (NOTE [a re-run stops at the last save]): after the
    # last op whose output is saved, or before the last op that saves its inputs (the matmuls and
    # convolutions: the ops with FLOPs), whichever comes later.
    last_save = max([k for k, op in enumerate(raw) if op[4]] + [k - 1 for k, op in enumerate(raw) if op[1]], default=-1)
    return tuple(OpProfile(name, t * scale, out, sum(n for n, _ in saved), cacheable, reads=r, replayed=k <= last_save)
                 for k, ((name, _, _, out, saved, cacheable), t, r) in enumerate(zip(raw, times, reads, strict=True)))


def _compressed(saved: list[_Storage], inputs: list[_Storage]) -> tuple[tuple[str, int, int, int, int], ...]:
    """``BlockProfile.compressed`` of a block that saves ``saved`` and takes ``inputs``: per codec,
    what the profiler records of a run (NOTE [analytic codec bytes])."""
    entries = []
    for codec in CODECS:
        saved_bytes, saved_max = swapped_sizes(codec, saved)
        input_bytes, input_max = swapped_sizes(codec, inputs)
        entries.append((codec.value, saved_bytes, input_bytes, saved_max, input_max))
    return tuple(entries)


def _chain_reads(count: int) -> list[tuple[int, ...]]:
    """Each op reads the one before it (the first reads the block's input)."""
    return [()] + [(k - 1,) for k in range(1, count)]


def _transformer_ops(s: int, b: int, h: int, a: int, e: int, flash_attention: bool) -> tuple[list[_RawOp], list[tuple[int, ...]]]:
    """A pre-LN GPT layer with dropout, ``e``-byte activations, 1-byte dropout masks.

    Saved per Korthikanti et al.: LN inputs, QKV input, Q/K/V, softmax output, its dropout mask and
    output, the projection's input and the dropout masks, the MLP's inputs (Korthikanti's 34*sbh + 5*as^2b).
    With ``flash_attention`` the scores are never materialised: one op saves its output and the
    softmax statistics (fp32, ``a*s*b`` values). Each op lists the storages it saves with their dtypes
    (NOTE [analytic codec bytes]). Returns the ops and what each reads (``OpProfile.reads``)."""
    n, S = s * b * h, a * s * s * b
    act = ACTIVATION_DTYPE[e]
    v = lambda nbytes: ((nbytes, act),)  # noqa: E731  one saved storage of activations
    mask = lambda nbytes: ((nbytes, "bool"),)  # noqa: E731  a dropout's mask, which no codec takes
    mm = lambda name, k, m, out_saved: (name, 2 * s * b * k * m, e * (s * b * k + k * m + s * b * m), e * s * b * m, out_saved, True)  # noqa: E731
    ops: list[_RawOp] = [
        ("layer_norm", 0.0, 2 * e * n, e * n, v(e * n), True),  # saved: the QKV matmul's input
        mm("qkv", h, 3 * h, v(3 * e * n)),  # saved: Q and K (scores), V (scores x V)
    ]
    if flash_attention:
        lse = 4 * a * s * b
        ops.append(("flash_attention", 4 * b * s * s * h, e * 4 * n + lse, e * n + lse, v(e * n) + ((lse, "float32"),), False))
    else:
        ops += [
            ("scores", 2 * b * s * s * h, e * (2 * n + S), e * S, (), True),
            ("softmax", 0.0, 2 * e * S, e * S, v(e * S), True),  # saved by its own backward
            ("attention_dropout", 0.0, (2 * e + 1) * S, (e + 1) * S, v(e * S) + mask(S), False),  # mask; output saved by scores x V
            ("scores_v", 2 * b * s * s * h, e * (S + 2 * n), e * n, v(e * n), True),  # saved: the projection's input
        ]
    ops += [
        mm("proj", h, h, ()),
        ("dropout", 0.0, (2 * e + 1) * n, (e + 1) * n, mask(n), False),  # saved: the mask
        ("add", 0.0, 3 * e * n, e * n, v(e * n), True),  # saved: the second layer norm's input
        ("layer_norm", 0.0, 2 * e * n, e * n, v(e * n), True),  # saved: fc1's input
        mm("fc1", h, 4 * h, v(4 * e * n)),  # saved: GELU's input
        ("gelu", 0.0, 8 * e * n, 4 * e * n, v(4 * e * n), True),  # saved: fc2's input
        mm("fc2", 4 * h, h, ()),
        ("dropout", 0.0, (2 * e + 1) * n, (e + 1) * n, mask(n), False),
        ("add", 0.0, 3 * e * n, e * n, (), False),  # the block's output (NOTE [analytic ops])
    ]
    # A chain, but for scores x V (the softmax's dropout and V from the QKV matmul) and the residual
    # adds (the first add's output is the second's residual; the block's input is no op).
    reads = _chain_reads(len(ops))
    first_add = len(ops) - 7
    reads[first_add + 6] = (first_add, first_add + 5)
    if not flash_attention:
        reads[5] = (1, 4)
    return ops, reads


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
    flash_attention: bool = False,
) -> Profile:
    """A decoder-only transformer with a 4x MLP; ``flash_attention``: fused attention that never
    materialises the scores (the block's saved bytes drop the ``5*a*s^2*b`` term); ``bytes_per_value``:
    2 (bf16/fp16) or 4 (fp32)."""
    if bytes_per_value not in ACTIVATION_DTYPE:
        raise ValueError(f"bytes_per_value must be one of {sorted(ACTIVATION_DTYPE)} (bf16/fp16 or fp32), got {bytes_per_value!r}")
    s, b, h, a = seq, batch, hidden, heads
    raw, reads = _transformer_ops(s, b, h, a, bytes_per_value, flash_attention)
    x = s * b * h * bytes_per_value
    act = ACTIVATION_DTYPE[bytes_per_value]
    storages = [(x, act)] + [storage for op in raw for storage in op[4]]  # the block's input, which its first op saves
    # Korthikanti's 34*sbh + 5*as^2b with 2-byte activations (scores materialised); the same storages
    # in the activations' dtype otherwise (fp32's: about twice, the 1-byte masks as they are).
    saved = sum(nbytes for nbytes, _ in storages)
    if flash_attention:
        matmul_flops = sum(op[1] for op in raw)
    else:
        matmul_flops = 24 * b * s * h * h + 4 * b * s * s * h
    params = 12 * h * h + 13 * h
    traffic = 2 * saved + params * bytes_per_value
    fwd = _time(matmul_flops, traffic, hardware)
    ops = _ops(raw, reads, fwd, hardware)
    block = BlockProfile(
        name="layer", forward_s=fwd, backward_s=2 * fwd, saved_bytes=saved, swappable_bytes=saved,
        input_bytes=x, input_swappable_bytes=x, output_bytes=x, param_bytes=params * bytes_per_value,
        grad_bytes=params * bytes_per_value, swappable_storages=20, input_swappable_storages=1,
        compressed=_compressed(storages, [(x, act)]), ops=ops, activation_dtype=act,
    )
    head_flops = 2 * b * s * h * vocab
    outside = _time(3 * head_flops, 3 * b * s * vocab * bytes_per_value, hardware)
    return Profile(
        blocks=tuple(BlockProfile(**{**block.__dict__, "name": f"layers.{i}"}) for i in range(layers)),
        outside_forward_s=outside,
        outside_param_bytes=(2 * vocab * h + 2 * h) * bytes_per_value,  # embedding, untied head, final norm
        model=name + ("-flash" if flash_attention else ""),
        source=f"analytic on {hardware.name}",
        machine={"hardware": hardware.name},
        notes=f"seq {seq}, micro-batch {batch}, {bytes_per_value}-byte activations; roofline at "
        f"{MATMUL_EFFICIENCY:.0%} of peak FLOP/s; saved bytes per Korthikanti et al. 2022"
        + ("; fused (flash) attention" if flash_attention else "") + "; op-level detail per NOTE [analytic ops]",
    )


def _conv(name: str, b: int, c_in: int, c_out: int, size_in: int, size_out: int, k: int, saved: bool) -> _RawOp:
    out = b * c_out * size_out * size_out * 4
    flops = 2 * b * size_out * size_out * k * k * c_in * c_out
    return (name, flops, 4 * (b * c_in * size_in * size_in + k * k * c_in * c_out) + out, out, ((out, "float32"),) if saved else (), True)


def _pointwise(name: str, b: int, c: int, size: int, saved: bool, *, inplace: bool = False, reads: int = 1) -> _RawOp:
    """BN, ReLU, add: reads ``reads`` maps and writes one; in place, it creates no storage."""
    nbytes = b * c * size * size * 4
    if inplace:
        return (name, 0.0, 2 * nbytes, 0, (), False)
    return (name, 0.0, (reads + 1) * nbytes, nbytes, ((nbytes, "float32"),) if saved else (), True)


def _output_add(b: int, c: int, size: int) -> _RawOp:
    """The residual add that makes the block's output (NOTE [analytic ops]: not cacheable)."""
    name, flops, nbytes, out, saved, _ = _pointwise("add", b, c, size, False, reads=2)
    return name, flops, nbytes, out, saved, False


def _conv_block(name: str, b: int, maps: list[tuple[int, int]], flops: float, params: int, hw: Hardware, in_elems: int,
                raw: list[_RawOp], reads: list[tuple[int, ...]]) -> BlockProfile:
    """``maps``: (channels, spatial size) of each saved fp32 feature map; ``raw``: the block's ops,
    ``reads``: what each reads (``OpProfile.reads``)."""
    storages = [(b * c * hw_ * hw_ * 4, "float32") for c, hw_ in maps]
    saved = sum(nbytes for nbytes, _ in storages)
    fwd = _time(flops, 2 * saved + params * 4, hw)
    x = b * in_elems * 4
    return BlockProfile(name, fwd, 2 * fwd, saved, saved, x, x, x, params * 4, params * 4,
                        swappable_storages=len(maps), input_swappable_storages=1, compressed=_compressed(storages, [(x, "float32")]),
                        ops=_ops(raw, reads, fwd, hw), activation_dtype="float32")


def wide_resnet(*, depth: int = 28, width: int = 10, batch: int, hardware: Hardware) -> Profile:
    """WRN-depth-width on 32x32 inputs (pre-activation basic blocks, 3 groups)."""
    per_group = (depth - 4) // 6
    blocks = []
    c_in, size = 16, 32
    b = batch
    for g, c in enumerate((16 * width, 32 * width, 64 * width)):
        for k in range(per_group):
            stride = 2 if g > 0 and k == 0 else 1
            out = size // stride
            # BN+ReLU on the input, conv, BN+ReLU, conv: input, bn1 out, relu1 out, conv1 out, bn2 out, relu2 out
            maps = [(c_in, size), (c_in, size), (c_in, size), (c, out), (c, out), (c, out)]
            flops = 2 * batch * out * out * 9 * (c_in * c + c * c)
            params = 9 * (c_in * c + c * c) + (c_in * c if c_in != c else 0)
            raw = [_pointwise("batch_norm", b, c_in, size, True), _pointwise("relu", b, c_in, size, True),
                   _conv("conv1", b, c_in, c, size, out, 3, True), _pointwise("batch_norm", b, c, out, True),
                   _pointwise("relu", b, c, out, True), _conv("conv2", b, c, c, out, out, 3, False)]
            reads = _chain_reads(len(raw))
            if c_in != c:
                raw.append(_conv("shortcut", b, c_in, c, size, out, 1, False))
                reads.append((1,))  # the pre-activated input
            raw.append(_output_add(b, c, out))
            reads.append((5, 6) if c_in != c else (5,))  # conv2's output and the shortcut's (or the block's input)
            blocks.append(_conv_block(f"group{g}.{k}", batch, maps, flops, params, hardware, c_in * size * size, raw, reads))
            c_in, size = c, out
    return Profile(tuple(blocks), outside_forward_s=blocks[0].forward_s * 0.1, model=f"wrn-{depth}-{width}",
                   source=f"analytic on {hardware.name}", machine={"hardware": hardware.name},
                   notes=f"batch {batch}, 32x32, fp32; roofline at {MATMUL_EFFICIENCY:.0%} of peak FLOP/s; "
                   "op-level detail per NOTE [analytic ops]")


def preact_resnet_bottleneck(*, depth: int = 1001, batch: int, hardware: Hardware) -> Profile:
    """Pre-activation bottleneck ResNet for 32x32 inputs (ResNet-1001: 3 stages of 111 blocks).

    Ops: BN, in-place ReLU, 1x1 conv, BN, in-place ReLU, 3x3 conv, BN, ReLU, 1x1 conv (its output
    counted as saved, as the block-level count has it), the shortcut's 1x1 conv where the width
    changes, the residual add."""
    per_stage = (depth - 2) // 9
    blocks = []
    c_in, size = 16, 32
    b = batch
    for stage, mid in enumerate((16, 32, 64)):
        c = 4 * mid
        for k in range(per_stage):
            stride = 2 if stage > 0 and k == 0 else 1
            out = size // stride
            maps = [(c_in, size), (c_in, size), (mid, size), (mid, size), (mid, out), (mid, out), (mid, out), (c, out)]
            flops = 2 * batch * (size * size * c_in * mid + out * out * 9 * mid * mid + out * out * mid * c)
            params = c_in * mid + 9 * mid * mid + mid * c + (c_in * c if c_in != c else 0)
            raw = [_pointwise("batch_norm", b, c_in, size, True), _pointwise("relu_", b, c_in, size, False, inplace=True),
                   _conv("conv1", b, c_in, mid, size, size, 1, True), _pointwise("batch_norm", b, mid, size, True),
                   _pointwise("relu_", b, mid, size, False, inplace=True), _conv("conv2", b, mid, mid, size, out, 3, True),
                   _pointwise("batch_norm", b, mid, out, True), _pointwise("relu", b, mid, out, True),
                   _conv("conv3", b, mid, c, out, out, 1, True)]
            # The in-place ReLUs write the batch norms' outputs: their readers read those storages.
            reads = [(), (0,), (0,), (2,), (3,), (3,), (5,), (6,), (7,)]
            if c_in != c:
                raw.append(_conv("shortcut", b, c_in, c, size, out, 1, False))
                reads.append((0,))  # the pre-activated input
            raw.append(_output_add(b, c, out))
            reads.append((8, 9) if c_in != c else (8,))
            blocks.append(_conv_block(f"stage{stage}.{k}", batch, maps, flops, params, hardware, c_in * size * size, raw, reads))
            c_in, size = c, out
    return Profile(tuple(blocks), outside_forward_s=blocks[0].forward_s * 0.1, model=f"resnet-{depth}",
                   source=f"analytic on {hardware.name}", machine={"hardware": hardware.name},
                   notes=f"batch {batch}, 32x32, fp32; roofline at {MATMUL_EFFICIENCY:.0%} of peak FLOP/s; "
                   "op-level detail per NOTE [analytic ops]")


def gpt2_xl(seq: int, batch: int, hardware: Hardware, *, flash_attention: bool = False) -> Profile:
    return transformer(name=f"gpt2-xl-s{seq}", layers=48, hidden=1600, heads=25, seq=seq, batch=batch, vocab=50304,
                       hardware=hardware, flash_attention=flash_attention)


def decoder_7b(seq: int, batch: int, hardware: Hardware, *, flash_attention: bool = False) -> Profile:
    """A LLaMA-7B-shaped decoder (32 layers, 4096 wide, 32 heads); GPT-style 4x MLP for the bytes."""
    return transformer(name=f"decoder-7b-s{seq}", layers=32, hidden=4096, heads=32, seq=seq, batch=batch, vocab=32000,
                       hardware=hardware, flash_attention=flash_attention)


ANALYTIC = {
    "gpt2-xl": gpt2_xl,
    "decoder-7b": decoder_7b,
}
