"""What the subcommands in ``cli/`` share: usage errors, JSON output, importing ``--import``'s user modules (the exit
statuses, the error line and the ``--import`` option itself are :mod:`opbridge._cli`'s, which every stage's
subcommand uses)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opbridge._cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, IMPORT_HELP, PROG, add_import_option, err
from opbridge.errors import UsageError

if TYPE_CHECKING:
    from opbridge.declare import Library

__all__ = ["EXIT_FAILURE", "EXIT_OK", "EXIT_USAGE", "IMPORT_HELP", "PROG", "UsageError", "UserImportError",
           "add_import_option", "err", "import_all", "import_user_module", "libraries", "print_json",
           "project_module", "resolve_imports", "usage_error"]


def usage_error(args: argparse.Namespace, msg: str) -> int:
    """Report the usage error *msg* as argparse reports its own, for the subcommand *args* ran: that command's
    usage, then ``opbridge bench gpu: error: <msg>``, on stderr; return the exit status, 2."""
    parser = getattr(args, "command_parser", None)
    if parser is None:
        err(msg)
    else:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def print_json(doc: Any) -> None:
    """Print *doc* as one indented JSON document."""
    print(json.dumps(doc, indent=2))


class UserImportError(UsageError):
    """An ``--import`` module (or the project's own, imported by default) raised while it was imported.

    Its ``__cause__`` is the exception raised; ``opbridge`` prints its traceback with ``OPBRIDGE_VERBOSE=1``
    (or ``build -v``), one line otherwise.
    """


#: Each ``--import`` given (and each module name it was imported as) -> (module name, namespaces it declared).
_IMPORTED: dict[str, tuple[str, tuple[str, ...]]] = {}


def _package_module(path: Path) -> tuple[Path, str] | None:
    """(folder to put on ``sys.path``, dotted name) of the ``.py`` file *path* when it lies in a package (a
    folder with ``__init__.py``, as ``my_plugin/ops/scale_add.py`` does); None for a file of a plain folder."""
    path = path.resolve()
    parts = [] if path.name == "__init__.py" else [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file() and folder.name.isidentifier():
        parts.insert(0, folder.name)
        folder = folder.parent
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        return None
    return folder, ".".join(parts)


def _cwd_on_path() -> None:
    """Put the current directory on ``sys.path``, as ``python -m`` does (the project's package is importable)."""
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(Path.cwd()))


def _import_file(path: Path) -> str:
    """Import the ``.py`` file at *path*; return the module name it was imported as.

    A file inside a package is imported as its package's module (``my_plugin/ops/scale_add.py`` as
    ``my_plugin.ops.scale_add``), the package's folder put on ``sys.path``; any other file as a top-level
    module named after it, as ``python FILE`` would, its folder put on ``sys.path`` (its sibling modules
    are importable). The current directory is put on ``sys.path`` too, as for a dotted name.
    """
    _cwd_on_path()
    packaged = _package_module(path)
    if packaged is not None:
        folder, name = packaged
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
        loaded = sys.modules.get(name)
        if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() != path.resolve():
            raise UsageError(f"--import {path}: a module named {name!r} is already imported from "
                             f"{loaded.__file__}")
        importlib.import_module(name)
        return name
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
    return name


def _where(e: BaseException) -> str:
    """`` (at FILE:LINE)``: where *e* was raised (a syntax error: where the bad line is), or nothing."""
    if isinstance(e, SyntaxError) and e.filename:
        return f" (at {e.filename}:{e.lineno})"
    frames = traceback.extract_tb(e.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def import_user_module(spec: str, label: str | None = None) -> str:
    """Import *spec*, a dotted module name or a path to a ``.py`` file, to declare its libraries.

    Importing the same *spec* again does nothing. Returns the name of the module imported. *label*
    names it in errors (default ``--import SPEC``).

    Raises
    ------
    UsageError
        If the module or file does not exist.
    UserImportError
        If importing it raised (its ``__cause__``): one line naming the module, the error and where.
    """
    from opbridge import registry

    if spec in _IMPORTED:
        return _IMPORTED[spec][0]
    before = {lib.namespace for lib in libraries()}  # the built-in library too: it is not one of theirs
    label = label or f"--import {spec}"
    path = Path(spec)
    is_file = spec.endswith(".py") or path.is_file()
    if is_file and not path.is_file():
        raise UsageError(f"{label}: no such file")
    packaged = _package_module(path) if is_file else None
    name = packaged[1] if packaged else path.stem if is_file else spec
    try:
        if is_file:
            name = _import_file(path)
        else:
            _cwd_on_path()
            try:
                importlib.import_module(spec)
            except ModuleNotFoundError as e:
                if e.name and (spec == e.name or spec.startswith(e.name + ".")):
                    raise UsageError(f"{label}: no module named {e.name!r}") from None
                raise
    except UsageError:
        raise
    except Exception as e:  # the user's module failed: say where in one line, not with our traceback
        what = label + (f" (as {name})" if packaged else "")
        text = e.msg if isinstance(e, SyntaxError) else str(e)
        message = f"{type(e).__name__}: {text.splitlines()[0]}" if text.strip() else type(e).__name__
        raise UserImportError(f"{what}: importing it raised {message}{_where(e)}") from e
    declared = tuple(lib.namespace for lib in registry.libraries() if lib.namespace not in before)
    _IMPORTED[spec] = _IMPORTED[name] = (name, declared)
    return name


def project_module(root: Path | None = None) -> str | None:
    """The module of the opbridge plugin project whose root is *root* (default: the current directory).

    That is ``[tool.opbridge] package`` of its ``pyproject.toml`` (what ``opbridge new --project`` writes),
    its ``ops`` subpackage when it has one (where the project's ops are declared); None when *root* is no
    such project, or the package is not in it.
    """
    from opbridge.scaffold import project_package  # reads pyproject.toml only

    root = Path.cwd() if root is None else root
    try:
        package = project_package(root)
    except (OSError, ValueError):  # unreadable, or not TOML: not a project for us
        return None
    if package is None or not (root / package / "__init__.py").is_file():
        return None
    return f"{package}.ops" if (root / package / "ops" / "__init__.py").is_file() else package


def resolve_imports(args: argparse.Namespace) -> None:
    """Import what a command's ``--import`` options name, before the command runs, in one place.

    Without ``--import``, in the root of an opbridge plugin project (:func:`project_module`), that
    is the project's own ops module. Entries that are files inside a package are replaced by the dotted
    name they were imported as, so that a command importing them again finds them imported.

    Raises
    ------
    UsageError, UserImportError
        As :func:`import_user_module`.
    """
    if not hasattr(args, "imports"):
        return
    label = None
    if not args.imports:
        default = project_module()
        if default is None:
            return
        args.imports = [default]
        label = (f"{default}, this project's ops (imported by default in a plugin project's root: "
                 f"[tool.opbridge] package in pyproject.toml)")
    resolved = []
    for spec in args.imports:
        name = import_user_module(spec, label)
        top_level_file = (spec.endswith(".py") or Path(spec).is_file()) and name == Path(spec).stem
        resolved.append(spec if top_level_file else name)
    args.imports = resolved


def import_all(specs: Sequence[str] | None) -> list[Library]:
    """Import each ``--import`` module or file, in order; return the libraries they declare.

    Those are the libraries declared while importing them, and those a module
    imported before (by an earlier ``--import``, or by another) declared under
    its name or a submodule's.
    """
    from opbridge import registry

    declared: set[str] = set()
    names = []
    for spec in specs or ():
        name = import_user_module(spec)
        names.append(name)
        declared.update(_IMPORTED[spec][1])
    return [lib for lib in registry.libraries() if lib.namespace in declared
            or any(lib.python_module == n or lib.python_module.startswith(n + ".") for n in names)]


def libraries() -> list[Library]:
    """Every declared library (the registry's list), the built-in ``opbridge`` library first."""
    import opbridge.ops  # noqa: F401 - declares the built-in library
    from opbridge import registry

    return registry.libraries()
