"""``opbridge bench outputs``: what a large new output costs, and what opbridge's pool saves.

A call with a new output pays for the output's memory as well as for the
kernel. For each op, shape and dtype (NumPy arrays, and torch tensors where
torch is installed), four candidates run the same kernel, timed interleaved
in one process (:func:`opbridge.bench.parity_timing.calibrated_each`):

==============  ==============================================================
``pool``        ``opbridge.ops.<op>(...)``: the output from opbridge's pool
                (:mod:`opbridge.call.memory`): recycled, 2 MiB-aligned huge pages
``aligned``     into a new 2 MiB-aligned, advised buffer that is not recycled
                (an over-allocated ``np.empty``/``torch.empty`` sliced to the
                boundary): the pool with recycling off
``malloc``      into a new ``np.empty``/``torch.empty`` buffer with huge-page
                advice on its aligned interior: how outputs were made before
                the pool
``existing``    into one buffer allocated before timing (``out=``): the floor
==============  ==============================================================

and reports each one's time and minor page faults per call, and
``malloc / pool`` (what the pool gains) and ``pool / existing`` (what a new
output still costs). Every candidate's result equals the pool's.
"""

from __future__ import annotations

import argparse
import functools
import resource
from collections.abc import Callable
from typing import Any

from opbridge.bench import POSITIVE_FLOAT, ListOption
from opbridge.bench.parity_timing import calibrated_each, load_context
from opbridge.bench.timing import machine_info, ratio

DESCRIPTION = (
    "What a large new CPU output costs: opbridge.ops.<op> with its output from opbridge's pool "
    "(recycled, aligned huge pages) against the same kernel into a new aligned buffer that is not "
    "recycled, into a plain np.empty/torch.empty buffer with huge-page advice (how outputs were made "
    "before the pool) and into an existing buffer; NumPy and torch, interleaved, with page faults per call."
)

OPS = ("add", "rms_norm")
SHAPES = ((1024, 4096), (4096, 4096))
DTYPES = ("float32", "bfloat16")
_HUGE = 2 << 20
_FAULT_CALLS = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--frameworks", action=ListOption, choices=("numpy", "torch"), default=["numpy", "torch"],
                        help="array types to measure (default: both; torch is skipped where it is missing)")
    parser.add_argument("--row-seconds", type=POSITIVE_FLOAT, default=4.0, metavar="S",
                        help="about S seconds of timing per row (default 4)")


def _faults(fn: Callable[[], Any]) -> float:
    fn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(_FAULT_CALLS):
        fn()
    return round((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / _FAULT_CALLS, 1)


def advised_empty_like(like: Any) -> Any:
    """A new ``np.empty_like`` buffer with huge-page advice on its aligned interior: NumPy outputs before the pool."""
    import numpy as np

    from opbridge.call import memory

    out = np.empty_like(like)
    memory.advise_fresh(out.ctypes.data, out.nbytes)
    return out


class _NumPy:
    name = "numpy"

    def __init__(self) -> None:
        import numpy as np

        self.np = np

    def arrays(self, shape: tuple[int, int], dtype: str) -> tuple[Any, Any]:
        np = self.np
        rng = np.random.default_rng(0)
        x, w = rng.standard_normal(shape, np.float32), rng.standard_normal(shape[-1:], np.float32)
        if dtype == "bfloat16":
            import ml_dtypes

            return x.astype(ml_dtypes.bfloat16), w.astype(ml_dtypes.bfloat16)
        return x, w

    def empty(self, like: Any) -> Any:
        return advised_empty_like(like)

    def aligned(self, like: Any) -> Any:
        from opbridge.call import memory

        n = like.nbytes
        raw = self.np.empty(n + _HUGE, self.np.uint8)
        off = -raw.ctypes.data % _HUGE
        memory.advise_fresh(raw.ctypes.data + off, n)
        return raw[off:off + n].view(like.dtype).reshape(like.shape)

    def equal(self, a: Any, b: Any) -> bool:
        return bool((a.view(self.np.uint8) == b.view(self.np.uint8)).all())


class _Torch:
    name = "torch"

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def arrays(self, shape: tuple[int, int], dtype: str) -> tuple[Any, Any]:
        x, w = _NumPy().arrays(shape, "float32")
        dt = getattr(self.torch, dtype)
        return self.torch.from_numpy(x).to(dt), self.torch.from_numpy(w).to(dt)

    def empty(self, like: Any) -> Any:
        from opbridge.call import memory

        out = self.torch.empty_like(like)
        memory.advise_fresh(out.data_ptr(), out.nbytes)
        return out

    def aligned(self, like: Any) -> Any:
        from opbridge.call import memory

        n = like.nbytes
        raw = self.torch.empty(n + _HUGE, dtype=self.torch.uint8)
        off = -raw.data_ptr() % _HUGE
        memory.advise_fresh(raw.data_ptr() + off, n)
        return raw[off:off + n].view(like.dtype).view(like.shape)

    def equal(self, a: Any, b: Any) -> bool:
        return bool(self.torch.equal(a, b))


def _row(fw: Any, op: str, shape: tuple[int, int], dtype: str, target_s: float, budget_s: float) -> dict[str, Any]:
    from opbridge import ops

    fn = getattr(ops, op)
    x, w = fw.arrays(shape, dtype)
    args = (x, x) if op == "add" else (x, w)
    existing = fw.empty(x)

    def into(make: Callable[[Any], Any]) -> Any:
        return fn(*args, out=make(x))

    fns: dict[str, Callable[[], Any]] = {
        "pool": functools.partial(fn, *args),
        "aligned": functools.partial(into, fw.aligned),
        "malloc": functools.partial(into, fw.empty),
        "existing": functools.partial(fn, *args, out=existing),
    }
    ref = fns["pool"]()
    bad = [k for k, f in fns.items() if not fw.equal(f(), ref)]
    row: dict[str, Any] = {"framework": fw.name, "op": op, "shape": list(shape), "dtype": dtype, **load_context()}
    if bad:
        row["error"] = f"results differ from the pool's: {', '.join(bad)}"
        return row
    del ref
    stats, rounds, calls = calibrated_each(fns, target_s=target_s, rounds=40, min_rounds=5, budget_s=budget_s)
    row.update({"stats_us": stats, "rounds": rounds, "calls": calls,
                "malloc_over_pool": ratio(stats, "malloc", "pool"),
                "aligned_over_pool": ratio(stats, "aligned", "pool"),
                "pool_over_existing": ratio(stats, "pool", "existing"),
                "faults_per_call": {k: _faults(f) for k, f in fns.items()}})
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    import importlib.util
    import sys

    from opbridge.call import memory

    frameworks: list[Any] = []
    skipped: dict[str, str] = {}
    for name in args.frameworks:
        if importlib.util.find_spec(name) is None:
            skipped[name] = f"{name} is not installed"
            continue
        frameworks.append(_NumPy() if name == "numpy" else _Torch())
    quick = bool(args.quick)
    dtypes: tuple[str, ...]  # bfloat16 may be dropped below
    shapes, dtypes = (SHAPES[:1], DTYPES[:1]) if quick else (SHAPES, DTYPES)
    if importlib.util.find_spec("ml_dtypes") is None and "bfloat16" in dtypes:
        dtypes = tuple(d for d in dtypes if d != "bfloat16")
        skipped["bfloat16"] = "ml_dtypes is not installed (NumPy has no bfloat16 without it)"
    budget = 0.5 if quick else args.row_seconds
    from opbridge.aot.natives import summary

    # the native entries, built before the timing (a background build takes idle CPU only)
    natives = summary(tuple(fw.name for fw in frameworks))
    rows = []
    for fw in frameworks:
        for shape in shapes:
            for dtype in dtypes:
                for op in OPS:
                    print(f"bench outputs: {fw.name} {op} {shape[0]}x{shape[1]} {dtype}", file=sys.stderr, flush=True)
                    rows.append(_row(fw, op, shape, dtype, target_s=0.02, budget_s=budget))
    return {"benchmark": "outputs", "quick": quick, "machine": machine_info(), "natives": natives,
            "pool": memory.host_stats(),
            "skipped": skipped, "rows": rows, "ok": not any("error" in r for r in rows)}


def format_text(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [f"opbridge bench outputs: {m['cpu_model']}, {m['cpus_usable']} CPUs, {m['date']}",
             "ms per call (p50); malloc/pool = what the pool gains; pool/existing = what a new output still "
             "costs; minor page faults per call (pool/aligned/malloc/existing)",
             f"  {'array':<6} {'op':<9} {'shape':<10} {'dtype':<9} {'pool':>7} {'aligned':>8} {'malloc':>7} "
             f"{'existing':>8} {'malloc/pool':>11} {'pool/exist':>10}   faults"]
    for r in result["rows"]:
        head = f"  {r['framework']:<6} {r['op']:<9} {r['shape'][0]}x{r['shape'][1]:<5} {r['dtype']:<9}"
        if "error" in r:
            lines.append(f"{head} ERROR: {r['error']}")
            continue
        st, f = r["stats_us"], r["faults_per_call"]
        ms = [f"{st[k]['p50'] / 1e3:>7.2f}" for k in ("pool", "aligned", "malloc")]
        lines.append(f"{head} {ms[0]} {ms[1]:>8} {ms[2]} {st['existing']['p50'] / 1e3:>8.2f} "
                     f"{r['malloc_over_pool']:>10.2f}x {r['pool_over_existing']:>9.2f}x   "
                     f"{f['pool']:g}/{f['aligned']:g}/{f['malloc']:g}/{f['existing']:g}")
    for k, why in result["skipped"].items():
        lines.append(f"  skipped {k}: {why}")
    return "\n".join(lines)
