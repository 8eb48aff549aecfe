"""Timing on a CUDA device: eager calls with CUDA events, and kernels alone inside CUDA graphs.

Eager
    ``number`` back-to-back calls between two CUDA events: the time includes
    each call's host side (Python, dispatch, launch), which is what a small
    serving-size call costs when launched from Python.
CUDA graph
    ``number`` calls captured once into a :class:`torch.cuda.CUDAGraph`,
    then the graph replayed between two events: the kernels alone, back to
    back, as a served model's captured decode step runs them. A candidate
    that cannot be captured (it synchronises, or launches on a stream other
    than the capturing one) has no graph time; the reason is recorded.

Candidates of a case are interleaved: round ``r`` runs them rotated by ``r``.
Every function here needs torch with CUDA.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from opbridge.bench.timing import calls_per_sample, gbps, summary

#: Bytes of the copy that measures the device's own bandwidth.
COPY_BYTES = 1 << 30


def _events() -> tuple[Any, Any]:
    import torch

    return (torch.cuda.Event(enable_timing=True),  # type: ignore[no-untyped-call]
            torch.cuda.Event(enable_timing=True))  # type: ignore[no-untyped-call]


def _timed(fn: Callable[[], Any], number: int, ev: tuple[Any, Any]) -> float:
    """Seconds per call of *number* calls of *fn* between two events."""
    start, end = ev
    start.record()
    for _ in range(number):
        fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3 / number


def _per_call(replay: Callable[[], Any], calls: int, ev: tuple[Any, Any]) -> float:
    """Seconds per call of one replay of a graph holding *calls* calls."""
    return _timed(replay, 1, ev) / calls


def _rotated(fns: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            samples[n].append(fns[n]())
    return samples


def time_eager(fns: dict[str, Callable[[], Any]], rounds: int,
               target_ms: float) -> tuple[dict[str, dict[str, float]], int]:
    """Per-call p20/p50/p80 (µs) of each candidate called eagerly, and the calls per sample."""
    import torch

    ev = _events()
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    slowest = max(_timed(fn, 3, ev) for fn in fns.values())
    number = calls_per_sample(target_ms / 1e3, slowest, 1000)
    samples = _rotated({n: functools.partial(_timed, f, number, ev) for n, f in fns.items()}, rounds)
    return summary(samples), number


def capture(fn: Callable[[], Any], number: int) -> Any:
    """A CUDA graph of *number* calls of *fn* (warmed up on a side stream first, as torch requires)."""
    import torch

    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()  # type: ignore[no-untyped-call]
    with torch.cuda.graph(graph):
        for _ in range(number):
            fn()
    torch.cuda.synchronize()
    return graph


def time_graphs(fns: dict[str, Callable[[], Any]], eager_us: dict[str, float], rounds: int,
                target_ms: float) -> tuple[dict[str, dict[str, float]], dict[str, int], dict[str, str]]:
    """Per-call p20/p50/p80 (µs) of each candidate inside a CUDA graph.

    Each graph holds about *target_ms* of the candidate's eager time worth of
    calls (1 to 1000). Returns the summaries, the calls per graph, and
    ``{candidate: why it has no graph}`` for those that could not be captured.
    """
    import torch

    graphs: dict[str, Any] = {}
    numbers: dict[str, int] = {}
    failed: dict[str, str] = {}
    for name, fn in fns.items():
        number = calls_per_sample(target_ms / 1e3, eager_us[name] * 1e-6, 1000)
        try:
            graphs[name] = capture(fn, number)
            numbers[name] = number
        except Exception as e:  # capture refuses host syncs, foreign streams, ...
            failed[name] = f"CUDA graph capture failed: {type(e).__name__}: {str(e).strip()[:200]}"
            torch.cuda.synchronize()
    if not graphs:
        return {}, numbers, failed
    ev = _events()
    samples = _rotated({n: functools.partial(_per_call, g.replay, numbers[n], ev) for n, g in graphs.items()},
                       rounds)
    del graphs
    return summary(samples), numbers, failed


def copy_bandwidth(device: Any, rounds: int, nbytes: int = COPY_BYTES) -> dict[str, Any]:
    """The device-to-device copy bandwidth: ``torch.empty_like(x).copy_(x)``, bytes read + written."""
    import torch

    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    stats, number = time_eager({"copy": lambda: torch.empty_like(x).copy_(x)}, rounds, 20.0)
    return {"bytes": 2 * nbytes, "us": stats["copy"], "number": number,
            "gbps": gbps(2 * nbytes, stats["copy"]["p50"])}
