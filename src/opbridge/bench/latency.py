"""Tail latency of small ops beside a competing process.

On a shared 2-core machine a busy neighbour takes one core. A kernel that
forks an OpenMP team for a small input then waits for a worker that the
scheduler has parked, and its p99 jumps from microseconds to milliseconds.
This benchmark times each call individually (interleaving opbridge and torch
call by call), first on a quiet machine, then with one process spinning on
a core, and reports p50/p99/p99.9 for both.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import Any

import numpy as np

from opbridge.bench import POSITIVE_INT

DESCRIPTION = ("Per-call latency percentiles (p50/p99/p99.9) of small built-in ops next to torch, "
               "quiet and beside one busy competing process.")

_SPIN = "import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"


def _shape(text: str) -> tuple[int, ...]:
    """``8,4096`` or ``8x4096`` (as ``bench kernels --sizes`` writes sizes)."""
    try:
        dims = tuple(int(s) for s in text.replace("x", ",").split(","))
    except ValueError:
        dims = ()
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"must be positive dims like 8,4096 or 8x4096, got {text!r}")
    return dims


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``opbridge bench latency``."""
    parser.add_argument("--calls", type=POSITIVE_INT, default=None,
                        help="calls per candidate and load (default 20000; 2000 with --quick)")
    parser.add_argument("--shape", type=_shape, default=(8, 4096), help="input shape, 8,4096 or 8x4096 (default)")


def _workloads(shape: tuple[int, ...]) -> dict[str, tuple[Any, Any]]:
    """``{op: (opbridge call, torch call)}``, each pair checked to compute the same values first.

    Functional ops write into existing buffers (``out=``) on both sides where
    torch can; the gated op takes ``x`` of *shape* (halves of the last dim);
    ``fused_add_rms_norm`` updates its own pair of tensors in place on each
    side (vLLM's semantics; torch: ``residual += input``, then the norm
    written back into ``input``).
    """
    import torch
    import torch.nn.functional as F  # noqa: N812

    from opbridge import ops

    x, y = torch.randn(shape), torch.randn(shape)
    h = shape[-1]
    w = torch.randn(h)
    o1, o2 = torch.empty(shape), torch.empty(shape)
    half = (*shape[:-1], h // 2)
    g1, g2 = torch.empty(half), torch.empty(half)
    # fused_add_rms_norm: each side mutates its own copies; rms_norm keeps input bounded
    inp = [x.clone(), x.clone()]
    res = [y.clone(), y.clone()]

    def torch_fused() -> None:
        res[1].add_(inp[1])
        torch.mul(F.rms_norm(res[1], (h,), None, 1e-6), w, out=inp[1])

    loads = {
        "add": (lambda: ops.add(x, y, out=o1), lambda: torch.add(x, y, out=o2)),
        "gelu": (lambda: ops.gelu(x, out=o1), lambda: F.gelu(x, approximate="tanh")),
        "rms_norm": (lambda: ops.rms_norm(x, w, 1e-6, out=o1), lambda: F.rms_norm(x, (h,), w, 1e-6)),
        "silu_and_mul": (lambda: ops.silu_and_mul(x, out=g1),
                         lambda: torch.mul(F.silu(x[..., : h // 2]), x[..., h // 2:], out=g2)),
        "fused_add_rms_norm": (lambda: ops.fused_add_rms_norm(inp[0], res[0], w, 1e-6), torch_fused),
    }
    for name, (ours, theirs) in loads.items():
        a: Any = ours()
        b: Any = theirs()
        if name == "fused_add_rms_norm":
            a, b = torch.cat([inp[0], res[0]]), torch.cat([inp[1], res[1]])
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-4, err_msg=name)
    return loads


def _measure(pair: tuple[Any, Any], calls: int) -> dict[str, dict[str, float]]:
    ours, theirs = pair
    t_ours = np.empty(calls)
    t_theirs = np.empty(calls)
    clock = time.perf_counter_ns
    for i in range(calls):
        t0 = clock()
        ours()
        t1 = clock()
        theirs()
        t2 = clock()
        t_ours[i] = t1 - t0
        t_theirs[i] = t2 - t1
    return {name: {f"p{q}": float(np.percentile(v, q)) / 1e3 for q in (50, 99, 99.9)}
            for name, v in (("opbridge", t_ours), ("torch", t_theirs))}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure quiet, then beside one spinning process."""
    from opbridge.aot.natives import summary
    from opbridge.bench.timing import machine_info

    calls = args.calls if args.calls is not None else 2000 if args.quick else 20000
    shape = tuple(args.shape)
    natives = summary(("torch",))  # built before the timing (a background build takes idle CPU only)
    loads = _workloads(shape)
    for ours, theirs in loads.values():  # warm up: build, page in, wake the thread pools
        for _ in range(200):
            ours()
            theirs()
    result: dict[str, Any] = {"benchmark": "latency", "machine": machine_info(), "shape": list(shape),
                              "calls": calls, "unit": "us", "natives": natives, "quiet": {}, "loaded": {}}
    for name, pair in loads.items():
        print(f"latency: {name} quiet", file=sys.stderr)
        result["quiet"][name] = _measure(pair, calls)
    spin = subprocess.Popen([sys.executable, "-c", _SPIN.format(seconds=600)])
    try:
        time.sleep(0.5)
        for name, pair in loads.items():
            print(f"latency: {name} beside a busy process", file=sys.stderr)
            result["loaded"][name] = _measure(pair, calls)
    finally:
        spin.kill()
        spin.wait()
    result["p99_ratio_loaded"] = {n: r["opbridge"]["p99"] / r["torch"]["p99"] for n, r in result["loaded"].items()}
    return result


def format_text(result: dict[str, Any]) -> str:
    """A table of percentiles per op, load and candidate."""
    lines = [f"per-call latency, shape {tuple(result['shape'])}, {result['calls']} calls each (µs)",
             f"{'op':18s} {'load':7s} {'candidate':9s} {'p50':>9s} {'p99':>9s} {'p99.9':>9s}"]
    for load in ("quiet", "loaded"):
        for op, by in result[load].items():
            for cand, q in by.items():
                lines.append(f"{op:18s} {load:7s} {cand:9s} {q['p50']:9.1f} {q['p99']:9.1f} {q['p99.9']:9.1f}")
    lines.append("p99 opbridge/torch beside a busy process: " +
                 ", ".join(f"{k} {v:.3g}" for k, v in result["p99_ratio_loaded"].items()))
    return "\n".join(lines)
