"""A Linear whose saved input is stored quantized, and whose weight gradient is computed from the
codes by a Triton matmul that dequantizes tiles in registers: the full-precision input is never
materialised again.

    forward:   y = x @ W^T + b           (input dtype, torch)         saves quantize(x) (one kernel)
    backward:  dx = dy @ W               (torch)
               dW = dy^T @ dequant(x_q)  (``_grad_weight_kernel``; on CPU the torch reference)
               db = dy.sum(0)

Shapes: ``x`` (..., K), ``weight`` (N, K), ``bias`` (N,), ``y`` (..., N); groups of ``group_size``
run along K, as ``quantize`` lays them out.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn as nn
import triton
import triton.language as tl

from ooc.kernels.quant import Quantized, launch_device, quantize, use_triton
from ooc.kernels.quant_reference import torch_dequantize

# Tiles: 64x64 outputs, 32 rows of the reduction per step, 8 warps. Compiled for sm_80 (ptxas -v):
# 190 registers, no spills, 45056 B shared; 64x64 with 4 warps spilled 544 B, 128x64 with 8 warps
# 588 B; 32x32 (the former tiles) used 168 registers and 22528 B for a quarter of the outputs.
# The dot is fp32 FMA ("ieee"), not tensor cores. Not yet timed on a GPU.
GPU_TILES = (64, 64, 32, 8)  # BLOCK_N, BLOCK_K, BLOCK_M, num_warps
# Triton's interpreter pays per element of a tile (numpy): 32x32 keeps the CPU tests fast.
INTERPRETER_TILES = (32, 32, 32, 4)


@triton.jit
def _grad_weight_kernel(
    g_ptr, codes_ptr, scales_ptr, out_ptr, M, N, K, groups_per_row,
    GROUP: tl.constexpr, PACK4: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr,
):
    # out[n, k] = sum_m g[m, n] * codes[m, k] * scale[m, k // GROUP]
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    k = pid_k * BK + tl.arange(0, BK)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for m0 in range(0, M, BM):
        m = (m0 + tl.arange(0, BM)).to(tl.int64)  # int64: m * N, m * K and m * groups can pass 2^31
        g = tl.load(g_ptr + m[:, None] * N + n[None, :], mask=(m[:, None] < M) & (n[None, :] < N), other=0.0).to(tl.float32)
        mk = (m[:, None] < M) & (k[None, :] < K)
        if PACK4:
            byte = tl.load(codes_ptr + m[:, None] * ((K + 1) // 2) + k[None, :] // 2, mask=mk, other=0).to(tl.int32)
            nib = (byte >> ((k[None, :] % 2) * 4)) & 0xF
            q = tl.where(nib > 7, nib - 16, nib).to(tl.float32)
        else:
            q = tl.load(codes_ptr + m[:, None] * K + k[None, :], mask=mk, other=0).to(tl.float32)
        scale = tl.load(scales_ptr + m[:, None] * groups_per_row + k[None, :] // GROUP, mask=mk, other=0.0)
        # "ieee": an fp32 dot otherwise runs on TF32 tensor cores (10 mantissa bits) on a GPU.
        acc += tl.dot(tl.trans(g), q * scale, input_precision="ieee")
    tl.store(out_ptr + n[:, None].to(tl.int64) * K + k[None, :], acc, mask=(n[:, None] < N) & (k[None, :] < K))


def grad_weight(grad_out: torch.Tensor, q: Quantized) -> torch.Tensor:
    """``grad_out^T @ dequant(q)``: (N, K) fp32, from ``grad_out`` (M, N) and ``q`` of an (M, K) input."""
    M, N = grad_out.shape
    K = q.cols
    if not use_triton(grad_out):
        return grad_out.float().t() @ torch_dequantize(q).float().reshape(M, K)
    grad_out = grad_out.contiguous()
    out = torch.empty(N, K, dtype=torch.float32, device=grad_out.device)
    block_n, block_k, block_m, num_warps = INTERPRETER_TILES if os.environ.get("TRITON_INTERPRET") == "1" else GPU_TILES
    grid = (triton.cdiv(N, block_n), triton.cdiv(K, block_k))
    with launch_device(out):  # NOTE [Triton launches on the current device] in ooc.kernels.quant
        _grad_weight_kernel[grid](grad_out, q.codes, q.scales, out, M, N, K, q.scales.shape[1], GROUP=q.group_size,
                                  PACK4=q.codec == "int4", BN=block_n, BK=block_k, BM=block_m, num_warps=num_warps)
    return out


class _LowBitLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, bits: int, group_size: int):  # noqa: ANN205
        y = torch.nn.functional.linear(x, weight, bias)
        # The only saved activation: x as codes + scales, written by one kernel that reads x once
        # (none for an empty batch, whose weight gradient is zero).
        ctx.q = quantize(x.detach().reshape(-1, x.shape[-1]), bits=bits, group_size=group_size) if x.numel() else None
        ctx.save_for_backward(weight)
        ctx.has_bias = bias is not None
        ctx.x_shape = x.shape
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):  # noqa: ANN205
        (weight,) = ctx.saved_tensors
        g = grad_y.reshape(-1, grad_y.shape[-1])
        # Under autocast the forward's matmul ran in the autocast dtype, and so does this one, as
        # nn.Linear's does (autograd casts dx to x's dtype); elsewhere the cast is a no-op.
        grad_x = (g @ weight.to(g.dtype)).reshape(ctx.x_shape) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = torch.zeros_like(weight) if ctx.q is None else grad_weight(g, ctx.q).to(weight.dtype)
        grad_b = g.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        ctx.q = None
        return grad_x, grad_w, grad_b, None, None


def lowbit_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, bits: int = 8,
                  group_size: int = 64) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` that saves ``x`` quantized to ``bits`` (8 or 4) for the backward;
    plain ``F.linear`` where no weight gradient will be computed (grad mode off, or a frozen weight)."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {weight.shape[1]}")
    if not (torch.is_grad_enabled() and weight.requires_grad):
        # No backward will read codes of x: none at all (evaluation), or one that needs W alone
        # (dx = dy @ W, a frozen weight): plain F.linear, without a quantize kernel and its host sync.
        return torch.nn.functional.linear(x, weight, bias)
    return _LowBitLinearFunction.apply(x, weight, bias, bits, group_size)


class LowBitLinear(nn.Linear):
    """Drop-in for ``nn.Linear`` whose backward reads a quantized copy of its input."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, bits: int = 8, group_size: int = 64,
                 device=None, dtype=None) -> None:  # noqa: ANN001
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.bits = bits
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lowbit_linear(x, self.weight, self.bias, bits=self.bits, group_size=self.group_size)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bits={self.bits}"


def convert_linear(model: nn.Module, *, bits: int = 8, group_size: int = 64,
                   filter: Callable[[str, nn.Linear], bool] | None = None) -> nn.Module:  # noqa: A002
    """Replace ``nn.Linear`` layers of ``model`` in place by :class:`LowBitLinear` sharing their
    parameters (optimizers and tied weights keep working). ``filter(name, module)`` picks layers."""
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is nn.Linear and (filter is None or filter(name, m)) and m.in_features >= 2]
    for name, linear in targets:
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        replacement = LowBitLinear.__new__(LowBitLinear)
        nn.Module.__init__(replacement)
        replacement.in_features, replacement.out_features = linear.in_features, linear.out_features
        replacement.weight = linear.weight
        replacement.bias = linear.bias
        replacement.bits, replacement.group_size = bits, group_size
        setattr(parent, name.rpartition(".")[2], replacement)
    return model
