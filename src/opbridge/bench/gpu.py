"""``opbridge bench gpu``: the CUDA kernels against the GPU's copy bandwidth, torch eager and torch.compile.

For each memory-bound op with a workload in :mod:`opbridge.bench.workloads`
(add, gelu, gelu_backward, rms_norm, rms_norm_backward, silu_and_mul,
gelu_and_mul, fused_add_rms_norm; the ones declared), at one large size
(default ``(8192, 8192)``, ``--quick`` ``(4096, 4096)``) in float32 and
bfloat16, on one CUDA device, these candidates compute the same result:

================  =========  ==========================================================
candidate         mode       what is called
================  =========  ==========================================================
``opbridge_out``  out        ``ops.<op>(..., out=buf)`` into an existing buffer
                  inplace    ``ops.<op>(...)`` for an op that mutates its arguments
``opbridge_new``  new        ``ops.<op>(...)``, a new output every call
``eager_new``     new        torch eager, the workload's formula
``eager_out``     out        torch eager into buffers (or in place), where torch can
``compile_new``   new        ``torch.compile(fullgraph=True, dynamic=False)`` of the formula
================  =========  ==========================================================

Every candidate is checked against opbridge's result on fresh copies of the
inputs (the op's tolerances, doubled: both sides approximate the exact
value) before anything is timed; a mismatch raises
:class:`~opbridge.bench.BenchError`. Timing uses CUDA events around
``number`` back-to-back calls (about 20 ms of GPU time), the candidates of
a case interleaved over the rounds, and reports per-call p20/p50/p80.

Bytes moved count each Tensor argument read once and each result written
once (:func:`opbridge.bench.workloads.bytes_moved`); GB/s is bytes over the
median time. The reference is the GPU's device-to-device copy bandwidth,
``torch.empty_like(x).copy_(x)`` of a 1 GiB tensor (bytes read + written),
measured at the start and at the end of the same run; fractions use the
higher of the two. Speed-ups are the competitor's median over opbridge's in
the same mode (> 1: opbridge is faster).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

from opbridge.bench import BenchError
from opbridge.bench.timing import dist_version, machine_info, summary

DESCRIPTION = (
    "CUDA kernels at large sizes on one GPU: each memory-bound op (add, gelu, rms_norm, the gated "
    "activations, fused_add_rms_norm, and their backward ops where declared) in float32 and bfloat16, "
    "opbridge into a buffer and with a new output, against torch eager and torch.compile; verified "
    "before timing, timed with CUDA events, interleaved; GB/s and the fraction of the GPU's own "
    "device-to-device copy bandwidth, measured in the same run. Without a CUDA GPU it reports why and "
    "measures nothing."
)

OPS = ("add", "gelu", "gelu_backward", "rms_norm", "rms_norm_backward", "silu_and_mul", "gelu_and_mul",
       "fused_add_rms_norm")
DTYPES = ("float32", "bfloat16")
DEFAULT_SIZE = (8192, 8192)
QUICK_SIZE = (4096, 4096)
COPY_BYTES = 1 << 30
TARGET_MS = 20.0

OURS_OUT, OURS_NEW = "opbridge_out", "opbridge_new"
EAGER_NEW, EAGER_OUT, COMPILE_NEW = "eager_new", "eager_out", "compile_new"
#: competitor -> the opbridge candidate of the same mode
_SAME_MODE = {EAGER_NEW: OURS_NEW, COMPILE_NEW: OURS_NEW, EAGER_OUT: OURS_OUT}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``opbridge bench gpu``."""
    parser.add_argument("--ops", nargs="+", metavar="OP", default=None,
                        help=f"ops to time (default: {', '.join(OPS)}, those declared)")
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "float16", "bfloat16"),
                        default=list(DTYPES), help="dtypes (default: float32 bfloat16)")
    parser.add_argument("--size", type=int, nargs=2, metavar=("ROWS", "COLS"), default=None,
                        help=f"size (default {DEFAULT_SIZE}; --quick {QUICK_SIZE})")
    parser.add_argument("--rounds", type=int, metavar="N", default=None,
                        help="interleaved rounds per case (default 15; --quick 5)")
    parser.add_argument("--device", type=int, metavar="INDEX", default=0,
                        help="CUDA device index (default 0)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile candidate")


def unavailable() -> str | None:
    """Why there is no CUDA GPU to measure in this process, or None if there is one."""
    try:
        import torch
    except ImportError:
        return "no CUDA GPU: torch is not installed"
    if not torch.cuda.is_available():
        built = torch.version.cuda
        build = f"built for CUDA {built}" if built else "a CPU-only build"
        return f"no CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, {build})"
    return None


# -- timing ----------------------------------------------------------------------------------------


def time_cuda(fns: dict[str, Callable[[], Any]], rounds: int,
              target_ms: float = TARGET_MS) -> tuple[dict[str, dict[str, float]], int]:
    """Per-call seconds of each candidate (p20/p50/p80 over *rounds*) and the calls per sample.

    Each sample is one CUDA-event-timed run of ``number`` back-to-back calls
    on the current stream; round ``r`` runs the candidates rotated by ``r``.
    """
    import torch

    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]

    def timed(fn: Callable[[], Any], number: int) -> float:
        start.record()
        for _ in range(number):
            fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3 / number

    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    slowest_ms = max(timed(fn, 1) for fn in fns.values()) * 1e3
    number = max(1, min(1000, round(target_ms / max(slowest_ms, 1e-3))))
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            samples[n].append(timed(fns[n], number))
    return summary(samples), number


def copy_bandwidth(device: Any, rounds: int, nbytes: int = COPY_BYTES) -> dict[str, Any]:
    """The device-to-device copy bandwidth: ``torch.empty_like(x).copy_(x)``, bytes read + written."""
    import torch

    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    stats, number = time_cuda({"copy": lambda: torch.empty_like(x).copy_(x)}, rounds)
    p50 = stats["copy"]["p50"]
    return {"bytes": 2 * nbytes, "seconds": stats["copy"], "number": number, "gbps": 2 * nbytes / p50 / 1e9}


# -- candidates --------------------------------------------------------------------------------------

# bind(args) -> (zero-argument call, ret -> results to verify: new outputs, then mutated arguments)
Bind = Callable[[list[Any]], tuple[Callable[[], Any], Callable[[Any], tuple[Any, ...]]]]


def _as_tuple(x: Any) -> tuple[Any, ...]:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _mutated(op: Any) -> list[int]:
    return [i for i, a in enumerate(op.schema.arguments) if a.is_mutated]


def _outputs(op: Any, args: Sequence[Any]) -> list[Any]:
    """NaN-filled output buffers on the lead argument's device (a result left unwritten shows)."""
    import torch

    device = args[op.dispatch_arg].device
    return [torch.full(tuple(sp.shape), float("nan"), device=device,
                       dtype=sp.dtype if isinstance(sp.dtype, torch.dtype) else getattr(torch, str(sp.dtype)))
            for sp in op.output_specs(args)]


def candidates(op: Any, impl: Any, compiled: Callable[..., Any] | None) -> dict[str, tuple[str, str, Bind]]:
    """``{name: (mode, what, bind)}`` for *op*: opbridge's and, given a torch *impl*, torch's."""
    mut = _mutated(op)
    cands: dict[str, tuple[str, str, Bind]] = {}

    def mutated_results(args: Sequence[Any]) -> tuple[Any, ...]:
        return tuple(args[i] for i in mut)

    if op.n_outputs:
        def ours_out(args: list[Any]) -> Any:
            outs = _outputs(op, args)
            target = outs[0] if len(outs) == 1 else tuple(outs)
            return functools.partial(op.call, *args, out=target), lambda _r: (*outs, *mutated_results(args))

        def ours_new(args: list[Any]) -> Any:
            return (functools.partial(op.call, *args),
                    lambda r: (*_as_tuple(r)[:op.n_outputs], *mutated_results(args)))

        cands[OURS_OUT] = ("out", f"ops.{op.name}(..., out=buf)", ours_out)
        cands[OURS_NEW] = ("new", f"ops.{op.name}(...), new output", ours_new)
    else:
        def ours_inplace(args: list[Any]) -> Any:
            return functools.partial(op.call, *args), lambda _r: mutated_results(args)

        cands[OURS_OUT] = ("inplace", f"ops.{op.name}(...), in place", ours_inplace)
    if impl is None:
        return cands

    def eager_new(args: list[Any]) -> Any:
        return functools.partial(impl.new, *args), _as_tuple

    cands[EAGER_NEW] = ("new", impl.what or "torch formula", eager_new)
    if impl.out is not None:
        if op.n_outputs:
            def eager_out(args: list[Any]) -> Any:
                outs = _outputs(op, args)
                return functools.partial(impl.out, *args, outs), lambda _r: (*outs, *mutated_results(args))

            cands[EAGER_OUT] = ("out", impl.out_note or "torch, into buffers", eager_out)
        else:
            def eager_inplace(args: list[Any]) -> Any:
                return functools.partial(impl.out, *args), lambda _r: mutated_results(args)

            cands[EAGER_OUT] = ("inplace", impl.out_note or "torch, in place", eager_inplace)
    if compiled is not None:
        def compile_new(args: list[Any]) -> Any:
            return functools.partial(compiled, *args), _as_tuple

        what = f"torch.compile(fullgraph=True, dynamic=False) of {impl.what or 'the formula'}"
        cands[COMPILE_NEW] = ("new", what, compile_new)
    return cands


# -- one case ------------------------------------------------------------------------------------------


def make_args(op: Any, wl: Any, size: tuple[int, int], dtype: str, device: Any, seed: int = 0) -> list[Any]:
    """Schema-ordered arguments of *op* at *size* on *device*: standard-normal tensors, then scalars."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = wl.shapes(size)
    args: list[Any] = []
    for a in op.schema.arguments:
        if a.type.is_tensor:
            shape = shapes.get(a.name)
            if shape is None:
                if a.type.optional:
                    args.append(None)
                    continue
                raise BenchError(f"{op.name}: the workload gives no shape for Tensor argument {a.name!r}")
            t = torch.randn(shape, generator=gen, dtype=torch.float32, device=device)
            args.append(t.to(getattr(torch, dtype)))
        elif a.name in wl.scalars:
            args.append(wl.scalars[a.name])
        elif a.has_default:
            args.append(a.default)
        else:
            raise BenchError(f"{op.name}: no value for argument {a.name!r}; give the workload scalars")
    return args


def _clone(args: Sequence[Any]) -> list[Any]:
    return [a.clone() if hasattr(a, "clone") else a for a in args]


def _check(op: Any, label: str, name: str, got: Sequence[Any], expected: Sequence[Any], dtype: str) -> None:
    from opbridge.testing.compare import assert_close

    if len(got) != len(expected):
        raise BenchError(f"{label}: {name} gave {len(got)} result(s), opbridge {len(expected)}")
    rtol, atol = op.tolerance(dtype)
    for j, (g, e) in enumerate(zip(got, expected, strict=True)):
        try:
            assert_close(g.cpu(), e.cpu(), rtol=2 * rtol, atol=2 * atol, dtype=dtype, name=f"result {j}")
        except AssertionError as err:
            raise BenchError(f"{label}: candidate {name!r} disagrees with opbridge:\n{err}") from None


def _expected(op: Any, cands: dict[str, tuple[str, str, Bind]], pristine: list[Any]) -> tuple[Any, ...]:
    name = OURS_NEW if OURS_NEW in cands else OURS_OUT
    fn, get = cands[name][2](_clone(pristine))
    return tuple(t.clone() for t in get(fn()))


def choose_torch(op: Any, wl: Any, device: Any) -> Any:
    """The first torch variant of *wl* whose float32 result matches opbridge's on the GPU, or None."""
    if not wl.torch:
        return None
    pristine = make_args(op, wl, (4, 256), "float32", device, seed=1)
    expected = _expected(op, candidates(op, None, None), pristine)
    errors = []
    for impl in wl.torch:
        try:
            _check(op, f"{op.name} (4, 256) float32", EAGER_NEW, _as_tuple(impl.new(*_clone(pristine))),
                   expected, "float32")
            return impl
        except BenchError as e:
            errors.append(str(e))
    raise BenchError(errors[0])


def run_case(op: Any, wl: Any, impl: Any, size: tuple[int, int], dtype: str, device: Any, rounds: int,
             use_compile: bool) -> dict[str, Any]:
    """Verify and time every candidate of *op* at *size* and *dtype*; return the case's record."""
    import torch

    from opbridge.bench.workloads import bytes_moved

    label = f"{op.name} {size} {dtype}"
    pristine = make_args(op, wl, size, dtype, device)
    notes: list[str] = []
    compiled = None
    if impl is not None and use_compile:
        try:
            compiled = torch.compile(impl.new, fullgraph=True, dynamic=False)
            compiled(*_clone(pristine))  # type: ignore[no-untyped-call]  # compile now, not while timing
        except Exception as e:  # any compiler failure only drops the candidate
            compiled = None
            notes.append(f"compile_new dropped: torch.compile failed: {type(e).__name__}: {str(e)[:300]}")
    cands = candidates(op, impl, compiled)
    expected = _expected(op, cands, pristine)
    for name, (_mode, _what, bind) in cands.items():
        fn, get = bind(_clone(pristine))
        _check(op, label, name, get(fn()), expected, dtype)
    del expected
    fns = {name: bind(_clone(pristine))[0] for name, (_m, _w, bind) in cands.items()}
    stats, number = time_cuda(fns, rounds)
    moved = bytes_moved(op, pristine)["total"]
    record: dict[str, Any] = {"op": op.name, "dtype": dtype, "size": list(size), "bytes": moved,
                              "number": number, "rounds": rounds, "candidates": {}, "notes": notes}
    for name, (mode, what, _bind) in cands.items():
        s = stats[name]
        record["candidates"][name] = {"mode": mode, "what": what, "seconds": s,
                                      "gbps": moved / s["p50"] / 1e9}
    for name, base in _SAME_MODE.items():
        if name in stats and base in stats:
            record["candidates"][name]["speedup_vs_opbridge"] = stats[name]["p50"] / stats[base]["p50"]
    del fns, pristine
    torch.cuda.empty_cache()
    return record


# -- the benchmark -------------------------------------------------------------------------------------


def _gpu_info(device: Any) -> dict[str, Any]:
    import torch

    p = torch.cuda.get_device_properties(device)
    return {"name": p.name, "capability": f"{p.major}.{p.minor}",
            "memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count,
            "torch_cuda": torch.version.cuda}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the GPU benchmark; ``{"skipped": "no CUDA GPU: ..."}`` where there is none."""
    reason = unavailable()
    if reason is not None:
        return {"skipped": reason}
    import sys

    import torch

    from opbridge import ops
    from opbridge.bench.workloads import workloads
    from opbridge.build.compile import nvcc_path

    if nvcc_path() is None:
        raise BenchError("nvcc was not found: the CUDA kernels cannot be built (install the CUDA toolkit)")
    quick = bool(getattr(args, "quick", False))
    size = tuple(args.size) if args.size else (QUICK_SIZE if quick else DEFAULT_SIZE)
    rounds = args.rounds or (5 if quick else 15)
    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)

    started = time.perf_counter()
    ops.LIBRARY.module("cuda")
    build_s = time.perf_counter() - started

    wls = workloads()
    skipped: dict[str, str] = {}
    names = list(args.ops or OPS)
    for n in names:
        if n not in ops.LIBRARY.ops:
            skipped[n] = "not declared"
        elif n not in wls:
            skipped[n] = "no workload in opbridge.bench.workloads"
        elif "cuda" not in ops.LIBRARY.ops[n].kernels:
            skipped[n] = "no CUDA kernel declared"
    names = [n for n in names if n not in skipped]

    print(f"gpu: {torch.cuda.get_device_name(device)}; copy bandwidth...", file=sys.stderr)
    copy_before = copy_bandwidth(device, rounds)
    results = []
    for n in names:
        op, wl = ops.LIBRARY.ops[n], wls[n]
        impl = choose_torch(op, wl, device)
        for dtype in args.dtypes:
            print(f"gpu: {n} {size} {dtype}", file=sys.stderr)
            results.append(run_case(op, wl, impl, size, dtype, device, rounds, not args.no_compile))
    copy_after = copy_bandwidth(device, rounds)
    ref = max(copy_before["gbps"], copy_after["gbps"])
    for rec in results:
        for c in rec["candidates"].values():
            c["copy_fraction"] = c["gbps"] / ref
    return {
        "benchmark": "gpu",
        "machine": machine_info(),
        "gpu": _gpu_info(device),
        "versions": {"torch": torch.__version__, "opbridge": dist_version("opbridge"),
                     "apache-tvm-ffi": dist_version("apache-tvm-ffi")},
        "size": list(size),
        "cuda_module_load_s": build_s,
        "copy": {"before": copy_before, "after": copy_after, "reference_gbps": ref},
        "results": results,
        "skipped_ops": skipped,
    }


def format_text(result: dict[str, Any]) -> str:
    """A readable report of :func:`run`'s result."""
    if isinstance(result.get("skipped"), str):
        return f"opbridge bench gpu: skipped: {result['skipped']}"
    gpu, copy = result["gpu"], result["copy"]
    lines = [
        f"GPU: {gpu['name']} (compute capability {gpu['capability']}, {gpu['memory_gib']} GiB, "
        f"torch CUDA {gpu['torch_cuda']})",
        f"copy bandwidth (empty_like(x).copy_(x), 1 GiB): {copy['before']['gbps']:.0f} GB/s before, "
        f"{copy['after']['gbps']:.0f} GB/s after; reference {copy['reference_gbps']:.0f} GB/s",
        f"size {tuple(result['size'])}; per-call p50 in us; fraction of copy bandwidth; "
        "speed-up = theirs / ours",
        "",
        f"{'op':<20} {'dtype':<9} {'candidate':<13} {'mode':<8} {'p50 us':>9} {'GB/s':>7} {'copy':>5} "
        f"{'speed-up':>8}",
    ]
    for rec in result["results"]:
        for name, c in rec["candidates"].items():
            sp = c.get("speedup_vs_opbridge")
            lines.append(f"{rec['op']:<20} {rec['dtype']:<9} {name:<13} {c['mode']:<8} "
                         f"{c['seconds']['p50'] * 1e6:>9.1f} {c['gbps']:>7.0f} {c['copy_fraction']:>5.2f} "
                         f"{'' if sp is None else f'{sp:.2f}x':>8}")
        lines += [f"  note: {n}" for n in rec["notes"]]
    for n, why in result.get("skipped_ops", {}).items():
        lines.append(f"skipped {n}: {why}")
    return "\n".join(lines)
