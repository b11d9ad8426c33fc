"""Pictures of a simulated step: a Gantt chart of the three streams over the device-memory curve."""

from __future__ import annotations

from pathlib import Path

from ooc.scheduler.simulate import SimResult

_COLORS = {
    "forward": "#4C72B0", "backward": "#DD8452", "recompute": "#C44E52", "outside": "#8C8C8C",
    "swap_out": "#55A868", "swap_in": "#8172B3", "release": "#000000", "stream_in": "#64B5CD",
    "decode": "#937860", "grad_out": "#DA8BC3", "exchange": "#CCB974", "update": "#8DA0CB", "share": "#A6D854",
    "param_in": "#E5C494",
}
_ROWS = ("compute", "d2h", "h2d", "net", "host")


def plot_timeline(result: SimResult, path: str | Path, *, title: str = "predicted step") -> None:
    """Write a PNG: one row per resource in use (compute, D2H, H2D, net, host), device bytes underneath."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never opens a window
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    used = {iv.resource.value for iv in result.timeline}
    rows = [r for r in _ROWS if r in used or r in ("compute", "d2h", "h2d")]
    fig, (gantt, memory) = plt.subplots(2, 1, figsize=(12, 5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for iv in result.timeline:
        kind = iv.label.split("/")[0]
        row = rows.index(iv.resource.value)
        width = (iv.end - iv.start) * 1e3
        if width > 0:
            gantt.barh(row, width, left=iv.start * 1e3, color=_COLORS.get(kind, "#999999"), edgecolor="white", linewidth=0.3)
    gantt.set_yticks(range(len(rows)), labels=rows)
    gantt.invert_yaxis()
    gantt.set_title(f"{title}: {result.step_time_s * 1e3:.2f} ms, peak {result.peak_bytes / 2**20:.1f} MiB")
    fig.legend(handles=[Patch(color=c, label=k) for k, c in _COLORS.items() if k != "release" and any(iv.label.split("/")[0] == k for iv in result.timeline)], ncol=6, fontsize=8,
               loc="lower center", frameon=False)
    if result.memory:
        times = [0.0] + [t * 1e3 for t, _ in result.memory]
        values = [0.0] + [b / 2**20 for _, b in result.memory]
        memory.step(times, values, where="post", color="#4C72B0")
        memory.fill_between(times, values, step="post", alpha=0.3, color="#4C72B0")
    memory.set_ylabel("device MiB")
    memory.set_xlabel("ms")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
