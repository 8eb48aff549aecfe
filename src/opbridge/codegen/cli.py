"""``opbridge codegen``: write or check a library's generated ``_custom_ops.py`` and stub.

Wiring (in ``opbridge.cli.build_parser``)::

    from opbridge.codegen import cli as codegen_cli
    codegen_cli.register(sub)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from opbridge._cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, add_import_option, err
from opbridge.errors import OpbridgeError


def run(args: argparse.Namespace) -> int:
    """Handle ``opbridge codegen``; return the exit status (1 when ``--check`` finds stale files)."""
    from opbridge.aot.cli import default_out_dir, import_declarations, select_libraries
    from opbridge.codegen import StaleGeneratedFilesError, generate

    try:
        import_declarations(args.imports)
        libs = select_libraries(args.library)
    except (ModuleNotFoundError, FileNotFoundError, OpbridgeError) as e:
        err(str(e))
        return EXIT_USAGE
    if not args.library:
        libs = [lib for lib in libs if lib.namespace != "opbridge"]
        if not libs:
            err("no library of yours is declared: pass --import MODULE (or --library opbridge for the built-in one)")
            return EXIT_USAGE
    if len(libs) != 1 and args.out is not None:
        names = ", ".join(lib.namespace for lib in libs) or "none"
        err(f"--out needs exactly one library (--library NS); found: {names}")
        return EXIT_USAGE
    status = EXIT_OK
    for lib in libs:
        out = args.out or default_out_dir(lib)
        if out is None:
            err(f"{lib.namespace}: pass --out DIR (no prebuilt= package to write into)")
            return EXIT_USAGE
        try:
            paths = generate(lib, out, name=args.name, check=args.check)
        except StaleGeneratedFilesError as e:
            err(str(e))
            status = EXIT_FAILURE
            continue
        verb = "current" if args.check else "wrote"
        print(f"{lib.namespace}: {verb} {', '.join(map(str, paths))}")
        _note_import_path(lib.python_module, args.imports, Path(out))
    return status


def _note_import_path(module: str, imports: list[str], out: Path) -> None:
    """The wrappers import *module* by name: where --import gave it as a file outside *out*, say that it must be
    importable where they run (a user's first `_custom_ops` call failed with ModuleNotFoundError)."""
    for given in imports:
        path = Path(given)
        if path.suffix == ".py" and path.stem == module and path.resolve().parent != out.resolve():
            print(f"opbridge: note: the wrappers import {module!r}, which --import read from {path}: they run where "
                  f"{module!r} is importable ({path.resolve().parent} on sys.path, or --out {path.parent})",
                  file=sys.stderr)


def register(subparsers: Any) -> None:
    """Add the ``codegen`` subcommand to *subparsers*."""
    p = subparsers.add_parser(
        "codegen", help="generate typed Python wrappers (_custom_ops.py + .pyi) of a library",
        description="Write <name>.py (one typed, documented wrapper per op, importing the declarations "
                    "on first call) and <name>.pyi for a declared library; --check verifies them instead.",
    )
    add_import_option(p)
    p.add_argument("--library", action="append", metavar="NS", help="the library's namespace; repeatable")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="package directory to write into (default: the package of the library's prebuilt=)")
    p.add_argument("--name", default="_custom_ops", help="module name of the wrappers (default _custom_ops)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the files are stale")
    p.set_defaults(func=run)
