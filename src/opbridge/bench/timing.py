"""Timing helpers for noisy machines: interleaved rounds, percentiles, machine info.

On a small shared machine (two cores, a busy neighbour, frequency scaling)
the speed of the whole process drifts over seconds. Timing candidate A for
ten seconds and then candidate B for ten seconds attributes that drift to
the candidates. :func:`interleaved` instead runs many short rounds and
rotates the order of the candidates every round, so drift hits every
candidate alike, and reports one per-call time per round; :func:`summary`
turns those into robust percentiles.

Nothing here imports a framework: versions are read from the installed
distributions' metadata.
"""

from __future__ import annotations

import datetime
import gc
import itertools
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from pathlib import Path

#: The percentiles :func:`summary` reports.
PERCENTILES = (20, 50, 80)


def interleaved(
    fns: Mapping[str, Callable[[], object]],
    *,
    rounds: int,
    number: int,
    warmup: int = 3,
    before: Callable[[], object] | None = None,
) -> dict[str, list[float]]:
    """Time each candidate in *rounds* interleaved rounds of *number* calls.

    Round ``r`` runs the candidates in the order of *fns* rotated by ``r``,
    so no candidate always runs first (or right after the most expensive
    one). The garbage collector is paused while timing, as :mod:`timeit`
    does.

    Parameters
    ----------
    fns
        ``{name: zero-argument callable}``; bind arguments with
        :func:`functools.partial` (a C-level call) rather than a lambda, to
        keep the harness's own cost small and equal for all.
    rounds
        Number of rounds; each yields one sample per candidate.
    number
        Calls per candidate per round; a sample is their mean.
    warmup
        Untimed calls of each candidate before the first round.
    before
        Called, untimed, before each candidate's warm-up and before each
        sample: restores state the calls use up (an in-place op that can
        only be repeated so often on the same inputs). None: nothing.

    Returns
    -------
    dict[str, list[float]]
        ``{name: [per-call seconds, one per round]}``, in the order of *fns*.

    Raises
    ------
    ValueError
        If *rounds* or *number* is not positive, or *fns* is empty.
    """
    if rounds < 1 or number < 1:
        raise ValueError(f"rounds and number must be positive, got rounds={rounds}, number={number}")
    names = list(fns)
    if not names:
        raise ValueError("interleaved() needs at least one candidate")
    for name in names:
        if before is not None:
            before()
        for _ in range(warmup):
            fns[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                if before is not None:
                    before()
                samples[name].append(_time_calls(fns[name], number) / number)
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def _time_calls(fn: Callable[[], object], number: int) -> float:
    """Seconds taken by *number* calls of *fn* (the loop of :mod:`timeit`)."""
    loop = itertools.repeat(None, number)
    start = time.perf_counter()
    for _ in loop:
        fn()
    return time.perf_counter() - start


def percentile(values: Sequence[float], q: float) -> float:
    """The *q*-th percentile of *values* (linear interpolation, like ``numpy.percentile``)."""
    if not values:
        raise ValueError("percentile() of an empty sequence")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary(samples: Mapping[str, Sequence[float]]) -> dict[str, dict[str, float]]:
    """Summarise per-call seconds as p20/p50/p80 in microseconds.

    Parameters
    ----------
    samples
        ``{name: [per-call seconds]}``, as returned by :func:`interleaved`.

    Returns
    -------
    dict[str, dict[str, float]]
        ``{name: {"p20": µs, "p50": µs, "p80": µs, "rounds": n}}``.
    """
    out: dict[str, dict[str, float]] = {}
    for name, values in samples.items():
        row = {f"p{q}": round(percentile(values, q) * 1e6, 4) for q in PERCENTILES}
        row["rounds"] = len(values)
        out[name] = row
    return out


def gbps(nbytes: float, us: float) -> float:
    """Bandwidth in GB/s (10^9 bytes per second) of moving *nbytes* in *us* microseconds.

    Every benchmark's GB/s comes from here: :func:`summary` reports
    microseconds, and dividing bytes by microseconds as if they were seconds
    gives a number 10^6 too small.
    """
    return float(nbytes) / (us * 1e-6) / 1e9


def calls_per_sample(target_s: float, slowest_s: float, cap: int = 10_000) -> int:
    """Calls per sample so the slowest candidate's sample takes about *target_s* (1 to *cap*)."""
    return max(1, min(cap, round(target_s / max(slowest_s, 1e-9))))


def probe_times(fns: Mapping[str, Callable[[], object]],
                before: Callable[[], object] | None = None) -> dict[str, float]:
    """Seconds per call of each of *fns*: a warm-up call, then the faster of two timed calls.

    A first call may load or compile, and a call on a busy machine may
    stall; either would make samples sized by it too small. *before*
    (untimed) precedes each call, as in :func:`interleaved`.
    """
    probes: dict[str, float] = {}
    for n, f in fns.items():
        for i in range(3):
            if before is not None:
                before()
            start = time.perf_counter()
            f()
            if i:
                probes[n] = min(probes.get(n, math.inf), time.perf_counter() - start)
    return probes


def calibrated(fns: Mapping[str, Callable[[], object]], *, target_s: float, rounds: int, min_rounds: int,
               budget_s: float, max_calls: int = 0,
               before: Callable[[], object] | None = None) -> tuple[dict[str, dict[str, float]], int, int]:
    """Time *fns* interleaved, with calls per sample and rounds fitted to a time budget.

    Each candidate is called once to warm up and twice more, timed, to size
    the samples by the faster (a first call may load or compile, and a call
    on a busy machine may stall, either of which would shrink them):
    ``number`` calls make a sample of about *target_s* for the slowest (at
    most *max_calls*, 0: no limit), and the rounds, between *min_rounds*
    and *rounds*, fit *budget_s*. *before* (untimed) precedes each call
    sequence, as in :func:`interleaved`.

    Returns
    -------
    tuple
        ``(summary, rounds, number)``.
    """
    probes = probe_times(fns, before)
    number = calls_per_sample(target_s, max(probes.values()), min(max_calls or 10_000, 10_000))
    per_round = number * sum(probes.values())
    n_rounds = max(min_rounds, min(rounds, int(budget_s / max(per_round, 1e-9))))
    samples = interleaved(fns, rounds=n_rounds, number=number, warmup=0, before=before)
    return summary(samples), n_rounds, number


def ratio(stats: Mapping[str, Mapping[str, float]], name: str, base: str, key: str = "p50") -> float:
    """``stats[name][key] / stats[base][key]``, rounded to 3 decimals."""
    return round(stats[name][key] / stats[base][key], 3)


def dist_version(dist: str) -> str | None:
    """Installed version of distribution *dist*, or None; never imports it."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (falls back to :func:`platform.processor`)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model"):
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_info() -> dict[str, object]:
    """Describe the machine and software versions a measurement ran with."""
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable_cpus(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "opbridge": dist_version("opbridge"),
        "numpy": dist_version("numpy"),
        "torch": dist_version("torch"),
        "tvm_ffi": dist_version("apache-tvm-ffi"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
