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

The source is kept here as a string and written into the JIT cache
directory on first use, so an installed wheel (which ships no ``.cc`` files
outside ``csrc``) measures STREAM too.
"""

from __future__ import annotations

import functools
import os
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

SOURCE = r"""// STREAM kernels for `opbridge bench kernels` (written by opbridge/bench/stream.py).
// Static schedule everywhere, so every kernel touches the pages its thread
// first touched in stream_fill_cpu.
#include <opbridge/opbridge.h>

#include <omp.h>

namespace {

using opbridge::TensorView;

float* f32(const char* op, const TensorView& t, int64_t n) {
  OPB_CHECK_DEVICE(op, t, kDLCPU);
  ::opbridge::check_dtype(op, "array", t, {::opbridge::kFloat32});
  OPB_CHECK_CONTIGUOUS(op, t);
  OPB_CHECK(t.numel() == n, ValueError) << op << ": arrays must have " << n << " elements, got "
                                        << t.numel();
  return opbridge::data_ptr<float>(t);
}

int team(int64_t threads) { return threads > 0 ? int(threads) : omp_get_max_threads(); }

}  // namespace

void stream_fill_cpu(TensorView a, double value, int64_t threads) {
  const int64_t n = a.numel();
  float* x = f32("stream_fill", a, n);
  const float v = float(value);
#pragma omp parallel for simd schedule(static) num_threads(team(threads))
  for (int64_t i = 0; i < n; ++i) x[i] = v;
}
OPBRIDGE_EXPORT(stream_fill_cpu);

void stream_copy_cpu(TensorView c, TensorView a, int64_t threads) {
  const int64_t n = a.numel();
  float* __restrict z = f32("stream_copy", c, n);
  const float* __restrict x = f32("stream_copy", a, n);
#pragma omp parallel for simd schedule(static) num_threads(team(threads))
  for (int64_t i = 0; i < n; ++i) z[i] = x[i];
}
OPBRIDGE_EXPORT(stream_copy_cpu);

void stream_scale_cpu(TensorView b, TensorView c, double s, int64_t threads) {
  const int64_t n = c.numel();
  float* __restrict y = f32("stream_scale", b, n);
  const float* __restrict z = f32("stream_scale", c, n);
  const float k = float(s);
#pragma omp parallel for simd schedule(static) num_threads(team(threads))
  for (int64_t i = 0; i < n; ++i) y[i] = k * z[i];
}
OPBRIDGE_EXPORT(stream_scale_cpu);

void stream_add_cpu(TensorView c, TensorView a, TensorView b, int64_t threads) {
  const int64_t n = a.numel();
  float* __restrict z = f32("stream_add", c, n);
  const float* __restrict x = f32("stream_add", a, n);
  const float* __restrict y = f32("stream_add", b, n);
#pragma omp parallel for simd schedule(static) num_threads(team(threads))
  for (int64_t i = 0; i < n; ++i) z[i] = x[i] + y[i];
}
OPBRIDGE_EXPORT(stream_add_cpu);

void stream_triad_cpu(TensorView a, TensorView b, TensorView c, double s, int64_t threads) {
  const int64_t n = b.numel();
  float* __restrict x = f32("stream_triad", a, n);
  const float* __restrict y = f32("stream_triad", b, n);
  const float* __restrict z = f32("stream_triad", c, n);
  const float k = float(s);
#pragma omp parallel for simd schedule(static) num_threads(team(threads))
  for (int64_t i = 0; i < n; ++i) x[i] = y[i] + k * z[i];
}
OPBRIDGE_EXPORT(stream_triad_cpu);

double stream_sum_cpu(TensorView a, int64_t threads) {
  const int64_t n = a.numel();
  const float* __restrict x = f32("stream_sum", a, n);
  double total = 0.0;
#pragma omp parallel for simd schedule(static) num_threads(team(threads)) reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) total += x[i];
  return total;
}
OPBRIDGE_EXPORT(stream_sum_cpu);
"""


def _source_path() -> Path:
    """Write :data:`SOURCE` into the private cache (only when it changed) and return its path."""
    from opbridge.build.cache import cache_root

    path = cache_root() / "bench" / "stream_kernels.cc"
    if not path.is_file() or path.read_text() != SOURCE:
        path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(SOURCE)
        os.replace(tmp, path)  # readers never see a half-written file
    return path


@functools.lru_cache(maxsize=1)
def library() -> Any:
    """The private ``opbridge_stream`` :class:`~opbridge.Library`, declared once per process."""
    from opbridge import Library, registry
    from opbridge.errors import DeclarationError

    path = _source_path()
    try:
        return Library(NAMESPACE, sources=[path], root=path.parent, python_module=__name__)
    except DeclarationError:  # declared earlier in this process (e.g. by a test)
        return registry.library(NAMESPACE)


def kernels() -> dict[str, Any]:
    """``{name: compiled tvm-ffi function}`` of the STREAM kernels (built on first use)."""
    mod = library().module("cpu")
    return {name: mod[f"stream_{name}_cpu"] for name in ("fill", *KERNELS)}


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
