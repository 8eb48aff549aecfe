"""The main job: build the built-in op library, then run every op in every
installed framework, check it against its reference and time it against the
framework's own implementation (interleaved, in one process).

Run ``python -m opbridge.demo`` (``scripts/demo.sh`` runs it in both
environments). Exit status 1 if any result disagrees with its reference.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from opbridge.aot import natives
from opbridge.bench import POSITIVE_INT, ListOption
from opbridge.testing.harness import HARNESSES, get
from opbridge.testing.matrix import NONCONTIGUOUS

DEFAULT_FRAMEWORKS = ("numpy", "torch", "jax", "paddle")


def _call_synced(fn: Any, args: Sequence[Any]) -> Any:
    return _sync(fn(*args))


def _sync(x: Any) -> Any:
    for y in x if isinstance(x, tuple) else (x,):
        if hasattr(y, "block_until_ready"):
            y.block_until_ready()
    return x


def _demo_case(op: Any) -> dict[str, Any]:
    from opbridge.testing import make_cases

    cases = make_cases(op, "float32", seed=1)

    def size(case: dict[str, Any]) -> int:
        return sum(int(np.asarray(v).size) for v in _ordered(op, case) if isinstance(v, np.ndarray))

    return max((c for c in cases if not c.get(NONCONTIGUOUS)), key=size)


def _ordered(op: Any, case: dict[str, Any]) -> list[Any]:
    """The case's argument values in schema order (cases also carry ``_``-prefixed layout keys)."""
    return [case[a.name] for a in op.schema.arguments]


def _results(op: Any, args: Sequence[Any], out: Any, mutates_in_place: bool) -> list[Any]:
    """The op's observable results: mutated arguments (or their new values), then returns."""
    outs = [] if out is None else list(out) if isinstance(out, tuple) else [out]
    mutated = [i for i, a in enumerate(op.schema.arguments) if a.is_mutated]
    if mutates_in_place:
        return [args[i] for i in mutated] + outs
    return outs


def _reference(op: Any, case: dict[str, Any]) -> list[np.ndarray]:
    args = [np.array(v, dtype=np.float64) if isinstance(v, np.ndarray) and v.dtype.kind == "f"
            else (np.array(v) if isinstance(v, np.ndarray) else v) for v in _ordered(op, case)]
    out = op.reference(*args)
    return _results(op, args, out, True)


def run_framework(name: str, rounds: int, number: int, width: int = 22) -> tuple[bool, list[str]]:
    """Check and time every built-in op in framework *name*; return (all ok, table rows)."""
    from opbridge import ops
    from opbridge.bench.natives import natives
    from opbridge.bench.timing import interleaved, summary

    harness = get(name)
    reason = harness.skip_reason()
    if reason:
        return True, [f"{name:10s} skipped: {reason}"]
    native = natives(name)
    ok_all = True
    rows = []
    for op in ops.LIBRARY.ops.values():
        case = _demo_case(op)
        args = [harness.from_numpy(v, "float32" if v.dtype.kind == "f" else None)
                if isinstance(v, np.ndarray) else v for v in _ordered(op, case)]
        want = _reference(op, case)  # first: harnesses may share memory with the case's arrays
        try:
            got = _results(op, args, op.call(*args), harness.mutates_in_place)
        except Exception as e:  # report and go on: the table shows every op
            ok_all = False
            rows.append(f"{name:10s} {op.name:{width}s} ERROR {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        rtol, atol = op.tolerance("float32")
        errs = [float(np.max(np.abs(harness.to_numpy(g).astype(np.float64) - w), initial=0.0))
                for g, w in zip(got, want)]
        ok = all(np.allclose(harness.to_numpy(g).astype(np.float64), w, rtol=rtol, atol=atol)
                 for g, w in zip(got, want))
        ok_all &= ok
        shape = "x".join(map(str, next(v.shape for v in _ordered(op, case) if isinstance(v, np.ndarray))))
        timing = ""
        if op.name in native and not op.schema.is_mutating:
            stats = summary(interleaved({
                "opbridge": functools.partial(_call_synced, op.call, args),
                "native": native[op.name](args),
            }, rounds=rounds, number=number))
            ours, theirs = stats["opbridge"]["p50"], stats["native"]["p50"]
            timing = f"{ours:10.1f} {theirs:10.1f} {ours / theirs:7.2f}"
        rows.append(f"{name:10s} {op.name:{width}s} {shape:>10s} {max(errs):10.2e} "
                    f"{'ok' if ok else 'FAIL':>5s} {timing}")
    return ok_all, rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to *parser* (``python -m opbridge.demo`` and ``opbridge demo``)."""
    parser.add_argument("--frameworks", action=ListOption, choices=HARNESSES, default=list(DEFAULT_FRAMEWORKS),
                        metavar="NAME",
                        help=f"a subset of {', '.join(HARNESSES)} "
                             f"(default {','.join(DEFAULT_FRAMEWORKS)})")
    parser.add_argument("--rounds", type=POSITIVE_INT, default=15, help="timing rounds per op (default 15)")
    parser.add_argument("--number", type=POSITIVE_INT, default=200, help="calls per round (default 200)")


def run(args: argparse.Namespace) -> int:
    """Run the demo with *args* parsed by a parser that :func:`add_arguments` filled."""
    from opbridge import ops

    # The native entries a program builds in the background on first use, on idle CPU, which the
    # demo's own timing would leave it none of: built now, beside the library, so the timings are the
    # native paths'.
    building = natives.start(tuple(args.frameworks))
    t0 = time.perf_counter()
    path = ops.LIBRARY.build("cpu")
    print(f"built-in library {ops.LIBRARY.namespace!r}: {len(ops.LIBRARY.ops)} ops, "
          f"module {path} ({time.perf_counter() - t0:.2f} s, cached builds are reused)")
    for b in building.results():
        print(f"{b.label}: {b.path} ({b.seconds:.2f} s)" if b.path is not None
              else f"{b.label}: not available ({b.why_not})")
    width = max(len(n) for n in ("op", *ops.LIBRARY.ops))  # every op's name whole, its columns aligned
    print(f"{'framework':10s} {'op':{width}s} {'shape':>10s} {'max |err|':>10s} {'ref':>5s} "
          f"{'ours µs':>10s} {'native µs':>10s} {'ratio':>7s}")
    ok_all = True
    for name in args.frameworks:
        ok, rows = run_framework(name, args.rounds, args.number, width)
        ok_all &= ok
        print("\n".join(rows), flush=True)
    print("all results match their references" if ok_all else "SOME RESULTS DISAGREE WITH THE REFERENCE")
    return 0 if ok_all else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m opbridge.demo``."""
    parser = argparse.ArgumentParser(prog="python -m opbridge.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
