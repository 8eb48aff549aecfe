"""Host-side logic of ``opbridge bench jax-gpu``: its records, ratios, misses, text report and CSV rows.

Nothing here imports JAX (or any framework), so all of it is tested without
a device. The measuring side is :mod:`opbridge.bench.jax_gpu`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opbridge.bench.report import closing_lines, sig
from opbridge.bench.timing import gbps

#: opbridge's candidate in every case; the peer's name depends on the section.
OURS = "opbridge"
#: Issue 12's targets: opbridge / peer at the p50, at most this.
TARGETS = {"per_call": 1.1, "large": 1.0}

CSV_FIELDS = ("section", "op", "dtype", "shape", "mode", "candidate", "p20_us", "p50_us", "p80_us", "number",
              "bytes", "gbps", "ratio", "target", "what")


def record(section: str, op: str, dtype: str, shape: Sequence[int], mode: str, peer: str,
           stats: dict[str, dict[str, float]], whats: dict[str, str], number: int,
           moved: int | None = None) -> dict[str, Any]:
    """The JSON record of one case from its timings.

    Parameters
    ----------
    section
        ``"per_call"`` or ``"large"`` (picks the target, :data:`TARGETS`).
    stats
        ``{candidate: {"p20", "p50", "p80" (µs), "rounds"}}`` of the candidates timed (those verified).
    whats
        ``{candidate: what it calls}`` of every candidate, timed or not.
    moved
        Bytes a kernel must move (each input read once, each output written once); None: no GB/s.

    ``ratio`` is opbridge's p50 over the peer's (<= ``target``: the target is
    met); None where either was not timed.
    """
    cands: dict[str, Any] = {}
    for name, what in whats.items():
        row: dict[str, Any] = {"what": what, "us": stats.get(name)}
        if moved is not None and name in stats:
            row["gbps"] = sig(gbps(moved, stats[name]["p50"]))
        cands[name] = row
    ratio = (sig(stats[OURS]["p50"] / stats[peer]["p50"]) if OURS in stats and peer in stats else None)
    target = TARGETS[section]
    return {"section": section, "op": op, "dtype": dtype, "shape": list(shape), "mode": mode, "peer": peer,
            "number": number, "bytes": moved, "candidates": cands, "ratio": ratio, "ratio_of": f"{OURS} / {peer}",
            "target": target, "meets_target": None if ratio is None else ratio <= target,
            "mismatches": [], "notes": []}


def label(rec: dict[str, Any]) -> str:
    """A case's name in reports: ``add eager`` (per call), ``add float32 4096x4096`` (large)."""
    if rec["section"] == "per_call":
        return f"{rec['op']} {rec['mode']}"
    return f"{rec['op']} {rec['dtype']} {'x'.join(map(str, rec['shape']))}"


def ratios(per_call: Sequence[dict[str, Any]], large: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{"per_call": {label: ratio}, "large": {label: ratio}}``: every case's opbridge / peer at a glance."""
    return {"per_call": {label(r): r["ratio"] for r in per_call}, "large": {label(r): r["ratio"] for r in large}}


def problems(records: Sequence[dict[str, Any]]) -> list[str]:
    """One line per candidate that disagreed with the float64 reference (or, opbridge's, failed to run)."""
    return [f"{label(r)}: {m['candidate']} disagrees with the float64 reference" for r in records
            for m in r["mismatches"]]


def misses(records: Sequence[dict[str, Any]]) -> list[str]:
    """One line per case whose ratio misses its target (reported; not a failure of the command)."""
    return [f"{label(r)}: {r['ratio_of']} = {r['ratio']:.3f} > {r['target']}" for r in records
            if r["meets_target"] is False]


def csv_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per case and candidate."""
    rows = []
    for rec in [*result.get("per_call", []), *result.get("large", [])]:
        for name, c in rec["candidates"].items():
            us = c["us"] or {}
            rows.append({"section": rec["section"], "op": rec["op"], "dtype": rec["dtype"],
                         "shape": "x".join(map(str, rec["shape"])), "mode": rec["mode"], "candidate": name,
                         "p20_us": us.get("p20", ""), "p50_us": us.get("p50", ""), "p80_us": us.get("p80", ""),
                         "number": rec["number"], "bytes": rec["bytes"] or "", "gbps": c.get("gbps", ""),
                         "ratio": rec["ratio"] if name == OURS and rec["ratio"] is not None else "",
                         "target": rec["target"], "what": c["what"]})
    return rows


def _us(c: dict[str, Any] | None) -> str:
    us = (c or {}).get("us")
    text = "-" if not us else f"{us['p50']:.2f} ({us['p20']:.2f}-{us['p80']:.2f})"
    return f"{text:>26}"


def _verdict(rec: dict[str, Any]) -> str:
    if rec["ratio"] is None:
        return f"{'-':>7}  -"
    return f"{rec['ratio']:>6.3f}x  {'met' if rec['meets_target'] else 'MISSED'} (<= {rec['target']})"


def _case_lines(rec: dict[str, Any]) -> list[str]:
    lines = [f"  MISMATCH {m['candidate']} (not timed): {m['message']}" for m in rec["mismatches"]]
    return lines + [f"  note: {n}" for n in rec["notes"]]


def format_text(result: dict[str, Any]) -> str:
    """A readable report of a ``bench jax-gpu`` result."""
    if isinstance(result.get("skipped"), str):
        return f"opbridge bench jax-gpu: skipped: {result['skipped']}"
    dev, v = result["device"], result["versions"]
    lines = [f"JAX device: {dev['description']} ({dev['platform']}); jax {v['jax']}, jaxlib {v['jaxlib']}, "
             f"jax-tvm-ffi {v['jax-tvm-ffi']}; {result['settings']['rounds']} interleaved rounds",
             "p50 µs per call (p20-p80), wall clock to block_until_ready(); ratio = opbridge / peer at the p50"]
    if result["per_call"]:
        lines += ["", f"per call ({'x'.join(map(str, result['settings']['per_call_shape']))}, float32): eager "
                      f"opbridge.ops.<op> vs the jnp formula op by op; jit: jax.jit of each",
                  f"{'op':<10} {'mode':<6} {'opbridge us':>26} {'jnp us':>26}  ratio"]
        for rec in result["per_call"]:
            c = rec["candidates"]
            lines.append(f"{rec['op']:<10} {rec['mode']:<6} {_us(c.get(OURS))} {_us(c.get(rec['peer']))}  "
                         f"{_verdict(rec)}")
            lines += _case_lines(rec)
    if result["large"]:
        copies = result["settings"].get("copies", 1)
        per = f" ({copies} copies of the arguments per jitted call; times per op)" if copies > 1 else ""
        lines += ["", f"large, under jax.jit{per}: opbridge vs XLA's fusion of the same formula; GB/s at the p50 "
                      "(each input read once, each output written once)",
                  f"{'op':<19} {'dtype':<9} {'shape':<11} {'opbridge us':>26} {'GB/s':>6} {'xla us':>26} "
                  f"{'GB/s':>6}  ratio"]
        for rec in result["large"]:
            c = rec["candidates"]
            ours, peer = c.get(OURS) or {}, c.get(rec["peer"]) or {}
            lines.append(f"{rec['op']:<19} {rec['dtype']:<9} {'x'.join(map(str, rec['shape'])):<11} "
                         f"{_us(ours)} {ours.get('gbps', 0):>6.0f} {_us(peer)} {peer.get('gbps', 0):>6.0f}  "
                         f"{_verdict(rec)}")
            lines += _case_lines(rec)
    lines += [f"skipped {name}: {why}" for name, why in result.get("skipped_ops", {}).items()]
    if result.get("misses"):
        lines += ["", f"targets missed ({len(result['misses'])}; reported, not a failure):"]
        lines += [f"  {m}" for m in result["misses"]]
    lines += closing_lines(result, skipped_ops=False)
    return "\n".join(lines)


__all__ = ["CSV_FIELDS", "OURS", "TARGETS", "csv_rows", "format_text", "label", "misses", "problems", "ratios",
           "record"]
