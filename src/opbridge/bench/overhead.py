"""``opbridge bench overhead``: per-call cost of one tiny op, through every route.

All candidates compute ``x + y`` on 8-element float32 tensors (CPU, or with
``--device cuda`` one GPU, where what is timed is the host's launch cost), so the
kernel's own work is negligible and what is measured is the per-call
overhead of each route into it:

=========================  ===================================================
``torch.add``              the anchor: a native ATen op
``opbridge``               ``opbridge.ops.add(x, y)``, the public callable
``torch.ops.opbridge.add`` the same op through the torch dispatcher
``torch.ops.aten.add``     ``torch.ops.aten.add.Tensor``: an ATen op through the
                           same Python entry, the floor of any ``torch.ops`` call
``custom_op``              a ``torch.library.custom_op`` running ``torch.add``
``torch.library.impl``     ``Library("...", "DEF")`` + a Python CPU impl
``tvm_ffi_raw``            the compiled kernel called directly, output preallocated
``np.add``                 NumPy's add on the same data as ``numpy.ndarray``
``opbridge_numpy``         ``opbridge.ops.add`` on ``numpy.ndarray``
=========================  ===================================================

On CUDA the NumPy candidates and the CPU-only ``torch.library.impl`` are left
out, and the raw kernel runs on torch's current stream. Then
``torch.compile(fullgraph=True)`` of ``ops.add(x, y) * 2`` against
``torch.add(x, y) * 2``. Every candidate's result is checked against
``torch.add`` before anything is timed, and all candidates of a section are
timed interleaved (see :mod:`opbridge.bench.timing`).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from typing import Any

from opbridge.bench import POSITIVE_INT, BenchError, UsageError
from opbridge.bench.timing import interleaved, machine_info, ratio, summary

DESCRIPTION = (
    "Per-call overhead of x+y on 8-element float32 CPU tensors: torch.add, opbridge.ops.add, "
    "torch.ops.opbridge.add, a torch.library.custom_op, a torch.library.Library impl, the raw "
    "tvm-ffi kernel and the op on NumPy arrays, all timed interleaved in one process; then "
    "torch.compile(fullgraph=True) of ops.add(x, y) * 2 against torch.add(x, y) * 2."
)

ANCHOR = "torch.add"
NUMPY_ANCHOR = "np.add"
CANDIDATES: dict[str, str] = {
    "torch.add": "torch.add(x, y)",
    "opbridge": "opbridge.ops.add(x, y)  (public callable, eager fast path)",
    "torch.ops.opbridge.add": "torch.ops.opbridge.add(x, y)  (through the dispatcher)",
    "torch.ops.aten.add": "torch.ops.aten.add.Tensor(x, y)  (ATen through the same entry: the floor of torch.ops)",
    "custom_op": "torch.library.custom_op functional op calling torch.add",
    "torch.library.impl": "torch.library.Library DEF + Python CPU impl calling torch.add, via torch.ops",
    "tvm_ffi_raw": "loader.kernel(add, x.device.type)(out, x, y), out preallocated (on CUDA inside "
                   "tvm_ffi.use_raw_stream of torch's current stream)",
    "np.add": "np.add(x, y) on numpy arrays",
    "opbridge_numpy": "opbridge.ops.add(x, y) on numpy arrays",
}
COMPILED: dict[str, str] = {
    "compiled_opbridge": "torch.compile(fullgraph=True)(lambda x, y: ops.add(x, y) * 2)",
    "compiled_torch": "torch.compile(fullgraph=True)(lambda x, y: torch.add(x, y) * 2)",
    "eager_opbridge": "ops.add(x, y) * 2, eager",
    "eager_torch": "torch.add(x, y) * 2, eager",
}
_NUMEL = 8
_FULL = {"rounds": 200, "number": 500}
_QUICK = {"rounds": 20, "number": 150}
_COMPILE_DIVISOR = 5
# Framework objects registered once per process: torch namespaces cannot be
# defined twice, so a second run() in the same process reuses them.
_BASELINES: dict[str, Any] = {}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this benchmark's options to *parser*."""
    parser.add_argument("--repeat", type=POSITIVE_INT, metavar="N", default=None,
                        help=f"interleaved rounds (default {_FULL['rounds']}, "
                             f"{_QUICK['rounds']} with --quick)")
    parser.add_argument("--number", type=POSITIVE_INT, metavar="N", default=None,
                        help=f"calls per candidate per round (default {_FULL['number']}, "
                             f"{_QUICK['number']} with --quick)")
    parser.add_argument("--compile-backend", metavar="NAME", default=None,
                        help="torch.compile backend (default inductor; aot_eager with --quick)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile section")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the tensors live (default cpu; cuda times the launch cost on GPU 0)")


def _progress(msg: str) -> None:
    print(f"bench overhead: {msg}", file=sys.stderr, flush=True)


def _settings(args: argparse.Namespace) -> tuple[int, int, str | None]:
    defaults = _QUICK if args.quick else _FULL
    rounds = args.repeat if args.repeat is not None else defaults["rounds"]
    number = args.number if args.number is not None else defaults["number"]
    if args.no_compile:
        if args.compile_backend is not None:
            raise UsageError("--compile-backend picks the backend of the torch.compile section, which --no-compile "
                             "leaves out: give one or the other")
        return rounds, number, None
    return rounds, number, args.compile_backend or ("aot_eager" if args.quick else "inductor")


def _baselines() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The custom_op and Library-impl baselines, defined once per process."""
    import torch

    if not _BASELINES:

        # An explicit schema: this module's annotations are strings (PEP 563) naming a local torch.
        @torch.library.custom_op("opbridge_bench::cop_add", mutates_args=(),
                                 schema="(Tensor x, Tensor y) -> Tensor")
        def cop_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.add(x, y)

        @cop_add.register_fake
        def _(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.empty_like(x)

        lib = torch.library.Library("opbridge_bench2", "DEF")  # type: ignore[no-untyped-call]
        lib.define("lib_add(Tensor x, Tensor y) -> Tensor")  # type: ignore[no-untyped-call]
        lib.impl("lib_add", lambda x, y: torch.add(x, y), "CPU")  # type: ignore[no-untyped-call]
        _BASELINES.update(custom_op=cop_add, library=lib)
    return _BASELINES["custom_op"], torch.ops.opbridge_bench2.lib_add


def _eager_candidates(x: Any, y: Any) -> tuple[dict[str, Callable[[], object]], Any]:
    """``{name: bound call}`` for every eager candidate, and the raw kernel's output tensor."""
    import numpy as np
    import torch

    from opbridge import loader, ops

    custom_op, lib_add = _baselines()
    out = torch.empty_like(x)
    kern = loader.kernel(ops.add.opdef, x.device.type)  # type: ignore[attr-defined]
    fns: dict[str, Callable[[], object]] = {
        "torch.add": functools.partial(torch.add, x, y),
        "opbridge": functools.partial(ops.add, x, y),
        "torch.ops.opbridge.add": functools.partial(torch.ops.opbridge.add, x, y),
        "torch.ops.aten.add": functools.partial(torch.ops.aten.add.Tensor, x, y),
        "custom_op": functools.partial(custom_op, x, y),
    }
    if x.is_cuda:
        from opbridge._tvm import tvm_ffi

        tvm = tvm_ffi()
        dev, handle = tvm.device(f"cuda:{x.device.index or 0}"), torch.cuda.current_stream(x.device).cuda_stream

        def raw() -> None:
            with tvm.use_raw_stream(dev, handle):
                kern(out, x, y)

        fns["tvm_ffi_raw"] = raw
        return fns, out
    nx, ny = x.numpy(), y.numpy()
    fns.update({
        "torch.library.impl": functools.partial(lib_add, x, y),
        "tvm_ffi_raw": functools.partial(kern, out, x, y),
        "np.add": functools.partial(np.add, nx, ny),
        "opbridge_numpy": functools.partial(ops.add, nx, ny),
    })
    return fns, out


def _verify(fns: dict[str, Callable[[], object]], expected: Any, out: Any) -> None:
    """Check every candidate computes *expected*; *out* is where the raw kernel writes."""
    import numpy as np
    import torch

    for name, fn in fns.items():
        out.zero_()
        got = fn()
        if got is None:
            got = out
        if isinstance(got, np.ndarray):
            got = torch.from_numpy(got)
        if isinstance(got, torch.Tensor) and got.is_cuda:
            torch.cuda.synchronize(got.device)
        if not isinstance(got, torch.Tensor) or not torch.equal(got, expected):
            raise BenchError(f"candidate {name!r} computed {got!r}, expected torch.add's {expected!r}")


def _tensors(seed: int, device: str) -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randn(_NUMEL, generator=gen).to(device), torch.randn(_NUMEL, generator=gen).to(device)


def _eager_section(rounds: int, number: int, device: str) -> dict[str, Any]:
    import torch

    x, y = _tensors(0, device)
    fns, out = _eager_candidates(x, y)
    _verify(fns, torch.add(x, y), out)
    _progress(f"timing {len(fns)} eager candidates, {rounds} rounds x {number} calls, interleaved")
    stats = summary(interleaved(fns, rounds=rounds, number=number))
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    ratios = {f"{name}/{ANCHOR}": ratio(stats, name, ANCHOR) for name in stats if name != ANCHOR}
    if NUMPY_ANCHOR in stats:
        ratios[f"opbridge_numpy/{NUMPY_ANCHOR}"] = ratio(stats, "opbridge_numpy", NUMPY_ANCHOR)
    return {"candidates": {n: CANDIDATES[n] for n in fns}, "stats_us": stats, "ratios": ratios}


def _compile_one(fn: Callable[..., Any], backend: str, x: Any, y: Any) -> tuple[Callable[..., Any], float]:
    """``torch.compile`` *fn* and run it once; return the compiled callable and that first call's seconds."""
    import torch

    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    start = time.perf_counter()
    compiled(x, y)
    return compiled, round(time.perf_counter() - start, 3)


def _compile_section(backend: str, rounds: int, number: int, device: str) -> dict[str, Any]:
    import torch

    from opbridge import ops

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ops.add(x, y) * 2  # type: ignore[no-any-return]

    def g(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.add(x, y) * 2

    x, y = _tensors(1, device)
    slow = " (the first inductor compile can take a while)" if backend == "inductor" else ""
    _progress(f"torch.compile(fullgraph=True, backend={backend!r}) of ops.add(x, y) * 2{slow}")
    cf, f_seconds = _compile_one(f, backend, x, y)
    _progress(f"torch.compile(fullgraph=True, backend={backend!r}) of torch.add(x, y) * 2")
    cg, g_seconds = _compile_one(g, backend, x, y)
    fns: dict[str, Callable[[], object]] = {
        "compiled_opbridge": functools.partial(cf, x, y),
        "compiled_torch": functools.partial(cg, x, y),
        "eager_opbridge": functools.partial(f, x, y),
        "eager_torch": functools.partial(g, x, y),
    }
    expected = g(x, y)
    for name, fn in fns.items():
        got = fn()
        if not torch.equal(got, expected):  # type: ignore[arg-type]
            raise BenchError(f"{name!r} computed {got!r}, expected {expected!r}")
    _progress(f"timing {len(fns)} compiled/eager candidates, {rounds} rounds x {number} calls, interleaved")
    stats = summary(interleaved(fns, rounds=rounds, number=number))
    return {
        "backend": backend,
        "rounds": rounds,
        "number": number,
        "first_call_seconds": {"compiled_opbridge": f_seconds, "compiled_torch": g_seconds},
        "first_call_note": "includes compilation; torch's on-disk compile caches may shorten it",
        "candidates": COMPILED,
        "stats_us": stats,
        "ratios": {
            "compiled_opbridge/compiled_torch": ratio(stats, "compiled_opbridge", "compiled_torch"),
            "eager_opbridge/eager_torch": ratio(stats, "eager_opbridge", "eager_torch"),
            "compiled_opbridge/eager_opbridge": ratio(stats, "compiled_opbridge", "eager_opbridge"),
        },
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; see the module docstring."""
    rounds, number, backend = _settings(args)
    device = getattr(args, "device", "cpu")
    _progress("importing torch and opbridge, loading the kernels")
    import torch

    if backend is not None and backend not in torch.compiler.list_backends(exclude_tags=()):
        raise UsageError(f"--compile-backend: torch.compile has no backend {backend!r}; choose from "
                         f"{', '.join(torch.compiler.list_backends())} or a debug one such as aot_eager or eager")
    if device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: torch sees no CUDA GPU here")
    info = machine_info()
    info["torch_threads"] = torch.get_num_threads()
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    # the torch shim and NumPy's C entry, built before the timing (a background build takes idle CPU only)
    from opbridge.aot.natives import summary

    natives = summary(("torch", "numpy"))
    eager = _eager_section(rounds, number, device)
    result: dict[str, Any] = {
        "benchmark": "overhead",
        "quick": bool(args.quick),
        "machine": info,
        "device": device,
        "workload": f"x + y, {_NUMEL} x float32, {device.upper()}, eager"
                    + (" (host launch cost; kernels run asynchronously)" if device == "cuda" else ""),
        "rounds": rounds,
        "number": number,
        "natives": natives,
        **eager,
    }
    if backend is None:
        result["compile"] = {"skipped": "--no-compile"}
    else:
        # Compiled calls cost ~100x an eager add: fewer calls per round keep the section short.
        result["compile"] = _compile_section(backend, rounds, max(1, number // _COMPILE_DIVISOR), device)
    return result


def _table(stats: dict[str, dict[str, float]], ratios: dict[str, float],
           anchors: dict[str, str]) -> list[str]:
    lines = [f"  {'candidate':<24} {'p20 µs':>9} {'p50 µs':>9} {'p80 µs':>9}   p50 ratio"]
    for name, row in stats.items():
        base = anchors.get(name)
        key = f"{name}/{base}" if base else ""
        rel = f"{ratios[key]:.2f}x {base}" if key in ratios else "-"
        lines.append(f"  {name:<24} {row['p20']:>9.3f} {row['p50']:>9.3f} {row['p80']:>9.3f}   {rel}")
    return lines


def format_text(result: dict[str, Any]) -> str:
    """Render *result* as a readable report."""
    m = result["machine"]
    lines = [
        f"opbridge bench overhead: {result['workload']}",
        f"machine: {m['cpu_model']}, {m['cpus_usable']} CPUs, python {m['python']}, torch {m['torch']}, "
        f"tvm-ffi {m['tvm_ffi']}, torch threads {m['torch_threads']}, {m['date']}",
        f"{result['rounds']} interleaved rounds x {result['number']} calls per candidate",
        "",
    ]
    anchors = {n: ANCHOR for n in result["stats_us"] if n != ANCHOR}
    if "opbridge_numpy" in result["stats_us"]:
        anchors["opbridge_numpy"] = NUMPY_ANCHOR
    lines += _table(result["stats_us"], result["ratios"], anchors)
    if "opbridge_numpy/torch.add" in result["ratios"]:
        lines.append(f"  opbridge_numpy vs torch.add: {result['ratios']['opbridge_numpy/torch.add']:.2f}x")
    comp = result["compile"]
    lines.append("")
    if "skipped" in comp:
        lines.append(f"torch.compile section skipped ({comp['skipped']})")
        return "\n".join(lines)
    first = comp["first_call_seconds"]
    lines.append(f"torch.compile(fullgraph=True, backend={comp['backend']!r}); first call (compile) "
                 f"{first['compiled_opbridge']:.1f}s opbridge, {first['compiled_torch']:.1f}s torch; "
                 f"{comp['rounds']} rounds x {comp['number']} calls")
    lines += _table(comp["stats_us"], comp["ratios"],
                    {"compiled_opbridge": "compiled_torch", "eager_opbridge": "eager_torch"})
    return "\n".join(lines)
