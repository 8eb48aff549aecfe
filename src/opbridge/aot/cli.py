"""``opbridge build --aot``: the command-line side of AOT builds.

Wiring (in ``opbridge.cli.build_parser``, after the ``build`` parser exists)::

    from opbridge.aot import cli as aot_cli
    aot_cli.register(sub)

:func:`register` adds ``--aot`` and ``--out DIR`` to the ``build`` command (or
creates the command when there is none) and routes ``--aot`` runs to
:func:`run`; runs without ``--aot`` go to the command's previous handler.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opbridge._cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, add_import_option, err
from opbridge.errors import OpbridgeError

if TYPE_CHECKING:
    from opbridge.declare import Library


def import_declarations(specs: Sequence[str]) -> None:
    """Import each of *specs* (a dotted module name or a ``.py`` path) so its libraries are declared.

    Dotted names are imported with the current directory on ``sys.path``, as ``python -m`` does.

    Raises
    ------
    ModuleNotFoundError, FileNotFoundError
        If a module or file does not exist.
    """
    for spec in specs:
        path = Path(spec)
        if spec.endswith(".py"):
            if not path.is_file():
                raise FileNotFoundError(f"--import {spec}: no such file")
            loaded = getattr(sys.modules.get(path.stem), "__file__", None)
            if loaded and Path(loaded).resolve() == path.resolve():
                continue  # imported already (the `opbridge` command imports --import files first)
            mod_spec = importlib.util.spec_from_file_location(path.stem, path)
            if mod_spec is None or mod_spec.loader is None:
                raise ModuleNotFoundError(f"--import {spec}: cannot import this file")
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[path.stem] = module
            mod_spec.loader.exec_module(module)
            continue
        if str(Path.cwd()) not in sys.path and "" not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        importlib.import_module(spec)


def select_libraries(namespaces: Sequence[str] | None) -> list[Library]:
    """The declared libraries named by *namespaces* (all when empty).

    Raises
    ------
    DeclarationError
        If a namespace is not declared.
    """
    import opbridge.ops  # noqa: F401 - declares the built-in library
    from opbridge import registry

    if not namespaces:
        return registry.libraries()
    return [registry.library(ns) for ns in namespaces]


def default_out_dir(lib: Library) -> Path | None:
    """The package directory ``lib.prebuilt`` lives in, or None when it cannot be found."""
    if not lib.prebuilt or "." not in lib.prebuilt:
        return None
    try:
        spec = importlib.util.find_spec(lib.prebuilt.rpartition(".")[0])
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--aot`` and ``--out`` to the ``build`` parser."""
    parser.add_argument("--aot", action="store_true",
                        help="build each library into one module file for a wheel (<prebuilt>.so) "
                             "instead of the JIT cache")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="with --aot: directory for the module (default: the package of the "
                             "library's prebuilt= module)")


def run(args: argparse.Namespace) -> int:
    """Handle ``opbridge build --aot``; return the exit status."""
    from opbridge.aot.build import build_aot, module_filename, module_name

    device = getattr(args, "device", "cpu")
    if getattr(args, "verbose", False):
        os.environ["OPBRIDGE_VERBOSE"] = "1"
    try:
        import_declarations(getattr(args, "imports", None) or [])
        libs = select_libraries(getattr(args, "library", None))
    except (ModuleNotFoundError, FileNotFoundError, OpbridgeError) as e:
        err(str(e))
        return EXIT_USAGE
    named = bool(getattr(args, "library", None))
    libs = [lib for lib in libs if named or lib.sources_for(device)]
    targets: dict[Path, str] = {}
    for lib in libs:
        out = args.out or default_out_dir(lib)
        if out is None:
            err(f"{lib.namespace}: declares no importable prebuilt= package; pass --out DIR")
            return EXIT_USAGE
        target = (Path(out) / module_filename(module_name(lib, device))).resolve()
        if target in targets:
            err(f"{lib.namespace} and {targets[target]} would both write {target}; build them one at a time "
                "(--library NS) or give them distinct prebuilt= names")
            return EXIT_USAGE
        targets[target] = lib.namespace
    status = EXIT_OK
    for lib, target in zip(libs, targets, strict=True):
        start = time.monotonic()
        try:
            path = build_aot(lib, target.parent, device=device, name=target.name.rpartition(".")[0])
        except (OpbridgeError, OSError) as e:
            err(f"library {lib.namespace!r} ({device}, AOT):\n{e}")
            status = EXIT_FAILURE
            continue
        print(f"{lib.namespace} ({device}, AOT): {path} ({time.monotonic() - start:.2f}s)")
    if not libs:
        print(f"nothing to build for {device}", file=sys.stderr)
    return status


def _dispatch(args: argparse.Namespace, previous: Callable[[argparse.Namespace], int] | None) -> int:
    if args.aot or previous is None:
        return run(args)
    if args.out is not None:  # else a JIT build would go into the cache, the directory asked for ignored
        err("--out DIR is for --aot builds (a JIT build goes into the cache, OPBRIDGE_CACHE_DIR): add --aot, or "
            "drop --out")
        return EXIT_USAGE
    return previous(args)


def register(subparsers: Any) -> None:
    """Add ``--aot``/``--out`` to the ``build`` subcommand of *subparsers* (creating it if absent)."""
    parser = subparsers.choices.get("build")
    if parser is None:
        parser = subparsers.add_parser("build", help="build the declared libraries",
                                       description="Build the declared libraries.")
        parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
        parser.add_argument("--library", action="append", metavar="NS")
        add_import_option(parser)
    add_arguments(parser)
    previous = parser.get_default("func")
    parser.set_defaults(func=functools.partial(_dispatch, previous=previous))
