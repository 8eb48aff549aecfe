"""The text report and CSV rows of a ``bench gpu`` result."""

from __future__ import annotations

from typing import Any

from opbridge.bench.report import closing_lines

CSV_FIELDS = ("op", "size", "rows_cols", "dtype", "candidate", "mode", "graph_p50_us", "eager_p50_us", "bytes",
              "gbps", "gbps_eager", "copy_fraction", "speedup_vs_opbridge", "what")


def csv_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per case and candidate."""
    rows = []
    for r in result.get("results", []):
        for name, c in r["candidates"].items():
            rows.append({"op": r["op"], "size": r["size"], "rows_cols": "x".join(map(str, r["rows_cols"])),
                         "dtype": r["dtype"], "candidate": name, "mode": c["mode"],
                         "graph_p50_us": (c["graph_us"] or {}).get("p50", ""), "eager_p50_us": c["eager_us"]["p50"],
                         "bytes": r["bytes"], "gbps": c["gbps"], "gbps_eager": c["gbps_eager"],
                         "copy_fraction": c.get("copy_fraction", ""),
                         "speedup_vs_opbridge": c.get("speedup_vs_opbridge", ""), "what": c["what"]})
    return rows


def _us(stats: dict[str, float] | None) -> str:
    return f"{'-':>9}" if stats is None else f"{stats['p50']:>9.2f}"


def format_text(result: dict[str, Any]) -> str:
    """A readable report of a ``bench gpu`` result."""
    if isinstance(result.get("skipped"), str):
        return f"opbridge bench gpu: skipped: {result['skipped']}"
    gpu, copy = result["gpu"], result["copy"]
    lines = [
        f"GPU: {gpu['name']} (compute capability {gpu['capability']}, {gpu['memory_gib']} GiB, "
        f"torch CUDA {gpu['torch_cuda']}); Liger-Kernel: {result['liger']}",
        f"copy bandwidth (empty_like(x).copy_(x), 1 GiB): {copy['before']['gbps']:.0f} GB/s before, "
        f"{copy['after']['gbps']:.0f} GB/s after; reference {copy['reference_gbps']:.0f} GB/s",
        "per-call p50 in µs, in a CUDA graph (kernels alone) and eager (launch included); GB/s at the graph "
        "p50 (eager where no graph); speed-up = theirs / ours, same mode (an in-place op's one form where "
        "it has no other)",
        "",
        f"{'op':<21} {'size':<10} {'dtype':<9} {'candidate':<13} {'mode':<8} {'graph us':>9} {'eager us':>9} "
        f"{'GB/s':>7} {'copy':>5} {'speed-up':>8}",
    ]
    for rec in result["results"]:
        for name, c in rec["candidates"].items():
            sp = c.get("speedup_vs_opbridge")
            lines.append(f"{rec['op']:<21} {rec['size']:<10} {rec['dtype']:<9} {name:<13} {c['mode']:<8} "
                         f"{_us(c['graph_us'])} {_us(c['eager_us'])} {c['gbps']:>7.0f} "
                         f"{c.get('copy_fraction', 0.0):>5.2f} {'' if sp is None else f'{sp:.2f}x':>8}")
        for m in rec.get("mismatches", []):
            lines.append(f"  MISMATCH {m['candidate']} (not timed): {m['message']}")
        lines += [f"  note: {n}" for n in rec.get("notes", [])]
    lines += standing_lines(result.get("standing"))
    lines += closing_lines(result)
    return "\n".join(lines)


def standing_lines(standing: dict[str, Any] | None) -> list[str]:
    """The report's closing summary of the cases in which a peer was faster (``cases.standing``)."""
    if not standing or not standing["cases"]:
        return []
    behind, n = standing["behind"], standing["cases"]
    if not behind:
        return ["", f"ahead of or level with every peer in all {n} cases"]
    lines = ["", f"ahead of or level with every peer in {n - len(behind)} of {n} cases; behind in {len(behind)} "
                 "(the fastest peer's time / ours, same mode):"]
    lines += [f"  {b['op']:<21} {b['size']:<10} {b['dtype']:<9} {b['ratio']:.3f}  {b['peer']} "
              f"{b['peer_us']:.2f} us against {b['opbridge_us']:.2f} us ({b['mode']})" for b in behind]
    return lines
