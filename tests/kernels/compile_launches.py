"""Compile every kernel the launchers launch, for real GPU targets, on a machine without a GPU.

Run as ``python compile_launches.py OUT_DIR`` in a process *without* ``TRITON_INTERPRET``. Each case
calls a public launcher (``quantize``, ``dequantize``, ``grad_weight``) on small CPU tensors; every
kernel launch is intercepted and, instead of running, compiled for the case's targets with the
specialisation Triton's JIT would give those exact arguments (ints equal to 1 become constants,
16-divisible ints and aligned pointers get divisibility hints). So what is compiled here is what a
GPU would compile for the same call. Writes ``OUT_DIR/<case>@sm_<arch>.ptx`` and prints one JSON line:
``{case: {"error": str} | {"sm_<arch>": {"kernel", "shared", "ptx"}}}``.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from ooc.kernels import lowbit_linear, quant
from ooc.kernels.quant_reference import torch_quantize

ARCHES = [80, 90]


def _rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)


def _quantize(shape, dtype, codec, stochastic=False, seed=0, flag_dtype=None):  # noqa: ANN001, ANN202
    flag = None if flag_dtype is None else torch.zeros(1, dtype=flag_dtype)
    return lambda: quant._quantize_triton(_rand(*shape, dtype=dtype), codec, 64, stochastic, seed, flag=flag)


def _dequantize(shape, dtype, codec):  # noqa: ANN001, ANN202
    return lambda: quant.dequantize(torch_quantize(_rand(*shape, dtype=dtype), codec=codec))


def _grad_weight(m, n, k, dtype, codec):  # noqa: ANN001, ANN202
    return lambda: lowbit_linear.grad_weight(_rand(m, n, dtype=dtype), torch_quantize(_rand(m, k), codec=codec))


# case -> (targets, launcher call)
CASES = {
    "quantize_int8_fp32": (ARCHES, _quantize((4, 4096), torch.float32, "int8")),
    "quantize_int8_stochastic_seed1": (ARCHES, _quantize((4, 4096), torch.float32, "int8", True, 1)),
    "quantize_int4_stochastic_seed1": (ARCHES, _quantize((4, 4096), torch.float16, "int4", True, 1)),
    "quantize_int4_bf16_odd_cols": (ARCHES, _quantize((3, 4097), torch.bfloat16, "int4", True, 7)),
    "quantize_int4_fp32_pairs": (ARCHES, _quantize((4, 4096), torch.float32, "int4")),
    "quantize_int4_bf16_pairs": (ARCHES, _quantize((4, 4096), torch.bfloat16, "int4")),
    "quantize_int8_one_element": (ARCHES, _quantize((1,), torch.float16, "int8")),
    "quantize_int4_one_pair_int32_flag": (ARCHES, _quantize((2,), torch.float16, "int4", True, 1, torch.int32)),
    "quantize_int8_int64_flag": (ARCHES, _quantize((4, 4096), torch.float32, "int8", flag_dtype=torch.int64)),
    "quantize_int4_int32_flag": (ARCHES, _quantize((4, 4096), torch.float16, "int4", flag_dtype=torch.int32)),
    "quantize_fp8_e4m3": ([90], _quantize((4, 4096), torch.float32, "fp8_e4m3")),
    "quantize_fp8_e4m3_int64_flag": ([90], _quantize((4, 4096), torch.float32, "fp8_e4m3", flag_dtype=torch.int64)),
    "quantize_fp8_e5m2": (ARCHES, _quantize((4, 4096), torch.bfloat16, "fp8_e5m2")),
    "dequantize_int8_fp32": (ARCHES, _dequantize((4, 4096), torch.float32, "int8")),
    "dequantize_int4_fp16": (ARCHES, _dequantize((4, 4096), torch.float16, "int4")),
    "dequantize_fp8_e4m3": ([90], _dequantize((4, 4096), torch.float32, "fp8_e4m3")),
    "grad_weight_int8": (ARCHES, _grad_weight(64, 96, 4096, torch.float32, "int8")),
    "grad_weight_int4_bf16": (ARCHES, _grad_weight(33, 1, 130, torch.bfloat16, "int4")),
}


def main(out_dir: Path) -> None:
    quant.use_triton = lowbit_linear.use_triton = lambda t: True
    results: dict[str, dict] = {}
    current: dict = {}

    def compile_only(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202, ARG001
        for arch in current["arches"]:
            target = GPUTarget("cuda", arch, 32)
            backend = make_backend(target)
            bound, specialization, options = create_function_from_signature(self.signature, self.params, backend)(*args, **kwargs)
            options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
            compiled = triton.compile(ASTSource(self, signature, constexprs, attrs), target=target, options=options.__dict__)
            ptx = out_dir / f"{current['case']}@sm_{arch}.ptx"
            ptx.write_text(compiled.asm["ptx"])
            current["result"][f"sm_{arch}"] = {"kernel": self.fn.__name__, "shared": compiled.metadata.shared, "ptx": str(ptx)}

    JITFunction.run = compile_only
    for case, (arches, call) in CASES.items():
        current.update(case=case, arches=arches, result={})
        try:
            call()
            results[case] = current["result"]
        except Exception as exc:  # one case's failure is that case's test failure, not the others'
            results[case] = {"error": "".join(traceback.format_exception_only(exc))[-3000:]}
    print(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
