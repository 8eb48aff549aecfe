"""STREAM on this machine, measured with a kernel built by opbridge itself.

The kernels of ``opbridge bench kernels`` are judged against the memory
bandwidth the machine actually delivers, measured in the same run: a
fraction of STREAM copy near 1 means a kernel moves its bytes as fast as
a plain copy loop can, and there is nothing left to gain but moving fewer
bytes.

The STREAM kernels (McCalpin's copy, scale, add, triad, plus a read-only
sum) are OpenMP loops over float32 arrays, compiled through opbridge's own
build machinery as the private library ``opbridge_stream`` (no ops, only
exported kernels), so they get the same compiler, flags and OpenMP runtime
as the ops they are compared with. Bytes are counted as STREAM does: each
array element read or written once, no write-allocate traffic.

``copy_chunked`` is the copy split as opbridge's kernels split their work
(``parallel_for``'s chunks, claimed as threads arrive), the local ceiling
``bench kernels`` times beside each case; ``update_chunked`` (``a[i] = s *
a[i]``, split the same way) is that ceiling for ops that update their
arguments in place. Neither is part of :func:`measure`.

The source is ``stream_kernels.cc`` beside this module, shipped in the
wheel as package data (``bench/*.cc``) and read at build time.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

NAMESPACE = "opbridge_stream"
#: Elements per array in a full run (64M float32 = 256 MiB each, well beyond any L3).
DEFAULT_N = 64 * 1024 * 1024
#: Elements per array with ``--quick``.
QUICK_N = 16 * 1024 * 1024
#: kernel -> (arrays touched per element, description)
KERNELS: dict[str, tuple[int, str]] = {
    "copy": (2, "c[i] = a[i]"),
    "scale": (2, "b[i] = s * c[i]"),
    "add": (3, "c[i] = a[i] + b[i]"),
    "triad": (3, "a[i] = b[i] + s * c[i]"),
    "sum": (1, "s += a[i] (read only)"),
}

#: The kernels' source, shipped beside this module (package data ``bench/*.cc``).
SOURCE_PATH = Path(__file__).with_name("stream_kernels.cc")


@functools.lru_cache(maxsize=1)
def library() -> Any:
    """The private ``opbridge_stream`` :class:`~opbridge.Library`, declared once per process."""
    from opbridge import Library, registry
    from opbridge.errors import DeclarationError

    path = SOURCE_PATH
    try:
        return Library(NAMESPACE, sources=[path], root=path.parent, python_module=__name__)
    except DeclarationError:  # declared earlier in this process (e.g. by a test)
        return registry.library(NAMESPACE)


def kernels() -> dict[str, Any]:
    """``{name: compiled tvm-ffi function}`` of the STREAM kernels (built on first use)."""
    mod = library().module("cpu")
    return {name: mod[f"stream_{name}_cpu"] for name in ("fill", "copy_chunked", "update_chunked", *KERNELS)}


def measure(n: int = DEFAULT_N, *, threads: int = 2, rounds: int = 10) -> dict[str, Any]:
    """Run STREAM on three float32 arrays of *n* elements with *threads* OpenMP threads.

    The kernels are timed interleaved (one call each per round, see
    :func:`opbridge.bench.timing.interleaved`) after the arrays are
    first-touched in parallel.

    Parameters
    ----------
    n
        Elements per array.
    threads
        OpenMP threads of every kernel.
    rounds
        Interleaved rounds; each gives one sample per kernel.

    Returns
    -------
    dict
        ``{"n", "threads", "rounds", "bytes_per_array", "kernels": {name: {"description",
        "bytes", "p20_us", "p50_us", "p80_us", "gbps_p50", "gbps_best"}}, "samples_s": {name: [...]}}``.
    """
    import numpy as np

    from opbridge.bench.timing import interleaved, summary

    k = kernels()
    a, b, c = (np.empty(n, dtype=np.float32) for _ in range(3))
    for arr, v in ((a, 1.0), (b, 2.0), (c, 0.0)):
        k["fill"](arr, v, threads)
    fns = {
        "copy": lambda: k["copy"](c, a, threads),
        "scale": lambda: k["scale"](b, c, 3.0, threads),
        "add": lambda: k["add"](c, a, b, threads),
        "triad": lambda: k["triad"](a, b, c, 3.0, threads),
        "sum": lambda: k["sum"](a, threads),
    }
    samples = interleaved(fns, rounds=rounds, number=1, warmup=2)
    stats = summary(samples)
    out: dict[str, Any] = {}
    for name, (arrays, desc) in KERNELS.items():
        nbytes = arrays * n * 4
        row = stats[name]
        out[name] = {
            "description": desc,
            "bytes": nbytes,
            "p20_us": row["p20"],
            "p50_us": row["p50"],
            "p80_us": row["p80"],
            "gbps_p50": round(nbytes / (row["p50"] * 1e-6) / 1e9, 3),
            "gbps_best": round(nbytes / min(samples[name]) / 1e9, 3),
        }
    return {"n": n, "threads": threads, "rounds": rounds, "bytes_per_array": n * 4, "kernels": out,
            "samples_s": samples}


def copy_gbps(passes: list[dict[str, Any]]) -> float:
    """STREAM copy GB/s over all *passes*: the median of every copy sample (the reference for fractions)."""
    from opbridge.bench.timing import percentile

    secs = [s for p in passes for s in p["samples_s"]["copy"]]
    nbytes = passes[0]["kernels"]["copy"]["bytes"]
    return round(float(nbytes) / percentile(secs, 50) / 1e9, 3)
