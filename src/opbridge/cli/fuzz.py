"""``opbridge fuzz``: :func:`opbridge.testing.fuzz.fuzz_op` over declared ops, from the command line."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from opbridge.bench import POSITIVE_INT, ListOption
from opbridge.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    add_import_option,
    err,
    import_all,
    libraries,
    print_json,
)

_FAILURE_LINES = 12


def register(sub: Any) -> None:
    """Add ``opbridge fuzz`` to the subcommands *sub*."""
    from opbridge.testing.fuzz import CHECKS, FRAMEWORKS

    p = sub.add_parser(
        "fuzz", help="fuzz declared ops against their references (hypothesis)",
        description="Run opbridge.testing.fuzz.fuzz_op on declared ops: hypothesis draws dtypes, values and "
                    "memory layouts, out= buffers (strided or over an input), written arguments sharing a "
                    "buffer, and inconsistent arguments and scalars; every call path is checked against the "
                    "op's NumPy reference (docs/testing.md). Each framework runs in this process (Paddle and "
                    "MindSpore cannot share one; MindSpore needs its own environment). Exit status 1 when a "
                    "check fails. Needs hypothesis.")
    add_import_option(p)
    p.add_argument("--ops", action=ListOption, metavar="NAME",
                   help="ops to fuzz, by name or namespace::name (default: the ops of the libraries the "
                        "--import modules declare, or in a plugin project's root its own; else every "
                        "declared op)")
    p.add_argument("--frameworks", action=ListOption, default=["numpy", "torch"], choices=FRAMEWORKS, metavar="NAME",
                   help="frameworks to fuzz in (default: numpy torch; choices: %(choices)s)")
    p.add_argument("--checks", action=ListOption, choices=CHECKS, metavar="CHECK",
                   help="checks to run (default: all of %(choices)s)")
    p.add_argument("--examples", type=POSITIVE_INT, default=25, metavar="N", help="examples per check (default: 25)")
    p.add_argument("--random", action="store_true",
                   help="draw new examples (default: the same ones every run, as in CI)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="torch only: the tensors' device")
    p.add_argument("--json", action="store_true", help="print one JSON document (a record per op, framework "
                                                       "and check)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Handle ``opbridge fuzz``; return the exit status."""
    if args.device == "cuda" and set(args.frameworks) != {"torch"}:
        err("--device cuda is for torch: pass --frameworks torch")
        return EXIT_USAGE
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():  # else every check would fail on its first tensor
            err("--device cuda: torch sees no CUDA GPU here (a CPU build of torch, or no device); "
                "nothing was fuzzed")
            return EXIT_FAILURE
    if {"paddle", "mindspore"} <= set(args.frameworks):
        err("Paddle and MindSpore cannot share a process (and MindSpore needs NumPy 1): fuzz them in two runs")
        return EXIT_USAGE
    try:
        from opbridge.testing.fuzz import CHECKS, fuzz_op
        from opbridge.testing.harness import get

        imported = import_all(args.imports)
    except ImportError as e:
        err(str(e))
        return EXIT_USAGE
    if args.imports and not imported and not args.ops:
        err(f"--import {' '.join(args.imports)}: declares no opbridge library, so there is no op to fuzz "
            "(name ops with --ops)")
        return EXIT_USAGE
    ops = [op for lib in libraries() for op in lib.ops.values()]
    if args.imports and not args.ops:  # your ops, not the built-in ones too
        ops = [op for lib in imported for op in lib.ops.values()]
    if args.ops:
        wanted = set(args.ops)
        ops = [op for op in ops if op.name in wanted or op.qualname in wanted]
        missing = wanted - {op.name for op in ops} - {op.qualname for op in ops}
        if missing:
            err(f"--ops: no declared op named {', '.join(sorted(missing))} (see `opbridge list`)")
            return EXIT_USAGE
    records: list[dict[str, Any]] = []
    failed = 0
    for fw in args.frameworks:
        reason = get(fw).skip_reason()
        if reason is not None:
            records.append({"framework": fw, "skipped": reason})
            _say(args, f"{fw}: skipped: {reason}")
            continue
        for op in ops:
            for check in args.checks or CHECKS:
                t0 = time.perf_counter()
                rec: dict[str, Any] = {"framework": fw, "op": op.qualname, "check": check}
                try:
                    report = fuzz_op(op, fw, examples=args.examples, checks=[check], device=args.device,
                                     derandomize=not args.random)
                except AssertionError as e:
                    failed += 1
                    rec["failure"] = str(e)
                    lines = str(e).splitlines()
                    _say(args, f"FAIL {fw} {op.qualname} {check}:\n  " + "\n  ".join(lines[:_FAILURE_LINES])
                         + ("\n  ..." if len(lines) > _FAILURE_LINES else ""))
                else:
                    rec["examples"] = report.examples[check]
                    if check in report.skipped:
                        rec["skipped"] = report.skipped[check]
                rec["seconds"] = round(time.perf_counter() - t0, 3)
                records.append(rec)
            done = [r for r in records if r.get("op") == op.qualname and r["framework"] == fw]
            ran = sum(1 for r in done if r.get("examples"))
            skipped = [r for r in done if "skipped" in r]
            _say(args, f"{fw} {op.qualname}: {ran} check(s) ran, "
                       f"{sum(1 for r in done if 'failure' in r)} failed, "
                       f"{len(skipped)} did not apply" + "".join(f"\n  {r['check']}: {r['skipped']}" for r in skipped))
    runs = sum(1 for r in records if r.get("examples"))
    if args.json:
        print_json(records)
    elif not failed and runs:
        print(f"opbridge fuzz: no failures ({runs} op/framework/check runs, {args.examples} examples each)")
    if not failed and not runs:  # every framework skipped, or no check could run: nothing was tested
        _say(args, "opbridge fuzz: nothing was fuzzed (see the skips above)")
        return EXIT_FAILURE
    return EXIT_FAILURE if failed else EXIT_OK


def _say(args: argparse.Namespace, msg: str) -> None:
    print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)
