"""Tile sweep for the quantize/dequantize kernels (``ooc.kernels.quant``): groups per program and
warps per program, each timed on 256 MiB of fp32 against a device-to-device copy of it measured in
the same run (the kernels are memory-bound: the copy is their bound). GPU only; prints one row per
setting and the best setting per kernel. Run: ``python benchmarks/sweep_quant.py [--gpp 16,32,64,128]
[--warps 2,4,8]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ooc.kernels.quant as quant  # noqa: E402
from common import machine_header, table  # noqa: E402
from ooc.calibrate import cuda_event_seconds  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpp", default="16,32,64,128")
    parser.add_argument("--warps", default="2,4,8")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_quant.py times the Triton kernels: it needs a CUDA device")
    print(machine_header("quantize/dequantize tile sweep"))
    x = torch.randn(64 * 2**20, device="cuda")
    copy_GBps = 2 * x.nbytes / cuda_event_seconds(lambda: x.clone(), 10) / 1e9
    rows = [["codec", "groups/program", "warps", "quantize GB/s", "vs copy", "dequantize GB/s", "vs copy"]]
    best: dict[str, tuple[float, str]] = {}
    for gpp in (int(v) for v in args.gpp.split(",")):
        for warps in (int(v) for v in args.warps.split(",")):
            quant.GROUPS_PER_PROGRAM, quant.NUM_WARPS = gpp, warps
            for codec in ("int8", "int4", "fp8_e4m3"):
                q = quant.quantize(x, codec=codec)
                moved = x.nbytes + q.codes.nbytes + q.scales.nbytes
                qs = moved / cuda_event_seconds(lambda c=codec: quant.quantize(x, codec=c), 10) / 1e9
                ds = moved / cuda_event_seconds(lambda q=q: quant.dequantize(q), 10) / 1e9
                rows.append([codec, str(gpp), str(warps), f"{qs:.0f}", f"{qs / copy_GBps:.2f}", f"{ds:.0f}", f"{ds / copy_GBps:.2f}"])
                for kind, value in (("quantize", qs), ("dequantize", ds)):
                    key = f"{kind} {codec}"
                    if value > best.get(key, (0.0, ""))[0]:
                        best[key] = (value, f"gpp {gpp} warps {warps}")
    print(f"copy (bound): {copy_GBps:.0f} GB/s")
    print(table(rows))
    for key, (value, where) in best.items():
        print(f"best {key}: {value:.0f} GB/s ({value / copy_GBps:.2f} of the copy) at {where}")


if __name__ == "__main__":
    main()
