"""Compile lane: every kernel launch the launchers make compiles for sm_80 and sm_90 (fp8 e4m3 for
sm_90), with the specialisation Triton's JIT would give the same arguments, and the PTX says what
the GPU will run; every .cu file compiles with nvcc. No GPU needed: Triton compiles in a subprocess
without TRITON_INTERPRET (``compile_launches.py``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.compile_launches import CASES

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ptx")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_launches.py")
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ptx(compiled: dict, case: str, arch: int) -> str:
    result = compiled[case]
    assert "error" not in result, result.get("error")
    return Path(result[f"sm_{arch}"]["ptx"]).read_text()


def _found(ptx: str, *ops: str) -> dict[str, bool]:
    return {op: op in ptx for op in ops}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_launch_compiles(compiled, case) -> None:
    result = compiled[case]
    assert "error" not in result, result.get("error")
    for arch in CASES[case][0]:
        assert ".entry" in Path(result[f"sm_{arch}"]["ptx"]).read_text()
        print(f"{case}@sm_{arch}: {result[f'sm_{arch}']['kernel']} shared={result[f'sm_{arch}']['shared']} B")


@pytest.mark.parametrize("arch", [80, 90])
def test_stochastic_rounding_with_seed_one_compiles(compiled, arch) -> None:
    # The JIT turns an int argument equal to 1 into a constant; the seed must not be specialised.
    for case in ("quantize_int8_stochastic_seed1", "quantize_int4_stochastic_seed1"):
        assert "error" not in compiled[case], compiled[case].get("error")
        assert ".entry" in _ptx(compiled, case, arch)


@pytest.mark.parametrize("case", sorted(c for c in CASES if c.startswith("quantize")))
def test_quantize_divides_with_ieee_rounding(compiled, case) -> None:
    # The reference divides in IEEE fp32; approximate division (div.full / div.approx) changes
    # scales and codes on a GPU though the interpreter, which uses numpy, cannot show it.
    for arch in CASES[case][0]:
        ptx = _ptx(compiled, case, arch)
        assert _found(ptx, "div.rn.f32", "div.full", "div.approx") == {"div.rn.f32": True, "div.full": False, "div.approx": False}


@pytest.mark.parametrize("case", sorted(c for c in CASES if c.startswith("quantize")))
def test_quantize_divides_once_per_group_and_fuses_no_multiply_add(compiled, case) -> None:
    # NOTE [one division per group] in ooc.kernels.quant_reference: each value is multiplied by the
    # group's reciprocal, in IEEE roundings as the reference's two ops; Triton fuses x * inv + 0.5 into
    # an fma by default, and ptxas fuses a mul.f32 and add.f32 without .rn, either a rounding apart.
    for arch in CASES[case][0]:
        ptx = _ptx(compiled, case, arch)
        assert "fma" not in ptx and not re.search(r"\b(mul|add)\.f32", ptx)
        if case not in ("quantize_int8_one_element", "quantize_int4_bf16_odd_cols"):
            # Rows of whole groups (4 x 4096): a thread divides once for its group, then multiplies each value
            # (17 divisions a thread before; odd shapes replicate the group's division either way).
            assert ptx.count("div.rn.f32") < ptx.count("mul.rn.f32")


@pytest.mark.parametrize("case", sorted(c for c in CASES if c.startswith("quantize")))
def test_quantize_computes_its_scales_in_fp32(compiled, case) -> None:
    # NOTE [smallest scale]: MIN_SCALE is an fp32 subnormal, which Triton types as fp64 when written as
    # a Python float; the kernels build it from its bits, so no scale is computed in fp64.
    for arch in CASES[case][0]:
        assert not re.search(r"\.f64\b", _ptx(compiled, case, arch))


@pytest.mark.parametrize("case", sorted(c for c in CASES if c.startswith("quantize")))
def test_only_a_flagged_quantize_counts_with_an_atomic(compiled, case) -> None:
    # NOTE [the NaN/Inf count in the kernel]: the count is added by an atomic (PTX atom or red) in the
    # kernel when the caller passes a flag, and the kernel without one has none.
    for arch in CASES[case][0]:
        ptx = _ptx(compiled, case, arch)
        assert bool(re.search(r"\b(atom|red)\.global", ptx)) == case.endswith("_flag")


@pytest.mark.parametrize("arch", [80, 90])
def test_int4_of_even_rows_packs_without_moving_its_tile_through_shared_memory(compiled, arch) -> None:
    # NOTE [int4 from pairs]: the general kernel's reshape and split of its code tile went through
    # shared memory (byte stores there, six barriers) and ran at 0.63 of the copy on an H200; read as
    # pairs, an even row's int4 kernel shares only its reductions' scratch, as int8's does.
    for case in ("quantize_int4_fp32_pairs", "quantize_int4_bf16_pairs", "quantize_int4_stochastic_seed1", "quantize_int4_int32_flag"):
        assert compiled[case][f"sm_{arch}"]["kernel"] == "_quantize_int4_pairs_kernel"
        ptx = _ptx(compiled, case, arch)
        int8 = _ptx(compiled, "quantize_int8_int64_flag" if case.endswith("_flag") else "quantize_int8_fp32", arch)
        assert not re.search(r"st\.shared\.(v\d\.)?b8", ptx) and ptx.count("bar.sync") <= int8.count("bar.sync")
    assert compiled["quantize_int4_bf16_odd_cols"][f"sm_{arch}"]["kernel"] == "_quantize_int_kernel"


@pytest.mark.parametrize("case", sorted(c for c in CASES if c.startswith("grad_weight")))
def test_grad_weight_dot_is_fp32_not_tf32(compiled, case) -> None:
    # Its test bounds the error by fp32 summation; a TF32 tensor-core dot keeps 10 mantissa bits.
    for arch in CASES[case][0]:
        ptx = _ptx(compiled, case, arch)
        assert _found(ptx, "tf32", "fma.rn.f32") == {"tf32": False, "fma.rn.f32": True}


@pytest.mark.parametrize("case", ["quantize_int8_fp32", "quantize_int8_stochastic_seed1", "quantize_int4_stochastic_seed1",
                                  "dequantize_int8_fp32", "dequantize_int4_fp16"])
def test_int_kernels_load_and_store_vectors_on_sm90(compiled, case) -> None:
    # Rows of 4096 columns: a group is 64 contiguous, 16-aligned values, so each thread moves
    # 8 or 16 bytes per instruction (the former even/odd-column tiles loaded one value at a time).
    ptx = _ptx(compiled, case, 90)
    assert re.search(r"ld\.global(\.\w+)*\.v[24]\.", ptx), "no vector load"
    assert re.search(r"st\.global(\.\w+)*\.v[24]\.", ptx), "no vector store"


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
