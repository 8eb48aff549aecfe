"""Host-side logic of ``opbridge bench gpu``: which cases run, what counts as right, GB/s.

Nothing here needs a GPU (or imports torch at module load), so all of it is
unit-tested on the CPU: the case list, the tolerance that grows with a
result's reduction length, the bandwidth arithmetic and the records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opbridge.bench.report import sig
from opbridge.bench.timing import gbps

#: Rows of the serving sizes: one token (decode), a small batch, a prefill chunk, a large prefill.
SERVING_ROWS = (1, 8, 256, 4096)
#: ``--quick``: one small and one large batch.
QUICK_ROWS = (8, 4096)
#: Hidden size of the serving sizes (Llama-3 8B).
HIDDEN = 4096
#: Intermediate size of the gated MLP ops (Llama-3 8B): their ``x`` is ``(rows, 2 * INTERMEDIATE)``.
INTERMEDIATE = 14336
#: The large size, beyond every cache.
LARGE = (8192, 8192)


def is_gated(op_name: str) -> bool:
    """Whether *op_name* is a gated MLP activation (``silu_and_mul``, ``gelu_and_mul``, their backward)."""
    return "_and_mul" in op_name


@dataclass(frozen=True)
class Size:
    """One benchmark size: a label for the report and the workload's ``(rows, cols)``."""

    label: str
    rows_cols: tuple[int, int]


def sizes_for(op_name: str, rows: Sequence[int], large: tuple[int, int] | None) -> list[Size]:
    """The sizes *op_name* runs at: serving rows of the hidden (or gated intermediate) width, then *large*.

    A gated op's size is its ``x``: ``(rows, 2 * INTERMEDIATE)``; every other
    op's is ``(rows, HIDDEN)``.
    """
    cols = 2 * INTERMEDIATE if is_gated(op_name) else HIDDEN
    out = [Size(f"rows={r}", (r, cols)) for r in rows]
    if large is not None:
        out.append(Size("large", tuple(large)))  # type: ignore[arg-type]
    return out


def record(op: str, dtype: str, size: Size, moved: int, stats: dict[str, dict[str, Any]],
           whats: dict[str, tuple[str, str]], pairs: dict[str, str]) -> dict[str, Any]:
    """The JSON record of one case from its timings.

    Parameters
    ----------
    stats
        ``{candidate: {"eager": summary µs, "graph": summary µs or None, "number": ..., "graph_number": ...,
        "graph_skipped": reason}}``.
    whats
        ``{candidate: (mode, what)}``.
    pairs
        ``{competitor: the opbridge candidate of the same mode}``. Where the case has one opbridge
        candidate only (an in-place op), every competitor is compared with it. A competitor's ``vs``
        names the candidate its speed-ups are against.

    GB/s is bytes over the median time inside a CUDA graph where there is
    one (the kernel alone), else over the eager median.
    """
    cands: dict[str, Any] = {}
    for name, st in stats.items():
        mode, what = whats[name]
        best = st["graph"] or st["eager"]
        row: dict[str, Any] = {"mode": mode, "what": what, "eager_us": st["eager"], "graph_us": st["graph"],
                               "number": st["number"], "graph_number": st.get("graph_number"),
                               "gbps": sig(gbps(moved, best["p50"])),
                               "gbps_eager": sig(gbps(moved, st["eager"]["p50"]))}
        if st.get("graph_skipped"):
            row["graph_skipped"] = st["graph_skipped"]
        cands[name] = row
    ours = [n for n in cands if n.startswith("opbridge_")]
    for name, base in pairs.items():
        if name in cands and base not in cands and len(ours) == 1:
            base = ours[0]  # an in-place op's one form (fused_add_rms_norm): against peers that write new outputs
        if name in cands and base in cands:
            cands[name]["vs"] = base
            cands[name]["speedup_vs_opbridge"] = sig(_p50(cands[name]) / _p50(cands[base]))
            cands[name]["speedup_vs_opbridge_eager"] = sig(cands[name]["eager_us"]["p50"]
                                                           / cands[base]["eager_us"]["p50"])
    return {"op": op, "dtype": dtype, "size": size.label, "rows_cols": list(size.rows_cols), "bytes": moved,
            "candidates": cands}


def _p50(row: dict[str, Any]) -> float:
    return float((row["graph_us"] or row["eager_us"])["p50"])


def problems(results: Sequence[dict[str, Any]]) -> list[str]:
    """One line per candidate that disagreed with the float64 reference, over every case."""
    return [f"{r['op']} {r['size']} {r['dtype']}: {m['candidate']} disagrees with the float64 reference"
            for r in results for m in r.get("mismatches", [])]


def standing(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Where opbridge stands against its peers (issue 12's "at least as fast as every peer"), over every case.

    ``{"cases": n, "behind": [...]}``: one entry per case in which some peer
    (torch eager, torch.compile, Liger-Kernel) ran faster than opbridge's
    candidate of the same mode (an in-place op's one form where it has no
    other: ``record``'s ``vs``), with the fastest such peer, ``ratio`` = its
    time / ours (below 1: we trail it; inside a CUDA graph where both were
    timed there), both times and the mode; slowest first. A case with a
    mismatch counts as it was timed (``problems`` reports the mismatch).
    """
    behind = []
    for r in results:
        peers = [(c["speedup_vs_opbridge"], name, c) for name, c in r["candidates"].items()
                 if c.get("speedup_vs_opbridge") is not None]
        if not peers:
            continue
        ratio, name, c = min(peers, key=lambda p: p[0])
        if ratio < 1.0:
            base = r["candidates"][c.get("vs") or _ours_of_mode(r["candidates"], c["mode"])]
            mode = c["mode"] if base["mode"] == c["mode"] else f"{c['mode']} vs {base['mode']}"
            behind.append({"op": r["op"], "size": r["size"], "dtype": r["dtype"], "peer": name, "mode": mode,
                           "ratio": ratio, "peer_us": _p50(c), "opbridge_us": _p50(base)})
    behind.sort(key=lambda b: b["ratio"])
    return {"cases": len(results), "behind": behind}


def _ours_of_mode(cands: dict[str, Any], mode: str) -> str:
    """The opbridge candidate of *mode*: what a competitor was compared with in a result saved before ``vs``."""
    return next(n for n, c in cands.items() if n.startswith("opbridge_") and c["mode"] == mode)
