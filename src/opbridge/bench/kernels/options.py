"""Options of ``opbridge bench kernels``: settings, the ops to run and the cases."""

from __future__ import annotations

import argparse
import datetime
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opbridge.bench import NON_NEGATIVE_FLOAT, POSITIVE_FLOAT, POSITIVE_INT, ListOption, UsageError, check_declared

DTYPES = ("float32", "float64", "bfloat16")
#: Every dtype ``--dtypes`` accepts.
FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")
#: The serving ops benchmarked by default when declared (the built-in forward ops always are).
DEFAULT_OPS = ("add", "gelu", "rms_norm", "silu_and_mul", "gelu_and_mul", "fused_add_rms_norm",
               "rotary_embedding", "advance_step_flashattn")


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


#: Cases moving at least this many bytes time a copy of their own byte count interleaved with their
#: candidates (``--local-stream-mib``), and their fractions of the copy ceiling are against it: the
#: copy sees the same cache residency and the same moment's load. The float64-vs-float32 table
#: starts at this size (:data:`opbridge.bench.kernels.text.FLOAT64_MIN_BYTES`), so each of its
#: rows has that local ceiling: a 16 MiB float32 case whose bytes fit in L3 is not judged
#: against DRAM bandwidth while its float64 twin (twice the bytes) falls out of the cache.
LOCAL_CEILING_BYTES = 1 << 20

FULL: dict[str, float] = {"rounds": 30, "min_rounds": 7, "target_ms": 20.0, "case_budget_s": 12.0, "stream_rounds": 10}
QUICK: dict[str, float] = {"rounds": 7, "min_rounds": 3, "target_ms": 5.0, "case_budget_s": 1.5, "stream_rounds": 5}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this benchmark's options to *parser*."""
    from opbridge.bench.stream import DEFAULT_N, QUICK_N
    from opbridge.bench.workloads import SIZES

    sizes = ", ".join(f"{k} {v[0]}x{v[1]}" for k, v in SIZES.items())
    parser.add_argument("--ops", action=ListOption, metavar="OP", default=None,
                        help=f"ops, as words or comma-separated (default: {', '.join(DEFAULT_OPS)}, where declared)")
    parser.add_argument("--all-ops", action="store_true",
                        help="every declared op with a workload, backward ops included")
    parser.add_argument("--sizes", action=ListOption, type=_size, metavar="SIZE", default=None,
                        help=f"sizes, as words or comma-separated: names ({sizes}) or RxC (default: all three)")
    parser.add_argument("--dtypes", action=ListOption, choices=FLOAT_DTYPES, metavar="DTYPE", default=list(DTYPES),
                        help=f"dtypes, as words or comma-separated (default {','.join(DTYPES)}); ops with fixed "
                             "integer dtypes (advance_step_flashattn) run once per size whatever this says")
    parser.add_argument("--rounds", type=POSITIVE_INT, metavar="N", default=None,
                        help=f"most interleaved rounds per case (default {FULL['rounds']}, "
                             f"{QUICK['rounds']} with --quick; large cases get fewer to fit a time budget)")
    parser.add_argument("--target-ms", type=POSITIVE_FLOAT, metavar="MS", default=None,
                        help=f"time of one sample of the slowest candidate (default {FULL['target_ms']:g}, "
                             f"{QUICK['target_ms']:g} with --quick)")
    parser.add_argument("--compile", dest="compile", action="store_true", default=None,
                        help="time torch.compile candidates (default on; off with --quick)")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="skip the torch.compile candidates")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument("--memory-size", type=_size, metavar="SIZE", default=None,
                        help="size of the peak-memory measurement (default large; 256x4096, float32 only, "
                             "with --quick)")
    parser.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    parser.add_argument("--stream-n", type=POSITIVE_INT, metavar="N", default=None,
                        help=f"STREAM floats per array (default {DEFAULT_N}, {QUICK_N} with --quick)")
    parser.add_argument("--local-stream-mib", type=NON_NEGATIVE_FLOAT, metavar="MIB",
                        default=LOCAL_CEILING_BYTES / 2**20,
                        help="cases moving at least MIB MiB also time a STREAM copy of their own byte count, "
                             "interleaved with the candidates, and their fractions of the copy ceiling are "
                             f"against it (default {LOCAL_CEILING_BYTES / 2**20:g}: every row of the float64 "
                             "vs float32 table); smaller cases time copies on 1 and N threads instead")
    parser.add_argument("--threads", type=POSITIVE_INT, metavar="N", default=None,
                        help="STREAM threads (default: torch's intra-op threads)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="results folder (default results/bench-kernels-<timestamp>/)")


def _size(text: str) -> tuple[str, tuple[int, int]]:
    """The argparse ``type`` of a size: ``(its name, (rows, cols))`` of a name or of ``RxC``."""
    from opbridge.bench.workloads import SIZES

    text = text.strip()
    if text in SIZES:
        return text, SIZES[text]
    rows, sep, cols = text.lower().partition("x")
    if not sep or not rows.isdigit() or not cols.isdigit() or int(rows) < 1 or int(cols) < 1:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(SIZES)} or RxC (e.g. 8x4096), got {text!r}")
    return text, (int(rows), int(cols))


def _check_options(args: argparse.Namespace) -> None:
    """Refuse what argparse cannot (:class:`~opbridge.errors.UsageError`): an op that is not declared, and
    options that do not go together; before torch is imported."""
    if args.ops and args.all_ops:
        raise UsageError("--ops names the ops to run, --all-ops runs every one: give one or the other")
    if args.no_memory and args.memory_size is not None:
        raise UsageError("--memory-size sizes the peak-memory measurement, which --no-memory leaves out: give "
                         "one or the other")
    check_declared(args.ops)


def settings(args: argparse.Namespace) -> Settings:
    """Resolve *args* (with ``--quick``) into :class:`Settings`."""
    from opbridge.bench.stream import DEFAULT_N, QUICK_N
    from opbridge.bench.workloads import SIZES

    _check_options(args)
    quick = bool(getattr(args, "quick", False))
    d = QUICK if quick else FULL
    sizes = dict(args.sizes) if args.sizes else dict(SIZES)  # (name, (rows, cols)) each, read by _size
    dtypes = tuple(args.dtypes) or DTYPES
    rounds = int(args.rounds if args.rounds is not None else d["rounds"])
    target_ms = args.target_ms if args.target_ms is not None else d["target_ms"]
    mem = args.memory_size[1] if args.memory_size else ((256, 4096) if quick else SIZES["large"])
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Settings(
        ops=tuple(args.ops) if args.ops else None,
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



# -- op selection and inputs -----------------------------------------------------------------


@dataclass
class Plan:
    """The ops to run, their workloads, and the ops skipped with why."""

    ops: list[Any] = field(default_factory=list)  # OpDef
    workloads: dict[str, Any] = field(default_factory=dict)  # name -> Workload
    torch: dict[str, Any] = field(default_factory=dict)  # name -> the TorchImpl that matches, or None
    skipped: list[dict[str, str]] = field(default_factory=list)


def is_backward(name: str) -> bool:
    return name.endswith("_backward")


def plan(s: Settings, *, for_memory: bool = False) -> Plan:
    """Choose the ops of the built-in library to benchmark and their workloads."""
    from opbridge import registry
    from opbridge.bench import workloads

    lib = registry.library("opbridge")
    known = workloads.workloads()
    if s.ops is not None:  # each declared: settings() checked
        names = list(s.ops)
    elif s.all_ops or for_memory:
        names = list(lib.ops)
    else:
        names = [n for n in lib.ops if n in DEFAULT_OPS]
        for n in lib.ops:
            if n not in DEFAULT_OPS and not is_backward(n):
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


def reference_dtype(wl: Any, dtype: str) -> bool:
    """Whether the NumPy reference runs at *dtype*: float32, float64 (NumPy's own dtypes), or the
    fixed dtypes of an integer op."""
    return dtype in ("float32", "float64") or bool(wl.dtype)
