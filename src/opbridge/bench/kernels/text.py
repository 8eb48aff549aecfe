"""The text, CSV and summary of a ``bench kernels`` result."""

from __future__ import annotations

from typing import Any

from opbridge.bench.candidates import (
    COMPILE_NEW,
    COMPILE_OUT,
    EAGER_NEW,
    EAGER_OUT,
    OURS_NEW,
    OURS_OUT,
    REF,
)
from opbridge.bench.kernels.options import LOCAL_CEILING_BYTES
from opbridge.bench.report import files_line, fmt_x, sig

#: ours -> the competitors it is compared with (same mode)
PAIRS = {OURS_OUT: (EAGER_OUT, COMPILE_OUT), OURS_NEW: (EAGER_NEW, COMPILE_NEW, REF)}

def speedups(case: dict[str, Any], mutating: bool) -> dict[str, dict[str, Any]]:
    cands = case["candidates"]
    out: dict[str, dict[str, Any]] = {}
    for ours, rivals in PAIRS.items():
        mine = ours if ours in cands else (OURS_OUT if mutating and OURS_OUT in cands else None)
        if mine is None:
            continue
        for r in rivals:
            if r in cands:
                out[r] = {"ours": mine, "speedup": sig(cands[r]["p50_us"] / cands[mine]["p50_us"]),
                          "speedup_p20": sig(cands[r]["p20_us"] / cands[mine]["p20_us"])}
    return out


def summarize(cases: list[dict[str, Any]]) -> dict[str, Any]:
    def get(op: str, size: str, dtype: str) -> dict[str, Any] | None:
        return next((c for c in cases if c["op"] == op and c["size"] == size and c["dtype"] == dtype), None)

    ops = list(dict.fromkeys(c["op"] for c in cases))
    sizes = list(dict.fromkeys(c["size"] for c in cases))
    dtypes = list(dict.fromkeys(c["dtype"] for c in cases))
    frac: dict[str, Any] = {}
    frac_run: dict[str, Any] = {}
    new_vs_eager: dict[str, Any] = {}
    vs_compile: dict[str, Any] = {}
    small: dict[str, Any] = {}
    ceiling: dict[str, Any] = {}
    for op in ops:
        c = get(op, "large", "float32")
        if c is not None:
            cc = c["candidates"]
            names = [n for n in (OURS_OUT, EAGER_OUT, COMPILE_OUT) if n in cc]
            frac[op] = {n: cc[n].get("frac_stream_copy_local", cc[n]["frac_stream_copy"]) for n in names}
            frac_run[op] = {n: cc[n]["frac_stream_copy"] for n in names}
        for d in dtypes:
            c = get(op, "large", d)
            if c is not None and EAGER_NEW in c["speedups"]:
                new_vs_eager.setdefault(op, {})[d] = c["speedups"][EAGER_NEW]["speedup"]
            c = get(op, "small", d)
            if c is not None:
                small.setdefault(op, {})[d] = {k: c["speedups"][r]["speedup"]
                                               for k, r in (("new", EAGER_NEW), ("out", EAGER_OUT))
                                               if r in c["speedups"]}
                if c.get("cache_copies"):
                    floor = min(r["p50_us"] for r in c["cache_copies"].values())
                    ceiling.setdefault(op, {})[d] = {k: sig(c["candidates"][r]["p50_us"] / floor)
                                                     for k, r in (("new", EAGER_NEW), ("out", EAGER_OUT))
                                                     if r in c["candidates"]}
            for sz in sizes:
                c = get(op, sz, d)
                if c is not None:
                    row = {k: c["speedups"][r]["speedup"] for k, r in (("new", COMPILE_NEW), ("out", COMPILE_OUT))
                           if r in c["speedups"]}
                    if row:
                        vs_compile.setdefault(op, {}).setdefault(sz, {})[d] = row
    return {"large_float32_frac_stream_copy": frac, "large_float32_frac_stream_copy_run": frac_run,
            "large_new_speedup_vs_eager": new_vs_eager,
            "speedup_vs_compile": vs_compile, "small_speedup_vs_eager": small,
            "small_ceiling_vs_eager": ceiling, "float64_vs_float32": float64_vs_float32(cases)}


#: float64 is compared with float32 at sizes whose float32 case moves at least this many bytes: those
#: that time a copy of their own bytes by default (the local copy ceiling).
FLOAT64_MIN_BYTES = LOCAL_CEILING_BYTES
#: What each ``"ceiling"`` of the float64-vs-float32 table means.
CEILINGS = {
    "local": "a copy of the case's own bytes (an in-place update of one array for ops that update their "
             "arguments in place; run's threads, split into chunks as the kernels split their work), timed "
             "interleaved with its candidates",
    "run": "the run's STREAM copy (large arrays, before and after the cases): --local-stream-mib was "
           "raised above this case's bytes",
}


def _ours(case: dict[str, Any]) -> dict[str, Any] | None:
    """opbridge's into-a-buffer (or in-place) row of *case*, else its new-output row."""
    cands: dict[str, dict[str, Any]] = case["candidates"]
    return cands.get(OURS_OUT) or cands.get(OURS_NEW)


def float64_vs_float32(cases: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{op: {size: {...}}}``: opbridge's fraction of the copy ceiling in float64 over float32's.

    float64 moves twice float32's bytes, so the fair measure is the fraction
    of a copy ceiling, not the time: a kernel as memory-bound in float64 as
    in float32 scores 1. Only sizes whose float32 case moves at least
    :data:`FLOAT64_MIN_BYTES`. Each dtype's fraction is against the copy of
    its own case's bytes timed interleaved with it (``"ceiling": "local"``),
    so a float32 case in cache is judged against an in-cache copy, and its
    float64 twin, twice the bytes, against a copy of twice the bytes.
    ``"ceiling_bytes"`` and ``"ceiling_gbps"`` (per dtype) say which copy,
    ``"ceiling_kind"`` whether it copies or, for an op that updates its
    arguments in place, updates one array in place; ``"ratio_p20"`` is the
    ratio from the p20 times, which a busy machine disturbs less than the
    medians. Where a case timed no such copy (``--local-stream-mib`` above
    its bytes) both fall back to the run's STREAM copy (``"ceiling":
    "run"``); see :data:`CEILINGS`.
    """
    by = {(c["op"], c["size"], c["dtype"]): c for c in cases}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (op, size, dtype), c32 in by.items():
        c64 = by.get((op, size, "float64"))
        if dtype != "float32" or c64 is None or c32["bytes"]["total"] < FLOAT64_MIN_BYTES:
            continue
        r32, r64 = _ours(c32), _ours(c64)
        if r32 is None or r64 is None:
            continue
        local = all("frac_stream_copy_local" in r for r in (r32, r64))
        key = "frac_stream_copy_local" if local else "frac_stream_copy"
        row: dict[str, Any] = {"float32": r32[key], "float64": r64[key], "ratio": sig(r64[key] / r32[key]),
                               "ceiling": "local" if local else "run"}
        if local:  # the same from the p20s: less of the time a busy machine takes away
            row["ratio_p20"] = sig(r64["frac_stream_copy_local_p20"] / r32["frac_stream_copy_local_p20"])
            pair = {"float32": c32["stream_copy_local"], "float64": c64["stream_copy_local"]}
            row["ceiling_bytes"] = {d: cp["bytes"] for d, cp in pair.items()}
            row["ceiling_gbps"] = {d: cp["gbps"] for d, cp in pair.items()}
            row["ceiling_kind"] = pair["float32"]["kind"]
        out.setdefault(op, {})[size] = row
    return out


CSV_FIELDS = ("op", "size", "shape", "dtype", "candidate", "mode", "p20_us", "p50_us", "p80_us", "rounds",
              "number", "bytes", "gbps", "frac_stream_copy", "frac_stream_copy_local", "frac_stream_copy_local_p20",
              "opbridge_speedup", "vs_ours", "what")


def csv_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per case and candidate (the CSV's content)."""
    rows = []
    for c in result["cases"]:
        shape = ";".join(f"{k}={'x'.join(map(str, v))}" for k, v in c["shapes"].items())
        for name, r in c["candidates"].items():
            sp = c["speedups"].get(name, {})
            rows.append({"op": c["op"], "size": c["size"], "shape": shape, "dtype": c["dtype"], "candidate": name,
                         "mode": r["mode"], "p20_us": r["p20_us"], "p50_us": r["p50_us"], "p80_us": r["p80_us"],
                         "rounds": r["rounds"], "number": r["number"], "bytes": c["bytes"]["total"],
                         "gbps": r["gbps"], "frac_stream_copy": r["frac_stream_copy"],
                         "frac_stream_copy_local": r.get("frac_stream_copy_local", ""),
                         "frac_stream_copy_local_p20": r.get("frac_stream_copy_local_p20", ""),
                         "opbridge_speedup": sp.get("speedup", ""), "vs_ours": sp.get("ours", ""),
                         "what": r["what"]})
    return rows


def format_text(result: dict[str, Any]) -> str:
    """Render *result* as a readable report: headline tables, memory, then every case."""
    m = result["machine"]
    st = result["stream"]
    k = st["passes"][0]["kernels"]
    lines = [
        f"opbridge bench kernels{' (--quick)' if result['quick'] else ''}",
        f"machine: {m['cpu_model']}, {m['cpus_usable']} CPUs, torch {m['torch']} ({m['torch_threads']} threads), "
        f"numpy {m['numpy']}, tvm-ffi {m['tvm_ffi']}, python {m['python']}, L3 {m.get('l3_cache')}, "
        f"{m['date']}; 1-min load average "
        f"{m['loadavg_1m_start_end'][0]} at the start, {m['loadavg_1m_start_end'][1]} at the end",
        f"STREAM ({st['passes'][0]['n']} floats, {st['passes'][0]['threads']} threads), GB/s p50 of the first "
        f"pass: " + ", ".join(f"{n} {v['gbps_p50']:.1f}" for n, v in k.items())
        + f"; copy reference (both passes) {st['copy_gbps']:.2f} GB/s",
        "speed-up = competitor p50 / opbridge p50 in the same mode (>1: opbridge faster)",
    ]
    loads = [x for x in m.get("loadavg_1m_start_end", []) if x is not None]
    if loads and max(loads) >= m["cpus_usable"]:
        lines.append(f"WARNING: the machine was busy (1-min load average up to {max(loads)} on {m['cpus_usable']} "
                     "CPUs): OpenMP-parallel calls wait for a descheduled team thread (milliseconds each), so "
                     "multi-threaded candidates at small sizes look far slower than on an idle machine")
    lines.append("")
    sm = result["summary"]
    if sm["large_float32_frac_stream_copy"]:
        lines.append("large float32, into an existing buffer / in place: fraction of STREAM copy, against a copy "
                     "of the same bytes timed interleaved (against the run's STREAM copy):")
        lines.append(f"  {'op':<22} {'opbridge':>14} {'eager':>14} {'compile':>14}")
        for op, row in sm["large_float32_frac_stream_copy"].items():
            run_row = sm["large_float32_frac_stream_copy_run"][op]
            lines.append(f"  {op:<22} " + " ".join(f"{row[n]:>6.2f} ({run_row[n]:.2f})" if n in row else f"{'-':>14}"
                                                    for n in (OURS_OUT, EAGER_OUT, COMPILE_OUT)))
        lines.append("")
    if sm.get("float64_vs_float32"):
        lines.append("float64 beside float32, opbridge into a buffer / in place: fraction of the copy ceiling, "
                     "and float64's over float32's (in brackets: from the p20 times; sizes moving >= "
                     f"{FLOAT64_MIN_BYTES / 2**20:g} MiB in float32); ceiling: {CEILINGS['local']} (its MiB and "
                     f"GB/s, float32 / float64), or * {CEILINGS['run']}:")
        lines.append(f"  {'op':<22} {'size':<8} {'float32':>8} {'float64':>8} {'ratio':>6} {'(p20)':>6}  ceiling")
        for op, by_size in sm["float64_vs_float32"].items():
            for sz, r in by_size.items():
                mark = "" if r["ceiling"] == "local" else "*"
                if r["ceiling"] == "local":
                    mib, gb = r["ceiling_bytes"], r["ceiling_gbps"]
                    what = "copy" if r["ceiling_kind"] == "copy" else "in-place update"
                    where = (f"local {what} {mib['float32'] / 2**20:.1f} / {mib['float64'] / 2**20:.1f} MiB at "
                             f"{gb['float32']:.1f} / {gb['float64']:.1f} GB/s")
                else:
                    where = "the run's STREAM copy"
                p20 = f"({r['ratio_p20']:.2f})" if "ratio_p20" in r else ""
                lines.append(f"  {op:<22} {sz:<8} {r['float32']:>7.2f}{mark:1} {r['float64']:>7.2f}{mark:1} "
                             f"{r['ratio']:>6.2f} {p20:>6}  {where}")
        lines.append("")
    if sm["large_new_speedup_vs_eager"]:
        lines.append("large, new output: opbridge speed-up vs torch eager (in-place ops: their in-place call):")
        for op, row in sm["large_new_speedup_vs_eager"].items():
            lines.append(f"  {op:<22} " + "  ".join(f"{d} {fmt_x(v)}" for d, v in row.items()))
        lines.append("")
    if sm["speedup_vs_compile"]:
        lines.append("speed-up vs torch.compile (Inductor), new output / into a buffer:")
        for op, by_size in sm["speedup_vs_compile"].items():
            for sz, by_dt in by_size.items():
                cells = "  ".join(f"{d} {fmt_x(r.get('new'))} / {fmt_x(r.get('out'))}" for d, r in by_dt.items())
                lines.append(f"  {op:<22} {sz:<6} {cells}")
        lines.append("")
    if sm["small_speedup_vs_eager"]:
        lines.append("small: opbridge speed-up vs torch eager, new output / into a buffer:")
        for op, by_dt in sm["small_speedup_vs_eager"].items():
            cells = "  ".join(f"{d} {fmt_x(r.get('new'))} / {fmt_x(r.get('out'))}" for d, r in by_dt.items())
            lines.append(f"  {op:<22} {cells}")
        lines.append("")
    if sm.get("small_ceiling_vs_eager"):
        lines.append("small: the most any kernel could beat torch eager by, new output / into a buffer: eager's time "
                     "over the fastest in-cache copy of the same bytes (one thread or the run's threads), call "
                     "overhead included:")
        for op, by_dt in sm["small_ceiling_vs_eager"].items():
            cells = "  ".join(f"{d} {fmt_x(r.get('new'))} / {fmt_x(r.get('out'))}" for d, r in by_dt.items())
            lines.append(f"  {op:<22} {cells}")
        lines.append("")
    mem = result["memory"]
    if "rows" in mem:
        lines.append(f"peak memory beyond inputs and outputs, one call at {mem['size'][0]}x{mem['size'][1]} "
                     f"(MiB; x = multiples of the largest input):")
        lines.append(f"  method: {mem['method']}; resolution {mem['resolution']}")
        by: dict[tuple[str, str], dict[str, Any]] = {}
        for r in mem["rows"]:
            by.setdefault((r["op"], r["dtype"]), {})[r["candidate"]] = r
        names = [n for n in (OURS_OUT, OURS_NEW, REF, EAGER_NEW, EAGER_OUT)
                 if any(n in v for v in by.values())]
        lines.append(f"  {'op':<22} {'dtype':<11} " + " ".join(f"{n:>18}" for n in names))
        for (op, d), row in by.items():
            mem_cells = []
            for n in names:
                r = row.get(n)
                mem_cells.append(f"{'-':>18}" if r is None else
                                 f"{r['beyond_io_bytes'] / 2**20:>9.2f} ({r['beyond_io_vs_input']:.2f}x)")
            lines.append(f"  {op:<22} {d:<11} " + " ".join(mem_cells))
        for op, v in mem["ops"].items():
            allowed = "none" if v["kind"] == "forward" else "at most one"
            lines.append(f"  {op}: opbridge's worst {v['worst_beyond_io_vs_input']:.2f}x of its largest input, "
                         f"{v['worst_beyond_noise_vs_input']:.2f}x beyond the {mem['noise_floor_bytes'] // 1024} KiB "
                         f"noise floor ({v['kind']}: {allowed} input-sized temporary allowed) -> "
                         f"{'ok' if v['ok'] else 'EXCEEDED'}")
        lines.append("")
    lines.append("every case (p20 / p50 / p80 µs, GB/s at p50, fraction of the run's STREAM copy, of the "
                 "interleaved copy of the same bytes where timed, opbridge speed-up):")
    for c in result["cases"]:
        shapes = ", ".join(f"{k}={tuple(v)}" for k, v in c["shapes"].items())
        lines.append(f"  {c['op']} {c['size']} {c['dtype']}  [{shapes}; {c['bytes']['total'] / 2**20:.2f} MiB moved]"
                     + (f"  torch: {c['torch_variant']}" if c["torch_variant"] else ""))
        for n, r in c["candidates"].items():
            sp = c["speedups"].get(n)
            rel = f"{sp['speedup']:.2f}x vs {sp['ours']}" if sp else ""
            loc = f"{r['frac_stream_copy_local']:>5.2f}" if "frac_stream_copy_local" in r else f"{'':>5}"
            lines.append(f"    {n:<13} {r['mode']:<8} {r['p20_us']:>11.1f} {r['p50_us']:>11.1f} {r['p80_us']:>11.1f}"
                         f" {r['gbps']:>7.2f} {r['frac_stream_copy']:>5.2f} {loc}  {rel}")
        copies = {"stream copy": c["stream_copy_local"]} if c.get("stream_copy_local") else {}
        copies.update({f"copy {r['threads']} thr": r for r in c.get("cache_copies", {}).values()})
        for name, r in copies.items():
            lines.append(f"    {name:<13} {'same B':<8} {r['p20_us']:>11.1f} {r['p50_us']:>11.1f} "
                         f"{r['p80_us']:>11.1f} {r['gbps']:>7.2f}")
        for n, why in c["skipped"].items():
            lines.append(f"    {n:<13} skipped: {why}")
    for sk in result["skipped_ops"]:
        lines.append(f"  skipped op {sk['op']}: {sk['reason']}")
    lines += ["", f"{files_line(result['files'])}; wall time {result['wall_seconds']:.0f}s"]
    return "\n".join(lines)
