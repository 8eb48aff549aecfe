"""One case of ``opbridge bench kernels``: verify every candidate, then time them interleaved."""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from opbridge.bench import BenchError
from opbridge.bench.candidates import (
    COMPILE_NEW,
    COMPILE_OUT,
    EAGER_NEW,
    EAGER_OUT,
    REF,
    Candidate,
    clone,
    eager_candidates,
    expected_of,
    formula_candidates,
    make_args,
    opbridge_candidates,
    reference_candidate,
)
from opbridge.bench.kernels.options import CaseSpec, Settings, reference_dtype
from opbridge.bench.report import sig
from opbridge.bench.timing import calibrated, gbps
from opbridge.bench.verify import check, mutated

#: The STREAM copy of a case's own byte count, timed interleaved with its candidates.
STREAM_LOCAL = "stream_copy_local"
#: Compiled code that allocates a buffer this large (relative to the smallest result) is not in place.
_INPLACE_ALLOC_FRACTION = 0.5


def _into(impl: Any, n_args: int, targets: Sequence[int] | None) -> Callable[..., None]:
    """A function Inductor can compile that writes the formula's results into buffers.

    ``targets`` None: the buffers are extra trailing arguments; else the
    results go into the arguments at those indices (a mutating op).
    """
    new = impl.new

    if targets is None:
        def into(*a: Any) -> None:
            for o, r in zip(a[n_args:], new(*a[:n_args])):
                o.copy_(r)
    else:
        def into(*a: Any) -> None:
            res = new(*a)
            for i, r in zip(targets, res):
                a[i].copy_(r)
    return into


def compiled_candidates(op: Any, impl: Any) -> list[Candidate]:
    """``compile_new`` and ``compile_out``: Inductor's compilations of the formula, new and into buffers."""
    import torch

    n = len(op.schema.arguments)
    into = _into(impl, n, None if op.n_outputs else mutated(op))
    return formula_candidates(
        op, torch.compile(impl.new, fullgraph=True, dynamic=False),
        torch.compile(into, fullgraph=True, dynamic=False), names=(COMPILE_NEW, COMPILE_OUT),
        what="torch.compile(formula, fullgraph=True, dynamic=False)",
        into_what="torch.compile(lambda *a: buf.copy_(formula(*a))); Inductor writes buf directly (checked in "
                  "its generated code)", spread=True)


def _capture_code(fn: Callable[[], Any]) -> tuple[Any, list[str], float]:
    """Call *fn* (a first call of a compiled function) and return its result, Inductor's code, seconds."""
    from unittest import mock

    import torch._inductor.config as inductor_config
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    start = time.perf_counter()
    # No FX-graph cache: a cache hit skips the lowering whose code is inspected.
    with mock.patch.object(GraphLowering, "save_output_code", codes.append), \
            inductor_config.patch(fx_graph_cache=False):
        ret = fn()
    return ret, codes, round(time.perf_counter() - start, 3)


def _allocations(codes: Sequence[str]) -> list[int]:
    """Element counts of the buffers Inductor's generated code allocates."""
    import re

    sizes = []
    for code in codes:
        for m in re.finditer(r"empty_strided(?:_cpu)?\(\(([^)]*)\)", code):
            dims = [d.strip() for d in m.group(1).split(",") if d.strip()]
            sizes.append(math.prod(int(d) for d in dims) if all(d.isdigit() for d in dims) else -1)
    return sizes


def _verify(op: Any, label: str, pristine: list[Any], cands: Sequence[Candidate], dtype: str,
            expected: Sequence[Any], skipped: dict[str, str]) -> list[Candidate]:
    """Check every candidate against opbridge's *expected*; return the ones kept.

    opbridge's own candidates and the NumPy reference must run and agree
    (else :class:`BenchError`). A torch peer is a competitor, not a judge:
    one that raises (a formula torch refuses in this dtype) is left out, and
    so is one that disagrees while the reference agrees with opbridge (a
    formula that computes in float32 when given float64), each with the
    reason in *skipped*. Without the reference's agreement a disagreement
    raises.
    """
    kept: list[Candidate] = []
    for c in cands:
        fn, get = c.bind(clone(pristine))
        peer = c.name in (EAGER_NEW, EAGER_OUT)
        try:
            check(op, label, c.name, get(fn()), expected, dtype)
        except BenchError as e:
            if not (peer and any(k.name == REF for k in kept)):
                raise
            skipped[c.name] = f"disagrees with opbridge and the NumPy reference in {dtype}: " + \
                str(e).splitlines()[1 if len(str(e).splitlines()) > 1 else 0]
            continue
        except Exception as e:
            if not peer:
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            skipped[c.name] = f"torch raised {type(e).__name__} in {dtype}: {first}"
            continue
        kept.append(c)
    return kept


def _restorer(op: Any, args: Sequence[Any]) -> Callable[[], None]:
    """A function that puts *args*' mutated tensors back to their present values."""
    saved = [(args[i], args[i].clone()) for i in mutated(op) if args[i] is not None]

    def restore() -> None:
        for t, v in saved:
            t.copy_(v)

    return restore


#: What the local ceiling of a case does: copy into another array, or update one array in place.
COPY, IN_PLACE = "copy", "in place"


def _local_copy(total_bytes: int, threads: int, kind: str = COPY) -> tuple[Callable[[], Any], int]:
    """A copy moving *total_bytes* (read + write), to time beside a case's candidates.

    The copy is split into chunks as opbridge's kernels split their work
    (``stream_copy_chunked``), so it waits for a descheduled thread no more
    than they do. *kind* :data:`IN_PLACE` updates one array in place instead
    (``stream_update_chunked``: each value read and written once, half the
    footprint, no write-allocate traffic), the ceiling of an op that updates
    its arguments in place. Returns the call and the bytes it moves: arrays
    of ``total_bytes // 8`` float32 elements, so up to 7 bytes fewer than
    asked.
    """
    import numpy as np

    from opbridge.bench import stream

    k = stream.kernels()
    n = max(1, total_bytes // 8)
    a = np.empty(n, dtype=np.float32)
    k["fill"](a, 1.0, threads)
    if kind == IN_PLACE:
        return functools.partial(k["update_chunked"], a, 1.0, threads), 8 * n
    c = np.empty(n, dtype=np.float32)
    k["fill"](c, 0.0, threads)
    return functools.partial(k["copy_chunked"], c, a, threads), 8 * n


def run_case(case: CaseSpec, s: Settings) -> dict[str, Any]:
    """Verify and time every candidate of *case*; return its result record."""
    import torch

    op, dtype = case.op, case.dtype
    pristine = make_args(op, case.wl, case.size, dtype)
    moved = case.wl.moved(op, pristine)
    expected = expected_of(op, pristine)
    impl = case.impl

    cands = opbridge_candidates(op)
    skipped: dict[str, str] = {}
    if op.reference is None:
        skipped[REF] = "the op declares no reference"
    elif not reference_dtype(case.wl, dtype):
        skipped[REF] = "float32 and float64 only"
    elif case.size_name == "large" and not s.reference_large:
        skipped[REF] = "skipped on the large size with --quick"
    else:
        cands.append(reference_candidate(op))
    compile_info: dict[str, Any] = {}
    if impl is None:
        for n in (EAGER_NEW, EAGER_OUT, COMPILE_NEW, COMPILE_OUT):
            skipped[n] = "no torch formula for this op"
    else:
        cands += eager_candidates(op, impl)
        if impl.out is None:
            skipped[EAGER_OUT] = "torch has no into-buffer form of this op"
        if not s.compile:
            skipped[COMPILE_NEW] = skipped[COMPILE_OUT] = "torch.compile not run (--no-compile or --quick)"
        else:
            cands += _compile_case(case, impl, pristine, expected, compile_info, skipped)
    label = case.label
    compiled = [c for c in cands if c.name.startswith("compile_")]
    cands = _verify(op, label, pristine, [c for c in cands if c not in compiled], dtype, expected, skipped)
    cands += compiled

    local = moved["total"] >= s.local_stream_bytes
    # With a local ceiling each candidate reads its own copy of the inputs, as the copy reads its own
    # array: shared inputs that one candidate has just read are still in L3 for the next, an advantage
    # the copy never gets and that is larger the smaller the case (gelu at (257, 5125), 2 threads:
    # float32 1.46-1.48x its copy, float64 1.11-1.19x). Not for an op whose inputs are restored
    # between samples (restore() puts back the shared ones).
    own_inputs = local and not case.wl.max_calls
    bound = {c.name: c.bind(clone(pristine) if own_inputs else pristine)[0] for c in cands}
    copy_bytes: dict[str, int] = {}
    # An op whose results all overwrite its arguments touches each line once, read then written:
    # its ceiling updates one array in place (the same footprint), not a copy into a second one.
    kind = COPY if op.n_outputs else IN_PLACE
    if local:  # the same bytes moved, interleaved with the candidates: drift hits both alike
        bound[STREAM_LOCAL], copy_bytes[STREAM_LOCAL] = _local_copy(moved["total"], s.threads, kind)
    # In cache, a copy of the same bytes on one thread and on the run's threads: how fast any kernel
    # that must move these bytes could be (the ceiling of a speed-up over torch, see _summary).
    copy_threads = {} if local else {f"cache_copy_{t}t": t for t in sorted({1, s.threads})}
    for name, t in copy_threads.items():
        bound[name], copy_bytes[name] = _local_copy(moved["total"], t)
    del expected
    gc.collect()
    recompile_guard = torch._dynamo.config.patch(error_on_recompile=True) if s.compile else contextlib.nullcontext()
    restore = _restorer(op, pristine) if case.wl.max_calls else None
    with recompile_guard:
        stats, rounds, number = calibrated(bound, target_s=s.target_s, rounds=s.rounds, min_rounds=s.min_rounds,
                                           budget_s=s.case_budget_s, max_calls=case.wl.max_calls,
                                           before=restore)
    bound.clear()
    shape = {a.name: list(v.shape) for a, v in zip(op.schema.arguments, pristine) if hasattr(v, "shape")}
    results: dict[str, Any] = {}
    for c in cands:
        row = stats[c.name]
        results[c.name] = {
            "mode": c.mode, "what": c.what, "p20_us": row["p20"], "p50_us": row["p50"], "p80_us": row["p80"],
            "rounds": rounds, "number": number,
            "gbps": sig(gbps(moved["total"], row["p50"])),
        }
        if local:  # GB/s over the copy's GB/s: exact although the copy moves up to 7 bytes fewer
            for key, q in (("frac_stream_copy_local", "p50"), ("frac_stream_copy_local_p20", "p20")):
                results[c.name][key] = sig(
                    gbps(moved["total"], row[q]) / gbps(copy_bytes[STREAM_LOCAL], stats[STREAM_LOCAL][q]))

    def copy_row(name: str) -> dict[str, Any]:
        st = stats[name]
        return {"p20_us": st["p20"], "p50_us": st["p50"], "p80_us": st["p80"], "bytes": copy_bytes[name],
                "gbps": sig(gbps(copy_bytes[name], st["p50"]))}

    return {
        "op": op.name, "size": case.size_name, "rows_cols": list(case.size), "dtype": dtype, "shapes": shape,
        "bytes": moved, "torch_variant": impl.label if impl is not None else "", "candidates": results,
        "skipped": skipped, "compile": compile_info,
        "stream_copy_local": dict(copy_row(STREAM_LOCAL), threads=s.threads, kind=kind) if local else None,
        "own_inputs": own_inputs,
        "cache_copies": {name: dict(copy_row(name), threads=t) for name, t in copy_threads.items()},
    }


def _compile_case(case: CaseSpec, impl: Any, pristine: list[Any], expected: Sequence[Any],
                  info: dict[str, Any], skipped: dict[str, str]) -> list[Candidate]:
    """Compile the case's formula (new output and into a buffer), verify both, keep what is fair.

    Each is compiled on its own: Inductor failing on one (it has bugs, e.g. a
    ``KeyError`` in the C++ outer-loop fusion of a graph that mutates two
    inputs) only drops that one, with the error recorded.
    """
    import torch

    op = case.op
    torch._dynamo.reset()  # compile once per case; never hit the recompile limit across cases
    kept = []
    smallest = min(math.prod(t.shape) for t in expected)
    for c in compiled_candidates(op, impl):
        try:
            fn, get = c.bind(clone(pristine))
            ret, codes, secs = _capture_code(fn)
            got = get(ret)
        except Exception as e:  # Inductor failing is a missing competitor, not our error
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            skipped[c.name] = f"torch.compile failed: {type(e).__name__}: {first}"
            continue
        check(op, case.label, c.name, got, expected, case.dtype)
        allocs = _allocations(codes)
        info[c.name] = {"first_call_seconds": secs, "allocations_numel": allocs}
        if c.name == COMPILE_OUT:
            big = [n for n in allocs if n < 0 or n >= _INPLACE_ALLOC_FRACTION * smallest]
            if not codes:
                skipped[c.name] = "Inductor's generated code could not be captured to check it writes in place"
                continue
            if big:
                skipped[c.name] = (f"Inductor allocates a temporary of {max(big)} elements before copying into "
                                   "the buffer: not in place, only its new output is reported")
                continue
        kept.append(c)
    return kept

