"""``opbridge bench gpu``: the CUDA kernels at serving and large sizes, against their peers.

For each memory-bound op with a workload in :mod:`opbridge.bench.workloads`
(add, gelu, gelu_backward, rms_norm, rms_norm_backward, silu_and_mul,
gelu_and_mul, silu_and_mul_backward, gelu_and_mul_backward,
fused_add_rms_norm; the ones declared), in float32 and bfloat16, at the
serving sizes (rows 1, 8, 256 and 4096 of hidden size 4096; the gated ops'
``x`` is ``(rows, 2 * 14336)``, their backward's ``grad`` ``(rows, 14336)``)
and one large size (default ``(8192, 8192)``), these candidates compute the
same result:

================  =========  ==========================================================
candidate         mode       what is called
================  =========  ==========================================================
``opbridge_out``  out        ``ops.<op>(..., out=buf)`` into an existing buffer
                  inplace    ``ops.<op>(...)`` for an op that mutates its arguments
``opbridge_new``  new        ``ops.<op>(...)``, a new output every call
``eager_new``     new        torch eager, the workload's formula (a gated op's backward: the
                             gradient torch.autograd computes for ``act(a) * b``, written out)
``eager_out``     out        torch eager into buffers (or in place), where torch can
``compile_new``   new        ``torch.compile(fullgraph=True, dynamic=False)`` of the formula
``liger``         new        Liger-Kernel's Triton kernel (the norms, the gated ops and their
                             backward), if installed
================  =========  ==========================================================

Verification
    Every candidate, opbridge's included, is checked before it is timed
    against the op's NumPy reference run in float64 on the same inputs,
    within the op's tolerance for the dtype, grown by ``sqrt(n)`` for a
    result that sums over ``n`` rows (``rms_norm_backward``'s weight
    gradient; :mod:`opbridge.bench.verify`). A candidate that disagrees is
    reported (text and JSON, ``mismatches`` and ``problems``), left out of
    the timing, and the run goes on; the result then has ``"ok": false``,
    which makes ``opbridge bench gpu`` exit non-zero after its report.
Timing
    Eager: CUDA events around ``number`` back-to-back calls, host overhead
    and launch included. CUDA graph: the same calls captured once and
    replayed, the kernels alone (:mod:`.timing`). Candidates are interleaved
    over the rounds; p20/p50/p80 per call, in µs.
Bandwidth
    Bytes moved count each Tensor argument read once and each result written
    once (:func:`opbridge.bench.workloads.bytes_moved`; a gated backward
    reads ``x`` (2d wide) and ``grad`` (d) and writes ``grad_x`` (2d)); GB/s is bytes over
    the median time (in a graph where there is one). The reference is the
    GPU's device-to-device copy, ``torch.empty_like(x).copy_(x)`` of 1 GiB
    (bytes read + written), measured at the start and the end of the run.
    Speed-ups are the competitor's median over opbridge's in the same mode
    (> 1: opbridge is faster).

``--quick`` runs rows 8 and 4096 only, no large size and no Inductor (each
shape would compile anew), five rounds: under two minutes on one GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from opbridge.bench import NON_NEGATIVE_INT, POSITIVE_INT, BenchError, ListOption, UsageError, check_declared
from opbridge.bench.gpu.cases import LARGE, QUICK_ROWS, SERVING_ROWS, Size, problems, sizes_for, standing
from opbridge.bench.gpu.text import CSV_FIELDS, csv_rows, format_text
from opbridge.bench.timing import dist_version

DESCRIPTION = (
    "CUDA kernels on one GPU at serving sizes (rows 1, 8, 256, 4096; hidden 4096, gated ops 14336) and a "
    "large size: each memory-bound op in float32 and bfloat16, opbridge into a buffer and with a new output, "
    "against torch eager, torch.compile and Liger-Kernel (if installed); every candidate verified against a "
    "float64 reference (a mismatch is reported and the exit status is 1); timed eagerly (launch included) and "
    "inside CUDA graphs (kernels alone); GB/s and the fraction of the GPU's device-to-device copy bandwidth. "
    "Without a CUDA GPU it reports why and measures nothing."
)

#: the default ops, each forward before its backward
OPS = ("add", "gelu", "gelu_backward", "rms_norm", "rms_norm_backward", "silu_and_mul", "gelu_and_mul",
       "silu_and_mul_backward", "gelu_and_mul_backward", "fused_add_rms_norm")
DTYPES = ("float32", "bfloat16")
DEFAULT_SIZE = LARGE
TARGET_MS = {"eager": 20.0, "graph": 5.0}
#: competitor -> the opbridge candidate of the same mode
SAME_MODE = {"eager_new": "opbridge_new", "compile_new": "opbridge_new", "liger": "opbridge_new",
             "eager_out": "opbridge_out"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``opbridge bench gpu``."""
    parser.add_argument("--ops", action=ListOption, metavar="OP", default=None,
                        help=f"ops to time, as words or comma-separated (default: {', '.join(OPS)}, where declared)")
    parser.add_argument("--dtypes", action=ListOption, choices=("float32", "float16", "bfloat16"),
                        default=list(DTYPES), help="dtypes, as words or comma-separated (default: float32 bfloat16)")
    parser.add_argument("--rows", action=ListOption, type=POSITIVE_INT, nargs="*", metavar="N", default=None,
                        help=f"serving rows, as words or comma-separated (default {','.join(map(str, SERVING_ROWS))}; "
                             f"--quick {','.join(map(str, QUICK_ROWS))}; --rows alone: none, only the large size)")
    parser.add_argument("--size", type=POSITIVE_INT, nargs=2, metavar=("ROWS", "COLS"), default=None,
                        help=f"the large size (default {DEFAULT_SIZE[0]} {DEFAULT_SIZE[1]}; left out with --quick)")
    parser.add_argument("--no-large", action="store_true", help="leave out the large size")
    parser.add_argument("--rounds", type=POSITIVE_INT, metavar="N", default=None,
                        help="interleaved rounds per case (default 15; --quick 5)")
    parser.add_argument("--device", type=NON_NEGATIVE_INT, metavar="INDEX", default=0,
                        help="CUDA device index (default 0)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile candidate")
    parser.add_argument("--no-graphs", action="store_true", help="time eagerly only (no CUDA graphs)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="also write results.json and results.csv into DIR")


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


def plan_sizes(args: argparse.Namespace, op_name: str) -> list[Size]:
    """The sizes *op_name* runs at under *args* (``--rows``, ``--size``, ``--no-large``, ``--quick``)."""
    quick = bool(getattr(args, "quick", False))
    rows = args.rows if args.rows is not None else (QUICK_ROWS if quick else SERVING_ROWS)
    large = None if args.no_large or (quick and args.size is None) else tuple(args.size or DEFAULT_SIZE)
    return sizes_for(op_name, rows, large)  # type: ignore[arg-type]


def check_options(args: argparse.Namespace) -> None:
    """Refuse what argparse cannot (:class:`~opbridge.errors.UsageError`): an op that is not declared, and
    options that do not go together. Needs no GPU (nor torch): :func:`run` calls it before looking for one."""
    check_declared(args.ops)
    if args.no_large and args.size is not None:
        raise UsageError("--size sets the large size, which --no-large leaves out: give one or the other")
    quick_large = bool(getattr(args, "quick", False)) and args.size is None
    if args.rows == [] and (args.no_large or quick_large):
        raise UsageError(f"--rows without a value leaves out the serving sizes, and "
                         f"{'--no-large' if args.no_large else '--quick (without --size)'} the large one: nothing "
                         f"would run")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the GPU benchmark; ``{"skipped": "no CUDA GPU: ..."}`` where there is none."""
    check_options(args)
    reason = unavailable()
    if reason is not None:
        return {"skipped": reason}
    import torch

    from opbridge import ops
    from opbridge.bench.gpu.device import choose_torch, run_case
    from opbridge.bench.gpu.peers import liger_impls, liger_missing
    from opbridge.bench.gpu.timing import copy_bandwidth
    from opbridge.bench.report import checked_result, say, write_json, write_results
    from opbridge.bench.workloads import left_out, workloads
    from opbridge.build.toolchain import nvcc_path

    if nvcc_path() is None:
        raise BenchError("nvcc was not found: the CUDA kernels cannot be built (install the CUDA toolkit)")
    quick = bool(getattr(args, "quick", False))
    rounds = args.rounds or (5 if quick else 15)
    use_compile = not (args.no_compile or quick)
    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)

    started = time.perf_counter()
    ops.LIBRARY.module("cuda")
    build_s = time.perf_counter() - started
    # the torch shim, built before the timing (a background build takes idle CPU only)
    from opbridge.aot.natives import summary

    natives = summary(("torch",))

    wls, liger = workloads(), liger_impls()
    names = list(args.ops or OPS)
    skipped = left_out(names, ops.LIBRARY.ops, wls, device="cuda")
    names = [n for n in names if n not in skipped]

    say("gpu", f"{torch.cuda.get_device_name(device)}; copy bandwidth...")
    copy_before = copy_bandwidth(device, rounds)
    results = []
    for n in names:
        op, wl = ops.LIBRARY.ops[n], wls[n]
        impl = choose_torch(op, wl, device)
        for size in plan_sizes(args, n):
            for dtype in args.dtypes:
                say("gpu", f"{n} {size.label} {tuple(size.rows_cols)} {dtype}")
                results.append(run_case(op, wl, impl, liger.get(n), size, dtype, device, rounds,
                                        use_compile=use_compile, graphs=not args.no_graphs, pairs=SAME_MODE,
                                        target_ms=TARGET_MS))
    copy_after = copy_bandwidth(device, rounds)
    ref = max(copy_before["gbps"], copy_after["gbps"])
    for rec in results:
        for c in rec["candidates"].values():
            c["copy_fraction"] = round(c["gbps"] / ref, 4)
    bad = problems(results)
    result: dict[str, Any] = {
        **checked_result("gpu", quick, bad),
        "gpu": _gpu_info(device),
        "versions": {"torch": torch.__version__, "opbridge": dist_version("opbridge"),
                     "apache-tvm-ffi": dist_version("apache-tvm-ffi"), "liger-kernel": dist_version("liger-kernel"),
                     "triton": dist_version("triton")},
        "settings": {"rounds": rounds, "compile": use_compile, "graphs": not args.no_graphs,
                     "target_ms": TARGET_MS},
        "liger": liger_missing() or "installed",
        "cuda_module_load_s": round(build_s, 3),
        "natives": natives,
        "copy": {"before": copy_before, "after": copy_after, "reference_gbps": ref},
        "results": results,
        "standing": standing(results),
        "skipped_ops": skipped,
    }
    if args.out:
        result["files"] = write_results(result, Path(args.out), CSV_FIELDS, csv_rows(result), None, bench="gpu")
        write_json(result, result["files"]["json"])
    if bad:
        print(f"bench gpu: {len(bad)} candidate(s) disagree with the float64 reference (see the report)",
              file=sys.stderr)
    return result


def _gpu_info(device: Any) -> dict[str, Any]:
    import torch

    p = torch.cuda.get_device_properties(device)
    return {"name": p.name, "capability": f"{p.major}.{p.minor}",
            "memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count,
            "torch_cuda": torch.version.cuda}


__all__ = ["DESCRIPTION", "DTYPES", "OPS", "add_arguments", "check_options", "format_text", "plan_sizes", "run",
           "unavailable"]
