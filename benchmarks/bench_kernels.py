"""Claims: quantize/dequantize and pack reach >= 80% of the device's memory bandwidth on a GPU;
compressed swap moves 4x (int8) to 8x (int4) fewer bytes at a small round-trip error.

On a GPU: GB/s of each kernel against a device-to-device copy of the same bytes measured in the same
run (the bandwidth bound). On CPU: the torch reference's throughput beside a memcpy, and a line saying
the GPU figures were not measured. Always: bytes per activation value and round-trip error for
none/int8/int4/fp8 on the demo GPT's saved tensors. ``--train`` adds the 200-step loss per codec.
Run: ``python benchmarks/bench_kernels.py [--train]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ooc  # noqa: E402
from common import machine_header, median_time, table  # noqa: E402
from ooc.kernels.lowbit_linear import grad_weight  # noqa: E402
from ooc.kernels.pack import pack, unpack  # noqa: E402
from ooc.kernels.quant import dequantize, quantize  # noqa: E402


def throughput(device: torch.device) -> None:
    n = (64 if device.type == "cuda" else 8) * 2**20 // 4
    x = torch.randn(n, device=device)
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)  # noqa: E731

    def timed(fn) -> float:
        def run() -> None:
            fn()
            sync()
        return median_time(run, reps=10)

    copy_s = timed(lambda: x.clone())
    rows = [["op", "ms", "GB/s", "vs copy"], ["copy (bound)", f"{copy_s * 1e3:.2f}", f"{2 * x.nbytes / copy_s / 1e9:.1f}", "1.00"]]
    for codec in ("int8", "int4"):
        q = quantize(x, codec=codec)
        moved = x.nbytes + q.nbytes  # read x, write codes + scales
        s = timed(lambda c=codec: quantize(x, codec=c))
        rows.append([f"quantize {codec}", f"{s * 1e3:.2f}", f"{moved / s / 1e9:.1f}", f"{(moved / s) / (2 * x.nbytes / copy_s):.2f}"])
        s = timed(lambda q=q: dequantize(q))
        rows.append([f"dequantize {codec}", f"{s * 1e3:.2f}", f"{moved / s / 1e9:.1f}", f"{(moved / s) / (2 * x.nbytes / copy_s):.2f}"])
    small = [torch.randn(1024 + 13 * k, device=device) for k in range(256)]
    total = sum(t.nbytes for t in small)
    s = timed(lambda: pack(small))
    rows.append(["pack 256 small", f"{s * 1e3:.2f}", f"{2 * total / s / 1e9:.1f}", f"{(2 * total / s) / (2 * x.nbytes / copy_s):.2f}"])
    buffer, layout = pack(small)
    s = timed(lambda: unpack(buffer, layout))
    rows.append(["unpack 256 small", f"{s * 1e3:.2f}", f"{2 * total / s / 1e9:.1f}", f"{(2 * total / s) / (2 * x.nbytes / copy_s):.2f}"])
    M, N, K = (8192, 1024, 1024) if device.type == "cuda" else (1024, 256, 256)
    g, xk = torch.randn(M, N, device=device), torch.randn(M, K, device=device)
    dense_s = timed(lambda: g.t() @ xk)
    for bits in (8, 4):
        q = quantize(xk, bits=bits)
        s = timed(lambda q=q: grad_weight(g, q))
        rows.append([f"grad_weight int{bits} {M}x{N}x{K}", f"{s * 1e3:.2f}", f"{2 * M * N * K / s / 1e12:.2f} TF/s",
                     f"{dense_s / s:.2f} of matmul"])
    rows.append([f"torch.matmul fp32 {M}x{N}x{K}", f"{dense_s * 1e3:.2f}", f"{2 * M * N * K / dense_s / 1e12:.2f} TF/s", "1.00"])
    print(table(rows))
    if device.type == "cuda":
        print("target: quantize/dequantize/pack >= 0.80 of the copy bandwidth")
    else:
        print("CPU: these are the torch reference's figures; the GPU figures (target >= 80% of HBM bandwidth) were not measured here")


def saved_tensor_errors() -> None:
    from ooc.apps.check import demo_model_and_batch

    model, batch = demo_model_and_batch(torch.device("cpu"))
    saved: list[torch.Tensor] = []

    def pack_hook(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.numel() * t.element_size() >= 4096 and not isinstance(t, torch.nn.Parameter):
            saved.append(t.detach().clone())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        model(*batch)[1].backward()
    params = {p.data_ptr() for p in model.parameters()}
    saved = [t for t in saved if t.data_ptr() not in params]
    values = sum(t.numel() for t in saved)
    rows = [["codec", "bytes/value", "vs fp32", "rel. RMS error", "max error / step"]]
    rows.append(["none", "4.000", "1.000", "0", "-"])
    for codec in ("int8", "int4", "fp8_e4m3"):
        nbytes, sq_err, sq_ref, worst = 0, 0.0, 0.0, 0.0
        for t in saved:
            q = quantize(t, codec=codec)
            nbytes += q.nbytes
            diff = dequantize(q).float() - t.float()
            sq_err += float(diff.square().sum())
            sq_ref += float(t.float().square().sum())
            if codec != "fp8_e4m3":
                step = q.scales.repeat_interleave(q.group_size, dim=1)[:, : t.shape[-1]].reshape(t.shape)
                worst = max(worst, float((diff.abs() / step.clamp_min(1e-30)).max()))
        rows.append([codec, f"{nbytes / values:.3f}", f"{nbytes / values / 4:.3f}", f"{(sq_err / sq_ref) ** 0.5:.4f}",
                     f"{worst:.3f}" if codec != "fp8_e4m3" else "-"])
    print(f"{len(saved)} saved activations of the demo GPT, {values} values")
    print(table(rows))
    print("bound: round-to-nearest error <= 0.5 step per value")


def training(steps: int) -> None:
    from ooc.apps.check import demo_model_and_batch, train_losses

    rows = [["codec", f"loss (mean of last 20 of {steps} steps)", "vs none"]]
    base = None
    for codec in ("none", "int8", "int4", "fp8"):
        model, _ = demo_model_and_batch(torch.device("cpu"))
        ooc.wrap(model, ooc.Plan.of([ooc.BlockPlan("swap", codec=codec)] * 6), backend="cpu")
        final = statistics.mean(train_losses(model, steps)[-20:])
        ooc.unwrap(model)
        base = base or final
        rows.append([codec, f"{final:.4f}", f"{(final - base) / base:+.2%}"])
    print(table(rows))
    print("target: int8 within 2% of none")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", action="store_true", help="also train the demo GPT 200 steps per codec (~4 min on CPU)")
    args = parser.parse_args()
    print(machine_header("bench_kernels: quantization and packing throughput, compression of saved activations"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    throughput(device)
    print()
    saved_tensor_errors()
    if args.train:
        print()
        training(200)


if __name__ == "__main__":
    main()
