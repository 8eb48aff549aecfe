"""Timing and context of the parity rows (:mod:`opbridge.bench.parity`).

:func:`calibrated_each` times candidates interleaved with calls per sample
sized per candidate; :func:`load_context` and :func:`oversubscribed` record
and judge what a row ran beside (kernel threads, CPUs, load average).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from typing import Any

from opbridge.bench.timing import calls_per_sample, interleaved, probe_times, summary


def _repeat(fn: Callable[[], Any], n: int) -> None:
    for _ in range(n):
        fn()


def calibrated_each(fns: dict[str, Callable[[], Any]], *, target_s: float, rounds: int, min_rounds: int,
                    budget_s: float, max_calls: int = 0) -> tuple[dict[str, dict[str, float]], int, dict[str, int]]:
    """Like :func:`opbridge.bench.timing.calibrated`, but with calls per sample sized per candidate.

    Each candidate's sample is about *target_s* of its own calls (at most
    *max_calls*), so one slow candidate (MindSpore's own gelu: 110 ms a call)
    no longer cuts every sample to a single call, which timed the first call
    after a switch of candidates (caches cold from the slow one) rather than
    the per-call cost: MindSpore gelu at (1024, 4096), one kernel thread,
    fw/np 1.18-1.22 with shared calls per sample, 1.07 per candidate.
    Returns ``(summary, rounds, {name: calls per sample})``.
    """
    probes = probe_times(fns)
    cap = min(max_calls or 10_000, 10_000)
    calls = {name: calls_per_sample(target_s, p, cap) for name, p in probes.items()}
    per_round = sum(calls[k] * probes[k] for k in fns)
    n_rounds = max(min_rounds, min(rounds, int(budget_s / max(per_round, 1e-9))))
    batches = {k: functools.partial(_repeat, f, calls[k]) for k, f in fns.items()}
    samples = interleaved(batches, rounds=n_rounds, number=1, warmup=0)
    return summary({k: [s / calls[k] for s in v] for k, v in samples.items()}), n_rounds, calls


def row_load() -> float | None:
    """The 1-minute load average now, or None."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - no load average on this platform
        return None


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def kernel_threads() -> int | None:
    """``omp_get_max_threads()`` of the OpenMP runtime the kernels call, or None where none is loaded.

    The kernels resolve OpenMP's symbols in the process's global scope first
    (torch's bundled libgomp, Paddle's libiomp5), else from their own
    ``libgomp.so.1``; the lookup here follows the same order and never loads a
    runtime of its own.
    """
    try:
        fn = ctypes.CDLL(None).omp_get_max_threads
    except AttributeError:
        try:
            fn = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD).omp_get_max_threads
        except (OSError, AttributeError):
            return None
    return int(fn())


def load_context() -> dict[str, Any]:
    """What a row's timings ran with and beside: kernel threads, ``OMP_NUM_THREADS``, CPUs, load before."""
    return {"kernel_threads": kernel_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "cpus": _cpus(), "loadavg_before": row_load()}


def oversubscribed(row: dict[str, Any]) -> bool:
    """Whether *row* was timed with the 1-minute load average above its usable CPUs."""
    loads = [x for x in (row.get("loadavg_before"), row.get("loadavg_after")) if x is not None]
    return bool(loads) and "cpus" in row and max(loads) > row["cpus"]
