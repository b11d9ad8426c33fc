"""ooc's own GPU kernels under NVIDIA's compute-sanitizer: memcheck (out-of-bounds and misaligned
accesses) and racecheck (shared-memory hazards). A small script quantizes and dequantizes odd
shapes with every codec (Triton) and packs/unpacks a tensor list (CuPy, when installed); the
sanitizer's exit code is non-zero on any error it reports in any kernel of the process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import torch
from ooc.kernels.quant import dequantize, quantize

codecs = ["int8", "int4"] + (["fp8_e4m3", "fp8_e5m2"] if torch.cuda.get_device_capability() >= (8, 9) else [])
for shape in [(1,), (7,), (3, 63), (2, 4097), (33, 4097)]:
    x = torch.randn(shape, device="cuda")
    for codec in codecs:
        out = torch.full(shape, float("nan"), device="cuda")
        dequantize(quantize(x, codec=codec), out=out)
        assert not out.isnan().any(), (shape, codec)
    dequantize(quantize(x, codec="int8", stochastic=True, seed=1))
try:
    import cupy  # noqa: F401
except ImportError:
    cupy = None
if cupy is not None:
    from ooc.kernels.pack import pack, unpack

    tensors = [torch.randn(7, device="cuda"), torch.randn(3, 5, device="cuda").half(), torch.arange(4097, device="cuda")]
    buffer, layout = pack(tensors)
    assert all(torch.equal(a, b) for a, b in zip(tensors, unpack(buffer, layout)))
torch.cuda.synchronize()
print("kernels ran")
"""


def sanitizer() -> str | None:
    """The compute-sanitizer binary: on PATH, else under CUDA_HOME or /usr/local/cuda."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "compute-sanitizer").is_file():
            return str(Path(home) / "bin" / "compute-sanitizer")
    return None


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_kernels_are_clean_under_compute_sanitizer(tool: str, tmp_path: Path) -> None:
    binary = sanitizer()
    if binary is None:
        pytest.skip("compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): install the CUDA toolkit to run this check")
    script = tmp_path / "kernels.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([binary, "--tool", tool, "--error-exitcode", "86", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=420, env=env, cwd=tmp_path)
    report = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, f"compute-sanitizer --tool {tool} exited {done.returncode}:\n{report}"
    assert "kernels ran" in done.stdout, report
    # Each tool ends with its own summary line: memcheck "ERROR SUMMARY: 0 errors", racecheck
    # "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)".
    summary = {"memcheck": "ERROR SUMMARY: 0 errors", "racecheck": "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"}
    assert summary[tool] in done.stdout + done.stderr, report
