"""Peak memory of one call of each candidate, measured in a child process (see the package docstring)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from typing import Any

from opbridge.bench import BenchError
from opbridge.bench.candidates import (
    OURS_NEW,
    OURS_OUT,
    Candidate,
    choose_torch,
    eager_candidates,
    make_args,
    opbridge_candidates,
    reference_candidate,
)
from opbridge.bench.kernels.options import Plan, Settings, case_dtypes, is_backward, reference_dtype

#: A temporary at least this fraction of the largest input counts as "input-sized".
_INPUT_SIZED = 0.5
#: Growth this small is below what one call's peak RSS resolves: the interpreter's and the allocator's
#: own pages (a frame, a small arena, a stack page) move it by tens of KiB from run to run. CI saw 52 KiB
#: beyond an op's 32 KiB largest input (1.6x) on a call this machine measures at 0 bytes, so the verdict
#: counts only the growth beyond this floor; the rows keep what was measured.
_NOISE_BYTES = 256 * 1024

_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TOP_PAD_": "0", "MALLOC_TRIM_THRESHOLD_": "0"}


def _status_kib() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssFile"):
                out[key] = int(value.split()[0])
    return out


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True



def _memory_candidates(op: Any, wl: Any, impl: Any, dtype: str) -> list[Candidate]:
    cands = opbridge_candidates(op)
    if op.reference is not None and reference_dtype(wl, dtype):
        cands.append(reference_candidate(op))
    if impl is not None:
        cands += eager_candidates(op, impl)
    return cands


def _address(t: Any) -> int:
    """Data address of a torch tensor or NumPy array."""
    return int(t.data_ptr()) if hasattr(t, "data_ptr") else int(t.__array_interface__["data"][0])


def _measure_one(op: Any, c: Candidate, args: list[Any], *, reset: bool, warm: bool) -> dict[str, Any]:
    import tracemalloc

    from opbridge.bench.workloads import nbytes

    fn, get = c.bind(args)
    inputs = {_address(a) for a in args if hasattr(a, "shape")}
    if warm:
        for _ in range(2):
            fn()
    gc.collect()
    best: dict[str, Any] | None = None
    for _ in range(2 if reset else 1):
        tracemalloc.reset_peak()
        tm0 = tracemalloc.get_traced_memory()[0]
        if reset:
            _reset_peak()
        before = _status_kib()
        ret = fn()
        after = _status_kib()
        tm_peak = tracemalloc.get_traced_memory()[1] - tm0
        new_bytes = sum(nbytes(t) for t in get(ret) if _address(t) not in inputs) if c.mode == "new" else 0
        del ret
        # library pages read back in during the call (dropped from the page cache while the machine
        # was short of memory) raise the peak too, but are not the call's memory: only anonymous
        # growth is (malloc, mmap), so file-backed growth is taken off
        paged_in = max(0, after["RssFile"] - before["RssFile"]) * 1024
        extra = max(0, (after["VmHWM"] - max(before["VmRSS"], 0 if reset else before["VmHWM"])) * 1024 - paged_in)
        row = {"peak_extra_bytes": extra, "new_output_bytes": new_bytes, "file_paged_in_bytes": paged_in,
               "beyond_io_bytes": max(0, extra - new_bytes), "tracemalloc_peak_bytes": tm_peak,
               "resolution_bytes": 4096 if reset else max(4096, (before["VmHWM"] - before["VmRSS"]) * 1024)}
        if best is None or row["peak_extra_bytes"] < best["peak_extra_bytes"]:
            best = row
    assert best is not None
    return best


def memory_child() -> None:
    """Entry point of the memory child process: JSON spec on stdin, JSON result on stdout."""
    import tracemalloc

    import torch  # noqa: F401 - the candidates need it

    import opbridge.ops  # noqa: F401 - declares the library
    from opbridge import registry
    from opbridge.aot.natives import summary
    from opbridge.bench import workloads

    spec = json.load(sys.stdin)
    # loaded now from the cache the parent filled: a library loaded by a background build's thread during
    # a measured call (its pages, its callbacks' generated code) would count as the call's memory
    natives = summary(("torch", "numpy"))
    gc.collect()
    gc.freeze()  # the imports' objects: later collections skip them (each would take ~0.2 s)
    lib = registry.library("opbridge")
    known = workloads.workloads()
    reset = spec["mode"] == "reset" and _reset_peak()
    tracemalloc.start()
    rows = []
    for item in spec["items"]:
        op = lib.ops[item["op"]]
        wl = known.get(op.name) or workloads.infer(op)[0]
        size = tuple(item["size"])
        cands = [c for c in _memory_candidates(op, wl, choose_torch(op, wl), item["dtype"])
                 if not item.get("candidates") or c.name in item["candidates"]]
        if not reset:  # warm up on a tiny case: a warm-up at full size would raise the peak we compare with
            tiny = make_args(op, wl, (2, 64), item["dtype"])
            for c in cands:
                c.bind(tiny)[0]()
        args = make_args(op, wl, size, item["dtype"])
        largest = max(workloads.nbytes(a) for a in args if hasattr(a, "shape"))
        for c in cands:
            row = _measure_one(op, c, args, reset=reset, warm=reset)
            row.update(op=op.name, dtype=item["dtype"], size=list(size), candidate=c.name, mode=c.mode,
                       largest_input_bytes=largest,
                       beyond_io_vs_input=round(row["beyond_io_bytes"] / largest, 3))
            rows.append(row)
    json.dump({"reset": reset, "rows": rows, "natives": natives}, sys.stdout)


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, **_MEMORY_ENV}
    code = "from opbridge.bench.kernels.memory import memory_child; memory_child()"
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(spec), capture_output=True,
                          text=True, env=env, timeout=1800, check=False)
    if proc.returncode != 0:
        raise BenchError(f"the memory child process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def verdict(rows: list[dict[str, Any]], *, backward: bool) -> dict[str, Any]:
    """Whether opbridge's rows of one op keep within the temporaries its kind may need.

    A forward kernel may need none the size of its largest input, a backward one at most one; growth
    below the noise floor counts as none.
    """
    worst = max((r["beyond_io_vs_input"] for r in rows), default=0.0)
    beyond_noise = max((max(0, r["beyond_io_bytes"] - _NOISE_BYTES) / r["largest_input_bytes"] for r in rows),
                       default=0.0)
    allowed = 1 if backward else 0
    return {"kind": "backward" if backward else "forward", "worst_beyond_io_vs_input": worst,
            "worst_beyond_noise_vs_input": round(beyond_noise, 3), "input_sized_temporaries": round(beyond_noise),
            "ok": beyond_noise < allowed + _INPUT_SIZED}


def measure_memory(p: Plan, s: Settings) -> dict[str, Any]:
    """Peak memory beyond inputs and outputs of one call of each candidate (see the module docstring)."""
    items = [{"op": op.name, "dtype": d, "size": list(s.memory_size)} for op in p.ops
             for d in case_dtypes(p.workloads[op.name], s.memory_dtypes)]
    result = _run_child({"mode": "reset", "items": items})
    natives = result["natives"]  # what every child loaded before it measured (the same cache)
    method = "reset"
    if not result["reset"]:  # one process per measurement
        method = "fresh process"
        rows = []
        for item in items:
            op = next(o for o in p.ops if o.name == item["op"])
            impl = p.torch[op.name] if op.name in p.torch else choose_torch(op, p.workloads[op.name])
            for c in _memory_candidates(op, p.workloads[op.name], impl, item["dtype"]):
                rows += _run_child({"mode": "fresh", "items": [{**item, "candidates": [c.name]}]})["rows"]
        result = {"reset": False, "rows": rows}
    verdicts = {}
    for op in p.ops:
        ours = [r for r in result["rows"] if r["op"] == op.name and r["candidate"] in (OURS_OUT, OURS_NEW)]
        verdicts[op.name] = verdict(ours, backward=is_backward(op.name))
    return {
        "method": (f"{method}: child process with {', '.join(f'{k}={v}' for k, v in _MEMORY_ENV.items())}; "
                   "peak RSS (VmHWM) of one call minus RSS before it, less the call's new outputs and "
                   "the file-backed pages it read in (RssFile growth); "
                   "tracemalloc peak beside it"),
        "noise_floor_bytes": _NOISE_BYTES,
        "resolution": "4 KiB pages plus interpreter noise (tens of KiB)" if result["reset"] else
                      "see resolution_bytes per row (earlier peak above the RSS before the call)",
        "size": list(s.memory_size),
        "torch_compile": "not measured (it would recompile every graph in the child process)",
        "natives": natives,
        "rows": result["rows"],
        "ops": verdicts,
    }

