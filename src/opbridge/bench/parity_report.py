"""The report of the parity rows that :mod:`opbridge.bench.parity` measures (``parity.py``).

The text table (:func:`format_table`), one CSV row per parity row (:func:`csv_rows`,
:data:`CSV_FIELDS`) and the targets of issue 21 a row misses (:func:`misses`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opbridge.bench.parity import TARGET_NUMPY
from opbridge.bench.parity_timing import oversubscribed

CSV_FIELDS = ("framework", "op", "shape", "dtype", "baseline", "numpy_us", "framework_us", "native_us",
              "framework_over_numpy", "framework_over_numpy_p20", "framework_over_numpy_fw_memory",
              "framework_over_numpy_fresh", "framework_out_over_numpy", "framework_over_native", "faults_numpy",
              "faults_framework", "faults_native", "rounds", "number", "verified", "native_max_abs_diff",
              "native_unavailable", "error", "kernel_threads", "omp_num_threads", "cpus", "loadavg_before",
              "loadavg_after")


def misses(row: dict[str, Any]) -> list[str]:
    """The targets *row* misses (issue 21), as short phrases."""
    out = []
    r = row.get("framework_over_numpy")
    if r is not None and r > TARGET_NUMPY:
        out.append(f"> {TARGET_NUMPY}x NumPy")
    if row["framework"] == "jax" and row.get("framework_over_native", 0) > 1.0:
        out.append("slower than XLA's fusion")
    return out


def csv_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One CSV row (:data:`CSV_FIELDS`) per parity row."""
    out = []
    for r in rows:
        st, fl = r.get("stats_us", {}), r.get("faults_per_call", {})
        out.append({
            "framework": r["framework"], "op": r["op"], "shape": "x".join(map(str, r["shape"])),
            "dtype": r["dtype"], "baseline": r["baseline"],
            **{f"{k}_us": st.get(k, {}).get("p50") for k in ("numpy", "framework", "native")},
            "framework_over_numpy": r.get("framework_over_numpy"),
            "framework_over_numpy_p20": r.get("framework_over_numpy_p20"),
            "framework_over_numpy_fw_memory": r.get("framework_over_numpy_fw_memory"),
            "framework_over_numpy_fresh": r.get("framework_over_numpy_fresh"),
            "framework_out_over_numpy": r.get("framework_out_over_numpy"),
            "framework_over_native": r.get("framework_over_native", r.get("numpy_over_native")),
            **{f"faults_{k}": fl.get(k) for k in ("numpy", "framework", "native")},
            "rounds": r.get("rounds"), "number": _number(r.get("number")), "verified": r.get("verified"),
            "native_max_abs_diff": r.get("native_max_abs_diff"),
            "native_unavailable": r.get("native_unavailable"), "error": r.get("error"),
            **{k: r.get(k) for k in ("kernel_threads", "omp_num_threads", "cpus", "loadavg_before", "loadavg_after")},
        })
    return out


def _number(n: Any) -> Any:
    """Calls per sample for the CSV: ``name=n`` per candidate (a plain count from older documents)."""
    return " ".join(f"{k}={v}" for k, v in n.items()) if isinstance(n, dict) else n


def _ms(st: dict[str, Any], key: str) -> str:
    return f"{st[key]['p50'] / 1e3:8.2f}" if key in st else f"{'-':>8}"


def _x(v: float | None) -> str:
    return f"{v:6.2f}x" if v is not None else f"{'-':>7}"


def format_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The parity table as text lines."""
    lines = [
        "parity: opbridge.ops.<op>, a new output per call; medians in ms; fw/np = framework path / NumPy "
        f"path (target <= {TARGET_NUMPY}x), p20 = the same for the fastest fifth of the samples, "
        "fw/own = framework path / the framework's own formula (JAX: "
        "XLA's fusion under jax.jit, target <= 1); fw/npv = framework path / NumPy path on views of the "
        "framework's own input memory; minor page faults per call (numpy/framework/own)",
        f"  {'framework':<10}{'op':<9}{'shape':<10}{'dtype':<9}{'numpy':>8}{'framework':>10}{'own':>9}"
        f"{'fw/np':>8}{'p20':>8}{'fw/npv':>8}{'fw/own':>8}   {'faults np/fw/own':<22}target",
    ]
    notes: set[str] = set()
    for r in rows:
        head = f"  {r['framework']:<10}{r['op']:<9}{'x'.join(map(str, r['shape'])):<10}{r['dtype']:<9}"
        if "error" in r:
            lines.append(f"{head}ERROR: {r['error']}")
            continue
        st, fl = r["stats_us"], r["faults_per_call"]
        faults = "/".join(f"{fl[k]:.0f}" if k in fl else "-" for k in ("numpy", "framework", "native"))
        miss = misses(r)
        lines.append(f"{head}{_ms(st, 'numpy')}  {_ms(st, 'framework')}{_ms(st, 'native')} "
                     f"{_x(r.get('framework_over_numpy'))} {_x(r.get('framework_over_numpy_p20'))} "
                     f"{_x(r.get('framework_over_numpy_fw_memory'))} "
                     f"{_x(r.get('framework_over_native', r.get('numpy_over_native')))}   "
                     f"{faults:<22}{'MISS: ' + ', '.join(miss) if miss else 'ok'}")
        if r["baseline"] not in ("numpy", "numpy (ml_dtypes bfloat16)"):
            notes.add(f"{r['framework']} {r['dtype']}: NumPy-path baseline is {r['baseline']}")
        if "native_unavailable" in r:
            notes.add(f"{r['framework']} {r['dtype']} {r['op']}: no own formula ({r['native_unavailable']})")
    lines += [f"  note: {n}" for n in sorted(notes)]
    lines += _fresh_notes(rows)
    lines += _load_notes(rows)
    return lines


def _fresh_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Under jax.jit XLA allocates each output fresh: the jitted path against the NumPy path on fresh memory."""
    out = []
    for shape in sorted({tuple(r["shape"]) for r in rows}):
        jax_rows = [r for r in rows if r["framework"] == "jax" and tuple(r["shape"]) == shape]
        got = [r["framework_over_numpy_fresh"] for r in jax_rows if "framework_over_numpy_fresh" in r]
        if got:
            out.append(f"  note: jax under jax.jit at {shape[0]}x{shape[1]} / the NumPy path with a fresh np.empty "
                       f"output (how XLA allocates a jitted program's outputs, and NumPy's before the pool): "
                       f"{min(got):.2f}-{max(got):.2f}x")
        donated = [r["framework_out_over_numpy"] for r in jax_rows if "framework_out_over_numpy" in r]
        if donated:
            out.append(f"  note: jax under jax.jit at {shape[0]}x{shape[1]} with out= a donated array (no fresh "
                       f"output) / the NumPy path: {min(donated):.2f}-{max(donated):.2f}x")
    return out


def _load_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Notes on the kernels' threads and on rows timed beside more work than the CPUs could run."""
    timed = [r for r in rows if "error" not in r and "cpus" in r]
    threads: dict[str, set[int]] = {}
    for r in timed:
        if r.get("kernel_threads") is not None:
            threads.setdefault(r["framework"], set()).add(r["kernel_threads"])
    out = ["  note: kernel threads (OpenMP, as the kernels see it): " + ", ".join(
        f"{fw} {'/'.join(map(str, sorted(n)))}" for fw, n in threads.items())] if threads else []
    over = [r for r in timed if oversubscribed(r)]
    if over:
        peak = max(x for r in over for x in (r.get("loadavg_before"), r.get("loadavg_after")) if x is not None)
        out.append(f"  note: {len(over)} of {len(timed)} rows were timed with the 1-minute load average above "
                   f"the {over[0]['cpus']} usable CPUs (up to {peak:g}): a kernel's OpenMP join then waits out "
                   f"scheduler slices on every path alike, which sets their medians more than any adapter "
                   f"does; OMP_WAIT_POLICY=passive (or OMP_NUM_THREADS=1) gives ratios that hold under load")
    return out
