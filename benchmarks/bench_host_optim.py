"""Claim (issue 5): HostAdamW runs at >= 0.9 of the host's memory-bandwidth bound and >= 1.0x torch's
fused AdamW. Napkin: Adam reads p, g, m, v and writes p, m, v in place: 28 bytes per fp32 parameter,
so params/s <= bandwidth / 28. The bandwidth is measured in the same run by three in-place probes
that, like Adam, write only lines they have read (so no write-allocate traffic is hidden): a += b
(12 B/element), a += s*b*c (16 B), a += s*b (12 B); the bound takes the fastest. (An out-of-place
triad a = b + s*c also reads each line of a before writing it, 16 B not 12, which made the earlier
probe read low.) Run: ``python benchmarks/bench_host_optim.py [--params 25e6]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import interleaved_medians, machine_header, table  # noqa: E402
from ooc.optim import HostAdamW  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, default=25e6)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    n = int(args.params)
    print(machine_header(f"bench_host_optim: AdamW on {n / 1e6:.0f}M fp32 parameters on the host"))
    a, b, c = torch.randn(n), torch.randn(n), torch.randn(n)
    probes = {  # name: (function, bytes moved per element)
        "a += b": (lambda: a.add_(b), 12),
        "a += s*b*c": (lambda: a.addcmul_(b, c, value=1e-9), 16),
        "a += s*b": (lambda: a.add_(b, alpha=1e-9), 12),
    }

    def make(kind: str):
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n)
        if kind == "HostAdamW":
            opt = HostAdamW([p], lr=1e-3)
        else:
            opt = torch.optim.AdamW([p], lr=1e-3, fused=kind == "torch fused", foreach=kind == "torch foreach" or None)
        return opt.step

    fns = {**{k: fn for k, (fn, _) in probes.items()}, **{k: make(k) for k in ("HostAdamW", "torch fused", "torch foreach")}}
    med = interleaved_medians(fns, reps=args.reps)
    bandwidths = {k: nbytes * n / med[k] for k, (_, nbytes) in probes.items()}
    bandwidth = max(bandwidths.values())
    bound = bandwidth / 28
    rows = [["", "ms", "Mparams/s", "GB/s (28 B/param)", "vs bound", "vs torch fused"]]
    for k, (_, nbytes) in probes.items():
        rows.append([f"probe {k} ({nbytes} B/elem)", f"{med[k] * 1e3:.2f}", "-", f"{bandwidths[k] / 1e9:.1f}", "-", "-"])
    for k in ("HostAdamW", "torch fused", "torch foreach"):
        rate = n / med[k]
        rows.append([k, f"{med[k] * 1e3:.2f}", f"{rate / 1e6:.0f}", f"{28 * rate / 1e9:.1f}", f"{rate / bound:.2f}",
                     f"{med['torch fused'] / med[k]:.2f}x"])
    print(table(rows))
    print("targets: >= 0.9 of the bound, >= 1.0x torch fused; median of interleaved reps")


if __name__ == "__main__":
    main()
