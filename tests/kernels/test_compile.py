"""Compile lane: every Triton kernel builds for sm_80 and sm_90 (fp8 for sm_90) and every .cu file
with nvcc, on a machine without a GPU. Triton compiles in a subprocess without TRITON_INTERPRET."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "kernels"

COMPILE = r'''
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ooc.kernels import lowbit_linear, quant

INT = {"rows": "i32", "cols": "i32", "groups_per_row": "i32"}
jobs = {
    "quantize_int8": (quant._quantize_int_kernel, {"x_ptr": "*fp32", "codes_ptr": "*i8", "scales_ptr": "*fp32", **INT, "seed": "i32"},
                      {"QMAX": 127, "GROUP": 64, "GPP": 32, "PACK4": False, "STOCHASTIC": True}),
    "quantize_int4_bf16": (quant._quantize_int_kernel, {"x_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": "*fp32", **INT, "seed": "i32"},
                           {"QMAX": 7, "GROUP": 64, "GPP": 32, "PACK4": True, "STOCHASTIC": False}),
    "dequantize_int4": (quant._dequantize_int_kernel, {"codes_ptr": "*u8", "scales_ptr": "*fp32", "out_ptr": "*fp16", **INT},
                        {"GROUP": 64, "GPP": 32, "PACK4": True}),
    "quantize_fp8": (quant._quantize_fp8_kernel, {"x_ptr": "*fp32", "codes_ptr": "*fp8e4nv", "scales_ptr": "*fp32", **INT},
                     {"FP8_MAX": 448.0, "GROUP": 64, "GPP": 32}),
    "grad_weight_int8": (lowbit_linear._grad_weight_kernel, {"g_ptr": "*fp32", "codes_ptr": "*i8", "scales_ptr": "*fp32", "out_ptr": "*fp32",
                          "M": "i32", "N": "i32", "K": "i32", "groups_per_row": "i32"},
                         {"GROUP": 64, "PACK4": False, "BN": 32, "BK": 32, "BM": 32}),
    "grad_weight_int4_bf16": (lowbit_linear._grad_weight_kernel, {"g_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": "*fp32", "out_ptr": "*fp32",
                               "M": "i32", "N": "i32", "K": "i32", "groups_per_row": "i32"},
                              {"GROUP": 64, "PACK4": True, "BN": 32, "BK": 32, "BM": 32}),
    "dequantize_fp8": (quant._dequantize_fp8_kernel, {"codes_ptr": "*fp8e4nv", "scales_ptr": "*fp32", "out_ptr": "*fp32", **INT},
                       {"GROUP": 64, "GPP": 32}),
}
arches = {name: ([90] if "fp8" in name else [80, 90]) for name in jobs}
out = {}
for name, (fn, signature, constexprs) in jobs.items():
    sig = dict(signature)
    sig.update({k: "constexpr" for k in constexprs})
    for arch in arches[name]:
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", arch, 32))
        out[f"{name}@sm_{arch}"] = {"ptx": len(compiled.asm["ptx"]), "cubin": len(compiled.asm["cubin"]), "shared": compiled.metadata.shared}
print(json.dumps(out))
'''


def _compile() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_quant_kernels_compile_for_sm80_and_sm90() -> None:
    results = _compile()
    for name in ("quantize_int8", "quantize_int4_bf16", "dequantize_int4", "grad_weight_int8", "grad_weight_int4_bf16"):
        for arch in (80, 90):
            assert results[f"{name}@sm_{arch}"]["cubin"] > 0
    assert results["quantize_fp8@sm_90"]["cubin"] > 0
    assert results["dequantize_fp8@sm_90"]["cubin"] > 0


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_sources_compile_with_nvcc(tmp_path, arch) -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed on this machine")
    sources = sorted(KERNELS.glob("*.cu"))
    assert sources, "no .cu files under kernels/"
    for source in sources:
        out = tmp_path / f"{source.stem}.{arch}.ptx"
        proc = subprocess.run([nvcc, "-ptx", f"-arch={arch}", str(source), "-o", str(out)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert ".entry" in out.read_text()
