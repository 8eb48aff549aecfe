"""The ``opbridge`` command line (also ``python -m opbridge``).

Exit status: 0 on success, 1 when the requested work fails (a build error, a
benchmark failure, a missing toolchain for ``doctor``), 2 on a usage error.

Each subcommand lives beside its handler and adds itself with ``register(sub)``:
``list``, ``build``, ``demo`` and ``bench`` in :mod:`opbridge.cli.commands`,
``doctor`` in :mod:`opbridge.cli.doctor`, ``build --aot`` in :mod:`opbridge.aot.cli`,
``codegen`` in :mod:`opbridge.codegen.cli` and ``new`` in :mod:`opbridge.scaffold.cli`.

This package imports no framework at import time: ``opbridge --help``,
``opbridge list`` and ``opbridge doctor`` never import torch, JAX, Paddle or
MindSpore (nor ``tvm_ffi``, which imports torch when it is installed).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from collections.abc import Sequence

from opbridge import __version__
from opbridge.cli import commands, doctor
from opbridge.cli.commands import op_info, shape_rule
from opbridge.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    UsageError,
    UserImportError,
    err,
    resolve_imports,
)
from opbridge.cli.doctor import FRAMEWORKS, doctor_report
from opbridge.errors import OpbridgeError

__all__ = ["EXIT_FAILURE", "EXIT_OK", "EXIT_USAGE", "FRAMEWORKS", "PROG", "UsageError", "build_parser",
           "doctor_report", "main", "op_info", "shape_rule"]

_shape_rule = shape_rule  # the name before the split into a package


def build_parser() -> argparse.ArgumentParser:
    """The ``opbridge`` argument parser."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="opbridge: declare a kernel once, use it as an op in every framework. "
                    "Exit status: 0 ok, 1 the requested work failed, 2 usage error.",
        epilog="Your own ops: list, build, fuzz and codegen take --import MODULE (a dotted name or a .py file) "
               "to declare them; run in the root of a plugin project (pyproject.toml with [tool.opbridge] "
               "package = PKG, as `opbridge new --project` writes), they import PKG.ops without it.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    from opbridge.aot import cli as aot_cli
    from opbridge.codegen import cli as codegen_cli
    from opbridge.scaffold import cli as scaffold_cli

    commands.register_list(sub)
    commands.register_build(sub)
    doctor.register(sub)
    __import__("opbridge.cli.cache", fromlist=["register"]).register(sub)  # `cache`
    aot_cli.register(sub)  # adds --aot / --out to `build`
    codegen_cli.register(sub)  # `codegen`
    scaffold_cli.register(sub)  # `new`
    commands.register_demo(sub)
    commands.register_bench(sub)
    __import__("opbridge.cli.fuzz", fromlist=["register"]).register(sub)  # `fuzz`
    for command in sub.choices.values():  # a command group's own subcommands (`bench gpu`) set theirs
        command.set_defaults(command_parser=command)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace | int:
    """Parse *argv*; an int is the exit status argparse chose (``--help``: 0, a usage error: 2).

    Options no parser knows are reported by the subcommand that was given them, with its usage
    (``usage: opbridge bench gpu ...``), not by the top-level parser, which would show its own.
    """
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
        return args
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_USAGE


#: Optional dependencies a command may need, and the extra that installs each.
_OPTIONAL = {"torch": "torch", "jax": "jax", "jaxlib": "jax", "jax_tvm_ffi": "jax", "paddle": "paddle",
             "mindspore": "mindspore", "matplotlib": "bench", "hypothesis": "dev", "ml_dtypes": None,
             "liger_kernel": None, "triton": None, "flatbuffers": None}


def _missing_dependency(e: ImportError, args: argparse.Namespace) -> str | None:
    """One line for an optional dependency *e* says is missing, or None (a bug: let its traceback show)."""
    command = " ".join(str(v) for v in (getattr(args, "command", None), getattr(args, "bench", None)) if v)
    name = (e.name or "").split(".")[0] if isinstance(e, ModuleNotFoundError) else ""
    if name in _OPTIONAL:
        extra = _OPTIONAL[name]
        return (f"{command} needs {name}, which is not installed here "
                f"({f'pip install opbridge[{extra}]' if extra else f'pip install {name}'})")
    if "pip install" in str(e):  # opbridge's own message for a missing dependency
        return f"{command}: {e}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``opbridge`` command line.

    Parameters
    ----------
    argv
        The arguments after the program name; default ``sys.argv[1:]``.

    Returns
    -------
    int
        The exit status: 0 ok, 1 the requested work failed, 2 usage error, 130 interrupted, 141 the
        reader of standard output left (SIGPIPE's status in a shell).
    """
    parser = build_parser()
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args
    try:
        resolve_imports(args)  # --import, or a plugin project's own ops: one way, one error for every command
        status: int = args.func(args)
    except UsageError as e:
        if isinstance(e, UserImportError) and e.__cause__ is not None:
            if getattr(args, "verbose", False) or os.environ.get("OPBRIDGE_VERBOSE", "") not in ("", "0"):
                traceback.print_exception(e.__cause__)
            else:
                e = UserImportError(f"{e} (OPBRIDGE_VERBOSE=1 shows the traceback)")
        err(str(e))
        return EXIT_USAGE
    except OpbridgeError as e:
        err(str(e))
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `opbridge list | head`: the reader left; stop quietly, as a shell tool does
        # Python flushes stdout again at exit: point it at /dev/null so that flush cannot fail too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except ImportError as e:  # an optional dependency the command needs; anything else keeps its traceback
        message = _missing_dependency(e, args)
        if message is None:
            raise
        err(message)
        return EXIT_FAILURE
    return status
