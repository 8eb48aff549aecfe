"""The text report of ``opbridge bench frameworks`` (:func:`format_text`); the run is :mod:`.frameworks`."""

from __future__ import annotations

from typing import Any

from opbridge.bench import fw_builds, parity_report
from opbridge.bench.report import files_line


def _f(x: float) -> str:
    return f"{x:.3g}" if x < 10 else f"{x:.1f}"


def _stats(row: dict[str, float]) -> str:
    return f"{_f(row['p20']):>7} {_f(row['p50']):>7} {_f(row['p80']):>7}"


def _calls(row: dict[str, Any]) -> str:
    """Calls per sample: one count, or opbridge's/native's where each sized its own (asynchronous)."""
    calls = row.get("calls", {})
    if len(set(calls.values())) > 1:
        return f"{calls['opbridge']}/{calls['native']}"
    return str(row["number"])


def _ratio(row: dict[str, Any]) -> str:
    """opbridge / native at the p50, from the stats (the stored ratio keeps 3 decimals: 0.000 for MindSpore's)."""
    x = row["stats_us"]["opbridge"]["p50"] / row["stats_us"]["native"]["p50"]
    return f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"


def _versions(doc: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in doc.get("versions", {}).items() if v and k != "opbridge")


def format_text(result: dict[str, Any]) -> str:
    """Render *result* as a readable report."""
    m, s = result["machine"], result["settings"]
    load = m.get("loadavg_at_start")
    lines = [
        "opbridge bench frameworks: " + ("the parity table, float32 and bfloat16, CPU" if "parity" in result else
                                         "opbridge.ops.<op> vs each framework's own op, float32, CPU"),
        f"machine: {m['cpu_model']}, {m['cpus_usable']} CPUs, python {m['python']}, tvm-ffi {m['tvm_ffi']}, "
        f"{m['date']}" + (f", load average {'/'.join(map(str, load))} at start" if load else ""),
        f"{s['rounds']} interleaved rounds per section; samples of ~{s['target_sample_ms']:g} ms "
        f"(at most {s['number']} calls); times are per call, µs",
    ]
    if s.get("ops"):
        lines.append(f"per-call ops (--ops): {', '.join(s['ops'])}")
    lines.append("")
    cold = result["cold_build"]
    if "seconds" in cold:
        samples = ", ".join(f"{x:.2f}" for x in cold["samples"])
        lines.append(f"op library: cold build {cold['seconds']:.2f} s wall, {cold['cpu_seconds']:.2f} s cpu "
                     f"(median of {len(cold['samples'])}: {samples} s; "
                     f"{len(cold['ops'])} ops, {len(cold['sources'])} sources)")
    else:
        lines.append(f"op library: cold build skipped ({cold['skipped']})")
    mod = result["module"]
    lines.append(f"  {mod['expected_path']}")
    for fw, path in mod["loaded_paths"].items():
        how = " (loaded explicitly: its own build key differs)" if fw in mod["pinned"] else ""
        lines.append(f"  {fw:<10} loaded {'that same file' if path == mod['expected_path'] else path}{how}")
    lines.append(f"  all workers loaded the same .so: {'yes' if mod['all_equal'] else 'NO'}")
    keys = [k for d in result["frameworks"].values()
            for part in ("sections", "skipped_sections", "errors") for k in d.get(part, {})]
    w = max([24, *map(len, keys)])
    header = (f"  {'section':<{w}} {'calls':>9}   {'opbridge p20/p50/p80':>23}   "
              f"{'native p20/p50/p80':>23}   ratio")
    for fw, doc in result["frameworks"].items():
        lines.append("")
        if "skipped" in doc:
            lines.append(f"{fw}: skipped ({doc['skipped']})")
            continue
        if "failed" in doc:
            lines.append(f"{fw}: worker FAILED ({doc['failed']})")
            lines += [f"    {ln}" for ln in doc.get("stderr_tail", "").splitlines()[-8:]]
            continue
        lines.append(f"{fw} ({_versions(doc)}; {doc['executable']})")
        if "parity" in doc:  # the per-call sections were not run (--parity)
            continue
        lines.append(header)
        natives = {}
        for key, row in doc["sections"].items():
            lines.append(f"  {key:<{w}} {_calls(row):>9}   {_stats(row['stats_us']['opbridge'])}   "
                         f"{_stats(row['stats_us']['native'])}   {_ratio(row)}")
            natives[key] = row["candidates"]["native"]
        for key, reason in doc.get("skipped_sections", {}).items():
            lines.append(f"  {key:<{w}} skipped: {reason}")
        for key, err in doc.get("errors", {}).items():
            lines.append(f"  {key:<{w}} ERROR: {err}")
        for key, native in natives.items():
            lines.append(f"    native {key}: {native}")
        notes = {row["sync"] for row in doc["sections"].values() if "sync" in row}
        lines += [f"    note: {n}" for n in sorted(notes)]
    lines.append("")
    lines += fw_builds.format_builds(result["builds"])
    if "parity" in result:
        lines += ["", *parity_report.format_table(result["parity"])]
        lines.append(f"  rows missing a target: {len(result['parity_misses'])} of {len(result['parity'])}")
    if "files" in result:
        lines += ["", files_line(result["files"])]
    if result["problems"]:
        lines.append("")
        lines.append("problems:")
        lines += [f"  {p}" for p in result["problems"]]
    return "\n".join(lines)
