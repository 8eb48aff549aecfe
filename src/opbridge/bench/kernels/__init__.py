"""``opbridge bench kernels``: kernel throughput against the machine's own STREAM bandwidth.

For each op (the built-in forward ops and, when declared, the serving ops;
``--all-ops`` adds the backward ops), each size (small ``(8, 4096)``, large
``(4096, 4096)``, odd ``(257, 5125)``) and each dtype (float32, float64, bfloat16),
these candidates compute the same result. An op whose tensors have fixed
integer dtypes (``advance_step_flashattn``: int64 and int32) runs once per
size, labelled with those dtypes; ops with index arguments get valid values
from their workload (:mod:`.workloads`):

===============  =========  ====================================================================
candidate        mode       what is called
===============  =========  ====================================================================
``opbridge_out`` out        ``ops.<op>(..., out=buf)`` into an existing buffer
                 inplace    ``ops.<op>(...)`` for an op that mutates its arguments
``opbridge_new`` new        ``ops.<op>(...)``, a fresh output every call
``numpy_ref``    new        the op's NumPy reference on the same memory (float32, float64)
``eager_new``    new        torch eager, the native op or a formula (:mod:`.workloads`)
``eager_out``    out        torch eager into a buffer (``out=``), where torch can
``compile_new``  new        ``torch.compile`` (Inductor, ``fullgraph``, static shapes) of the formula
``compile_out``  out        the compiled formula ``copy_``-ed into a buffer, kept only when
                            Inductor's generated code writes the buffer directly (no temporary
                            of the output's size); otherwise dropped, with the reason recorded
===============  =========  ====================================================================

Every candidate's result is checked against opbridge's on fresh copies of
the inputs before anything is timed (a mismatch raises
:class:`~opbridge.bench.BenchError`; integer results must match exactly);
then all candidates of a case are timed interleaved
(:func:`opbridge.bench.timing.interleaved`). An in-place op that uses up its
inputs (``advance_step_flashattn`` moves every sequence one token on per
call) has its mutated arguments restored, untimed, before each sample.
Bytes moved count each Tensor argument read once and each result written
once (:func:`opbridge.bench.workloads.bytes_moved`), or what the workload
counts (rows gathered from a table, not the table); GB/s is bytes over the
median time. Two fractions of STREAM copy are reported: against the copy
bandwidth of :mod:`opbridge.bench.stream` measured (on 256 MiB arrays) at
the start and the end of this run, and -- for cases moving 1 MiB or more
(``--local-stream-mib``) -- against a copy of the case's own byte count
timed interleaved with its candidates (the local copy ceiling), which sees
the same cache residency and the same moment's load (an L3 may hold a
16 MiB case, and much of a 64 MiB one). That copy is split into chunks
claimed as threads arrive, as the kernels split their work
(``parallel_for``), not into STREAM's static halves, which wait for a
descheduled thread; and as the copy reads its own array, each candidate of
such a case reads its own copy of the inputs (``own_inputs``), so none
finds inputs in L3 that another has just read. The summary's
float64-vs-float32 table compares each dtype's local fraction, so a
float32 case in cache is not judged against DRAM bandwidth while its
float64 twin, twice the bytes, falls out of the cache; each row names its
ceiling. An op whose results all overwrite its
arguments (``fused_add_rms_norm``, ``rotary_embedding``) is judged instead
against an in-place update of one array moving the same bytes: its own
footprint, half a copy's. A fraction can exceed 1: STREAM counts no
write-allocate traffic, so a copy into a separate array really moves 3
bytes per 2 counted, while an op that writes lines it has just read (in
place) or with streaming stores moves only what is counted; the run's
STREAM fraction of an in-place op, and the local one of an op with
streaming stores, can so reach 1.5. Cases below that size time instead a copy of their own
byte count on one thread and on the run's threads, both called through
tvm-ffi like the kernels: the faster of the two is what merely moving
those bytes costs, so torch eager's time over it is the largest speed-up
over eager that the hardware leaves room for (the summary's
``small_ceiling_vs_eager``; for float32 ``add`` at (8, 4096) it is below 2).
Speed-ups are the competitor's median over ours in the same mode (> 1:
opbridge is faster); an op that mutates in place has only its in-place
form, which stands in for "new output" too.

``opbridge_new`` is timed as a loop calling the op sees it: its large
outputs come from opbridge's pool of recycled buffers, warm. The
interleaved NumPy reference runs for over a second at (4096, 4096) (``gelu``:
1.2 s), longer than the pool keeps an idle buffer (1000 ms), so each new
output would map fresh memory again (``gelu`` float32: 7.4 against 4.0 ms).
The timing process therefore keeps idle buffers for
:data:`KEEP_IDLE_MS` (``settings.output_cache_idle_ms`` in the JSON), unless
``OPBRIDGE_OUTPUT_CACHE_IDLE_MS`` is set; the memory child keeps the
setting's.

Peak memory: a fresh child process (``MALLOC_MMAP_THRESHOLD_`` fixed at
64 KiB, so every allocation of 64 KiB or more is a fresh ``mmap`` that is
returned on ``free``) binds each candidate at the memory size, warms it up,
resets the kernel's peak-RSS counter (``/proc/self/clear_refs`` = 5), makes
one call and reads ``VmHWM``; the peak minus the RSS before the call, less
the bytes of the call's new outputs, is the memory it needed beyond its
inputs and outputs. This sees every allocator (torch, NumPy, C++ ``new``)
but only touched pages, at 4 KiB resolution plus a few KiB of interpreter
noise; ``tracemalloc``'s exact peak of Python/NumPy allocations is recorded
beside it. Where the counter cannot be reset, each measurement runs in its
own process and the resolution is the distance between that process's
earlier peak and its RSS before the call (reported).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import time
from pathlib import Path
from typing import Any

from opbridge.bench import BenchError
from opbridge.bench.candidates import (
    COMPILE_NEW,
    COMPILE_OUT,
    EAGER_NEW,
    EAGER_OUT,
    OURS_NEW,
    OURS_OUT,
    REF,
    choose_torch,
    make_args,
)
from opbridge.bench.kernels.cases import STREAM_LOCAL, run_case
from opbridge.bench.kernels.memory import measure_memory, memory_child
from opbridge.bench.kernels.options import (
    DEFAULT_OPS,
    DTYPES,
    FULL,
    QUICK,
    CaseSpec,
    Plan,
    Settings,
    add_arguments,
    case_dtypes,
    plan,
    settings,
)
from opbridge.bench.kernels.text import CSV_FIELDS, PAIRS, csv_rows, format_text, speedups, summarize
from opbridge.bench.report import Progress, loadavg, say, sig, write_json, write_results
from opbridge.bench.timing import machine_info

DESCRIPTION = (
    "Kernel throughput against STREAM: each op (add, gelu, rms_norm, and silu_and_mul, gelu_and_mul, "
    "fused_add_rms_norm, rotary_embedding, advance_step_flashattn when declared; --all-ops adds the "
    "backward ops) at small, large and odd sizes in float32, float64 and bfloat16 (integer-only ops once "
    "per size), opbridge into an existing buffer and with a new output, against the NumPy "
    "reference, torch eager and torch.compile (Inductor); verified before timing, timed interleaved; GB/s "
    "and the fraction of STREAM copy measured in the same run, speed-ups, peak extra memory per call; "
    "JSON, CSV and PNG plots under --out."
)

CANDIDATES = (OURS_OUT, OURS_NEW, REF, EAGER_NEW, EAGER_OUT, COMPILE_NEW, COMPILE_OUT)


def _weight(case: CaseSpec, s: Settings) -> float:
    from opbridge.bench.workloads import itemsize

    rows, cols = case.size
    w = 1.0 + rows * cols * itemsize(case.dtype.split("/")[0]) / (8 << 20)
    return w * (2.0 if s.compile else 1.0)


def _l3_size() -> str | None:
    """The last-level cache size the kernel reports (``/sys``), e.g. ``"491520K"``, or None."""
    try:
        return Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return None


#: How long the timing process keeps an idle recycled output buffer (see the module docstring).
KEEP_IDLE_MS = 60_000


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; see the module docstring."""
    from opbridge.call import memory

    set_by_user = bool(os.environ.get("OPBRIDGE_OUTPUT_CACHE_IDLE_MS"))
    with contextlib.nullcontext() if set_by_user else memory.keep_idle_buffers(KEEP_IDLE_MS):
        return _run(args, memory.idle_ms())


def _run(args: argparse.Namespace, idle_ms: int) -> dict[str, Any]:
    wall0 = time.monotonic()
    s = settings(args)
    say("kernels", "importing torch and opbridge, loading the kernels")
    import torch

    from opbridge.aot.natives import summary
    from opbridge.bench import stream

    # the native entries the calls go through, built and loaded now, not by a background build that
    # finishes, and loads them, in the middle of a timing or a memory measurement
    natives = summary(("torch", "numpy"))
    load_start = loadavg()
    p = plan(s)
    if not p.ops:
        raise BenchError("no op to benchmark: " + "; ".join(f"{k['op']}: {k['reason']}" for k in p.skipped))
    mem_plan = plan(s, for_memory=True) if s.memory and s.ops is None else p
    s = dataclasses.replace(s, threads=s.threads or torch.get_num_threads())
    threads = s.threads
    p.torch = {op.name: choose_torch(op, p.workloads[op.name]) for op in p.ops}
    cases = [CaseSpec(op, p.workloads[op.name], p.torch[op.name], sn, sz, d) for op in p.ops
             for sn, sz in s.sizes.items() for d in case_dtypes(p.workloads[op.name], s.dtypes)]
    stream_w = 2.0 * s.stream_n / (16 << 20)
    total = sum(_weight(c, s) for c in cases) + 2 * stream_w + (8.0 if s.memory else 0.0)
    bar = Progress(total, len(cases) + 2 + int(s.memory))
    for skip in p.skipped:
        bar.note(f"skipping {skip['op']}: {skip['reason']}")

    bar.show(f"STREAM ({s.stream_n} floats, {threads} threads)")
    passes = [stream.measure(s.stream_n, threads=threads, rounds=s.stream_rounds)]
    bar.advance(stream_w)
    records = []
    for case in cases:
        bar.show(case.label)
        try:
            records.append(run_case(case, s))
        except BenchError:
            raise
        except Exception as e:
            if case.wl.torch or "inferred" not in case.wl.note:
                raise
            # An inferred workload may not fit the op (a size its kernel rejects): skip, do not abort.
            p.skipped.append({"op": case.op.name, "reason": f"{case.label}: {type(e).__name__}: {e}"})
        bar.advance(_weight(case, s))
        gc.collect()
    bar.show("STREAM again")
    passes.append(stream.measure(s.stream_n, threads=threads, rounds=s.stream_rounds))
    bar.advance(stream_w)
    copy = stream.copy_gbps(passes)
    memory: dict[str, Any] = {"skipped": "--no-memory"}
    if s.memory:
        bar.show(f"peak memory at {s.memory_size[0]}x{s.memory_size[1]} (child process)")
        memory = measure_memory(mem_plan, s)
        bar.advance(8.0)
    bar.finish()

    mutating = {op.name: op.n_outputs == 0 for op in p.ops}
    for rec in records:
        for row in rec["candidates"].values():
            row["frac_stream_copy"] = sig(row["gbps"] / copy)
        rec["speedups"] = speedups(rec, mutating[rec["op"]])
    info = machine_info()
    info["torch_threads"] = torch.get_num_threads()
    info["omp_num_threads_env"] = os.environ.get("OMP_NUM_THREADS")
    info["l3_cache"] = _l3_size()
    info["loadavg_1m_start_end"] = [load_start, loadavg()]
    for pss in passes:
        pss.pop("samples_s", None)
    result: dict[str, Any] = {
        "benchmark": "kernels",
        "quick": bool(getattr(args, "quick", False)),
        "machine": info,
        "natives": natives,
        "settings": {
            "sizes": {k: list(v) for k, v in s.sizes.items()}, "dtypes": list(s.dtypes), "rounds_max": s.rounds,
            "rounds_min": s.min_rounds, "target_ms": s.target_s * 1e3, "case_budget_s": s.case_budget_s,
            "compile": s.compile, "reference_on_large": s.reference_large, "output_cache_idle_ms": idle_ms,
        },
        "stream": {"copy_gbps": copy, "reference": "median of every copy sample of both passes",
                   "passes": passes},
        "ops": {op.name: {"schema": str(op.schema), "workload_note": p.workloads[op.name].note}
                for op in p.ops},
        "skipped_ops": p.skipped,
        "cases": records,
        "memory": memory,
        "summary": summarize(records),
    }
    result["files"] = write_results(result, s.out, CSV_FIELDS, csv_rows(result), plot_all if s.plots else None,
                                    bench="kernels")
    result["wall_seconds"] = round(time.monotonic() - wall0, 1)
    write_json(result, result["files"]["json"])
    return result


def plot_all(result: dict[str, Any], folder: Path) -> list[Path]:
    """The PNG plots of *result* (needs matplotlib)."""
    from opbridge.bench import plot

    return plot.plot_all(result, folder)


__all__ = [
    "CANDIDATES", "COMPILE_NEW", "COMPILE_OUT", "CSV_FIELDS", "DEFAULT_OPS", "DESCRIPTION", "DTYPES", "EAGER_NEW",
    "EAGER_OUT", "FULL", "OURS_NEW", "OURS_OUT", "PAIRS", "QUICK", "REF", "STREAM_LOCAL", "BenchError", "CaseSpec",
    "Plan", "Progress", "Settings", "add_arguments", "case_dtypes", "choose_torch", "csv_rows", "format_text",
    "make_args", "measure_memory", "memory_child", "plan", "run", "run_case", "settings",
]
