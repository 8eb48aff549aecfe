"""One case of ``opbridge bench gpu`` on the device: verify against float64, then time eagerly and in graphs."""

from __future__ import annotations

from typing import Any

from opbridge.bench.candidates import (
    Candidate,
    choose_torch,
    clone,
    eager_candidates,
    make_args,
    opbridge_candidates,
)
from opbridge.bench.gpu.cases import Size, record
from opbridge.bench.verify import mismatch, reference64, reference_tolerances

__all__ = ["candidates", "choose_torch"]


def candidates(op: Any, impl: Any, liger: Any, use_compile: bool) -> list[Candidate]:
    """opbridge's candidates, torch eager's, Inductor's (*use_compile*) and Liger-Kernel's (*liger*)."""
    from opbridge.bench.gpu.peers import compile_candidate, liger_candidate

    cands = opbridge_candidates(op)
    if impl is not None:
        cands += eager_candidates(op, impl)
        if use_compile:
            cands.append(compile_candidate(op, impl))
    if liger is not None:
        cands.append(liger_candidate(op, liger))
    return cands


def verify(op: Any, cands: list[Candidate], pristine: list[Any], dtype: str,
           notes: list[str]) -> tuple[list[Candidate], list[dict[str, str]]]:
    """The candidates that match the float64 reference, and one mismatch record per one that does not.

    A candidate that raises (a compiler failure included) is left out with a note, not a mismatch.
    """
    expected = reference64(op, pristine)
    tols = reference_tolerances(op, dtype, expected, pristine)
    kept, bad = [], []
    for c in cands:
        try:
            fn, get = c.bind(clone(pristine))
            got = get(fn())
        except Exception as e:  # a peer that cannot run this case is missing, not wrong
            notes.append(f"{c.name} dropped: {type(e).__name__}: {str(e).strip()[:300]}")
            continue
        why = mismatch(got, expected, tols, dtype)
        if why is None:
            kept.append(c)
        else:
            bad.append({"candidate": c.name, "message": why,
                        "tolerances": "; ".join(f"rtol={r:.3g} atol={a:.3g}" for r, a in tols)})
    return kept, bad


def run_case(op: Any, wl: Any, impl: Any, liger: Any, size: Size, dtype: str, device: Any, rounds: int, *,
             use_compile: bool, graphs: bool, pairs: dict[str, str], target_ms: dict[str, float]) -> dict[str, Any]:
    """Verify and time every candidate of *op* at *size* and *dtype*; return the case's record."""
    import torch

    from opbridge.bench.gpu.timing import time_eager, time_graphs

    pristine = make_args(op, wl, size.rows_cols, dtype, device=device)
    notes: list[str] = []
    cands, bad = verify(op, candidates(op, impl, liger, use_compile), pristine, dtype, notes)
    moved = wl.moved(op, pristine)["total"]
    fns = {c.name: c.bind(clone(pristine))[0] for c in cands}
    stats: dict[str, dict[str, Any]] = {}
    if fns:
        eager, number = time_eager(fns, rounds, target_ms["eager"])
        graph: dict[str, dict[str, float]] = {}
        numbers: dict[str, int] = {}
        failed: dict[str, str] = {}
        if graphs:
            graph, numbers, failed = time_graphs(fns, {n: s["p50"] for n, s in eager.items()}, rounds,
                                                 target_ms["graph"])
        for n in fns:
            stats[n] = {"eager": eager[n], "number": number, "graph": graph.get(n),
                        "graph_number": numbers.get(n), "graph_skipped": failed.get(n)}
    rec = record(op.name, dtype, size, moved, stats, {c.name: (c.mode, c.what) for c in cands}, pairs)
    rec["mismatches"] = bad
    rec["notes"] = notes
    del fns, pristine
    torch.cuda.empty_cache()
    return rec
