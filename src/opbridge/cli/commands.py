"""``opbridge list``, ``build``, ``demo`` and ``bench``: each command's parser and handler."""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opbridge.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    UsageError,
    add_import_option,
    err,
    import_all,
    libraries,
    print_json,
    usage_error,
)
from opbridge.errors import OpbridgeError

if TYPE_CHECKING:
    from opbridge.aot.natives import Building
    from opbridge.declare import Library, OpDef


# -- opbridge list -------------------------------------------------------------


def shape_rule(op: OpDef) -> str | None:
    """How ``opbridge list`` names *op*'s shape rule, or None.

    ``like(...)``; ``module.function`` for a function its module defines; for one made inside
    another function (a rule factory's) or a lambda, its name and its docstring's first line,
    else its name and where it was made.
    """
    rule = op.shape
    if rule is None:
        return None
    if type(rule).__name__ == "like":
        return repr(rule)
    qualname = getattr(rule, "__qualname__", None)
    module = getattr(rule, "__module__", None)
    if not qualname or not module:
        return repr(rule)
    if "<" not in qualname:  # neither <locals> nor <lambda>: a name the module has
        return f"{module}.{qualname}"
    name = getattr(rule, "__name__", "") or "rule"
    name = "lambda" if name == "<lambda>" else name
    doc = (inspect.getdoc(rule) or "").strip().splitlines()
    if doc:
        return f"{name} ({doc[0].rstrip('.')})"
    outer = qualname.split(".<locals>")[0] if ".<locals>" in qualname else ""
    return f"{name} (in {module}{'.' + outer if outer else ''})"


def op_info(op: OpDef) -> dict[str, Any]:
    """The ``opbridge list --json`` record of *op*."""
    return {
        "namespace": op.library.namespace,
        "name": op.name,
        "qualname": op.qualname,
        "schema": str(op.schema),
        "devices": sorted(op.kernels),
        "kernels": dict(op.kernels),
        "dtypes": list(op.dtypes),
        "backward": op.backward is not None,
        "shape": shape_rule(op),
        "module": op.library.python_module,
    }


def _cmd_list(args: argparse.Namespace) -> int:
    import_all(args.imports)
    rows = [op_info(op) for lib in libraries() for op in lib.ops.values()]
    if args.json:
        print_json(rows)
        return EXIT_OK
    if not rows:
        print("no ops are declared")
        return EXIT_OK
    width = max(len(r["qualname"]) for r in rows)
    for r in rows:
        print(f"{r['qualname']:<{width}}  {r['schema']}")
        print(f"{'':<{width}}    devices: {', '.join(r['devices'])}; dtypes: {', '.join(r['dtypes'])}; "
              f"backward: {'yes' if r['backward'] else 'no'}; shape: {r['shape']}")
    return EXIT_OK


def register_list(sub: Any) -> None:
    """Add ``opbridge list`` to the subcommands *sub*."""
    p = sub.add_parser("list", help="list the declared ops",
                       description="List every declared op: namespace, name, canonical schema, devices "
                                   "with kernels, the dtypes it takes, whether it has a backward, and "
                                   "its shape rule.")
    p.add_argument("--json", action="store_true", help="print one JSON document (a list of objects)")
    add_import_option(p)
    p.set_defaults(func=_cmd_list)


# -- opbridge build ------------------------------------------------------------


def _selected_libraries(names: Sequence[str] | None) -> list[Library]:
    libs = libraries()
    if not names:
        return libs
    by_name = {lib.namespace: lib for lib in libs}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise UsageError(f"no library {', '.join(map(repr, missing))}; declared: "
                         f"{', '.join(sorted(by_name)) or 'none'} (use --import MODULE for your own, or run "
                         f"in your plugin project's root)")
    return [by_name[n] for n in names]


def _build_one(lib: Library, device: str, force: bool) -> bool:
    """Build *lib* and report it; return False (after printing why) if the build failed."""
    from opbridge import loader  # the build toolchain, imported only by `build`

    start = time.monotonic()
    try:
        path = loader.build(lib, device, force=force)
    except (OpbridgeError, OSError) as e:  # BuildError, BackendUnavailableError, CacheSecurityError
        err(f"library {lib.namespace!r} ({device}):\n{e}")
        return False
    print(f"{lib.namespace} ({device}): {path} ({time.monotonic() - start:.2f}s)")
    return True


def _cmd_build(args: argparse.Namespace) -> int:
    if args.verbose:
        os.environ["OPBRIDGE_VERBOSE"] = "1"
    import_all(args.imports)
    libs = _selected_libraries(args.library)
    from opbridge.build.cache import cache_root

    try:  # every build below goes into it: one message, not one per build
        cache_root()
    except OSError as e:  # CacheError, CacheSecurityError
        err(str(e))
        return EXIT_FAILURE
    from opbridge.aot import natives

    building = natives.start()  # beside the libraries' builds: the shim is one long compile
    ok = True
    built = 0
    for lib in libs:
        if not lib.sources_for(args.device) and not args.library:
            print(f"{lib.namespace}: skipped (no {args.device} sources)", file=sys.stderr)
            continue
        ok = _build_one(lib, args.device, args.force) and ok
        built += 1
    if built == 0:
        print(f"nothing to build for {args.device}", file=sys.stderr)
    ok = _report_natives(building) and ok
    return EXIT_OK if ok else EXIT_FAILURE


def _report_natives(building: Building) -> bool:
    """Wait for the native entries (:mod:`opbridge.aot.natives`) every installed framework would build in
    the background on first use, and print them. False when one failed (the program would keep its Python
    path: `opbridge build` says so and exits 1)."""
    ok = True
    for b in building.results():
        if b.path is None:
            err(f"{b.label}: not available ({b.why_not})")
            ok = False
        else:
            print(f"{b.label}: {b.path} ({b.seconds:.2f}s)")
    return ok


def register_build(sub: Any) -> None:
    """Add ``opbridge build`` (JIT builds; ``opbridge.aot.cli`` adds ``--aot``) to *sub*."""
    p = sub.add_parser("build", help="build the declared libraries",
                       description="Compile (or fetch from the JIT cache) every declared library's module "
                                   "and print its path and the seconds it took. A compile error prints "
                                   "the failing command and the compiler's first file:line errors.")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="target device (default cpu)")
    p.add_argument("--force", action="store_true",
                   help="compile every source again and relink, even when the cache has the module or its objects")
    p.add_argument("-v", "--verbose", action="store_true", help="show compiler commands (OPBRIDGE_VERBOSE=1)")
    p.add_argument("--library", action="append", metavar="NS",
                   help="build only the library with namespace NS; repeatable")
    add_import_option(p)
    p.set_defaults(func=_cmd_build)


# -- opbridge demo -------------------------------------------------------------


def _cmd_demo(args: argparse.Namespace) -> int:
    from opbridge import demo

    return demo.run(args)


def register_demo(sub: Any) -> None:
    """Add ``opbridge demo``, with the options of ``python -m opbridge.demo``, to *sub*."""
    from opbridge import demo

    p = sub.add_parser("demo", help="the main job: build, check and time every op in every framework",
                       description="Build the built-in library, run every op in each installed framework, "
                                   "check it against its reference and time it against the framework's own op.")
    demo.add_arguments(p)
    p.set_defaults(func=_cmd_demo)


# -- opbridge bench --------------------------------------------------------------


def _cmd_bench(args: argparse.Namespace) -> int:
    from opbridge import bench

    mod = bench.load(args.bench)
    try:
        result = mod.run(args)
    except UsageError as e:  # an option's value, or options that do not go together: checked before any work
        return usage_error(args, str(e))
    if args.json:
        print_json(result)
    else:
        print(mod.format_text(result))
    return bench.exit_status(result)  # a benchmark that found a mismatch reports it, then fails


def register_bench(sub: Any) -> None:
    """Add ``opbridge bench NAME``, one subcommand per entry of ``opbridge.bench.BENCHES``, to *sub*."""
    from opbridge import bench

    bench_parser = sub.add_parser(
        "bench", help="run a benchmark",
        description="Run one of opbridge's benchmarks; `opbridge bench NAME --help` describes each.",
    )
    names = bench_parser.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name in bench.BENCHES:
        mod = bench.load(name)
        p = names.add_parser(name, help=mod.DESCRIPTION.split(":")[0], description=mod.DESCRIPTION)
        p.add_argument("--json", action="store_true", help="print one JSON document")
        p.add_argument("--quick", action="store_true", help="a short run (smoke test; numbers are rough)")
        mod.add_arguments(p)
        p.set_defaults(func=_cmd_bench, command_parser=p)
