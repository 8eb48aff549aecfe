"""``opbridge bench kernels``: kernel throughput against the machine's own STREAM bandwidth.

For each op (the built-in forward ops and, when declared, the serving ops;
``--all-ops`` adds the backward ops), each size (small ``(8, 4096)``, large
``(4096, 4096)``, odd ``(257, 5125)``) and each dtype (float32, bfloat16),
these candidates compute the same result. An op whose tensors have fixed
integer dtypes (``advance_step_flashattn``: int64 and int32) runs once per
size, labelled with those dtypes; ops with index arguments get valid values
from their workload (:mod:`.workloads`):

===============  =========  ====================================================================
candidate        mode       what is called
===============  =========  ====================================================================
``opbridge_out`` out        ``ops.<op>(..., out=buf)`` into an existing buffer
                 inplace    ``ops.<op>(...)`` for an op that mutates its arguments
``opbridge_new`` new        ``ops.<op>(...)``, a fresh output every call
``numpy_ref``    new        the op's NumPy reference on the same memory (float32 only)
``eager_new``    new        torch eager, the native op or a formula (:mod:`.workloads`)
``eager_out``    out        torch eager into a buffer (``out=``), where torch can
``compile_new``  new        ``torch.compile`` (Inductor, ``fullgraph``, static shapes) of the formula
``compile_out``  out        the compiled formula ``copy_``-ed into a buffer, kept only when
                            Inductor's generated code writes the buffer directly (no temporary
                            of the output's size); otherwise dropped, with the reason recorded
===============  =========  ====================================================================

Every candidate's result is checked against opbridge's on fresh copies of
the inputs before anything is timed (a mismatch raises
:class:`~opbridge.bench.BenchError`; integer results must match exactly);
then all candidates of a case are timed interleaved
(:func:`opbridge.bench.timing.interleaved`). An in-place op that uses up its
inputs (``advance_step_flashattn`` moves every sequence one token on per
call) has its mutated arguments restored, untimed, before each sample.
Bytes moved count each Tensor argument read once and each result written
once (:func:`opbridge.bench.workloads.bytes_moved`), or what the workload
counts (rows gathered from a table, not the table); GB/s is bytes over the
median time. Two fractions of STREAM copy are reported: against the copy
bandwidth of :mod:`opbridge.bench.stream` measured (on 256 MiB arrays) at
the start and the end of this run, and -- for cases moving 32 MiB or more --
against a STREAM copy of the case's own byte count timed interleaved with
its candidates, which sees the same cache residency and the same moment's
load (this machine's L3 may hold much of a 64 MiB case). A fraction can
exceed 1: STREAM counts no write-allocate traffic, so a copy into a
separate array really moves 3 bytes per 2 counted, while an op that
writes lines it has just read (in place, e.g. ``fused_add_rms_norm``)
moves only what is counted. Cases below that size (in cache) time instead
a copy of their own byte count on one thread and on the run's threads, both
called through tvm-ffi like the kernels: the faster of the two is what
merely moving those bytes costs, so torch eager's time over it is the
largest speed-up over eager that the hardware leaves room for (the summary's
``small_ceiling_vs_eager``; for float32 ``add`` at (8, 4096) it is below 2).
Speed-ups are the competitor's median over ours in the same mode (> 1:
opbridge is faster); an op that mutates in place has only its in-place
form, which stands in for "new output" too.

Peak memory: a fresh child process (``MALLOC_MMAP_THRESHOLD_`` fixed at
64 KiB, so every allocation of 64 KiB or more is a fresh ``mmap`` that is
returned on ``free``) binds each candidate at the memory size, warms it up,
resets the kernel's peak-RSS counter (``/proc/self/clear_refs`` = 5), makes
one call and reads ``VmHWM``; the peak minus the RSS before the call, less
the bytes of the call's new outputs, is the memory it needed beyond its
inputs and outputs. This sees every allocator (torch, NumPy, C++ ``new``)
but only touched pages, at 4 KiB resolution plus a few KiB of interpreter
noise; ``tracemalloc``'s exact peak of Python/NumPy allocations is recorded
beside it. Where the counter cannot be reset, each measurement runs in its
own process and the resolution is the distance between that process's
earlier peak and its RSS before the call (reported).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opbridge.bench import BenchError
from opbridge.bench.timing import interleaved, machine_info, summary

DESCRIPTION = (
    "Kernel throughput against STREAM: each op (add, gelu, rms_norm, and silu_and_mul, gelu_and_mul, "
    "fused_add_rms_norm, rotary_embedding, advance_step_flashattn when declared; --all-ops adds the "
    "backward ops) at small, large and odd sizes in float32 and bfloat16 (integer-only ops once per "
    "size), opbridge into an existing buffer and with a new output, against the NumPy "
    "reference, torch eager and torch.compile (Inductor); verified before timing, timed interleaved; GB/s "
    "and the fraction of STREAM copy measured in the same run, speed-ups, peak extra memory per call; "
    "JSON, CSV and PNG plots under --out."
)

OURS_OUT, OURS_NEW, REF = "opbridge_out", "opbridge_new", "numpy_ref"
#: The STREAM copy of a case's own byte count, timed interleaved with its candidates.
STREAM_LOCAL = "stream_copy_local"
EAGER_NEW, EAGER_OUT, COMPILE_NEW, COMPILE_OUT = "eager_new", "eager_out", "compile_new", "compile_out"
CANDIDATES = (OURS_OUT, OURS_NEW, REF, EAGER_NEW, EAGER_OUT, COMPILE_NEW, COMPILE_OUT)
#: ours -> the competitors it is compared with (same mode)
PAIRS = {OURS_OUT: (EAGER_OUT, COMPILE_OUT), OURS_NEW: (EAGER_NEW, COMPILE_NEW, REF)}
DTYPES = ("float32", "bfloat16")
#: The serving ops benchmarked by default when declared (the built-in forward ops always are).
DEFAULT_OPS = ("add", "gelu", "rms_norm", "silu_and_mul", "gelu_and_mul", "fused_add_rms_norm",
               "rotary_embedding", "advance_step_flashattn")
#: Compiled code that allocates a buffer this large (relative to the smallest result) is not in place.
_INPLACE_ALLOC_FRACTION = 0.5
#: A temporary at least this fraction of the largest input counts as "input-sized".
_INPUT_SIZED = 0.5


@dataclass(frozen=True)
class Settings:
    """Everything a run depends on, resolved from the command line."""

    ops: tuple[str, ...] | None
    all_ops: bool
    sizes: dict[str, tuple[int, int]]
    dtypes: tuple[str, ...]
    rounds: int
    min_rounds: int
    target_s: float
    case_budget_s: float
    compile: bool
    reference_large: bool
    memory: bool
    memory_size: tuple[int, int]
    memory_dtypes: tuple[str, ...]
    plots: bool
    stream_n: int
    stream_rounds: int
    threads: int
    local_stream_bytes: int
    out: Path


FULL: dict[str, float] = {"rounds": 30, "min_rounds": 7, "target_ms": 20.0, "case_budget_s": 12.0, "stream_rounds": 10}
QUICK: dict[str, float] = {"rounds": 7, "min_rounds": 3, "target_ms": 5.0, "case_budget_s": 1.5, "stream_rounds": 5}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this benchmark's options to *parser*."""
    from opbridge.bench.stream import DEFAULT_N, QUICK_N
    from opbridge.bench.workloads import SIZES

    sizes = ", ".join(f"{k} {v[0]}x{v[1]}" for k, v in SIZES.items())
    parser.add_argument("--ops", metavar="LIST", default=None,
                        help=f"comma-separated ops (default: {', '.join(DEFAULT_OPS)}, those declared)")
    parser.add_argument("--all-ops", action="store_true",
                        help="every declared op with a workload, backward ops included")
    parser.add_argument("--sizes", metavar="LIST", default=None,
                        help=f"comma-separated sizes: names ({sizes}) or RxC (default: all three)")
    parser.add_argument("--dtypes", metavar="LIST", default=",".join(DTYPES),
                        help=f"comma-separated dtypes (default {','.join(DTYPES)}); ops with fixed integer "
                             "dtypes (advance_step_flashattn) run once per size whatever this says")
    parser.add_argument("--rounds", type=int, metavar="N", default=None,
                        help=f"most interleaved rounds per case (default {FULL['rounds']}, "
                             f"{QUICK['rounds']} with --quick; large cases get fewer to fit a time budget)")
    parser.add_argument("--target-ms", type=float, metavar="MS", default=None,
                        help=f"time of one sample of the slowest candidate (default {FULL['target_ms']:g}, "
                             f"{QUICK['target_ms']:g} with --quick)")
    parser.add_argument("--compile", dest="compile", action="store_true", default=None,
                        help="time torch.compile candidates (default on; off with --quick)")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="skip the torch.compile candidates")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument("--memory-size", metavar="SIZE", default=None,
                        help="size of the peak-memory measurement (default large; 256x4096, float32 only, "
                             "with --quick)")
    parser.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    parser.add_argument("--stream-n", type=int, metavar="N", default=None,
                        help=f"STREAM floats per array (default {DEFAULT_N}, {QUICK_N} with --quick)")
    parser.add_argument("--local-stream-mib", type=float, metavar="MIB", default=32.0,
                        help="cases moving at least MIB MiB also time a STREAM copy of their own byte count, "
                             "interleaved with the candidates (default 32: beyond the L3 cache)")
    parser.add_argument("--threads", type=int, metavar="N", default=None,
                        help="STREAM threads (default: torch's intra-op threads)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="results folder (default results/bench-kernels-<timestamp>/)")


def _parse_size(text: str) -> tuple[str, tuple[int, int]]:
    from opbridge.bench.workloads import SIZES

    text = text.strip()
    if text in SIZES:
        return text, SIZES[text]
    rows, sep, cols = text.lower().partition("x")
    if not sep or not rows.isdigit() or not cols.isdigit() or int(rows) < 1 or int(cols) < 1:
        raise BenchError(f"size {text!r}: expected one of {', '.join(SIZES)} or RxC, e.g. 8x4096")
    return text, (int(rows), int(cols))


def _csv_list(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def settings(args: argparse.Namespace) -> Settings:
    """Resolve *args* (with ``--quick``) into :class:`Settings`."""
    from opbridge.bench.stream import DEFAULT_N, QUICK_N
    from opbridge.bench.workloads import SIZES

    quick = bool(getattr(args, "quick", False))
    d = QUICK if quick else FULL
    sizes = dict(_parse_size(s) for s in _csv_list(args.sizes)) if args.sizes else dict(SIZES)
    dtypes = tuple(_csv_list(args.dtypes)) or DTYPES
    bad = [t for t in dtypes if t not in ("float32", "float16", "bfloat16")]
    if bad:
        raise BenchError(f"--dtypes: unsupported {', '.join(bad)} (float32, float16, bfloat16)")
    rounds = int(args.rounds if args.rounds is not None else d["rounds"])
    target_ms = args.target_ms if args.target_ms is not None else d["target_ms"]
    if rounds < 1 or target_ms <= 0:
        raise BenchError(f"--rounds and --target-ms must be positive (got {rounds}, {target_ms})")
    mem = _parse_size(args.memory_size)[1] if args.memory_size else ((256, 4096) if quick else SIZES["large"])
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Settings(
        ops=tuple(_csv_list(args.ops)) if args.ops else None,
        all_ops=bool(args.all_ops),
        sizes=sizes,
        dtypes=dtypes,
        rounds=rounds,
        min_rounds=min(int(d["min_rounds"]), rounds),
        target_s=target_ms / 1e3,
        case_budget_s=d["case_budget_s"],
        compile=(not quick) if args.compile is None else bool(args.compile),
        reference_large=not quick,
        memory=not args.no_memory,
        memory_size=mem,
        memory_dtypes=dtypes[:1] if quick else dtypes,
        plots=not args.no_plots,
        stream_n=args.stream_n or (QUICK_N if quick else DEFAULT_N),
        stream_rounds=int(d["stream_rounds"]),
        threads=args.threads or 0,
        local_stream_bytes=int(args.local_stream_mib * 2**20),
        out=Path(args.out) if args.out else Path("results") / f"bench-kernels-{stamp}",
    )


# -- progress ---------------------------------------------------------------------------


class Progress:
    """A text progress bar on stderr: counts, current step, elapsed time and ETA.

    Steps have weights (their expected cost); the ETA extrapolates the time
    per unit of weight done so far. On a terminal the bar redraws in place;
    otherwise each step prints one line.
    """

    def __init__(self, total: float, steps: int, *, stream: Any = None, width: int = 24) -> None:
        self.total = max(total, 1e-9)
        self.steps = steps
        self.done_weight = 0.0
        self.done_steps = 0
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.start = time.monotonic()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    @staticmethod
    def _clock(seconds: float) -> str:
        s = int(seconds + 0.5)
        return f"{s // 60}m{s % 60:02d}s"

    def show(self, label: str) -> None:
        """Draw the bar with *label* as the step now running."""
        frac = min(self.done_weight / self.total, 1.0)
        filled = round(frac * self.width)
        elapsed = time.monotonic() - self.start
        eta = "?" if self.done_weight <= 0 else self._clock(elapsed * (self.total - self.done_weight)
                                                             / self.done_weight)
        line = (f"bench kernels [{'#' * filled}{'.' * (self.width - filled)}] {self.done_steps}/{self.steps} "
                f"{frac:4.0%}  {self._clock(elapsed)} elapsed, ETA {eta}  {label}")
        if self.tty:
            self.stream.write("\r\x1b[2K" + line[:200])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def advance(self, weight: float) -> None:
        """Mark a step of *weight* done."""
        self.done_weight += weight
        self.done_steps += 1

    def note(self, msg: str) -> None:
        """Print a message on its own line without losing the bar."""
        self.stream.write(("\r\x1b[2K" if self.tty else "") + f"bench kernels: {msg}\n")
        self.stream.flush()

    def finish(self) -> None:
        """Draw the final state and end the line."""
        self.show("done")
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# -- op selection and inputs -----------------------------------------------------------------


@dataclass
class Plan:
    """The ops to run, their workloads, and the ops skipped with why."""

    ops: list[Any] = field(default_factory=list)  # OpDef
    workloads: dict[str, Any] = field(default_factory=dict)  # name -> Workload
    torch: dict[str, Any] = field(default_factory=dict)  # name -> the TorchImpl that matches, or None
    skipped: list[dict[str, str]] = field(default_factory=list)


def _is_backward(name: str) -> bool:
    return name.endswith("_backward")


def plan(s: Settings, *, for_memory: bool = False) -> Plan:
    """Choose the ops of the built-in library to benchmark and their workloads."""
    from opbridge import registry
    from opbridge.bench import workloads

    lib = registry.library("opbridge")
    known = workloads.workloads()
    if s.ops is not None:
        missing = [n for n in s.ops if n not in lib.ops]
        if missing:
            raise BenchError(f"--ops: no op {', '.join(map(repr, missing))} in the opbridge library; "
                             f"declared: {', '.join(lib.ops)}")
        names = list(s.ops)
    elif s.all_ops or for_memory:
        names = list(lib.ops)
    else:
        names = [n for n in lib.ops if n in DEFAULT_OPS]
        for n in lib.ops:
            if n not in DEFAULT_OPS and not _is_backward(n):
                names.append(n)  # any other forward op; skipped below unless it has a workload
    out = Plan()
    for name in names:
        op = lib.ops[name]
        if "cpu" not in op.kernels:
            out.skipped.append({"op": name, "reason": "no cpu kernel"})
            continue
        wl = known.get(name)
        reason = ""
        if wl is None:
            wl, reason = workloads.infer(op)
        if wl is None:
            out.skipped.append({"op": name, "reason": reason})
            continue
        out.ops.append(op)
        out.workloads[name] = wl
    return out


def case_dtypes(wl: Any, dtypes: Sequence[str]) -> tuple[str, ...]:
    """The dtypes *wl*'s op runs with: its fixed dtype label, else each of *dtypes*."""
    return (wl.dtype,) if wl.dtype else tuple(dtypes)


def make_args(op: Any, wl: Any, size: tuple[int, int], dtype: str, seed: int = 0) -> list[Any]:
    """Schema-ordered arguments of *op* at *size*: the workload's own values (``wl.make_args``) where
    it gives them, standard-normal tensors of *dtype* for the other Tensor arguments, then scalars."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    given = wl.make_args(size, dtype, gen) if wl.make_args is not None else {}
    shapes = wl.shapes(size)
    args: list[Any] = []
    for a in op.schema.arguments:
        if a.name in given:
            args.append(given[a.name])
        elif a.type.is_tensor:
            shape = shapes.get(a.name)
            if shape is None:
                if a.type.optional:
                    args.append(None)
                    continue
                raise BenchError(f"{op.name}: the workload gives no shape for Tensor argument {a.name!r}")
            args.append(torch.randn(shape, generator=gen, dtype=torch.float32).to(getattr(torch, dtype)))
        elif a.name in wl.scalars:
            args.append(wl.scalars[a.name])
        elif a.has_default:
            args.append(a.default)
        else:
            raise BenchError(f"{op.name}: no value for argument {a.name!r}; give the workload scalars")
    return args


def _split_call(op: Any, args: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
    """Positional and keyword-only parts of schema-ordered *args*."""
    pos = [v for a, v in zip(op.schema.arguments, args) if not a.kwarg_only]
    kw = {a.name: v for a, v in zip(op.schema.arguments, args) if a.kwarg_only}
    return pos, kw


def _clone(args: Sequence[Any]) -> list[Any]:
    return [a.clone() if hasattr(a, "clone") else a for a in args]


def _as_tuple(x: Any) -> tuple[Any, ...]:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


# -- candidates -----------------------------------------------------------------------------------

Bound = tuple[Callable[[], Any], Callable[[Any], tuple[Any, ...]]]


@dataclass
class Candidate:
    """One way of computing a case's result.

    ``bind(args)`` returns a zero-argument call on those arguments (with its
    own output buffers) and a function that maps the call's return value to
    the results to verify: new outputs first, then mutated arguments.
    """

    name: str
    mode: str  # "out", "new" or "inplace"
    what: str
    bind: Callable[[list[Any]], Bound]


def _nan_outputs(op: Any, args: Sequence[Any]) -> list[Any]:
    import torch

    return [torch.full(tuple(sp.shape), float("nan"), dtype=_torch_dtype(sp.dtype))
            for sp in op.output_specs(args)]


def _torch_dtype(d: Any) -> Any:
    import torch

    return d if isinstance(d, torch.dtype) else getattr(torch, str(d))


def _mutated(op: Any) -> list[int]:
    return [i for i, a in enumerate(op.schema.arguments) if a.is_mutated]


def opbridge_candidates(op: Any) -> list[Candidate]:
    """``opbridge_out`` (into a buffer, or in place) and, for ops with new outputs, ``opbridge_new``."""
    mut = _mutated(op)
    cands: list[Candidate] = []

    if op.n_outputs:
        def bind_out(args: list[Any]) -> Bound:
            outs = _nan_outputs(op, args)
            pos, kw = _split_call(op, args)
            target = outs[0] if len(outs) == 1 else tuple(outs)
            return (functools.partial(op.call, *pos, **kw, out=target),
                    lambda _ret: (*outs, *(args[i] for i in mut)))

        cands.append(Candidate(OURS_OUT, "out", f"ops.{op.name}(..., out=buf)", bind_out))

        def bind_new(args: list[Any]) -> Bound:
            pos, kw = _split_call(op, args)
            return (functools.partial(op.call, *pos, **kw),
                    lambda ret: (*_as_tuple(ret)[:op.n_outputs], *(args[i] for i in mut)))

        cands.append(Candidate(OURS_NEW, "new", f"ops.{op.name}(...), new output", bind_new))
    else:
        def bind_inplace(args: list[Any]) -> Bound:
            pos, kw = _split_call(op, args)
            return functools.partial(op.call, *pos, **kw), lambda _ret: tuple(args[i] for i in mut)

        cands.append(Candidate(OURS_OUT, "inplace", f"ops.{op.name}(...), in place", bind_inplace))
    return cands


def reference_candidate(op: Any) -> Candidate:
    """The op's NumPy reference on NumPy views of the same tensors."""
    mut = _mutated(op)

    def bind(args: list[Any]) -> Bound:
        np_args = [a.numpy() if hasattr(a, "numpy") else a for a in args]
        pos, kw = _split_call(op, np_args)
        return (functools.partial(op.reference, *pos, **kw),
                lambda ret: (*_as_tuple(ret)[:op.n_outputs], *(np_args[i] for i in mut)))

    mode = "new" if op.n_outputs else "inplace"
    return Candidate(REF, mode, f"{op.reference.__module__}.{op.reference.__qualname__} (NumPy)", bind)


def eager_candidates(op: Any, impl: Any) -> list[Candidate]:
    """``eager_new`` (the functional formula) and ``eager_out`` when torch has an into-buffer form."""
    mut = _mutated(op)

    def bind_new(args: list[Any]) -> Bound:
        return functools.partial(impl.new, *args), _as_tuple

    cands = [Candidate(EAGER_NEW, "new", impl.what or "torch formula", bind_new)]
    if impl.out is not None:
        if op.n_outputs:
            def bind_out(args: list[Any]) -> Bound:
                outs = _nan_outputs(op, args)
                return (functools.partial(impl.out, *args, outs),
                        lambda _ret: (*outs, *(args[i] for i in mut)))

            mode = "out"
        else:
            def bind_out(args: list[Any]) -> Bound:
                return functools.partial(impl.out, *args), lambda _ret: tuple(args[i] for i in mut)

            mode = "inplace"
        cands.append(Candidate(EAGER_OUT, mode, impl.out_note or "torch, into a buffer", bind_out))
    return cands


def _into(impl: Any, n_args: int, targets: Sequence[int] | None) -> Callable[..., None]:
    """A function Inductor can compile that writes the formula's results into buffers.

    ``targets`` None: the buffers are extra trailing arguments; else the
    results go into the arguments at those indices (a mutating op).
    """
    new = impl.new

    if targets is None:
        def into(*a: Any) -> None:
            for o, r in zip(a[n_args:], new(*a[:n_args])):
                o.copy_(r)
    else:
        def into(*a: Any) -> None:
            res = new(*a)
            for i, r in zip(targets, res):
                a[i].copy_(r)
    return into


@dataclass
class CompiledPair:
    """The compiled functions of one case and what their first calls showed."""

    new: Callable[..., Any]
    into: Callable[..., Any]
    info: dict[str, Any] = field(default_factory=dict)


def compiled_candidates(op: Any, impl: Any, pair: CompiledPair) -> list[Candidate]:
    """``compile_new`` and ``compile_out`` around the compiled functions of *pair*."""
    mut = _mutated(op)

    def bind_new(args: list[Any]) -> Bound:
        return functools.partial(pair.new, *args), _as_tuple

    if op.n_outputs:
        def bind_out(args: list[Any]) -> Bound:
            outs = _nan_outputs(op, args)
            return functools.partial(pair.into, *args, *outs), lambda _ret: (*outs, *(args[i] for i in mut))

        mode = "out"
    else:
        def bind_out(args: list[Any]) -> Bound:
            return functools.partial(pair.into, *args), lambda _ret: tuple(args[i] for i in mut)

        mode = "inplace"
    return [Candidate(COMPILE_NEW, "new", "torch.compile(formula, fullgraph=True, dynamic=False)", bind_new),
            Candidate(COMPILE_OUT, mode, "torch.compile(lambda *a: buf.copy_(formula(*a))); Inductor "
                      "writes buf directly (checked in its generated code)", bind_out)]


def _compile(op: Any, impl: Any) -> CompiledPair:
    import torch

    n = len(op.schema.arguments)
    targets = None if op.n_outputs else _mutated(op)
    return CompiledPair(torch.compile(impl.new, fullgraph=True, dynamic=False),
                        torch.compile(_into(impl, n, targets), fullgraph=True, dynamic=False))


def _capture_code(fn: Callable[[], Any]) -> tuple[Any, list[str], float]:
    """Call *fn* (a first call of a compiled function) and return its result, Inductor's code, seconds."""
    from unittest import mock

    import torch._inductor.config as inductor_config
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    start = time.perf_counter()
    # No FX-graph cache: a cache hit skips the lowering whose code is inspected.
    with mock.patch.object(GraphLowering, "save_output_code", codes.append), \
            inductor_config.patch(fx_graph_cache=False):
        ret = fn()
    return ret, codes, round(time.perf_counter() - start, 3)


def _allocations(codes: Sequence[str]) -> list[int]:
    """Element counts of the buffers Inductor's generated code allocates."""
    import re

    sizes = []
    for code in codes:
        for m in re.finditer(r"empty_strided(?:_cpu)?\(\(([^)]*)\)", code):
            dims = [d.strip() for d in m.group(1).split(",") if d.strip()]
            sizes.append(math.prod(int(d) for d in dims) if all(d.isdigit() for d in dims) else -1)
    return sizes


# -- verification and timing ---------------------------------------------------------------------


def _tolerance(op: Any, dtype: str) -> tuple[float, float]:
    rtol, atol = op.tolerance(dtype)
    # Both sides are approximations of the exact result, each within the op's tolerance.
    return 2 * rtol, 2 * atol


def _close(got: Any, expected: Any, rtol: float, atol: float) -> bool:
    """``|got - expected| <= atol + rtol |expected|`` everywhere (NaN matching NaN), computed by torch.

    A fast pass for large results; :func:`~opbridge.testing.compare.assert_close`
    explains a failure.
    """
    import torch

    g = torch.from_numpy(got) if not isinstance(got, torch.Tensor) else got
    e = torch.from_numpy(expected) if not isinstance(expected, torch.Tensor) else expected
    if g.shape != e.shape:
        return False
    if not (g.is_floating_point() or e.is_floating_point()):  # exact; float32 would round ids past 2^24
        return g.dtype == e.dtype and bool(torch.equal(g, e))
    return bool(torch.isclose(g.float(), e.float(), rtol=rtol, atol=atol, equal_nan=True).all())


def _check(op: Any, label: str, name: str, got: Sequence[Any], expected: Sequence[Any], dtype: str) -> None:
    from opbridge.testing.compare import assert_close

    if len(got) != len(expected):
        raise BenchError(f"{label}: {name} gave {len(got)} result(s), opbridge {len(expected)}")
    rtol, atol = _tolerance(op, dtype)
    for j, (g, e) in enumerate(zip(got, expected)):
        if _close(g, e, rtol, atol):
            continue
        try:
            assert_close(g, e, rtol=rtol, atol=atol, dtype=dtype, name=f"result {j}")
        except AssertionError as err:
            raise BenchError(f"{label}: candidate {name!r} disagrees with opbridge:\n{err}") from None
        raise BenchError(f"{label}: candidate {name!r} disagrees with opbridge (result {j})")


def _verify(op: Any, label: str, pristine: list[Any], cands: Sequence[Candidate], dtype: str,
            expected: Sequence[Any]) -> None:
    for c in cands:
        fn, get = c.bind(_clone(pristine))
        _check(op, label, c.name, get(fn()), expected, dtype)


def _expected(op: Any, pristine: list[Any]) -> tuple[Any, ...]:
    """opbridge's result on a fresh copy of the inputs: the values every candidate must match."""
    ours = opbridge_candidates(op)
    fn, get = ours[-1].bind(_clone(pristine))  # opbridge_new, or the in-place call
    return tuple(t.clone() for t in get(fn()))


def _sig(x: float, digits: int = 4) -> float:
    """*x* rounded to *digits* significant digits (ratios and rates span many decades)."""
    return float(f"{x:.{digits}g}")


def _probe(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _time_case(fns: dict[str, Callable[[], Any]], s: Settings, *, max_calls: int = 0,
               before: Callable[[], Any] | None = None) -> tuple[dict[str, dict[str, float]], int, int]:
    """Time *fns* interleaved; *before* (untimed) precedes each sample, of at most *max_calls* calls."""
    probes = {}
    for n, f in fns.items():  # also the warm-up call
        if before is not None:
            before()
        probes[n] = _probe(f)
    slowest = max(probes.values())
    number = max(1, min(max_calls or 10_000, 10_000, round(s.target_s / max(slowest, 1e-9))))
    per_round = number * sum(probes.values())
    rounds = max(s.min_rounds, min(s.rounds, int(s.case_budget_s / max(per_round, 1e-9))))
    stats = interleaved(fns, rounds=rounds, number=number, warmup=0, before=before)
    return summary(stats), rounds, number


def _restorer(op: Any, args: Sequence[Any]) -> Callable[[], None]:
    """A function that puts *args*' mutated tensors back to their present values."""
    saved = [(args[i], args[i].clone()) for i in _mutated(op) if args[i] is not None]

    def restore() -> None:
        for t, v in saved:
            t.copy_(v)

    return restore


def _local_copy(total_bytes: int, threads: int) -> Callable[[], Any]:
    """A STREAM copy moving *total_bytes* (read + write), to time beside a case's candidates."""
    import numpy as np

    from opbridge.bench import stream

    k = stream.kernels()
    n = max(1, total_bytes // 8)
    a, c = np.empty(n, dtype=np.float32), np.empty(n, dtype=np.float32)
    k["fill"](a, 1.0, threads)
    k["fill"](c, 0.0, threads)
    return functools.partial(k["copy"], c, a, threads)


@dataclass
class CaseSpec:
    """One op at one size and dtype."""

    op: Any
    wl: Any
    impl: Any  # the op's TorchImpl, or None
    size_name: str
    size: tuple[int, int]
    dtype: str

    @property
    def label(self) -> str:
        return f"{self.op.name} {self.size_name} {self.dtype}"


def choose_torch(op: Any, wl: Any) -> Any:
    """The first torch variant of *wl* whose float32 result matches opbridge's (None if it lists none).

    Chosen once per op, in float32 where a wrong variant cannot hide in the
    tolerance (erf and tanh GELU agree to bfloat16 precision).

    Raises
    ------
    BenchError
        If no variant matches.
    """
    if not wl.torch:
        return None
    dtype = wl.dtype or "float32"
    pristine = make_args(op, wl, (4, 256), dtype, seed=1)
    expected = _expected(op, pristine)
    errors = []
    for impl in wl.torch:
        try:
            got = _as_tuple(impl.new(*_clone(pristine)))
            _check(op, f"{op.name} (4, 256) {dtype}", EAGER_NEW, got, expected, dtype)
            return impl
        except BenchError as e:
            errors.append(str(e))
    raise BenchError(errors[0] + ("" if len(errors) == 1 else
                                  f"\n(and {len(errors) - 1} other torch variant(s) disagree too)"))


def run_case(case: CaseSpec, s: Settings) -> dict[str, Any]:
    """Verify and time every candidate of *case*; return its result record."""
    import torch

    op, dtype = case.op, case.dtype
    pristine = make_args(op, case.wl, case.size, dtype)
    moved = case.wl.moved(op, pristine)
    expected = _expected(op, pristine)
    impl = case.impl

    cands = opbridge_candidates(op)
    skipped: dict[str, str] = {}
    if op.reference is None:
        skipped[REF] = "the op declares no reference"
    elif not _reference_dtype(case.wl, dtype):
        skipped[REF] = "float32 only"
    elif case.size_name == "large" and not s.reference_large:
        skipped[REF] = "skipped on the large size with --quick"
    else:
        cands.append(reference_candidate(op))
    compile_info: dict[str, Any] = {}
    if impl is None:
        for n in (EAGER_NEW, EAGER_OUT, COMPILE_NEW, COMPILE_OUT):
            skipped[n] = "no torch formula for this op"
    else:
        cands += eager_candidates(op, impl)
        if impl.out is None:
            skipped[EAGER_OUT] = "torch has no into-buffer form of this op"
        if not s.compile:
            skipped[COMPILE_NEW] = skipped[COMPILE_OUT] = "torch.compile not run (--no-compile or --quick)"
        else:
            cands += _compile_case(case, impl, pristine, expected, compile_info, skipped)
    label = case.label
    _verify(op, label, pristine, [c for c in cands if not c.name.startswith("compile_")], dtype, expected)

    bound = {c.name: c.bind(pristine)[0] for c in cands}
    local = moved["total"] >= s.local_stream_bytes
    if local:  # the same bytes copied by STREAM, interleaved with the candidates: drift hits both alike
        bound[STREAM_LOCAL] = _local_copy(moved["total"], s.threads)
    # In cache, a copy of the same bytes on one thread and on the run's threads: how fast any kernel
    # that must move these bytes could be (the ceiling of a speed-up over torch, see _summary).
    copy_threads = {} if local else {f"cache_copy_{t}t": t for t in sorted({1, s.threads})}
    for name, t in copy_threads.items():
        bound[name] = _local_copy(moved["total"], t)
    del expected
    gc.collect()
    recompile_guard = torch._dynamo.config.patch(error_on_recompile=True) if s.compile else _nullcontext()
    restore = _restorer(op, pristine) if case.wl.max_calls else None
    with recompile_guard:
        stats, rounds, number = _time_case(bound, s, max_calls=case.wl.max_calls, before=restore)
    bound.clear()
    shape = {a.name: list(v.shape) for a, v in zip(op.schema.arguments, pristine) if hasattr(v, "shape")}
    results: dict[str, Any] = {}
    for c in cands:
        row = stats[c.name]
        results[c.name] = {
            "mode": c.mode, "what": c.what, "p20_us": row["p20"], "p50_us": row["p50"], "p80_us": row["p80"],
            "rounds": rounds, "number": number,
            "gbps": _sig(moved["total"] / (row["p50"] * 1e-6) / 1e9),
        }
        if local:
            results[c.name]["frac_stream_copy_local"] = _sig(stats[STREAM_LOCAL]["p50"] / row["p50"])
    def copy_row(name: str) -> dict[str, Any]:
        st = stats[name]
        return {"p20_us": st["p20"], "p50_us": st["p50"], "p80_us": st["p80"],
                "gbps": _sig(moved["total"] / (st["p50"] * 1e-6) / 1e9)}

    return {
        "op": op.name, "size": case.size_name, "rows_cols": list(case.size), "dtype": dtype, "shapes": shape,
        "bytes": moved, "torch_variant": impl.label if impl is not None else "", "candidates": results,
        "skipped": skipped, "compile": compile_info,
        "stream_copy_local": copy_row(STREAM_LOCAL) if local else None,
        "cache_copies": {name: dict(copy_row(name), threads=t) for name, t in copy_threads.items()},
    }


class _nullcontext:  # noqa: N801 - contextlib.nullcontext without importing it at module load
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _compile_case(case: CaseSpec, impl: Any, pristine: list[Any], expected: Sequence[Any],
                  info: dict[str, Any], skipped: dict[str, str]) -> list[Candidate]:
    """Compile the case's formula (new output and into a buffer), verify both, keep what is fair.

    Each is compiled on its own: Inductor failing on one (it has bugs, e.g. a
    ``KeyError`` in the C++ outer-loop fusion of a graph that mutates two
    inputs) only drops that one, with the error recorded.
    """
    import torch

    op = case.op
    torch._dynamo.reset()  # compile once per case; never hit the recompile limit across cases
    kept = []
    smallest = min(math.prod(t.shape) for t in expected)
    for c in compiled_candidates(op, impl, _compile(op, impl)):
        try:
            fn, get = c.bind(_clone(pristine))
            ret, codes, secs = _capture_code(fn)
            got = get(ret)
        except Exception as e:  # Inductor failing is a missing competitor, not our error
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            skipped[c.name] = f"torch.compile failed: {type(e).__name__}: {first}"
            continue
        _check(op, case.label, c.name, got, expected, case.dtype)
        allocs = _allocations(codes)
        info[c.name] = {"first_call_seconds": secs, "allocations_numel": allocs}
        if c.name == COMPILE_OUT:
            big = [n for n in allocs if n < 0 or n >= _INPLACE_ALLOC_FRACTION * smallest]
            if not codes:
                skipped[c.name] = "Inductor's generated code could not be captured to check it writes in place"
                continue
            if big:
                skipped[c.name] = (f"Inductor allocates a temporary of {max(big)} elements before copying into "
                                   "the buffer: not in place, only its new output is reported")
                continue
        kept.append(c)
    return kept


# -- peak memory -------------------------------------------------------------------------------

_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TOP_PAD_": "0", "MALLOC_TRIM_THRESHOLD_": "0"}


def _status_kib() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _reference_dtype(wl: Any, dtype: str) -> bool:
    """Whether the NumPy reference runs at *dtype*: float32, or the fixed dtypes of an integer op."""
    return dtype == "float32" or bool(wl.dtype)


def _memory_candidates(op: Any, wl: Any, impl: Any, dtype: str) -> list[Candidate]:
    cands = opbridge_candidates(op)
    if op.reference is not None and _reference_dtype(wl, dtype):
        cands.append(reference_candidate(op))
    if impl is not None:
        cands += eager_candidates(op, impl)
    return cands


def _address(t: Any) -> int:
    """Data address of a torch tensor or NumPy array."""
    return int(t.data_ptr()) if hasattr(t, "data_ptr") else int(t.__array_interface__["data"][0])


def _measure_one(op: Any, c: Candidate, args: list[Any], *, reset: bool, warm: bool) -> dict[str, Any]:
    import tracemalloc

    from opbridge.bench.workloads import nbytes

    fn, get = c.bind(args)
    inputs = {_address(a) for a in args if hasattr(a, "shape")}
    if warm:
        for _ in range(2):
            fn()
    gc.collect()
    best: dict[str, Any] | None = None
    for _ in range(2 if reset else 1):
        tracemalloc.reset_peak()
        tm0 = tracemalloc.get_traced_memory()[0]
        if reset:
            _reset_peak()
        before = _status_kib()
        ret = fn()
        after = _status_kib()
        tm_peak = tracemalloc.get_traced_memory()[1] - tm0
        new_bytes = sum(nbytes(t) for t in get(ret) if _address(t) not in inputs) if c.mode == "new" else 0
        del ret
        extra = max(0, after["VmHWM"] - max(before["VmRSS"], 0 if reset else before["VmHWM"])) * 1024
        row = {"peak_extra_bytes": extra, "new_output_bytes": new_bytes,
               "beyond_io_bytes": max(0, extra - new_bytes), "tracemalloc_peak_bytes": tm_peak,
               "resolution_bytes": 4096 if reset else max(4096, (before["VmHWM"] - before["VmRSS"]) * 1024)}
        if best is None or row["peak_extra_bytes"] < best["peak_extra_bytes"]:
            best = row
    assert best is not None
    return best


def memory_child() -> None:
    """Entry point of the memory child process: JSON spec on stdin, JSON result on stdout."""
    import tracemalloc

    import torch  # noqa: F401 - the candidates need it

    import opbridge.ops  # noqa: F401 - declares the library
    from opbridge import registry
    from opbridge.bench import workloads

    spec = json.load(sys.stdin)
    gc.collect()
    gc.freeze()  # the imports' objects: later collections skip them (each would take ~0.2 s)
    lib = registry.library("opbridge")
    known = workloads.workloads()
    reset = spec["mode"] == "reset" and _reset_peak()
    tracemalloc.start()
    rows = []
    for item in spec["items"]:
        op = lib.ops[item["op"]]
        wl = known.get(op.name) or workloads.infer(op)[0]
        size = tuple(item["size"])
        cands = [c for c in _memory_candidates(op, wl, choose_torch(op, wl), item["dtype"])
                 if not item.get("candidates") or c.name in item["candidates"]]
        if not reset:  # warm up on a tiny case: a warm-up at full size would raise the peak we compare with
            tiny = make_args(op, wl, (2, 64), item["dtype"])
            for c in cands:
                c.bind(tiny)[0]()
        args = make_args(op, wl, size, item["dtype"])
        largest = max(workloads.nbytes(a) for a in args if hasattr(a, "shape"))
        for c in cands:
            row = _measure_one(op, c, args, reset=reset, warm=reset)
            row.update(op=op.name, dtype=item["dtype"], size=list(size), candidate=c.name, mode=c.mode,
                       largest_input_bytes=largest,
                       beyond_io_vs_input=round(row["beyond_io_bytes"] / largest, 3))
            rows.append(row)
    json.dump({"reset": reset, "rows": rows}, sys.stdout)


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, **_MEMORY_ENV}
    code = "from opbridge.bench.kernels import memory_child; memory_child()"
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(spec), capture_output=True,
                          text=True, env=env, timeout=1800, check=False)
    if proc.returncode != 0:
        raise BenchError(f"the memory child process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def measure_memory(p: Plan, s: Settings) -> dict[str, Any]:
    """Peak memory beyond inputs and outputs of one call of each candidate (see the module docstring)."""
    items = [{"op": op.name, "dtype": d, "size": list(s.memory_size)} for op in p.ops
             for d in case_dtypes(p.workloads[op.name], s.memory_dtypes)]
    result = _run_child({"mode": "reset", "items": items})
    method = "reset"
    if not result["reset"]:  # one process per measurement
        method = "fresh process"
        rows = []
        for item in items:
            op = next(o for o in p.ops if o.name == item["op"])
            impl = p.torch[op.name] if op.name in p.torch else choose_torch(op, p.workloads[op.name])
            for c in _memory_candidates(op, p.workloads[op.name], impl, item["dtype"]):
                rows += _run_child({"mode": "fresh", "items": [{**item, "candidates": [c.name]}]})["rows"]
        result = {"reset": False, "rows": rows}
    verdicts = {}
    for op in p.ops:
        ours = [r for r in result["rows"] if r["op"] == op.name and r["candidate"] in (OURS_OUT, OURS_NEW)]
        worst = max((r["beyond_io_vs_input"] for r in ours), default=0.0)
        backward = _is_backward(op.name)
        allowed = 1 if backward else 0  # input-sized temporaries a kernel may need
        verdicts[op.name] = {
            "kind": "backward" if backward else "forward", "worst_beyond_io_vs_input": worst,
            "input_sized_temporaries": round(worst),
            "ok": worst < allowed + _INPUT_SIZED,
        }
    return {
        "method": (f"{method}: child process with {', '.join(f'{k}={v}' for k, v in _MEMORY_ENV.items())}; "
                   "peak RSS (VmHWM) of one call minus RSS before it, less the call's new outputs; "
                   "tracemalloc peak beside it"),
        "resolution": "4 KiB pages plus interpreter noise (a few KiB)" if result["reset"] else
                      "see resolution_bytes per row (earlier peak above the RSS before the call)",
        "size": list(s.memory_size),
        "torch_compile": "not measured (it would recompile every graph in the child process)",
        "rows": result["rows"],
        "ops": verdicts,
    }


# -- the run ---------------------------------------------------------------------------------------


def _weight(case: CaseSpec, s: Settings) -> float:
    rows, cols = case.size
    w = 1.0 + rows * cols * (4 if case.dtype == "float32" else 2) / (8 << 20)
    return w * (2.0 if s.compile else 1.0)


def _speedups(case: dict[str, Any], mutating: bool) -> dict[str, dict[str, Any]]:
    cands = case["candidates"]
    out: dict[str, dict[str, Any]] = {}
    for ours, rivals in PAIRS.items():
        mine = ours if ours in cands else (OURS_OUT if mutating and OURS_OUT in cands else None)
        if mine is None:
            continue
        for r in rivals:
            if r in cands:
                out[r] = {"ours": mine, "speedup": _sig(cands[r]["p50_us"] / cands[mine]["p50_us"]),
                          "speedup_p20": _sig(cands[r]["p20_us"] / cands[mine]["p20_us"])}
    return out


def _summary(cases: list[dict[str, Any]]) -> dict[str, Any]:
    def get(op: str, size: str, dtype: str) -> dict[str, Any] | None:
        return next((c for c in cases if c["op"] == op and c["size"] == size and c["dtype"] == dtype), None)

    ops = list(dict.fromkeys(c["op"] for c in cases))
    sizes = list(dict.fromkeys(c["size"] for c in cases))
    dtypes = list(dict.fromkeys(c["dtype"] for c in cases))
    frac: dict[str, Any] = {}
    frac_run: dict[str, Any] = {}
    new_vs_eager: dict[str, Any] = {}
    vs_compile: dict[str, Any] = {}
    small: dict[str, Any] = {}
    ceiling: dict[str, Any] = {}
    for op in ops:
        c = get(op, "large", "float32")
        if c is not None:
            cc = c["candidates"]
            names = [n for n in (OURS_OUT, EAGER_OUT, COMPILE_OUT) if n in cc]
            frac[op] = {n: cc[n].get("frac_stream_copy_local", cc[n]["frac_stream_copy"]) for n in names}
            frac_run[op] = {n: cc[n]["frac_stream_copy"] for n in names}
        for d in dtypes:
            c = get(op, "large", d)
            if c is not None and EAGER_NEW in c["speedups"]:
                new_vs_eager.setdefault(op, {})[d] = c["speedups"][EAGER_NEW]["speedup"]
            c = get(op, "small", d)
            if c is not None:
                small.setdefault(op, {})[d] = {k: c["speedups"][r]["speedup"]
                                               for k, r in (("new", EAGER_NEW), ("out", EAGER_OUT))
                                               if r in c["speedups"]}
                if c.get("cache_copies"):
                    floor = min(r["p50_us"] for r in c["cache_copies"].values())
                    ceiling.setdefault(op, {})[d] = {k: _sig(c["candidates"][r]["p50_us"] / floor)
                                                     for k, r in (("new", EAGER_NEW), ("out", EAGER_OUT))
                                                     if r in c["candidates"]}
            for sz in sizes:
                c = get(op, sz, d)
                if c is not None:
                    row = {k: c["speedups"][r]["speedup"] for k, r in (("new", COMPILE_NEW), ("out", COMPILE_OUT))
                           if r in c["speedups"]}
                    if row:
                        vs_compile.setdefault(op, {}).setdefault(sz, {})[d] = row
    return {"large_float32_frac_stream_copy": frac, "large_float32_frac_stream_copy_run": frac_run,
            "large_new_speedup_vs_eager": new_vs_eager,
            "speedup_vs_compile": vs_compile, "small_speedup_vs_eager": small,
            "small_ceiling_vs_eager": ceiling}


def _l3_size() -> str | None:
    """The last-level cache size the kernel reports (``/sys``), e.g. ``"491520K"``, or None."""
    try:
        return Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return None


def _loadavg() -> float | None:
    """The 1-minute load average (other work competing for the cores), or None."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; see the module docstring."""
    wall0 = time.monotonic()
    s = settings(args)
    print("bench kernels: importing torch and opbridge, loading the kernels", file=sys.stderr, flush=True)
    import torch

    from opbridge.bench import stream

    load_start = _loadavg()
    p = plan(s)
    if not p.ops:
        raise BenchError("no op to benchmark: " + "; ".join(f"{k['op']}: {k['reason']}" for k in p.skipped))
    mem_plan = plan(s, for_memory=True) if s.memory and s.ops is None else p
    s = dataclasses.replace(s, threads=s.threads or torch.get_num_threads())
    threads = s.threads
    p.torch = {op.name: choose_torch(op, p.workloads[op.name]) for op in p.ops}
    cases = [CaseSpec(op, p.workloads[op.name], p.torch[op.name], sn, sz, d) for op in p.ops
             for sn, sz in s.sizes.items() for d in case_dtypes(p.workloads[op.name], s.dtypes)]
    stream_w = 2.0 * s.stream_n / (16 << 20)
    total = sum(_weight(c, s) for c in cases) + 2 * stream_w + (8.0 if s.memory else 0.0)
    bar = Progress(total, len(cases) + 2 + int(s.memory))
    for skip in p.skipped:
        bar.note(f"skipping {skip['op']}: {skip['reason']}")

    bar.show(f"STREAM ({s.stream_n} floats, {threads} threads)")
    passes = [stream.measure(s.stream_n, threads=threads, rounds=s.stream_rounds)]
    bar.advance(stream_w)
    records = []
    for case in cases:
        bar.show(case.label)
        try:
            records.append(run_case(case, s))
        except BenchError:
            raise
        except Exception as e:
            if case.wl.torch or "inferred" not in case.wl.note:
                raise
            # An inferred workload may not fit the op (a size its kernel rejects): skip, do not abort.
            p.skipped.append({"op": case.op.name, "reason": f"{case.label}: {type(e).__name__}: {e}"})
        bar.advance(_weight(case, s))
        gc.collect()
    bar.show("STREAM again")
    passes.append(stream.measure(s.stream_n, threads=threads, rounds=s.stream_rounds))
    bar.advance(stream_w)
    copy = stream.copy_gbps(passes)
    memory: dict[str, Any] = {"skipped": "--no-memory"}
    if s.memory:
        bar.show(f"peak memory at {s.memory_size[0]}x{s.memory_size[1]} (child process)")
        memory = measure_memory(mem_plan, s)
        bar.advance(8.0)
    bar.finish()

    mutating = {op.name: op.n_outputs == 0 for op in p.ops}
    for rec in records:
        for row in rec["candidates"].values():
            row["frac_stream_copy"] = _sig(row["gbps"] / copy)
        rec["speedups"] = _speedups(rec, mutating[rec["op"]])
    info = machine_info()
    info["torch_threads"] = torch.get_num_threads()
    info["omp_num_threads_env"] = os.environ.get("OMP_NUM_THREADS")
    info["l3_cache"] = _l3_size()
    info["loadavg_1m_start_end"] = [load_start, _loadavg()]
    for pss in passes:
        pss.pop("samples_s", None)
    result: dict[str, Any] = {
        "benchmark": "kernels",
        "quick": bool(getattr(args, "quick", False)),
        "machine": info,
        "settings": {
            "sizes": {k: list(v) for k, v in s.sizes.items()}, "dtypes": list(s.dtypes), "rounds_max": s.rounds,
            "rounds_min": s.min_rounds, "target_ms": s.target_s * 1e3, "case_budget_s": s.case_budget_s,
            "compile": s.compile, "reference_on_large": s.reference_large,
        },
        "stream": {"copy_gbps": copy, "reference": "median of every copy sample of both passes",
                   "passes": passes},
        "ops": {op.name: {"schema": str(op.schema), "workload_note": p.workloads[op.name].note}
                for op in p.ops},
        "skipped_ops": p.skipped,
        "cases": records,
        "memory": memory,
        "summary": _summary(records),
    }
    result["files"] = write_results(result, s)
    result["wall_seconds"] = round(time.monotonic() - wall0, 1)
    Path(result["files"]["json"]).write_text(json.dumps(result, indent=1))
    return result


# -- output -------------------------------------------------------------------------------------------

CSV_FIELDS = ("op", "size", "shape", "dtype", "candidate", "mode", "p20_us", "p50_us", "p80_us", "rounds",
              "number", "bytes", "gbps", "frac_stream_copy", "frac_stream_copy_local", "opbridge_speedup",
              "vs_ours", "what")


def csv_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per case and candidate (the CSV's content)."""
    rows = []
    for c in result["cases"]:
        shape = ";".join(f"{k}={'x'.join(map(str, v))}" for k, v in c["shapes"].items())
        for name, r in c["candidates"].items():
            sp = c["speedups"].get(name, {})
            rows.append({"op": c["op"], "size": c["size"], "shape": shape, "dtype": c["dtype"], "candidate": name,
                         "mode": r["mode"], "p20_us": r["p20_us"], "p50_us": r["p50_us"], "p80_us": r["p80_us"],
                         "rounds": r["rounds"], "number": r["number"], "bytes": c["bytes"]["total"],
                         "gbps": r["gbps"], "frac_stream_copy": r["frac_stream_copy"],
                         "frac_stream_copy_local": r.get("frac_stream_copy_local", ""),
                         "opbridge_speedup": sp.get("speedup", ""), "vs_ours": sp.get("ours", ""),
                         "what": r["what"]})
    return rows


def write_results(result: dict[str, Any], s: Settings) -> dict[str, Any]:
    """Write ``results.json``, ``results.csv`` and the plots into ``s.out``; return their paths."""
    out = s.out
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Any] = {"dir": str(out), "json": str(out / "results.json"), "csv": str(out / "results.csv")}
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(csv_rows(result))
    if s.plots:
        from opbridge.bench import plot

        files["plots"] = [str(pth) for pth in plot.plot_all(result, out / "plots")]
    else:
        files["plots"] = []
    return files


def _fmt_x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def format_text(result: dict[str, Any]) -> str:
    """Render *result* as a readable report: headline tables, memory, then every case."""
    m = result["machine"]
    st = result["stream"]
    k = st["passes"][0]["kernels"]
    lines = [
        f"opbridge bench kernels{' (--quick)' if result['quick'] else ''}",
        f"machine: {m['cpu_model']}, {m['cpus_usable']} CPUs, torch {m['torch']} ({m['torch_threads']} threads), "
        f"numpy {m['numpy']}, tvm-ffi {m['tvm_ffi']}, python {m['python']}, L3 {m.get('l3_cache')}, "
        f"{m['date']}; 1-min load average "
        f"{m['loadavg_1m_start_end'][0]} at the start, {m['loadavg_1m_start_end'][1]} at the end",
        f"STREAM ({st['passes'][0]['n']} floats, {st['passes'][0]['threads']} threads), GB/s p50 of the first "
        f"pass: " + ", ".join(f"{n} {v['gbps_p50']:.1f}" for n, v in k.items())
        + f"; copy reference (both passes) {st['copy_gbps']:.2f} GB/s",
        "speed-up = competitor p50 / opbridge p50 in the same mode (>1: opbridge faster)",
    ]
    loads = [x for x in m.get("loadavg_1m_start_end", []) if x is not None]
    if loads and max(loads) >= m["cpus_usable"]:
        lines.append(f"WARNING: the machine was busy (1-min load average up to {max(loads)} on {m['cpus_usable']} "
                     "CPUs): OpenMP-parallel calls wait for a descheduled team thread (milliseconds each), so "
                     "multi-threaded candidates at small sizes look far slower than on an idle machine")
    lines.append("")
    sm = result["summary"]
    if sm["large_float32_frac_stream_copy"]:
        lines.append("large float32, into an existing buffer / in place: fraction of STREAM copy, against a copy "
                     "of the same bytes timed interleaved (against the run's STREAM copy):")
        lines.append(f"  {'op':<22} {'opbridge':>14} {'eager':>14} {'compile':>14}")
        for op, row in sm["large_float32_frac_stream_copy"].items():
            run_row = sm["large_float32_frac_stream_copy_run"][op]
            lines.append(f"  {op:<22} " + " ".join(f"{row[n]:>6.2f} ({run_row[n]:.2f})" if n in row else f"{'-':>14}"
                                                    for n in (OURS_OUT, EAGER_OUT, COMPILE_OUT)))
        lines.append("")
    if sm["large_new_speedup_vs_eager"]:
        lines.append("large, new output: opbridge speed-up vs torch eager (in-place ops: their in-place call):")
        for op, row in sm["large_new_speedup_vs_eager"].items():
            lines.append(f"  {op:<22} " + "  ".join(f"{d} {_fmt_x(v)}" for d, v in row.items()))
        lines.append("")
    if sm["speedup_vs_compile"]:
        lines.append("speed-up vs torch.compile (Inductor), new output / into a buffer:")
        for op, by_size in sm["speedup_vs_compile"].items():
            for sz, by_dt in by_size.items():
                cells = "  ".join(f"{d} {_fmt_x(r.get('new'))} / {_fmt_x(r.get('out'))}" for d, r in by_dt.items())
                lines.append(f"  {op:<22} {sz:<6} {cells}")
        lines.append("")
    if sm["small_speedup_vs_eager"]:
        lines.append("small: opbridge speed-up vs torch eager, new output / into a buffer:")
        for op, by_dt in sm["small_speedup_vs_eager"].items():
            cells = "  ".join(f"{d} {_fmt_x(r.get('new'))} / {_fmt_x(r.get('out'))}" for d, r in by_dt.items())
            lines.append(f"  {op:<22} {cells}")
        lines.append("")
    if sm.get("small_ceiling_vs_eager"):
        lines.append("small: the most any kernel could beat torch eager by, new output / into a buffer: eager's time "
                     "over the fastest in-cache copy of the same bytes (one thread or the run's threads), call "
                     "overhead included:")
        for op, by_dt in sm["small_ceiling_vs_eager"].items():
            cells = "  ".join(f"{d} {_fmt_x(r.get('new'))} / {_fmt_x(r.get('out'))}" for d, r in by_dt.items())
            lines.append(f"  {op:<22} {cells}")
        lines.append("")
    mem = result["memory"]
    if "rows" in mem:
        lines.append(f"peak memory beyond inputs and outputs, one call at {mem['size'][0]}x{mem['size'][1]} "
                     f"(MiB; x = multiples of the largest input):")
        lines.append(f"  method: {mem['method']}; resolution {mem['resolution']}")
        by: dict[tuple[str, str], dict[str, Any]] = {}
        for r in mem["rows"]:
            by.setdefault((r["op"], r["dtype"]), {})[r["candidate"]] = r
        names = [n for n in (OURS_OUT, OURS_NEW, REF, EAGER_NEW, EAGER_OUT)
                 if any(n in v for v in by.values())]
        lines.append(f"  {'op':<22} {'dtype':<11} " + " ".join(f"{n:>18}" for n in names))
        for (op, d), row in by.items():
            mem_cells = []
            for n in names:
                r = row.get(n)
                mem_cells.append(f"{'-':>18}" if r is None else
                                 f"{r['beyond_io_bytes'] / 2**20:>9.2f} ({r['beyond_io_vs_input']:.2f}x)")
            lines.append(f"  {op:<22} {d:<11} " + " ".join(mem_cells))
        for op, v in mem["ops"].items():
            allowed = "none" if v["kind"] == "forward" else "at most one"
            lines.append(f"  {op}: opbridge's worst {v['worst_beyond_io_vs_input']:.2f}x of its largest input "
                         f"({v['kind']}: {allowed} input-sized temporary allowed) -> {'ok' if v['ok'] else 'EXCEEDED'}")
        lines.append("")
    lines.append("every case (p20 / p50 / p80 µs, GB/s at p50, fraction of the run's STREAM copy, of the "
                 "interleaved copy of the same bytes where timed, opbridge speed-up):")
    for c in result["cases"]:
        shapes = ", ".join(f"{k}={tuple(v)}" for k, v in c["shapes"].items())
        lines.append(f"  {c['op']} {c['size']} {c['dtype']}  [{shapes}; {c['bytes']['total'] / 2**20:.2f} MiB moved]"
                     + (f"  torch: {c['torch_variant']}" if c["torch_variant"] else ""))
        for n, r in c["candidates"].items():
            sp = c["speedups"].get(n)
            rel = f"{sp['speedup']:.2f}x vs {sp['ours']}" if sp else ""
            loc = f"{r['frac_stream_copy_local']:>5.2f}" if "frac_stream_copy_local" in r else f"{'':>5}"
            lines.append(f"    {n:<13} {r['mode']:<8} {r['p20_us']:>11.1f} {r['p50_us']:>11.1f} {r['p80_us']:>11.1f}"
                         f" {r['gbps']:>7.2f} {r['frac_stream_copy']:>5.2f} {loc}  {rel}")
        copies = {"stream copy": c["stream_copy_local"]} if c.get("stream_copy_local") else {}
        copies.update({f"copy {r['threads']} thr": r for r in c.get("cache_copies", {}).values()})
        for name, r in copies.items():
            lines.append(f"    {name:<13} {'same B':<8} {r['p20_us']:>11.1f} {r['p50_us']:>11.1f} "
                         f"{r['p80_us']:>11.1f} {r['gbps']:>7.2f}")
        for n, why in c["skipped"].items():
            lines.append(f"    {n:<13} skipped: {why}")
    for sk in result["skipped_ops"]:
        lines.append(f"  skipped op {sk['op']}: {sk['reason']}")
    f = result["files"]
    lines += ["", f"results: {f['dir']} (results.json, results.csv, {len(f['plots'])} plots); "
                  f"wall time {result['wall_seconds']:.0f}s"]
    return "\n".join(lines)
