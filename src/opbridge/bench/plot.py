"""PNG plots of ``opbridge bench kernels`` results: bandwidth against bytes moved, per op.

One figure per op, one panel per dtype; x is the bytes a call moves (log
scale), y the bandwidth at the median time, one line per candidate, and the
STREAM copy bandwidth measured in the same run drawn across. matplotlib
(Agg backend) is imported only when plotting.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: candidate -> (colour, line style, marker); opbridge solid, torch dashed, the reference dotted.
STYLE: dict[str, tuple[str, str, str]] = {
    "opbridge_out": ("#d62728", "-", "o"),
    "opbridge_new": ("#ff7f0e", "-", "s"),
    "numpy_ref": ("#7f7f7f", ":", "x"),
    "eager_new": ("#1f77b4", "--", "s"),
    "eager_out": ("#17becf", "--", "o"),
    "compile_new": ("#2ca02c", "-.", "s"),
    "compile_out": ("#9467bd", "-.", "o"),
}
LABELS: dict[str, str] = {
    "opbridge_out": "opbridge, into a buffer",
    "opbridge_new": "opbridge, new output",
    "numpy_ref": "NumPy reference",
    "eager_new": "torch eager, new output",
    "eager_out": "torch eager, into a buffer",
    "compile_new": "torch.compile, new output",
    "compile_out": "torch.compile, into a buffer",
}


def _bytes_label(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def plot_op(op: str, cases: Sequence[dict[str, Any]], copy_gbps: float, path: Path,
            *, inplace: bool = False) -> Path:
    """Draw one op's bandwidth-vs-bytes figure from its case records and save it to *path*."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    dtypes = list(dict.fromkeys(c["dtype"] for c in cases))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.2 * len(dtypes), 4.6), sharey=True, squeeze=False)
    ymax = copy_gbps
    for ax, dtype in zip(axes[0], dtypes):
        mine = sorted((c for c in cases if c["dtype"] == dtype), key=lambda c: c["bytes"]["total"])
        names = [n for n in STYLE if any(n in c["candidates"] for c in mine)]
        for name in names:
            pts = [(c["bytes"]["total"], c["candidates"][name]["gbps"], c["size"]) for c in mine
                   if name in c["candidates"]]
            colour, ls, marker = STYLE[name]
            label = LABELS[name]
            if name == "opbridge_out" and inplace:
                label = "opbridge, in place"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colour, linestyle=ls, marker=marker,
                    linewidth=1.8 if name.startswith("opbridge") else 1.3, markersize=5, label=label)
            ymax = max(ymax, *(p[1] for p in pts))
        local = [(c["bytes"]["total"], c["stream_copy_local"]["gbps"]) for c in mine if c.get("stream_copy_local")]
        if local:
            ax.plot([p[0] for p in local], [p[1] for p in local], color="black", linestyle="none", marker="D",
                    markersize=5, markerfacecolor="none", label="STREAM copy of the same bytes, interleaved")
            ymax = max(ymax, *(p[1] for p in local))
        ax.axhline(copy_gbps, color="black", linewidth=1.2, linestyle=(0, (6, 3)))
        ax.annotate(f"STREAM copy {copy_gbps:.1f} GB/s", xy=(0.01, copy_gbps), xycoords=("axes fraction", "data"),
                    xytext=(2, 3), textcoords="offset points", fontsize=8)
        for c in mine:
            ax.axvline(c["bytes"]["total"], color="#dddddd", linewidth=0.8, zorder=0)
            ax.annotate(c["size"], xy=(c["bytes"]["total"], 1.0), xycoords=("data", "axes fraction"),
                        xytext=(2, -10), textcoords="offset points", fontsize=8, color="#666666")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: _bytes_label(v)))
        ax.set_xlabel("bytes moved per call (inputs read + outputs written)")
        ax.set_title(f"{op}, {dtype}")
        ax.grid(True, which="major", axis="y", color="#eeeeee")
        if len(mine) == 1:
            x = mine[0]["bytes"]["total"]
            ax.set_xlim(x / 3, x * 3)
    axes[0][0].set_ylabel("GB/s at the median time")
    axes[0][0].set_ylim(0, ymax * 1.12)
    handles, labels = [], []
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    ncol = max(1, min(4, 2 * len(dtypes), len(labels)))  # a one-panel figure (one dtype) fits two per line
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.02 + 0.045 * -(-len(labels) // ncol), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(result: dict[str, Any], folder: Path) -> list[Path]:
    """One PNG per op of a ``bench kernels`` result, written into *folder*; returns their paths."""
    copy = result["stream"]["copy_gbps"]
    paths = []
    for op in dict.fromkeys(c["op"] for c in result["cases"]):
        cases = [c for c in result["cases"] if c["op"] == op]
        inplace = any(r["mode"] == "inplace" for c in cases for r in c["candidates"].values()
                      if r is c["candidates"].get("opbridge_out"))
        paths.append(plot_op(op, cases, copy, folder / f"{op}.png", inplace=inplace))
    return paths
