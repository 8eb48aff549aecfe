"""What every ``opbridge`` subcommand shares: exit codes, error output, ``--import`` of user modules."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opbridge.errors import OpbridgeError

if TYPE_CHECKING:
    from opbridge.declare import Library

PROG = "opbridge"
EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class UsageError(OpbridgeError, ValueError):
    """The command line asks for something that does not exist (exit status 2)."""


def err(msg: str) -> None:
    """Print ``opbridge: error: <msg>`` on stderr (once: an error message that already starts with
    ``opbridge: ``, as the cache's do, does not get it twice)."""
    print(f"{PROG}: error: {msg.removeprefix(f'{PROG}: ')}", file=sys.stderr)


def print_json(doc: Any) -> None:
    """Print *doc* as one indented JSON document."""
    print(json.dumps(doc, indent=2))


def _import_file(path: Path) -> None:
    """Import the ``.py`` file at *path* as a top-level module named after it, as ``python FILE`` would."""
    name = path.stem
    if name in sys.modules:
        raise UsageError(f"--import {path}: a module named {name!r} is already imported; rename the file "
                         "or import it by its dotted name")
    mod_spec = importlib.util.spec_from_file_location(name, path)
    if mod_spec is None or mod_spec.loader is None:
        raise UsageError(f"--import {path}: cannot import this file")
    sys.path.insert(0, str(path.resolve().parent))  # its sibling modules are importable
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = module
    try:
        mod_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


def import_user_module(spec: str) -> None:
    """Import *spec*, a dotted module name or a path to a ``.py`` file, to declare its libraries.

    Raises
    ------
    UsageError
        If the module or file does not exist.
    """
    path = Path(spec)
    if spec.endswith(".py") or path.is_file():
        if not path.is_file():
            raise UsageError(f"--import {spec}: no such file")
        _import_file(path)
        return
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # as `python -m` would
    try:
        importlib.import_module(spec)
    except ModuleNotFoundError as e:
        if e.name and (spec == e.name or spec.startswith(e.name + ".")):
            raise UsageError(f"--import {spec}: no module named {e.name!r}") from None
        raise


def import_all(specs: Sequence[str] | None) -> list[Library]:
    """Import each ``--import`` module or file, in order; return the libraries they declare.

    Those are the libraries declared while importing them, and those a module
    imported before (by an earlier ``--import``, or by another) declared under
    its name or a submodule's.
    """
    from opbridge import registry

    before = {lib.namespace for lib in libraries()}
    names = []
    for spec in specs or ():
        import_user_module(spec)
        names.append(Path(spec).stem if spec.endswith(".py") or Path(spec).is_file() else spec)
    return [lib for lib in registry.libraries() if lib.namespace not in before
            or any(lib.python_module == n or lib.python_module.startswith(n + ".") for n in names)]


def add_import_option(parser: argparse.ArgumentParser) -> None:
    """Add the repeatable ``--import MODULE`` option to a subcommand's parser."""
    parser.add_argument(
        "--import", dest="imports", action="append", metavar="MODULE", default=[],
        help="import MODULE (a dotted name, or a path to a .py file) first, so the libraries it "
             "declares are included; repeatable",
    )


def libraries() -> list[Library]:
    """Every declared library (the registry's list), the built-in ``opbridge`` library first."""
    import opbridge.ops  # noqa: F401 - declares the built-in library
    from opbridge import registry

    return registry.libraries()
