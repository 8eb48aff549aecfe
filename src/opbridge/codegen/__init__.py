"""Generated Python wrappers: a ``_custom_ops.py`` module and its ``.pyi`` stub, from the declarations.

:func:`generate` writes, for one library, a module with one typed wrapper per
op (signature and NumPy docstring from the schema and the reference's
docstring) that imports the declarations on first call -- the vLLM plugins'
``_custom_ops.py``, without writing any signature by hand -- and a stub for
type checkers. ``check=True`` instead compares the files on disk with what
would be generated and raises :class:`StaleGeneratedFilesError` when they differ,
so a test keeps them current.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING

from opbridge.codegen.render import render_module, render_stub
from opbridge.errors import OpbridgeError

if TYPE_CHECKING:
    from opbridge.declare import Library

__all__ = ["DEFAULT_NAME", "StaleGeneratedFilesError", "generate", "render"]

DEFAULT_NAME = "_custom_ops"
_DIFF_LINES = 40


class StaleGeneratedFilesError(OpbridgeError, RuntimeError):
    """Generated files on disk differ from what the declarations generate now.

    Attributes
    ----------
    paths
        The stale or missing files.
    """

    def __init__(self, message: str, paths: list[Path]) -> None:
        super().__init__(message)
        self.paths = paths


def render(lib: Library, *, declarations: str | None = None, name: str = DEFAULT_NAME) -> dict[str, str]:
    """``{file name: text}`` of the wrapper module and stub of *lib*.

    Parameters
    ----------
    lib
        The declared library.
    declarations
        Module whose import declares *lib*; default ``lib.python_module``.
    name
        Module name of the wrappers (``_custom_ops``).
    """
    decl = declarations or lib.python_module
    return {
        f"{name}.py": render_module(lib, decl, f"{name}.py"),
        f"{name}.pyi": render_stub(lib, decl, f"{name}.pyi"),
    }


def generate(
    lib: Library,
    out_dir: str | Path,
    *,
    declarations: str | None = None,
    name: str = DEFAULT_NAME,
    check: bool = False,
) -> list[Path]:
    """Write (or, with *check*, verify) ``<name>.py`` and ``<name>.pyi`` for *lib* in *out_dir*.

    Parameters
    ----------
    lib
        The declared library.
    out_dir
        The package directory the files belong in.
    declarations
        Module whose import declares *lib*; default ``lib.python_module``.
    name
        Module name of the wrappers.
    check
        Write nothing; raise if a file is missing or differs.

    Returns
    -------
    list of Path
        The generated files (written, or verified current).

    Raises
    ------
    StaleGeneratedFilesError
        With *check*, naming each stale file with the start of its diff and
        the command that regenerates it.
    """
    out = Path(out_dir)
    paths: list[Path] = []
    stale: list[Path] = []
    diffs: list[str] = []
    for fname, text in render(lib, declarations=declarations, name=name).items():
        path = out / fname
        paths.append(path)
        old = path.read_text() if path.is_file() else None
        if old == text:
            continue
        if check:
            stale.append(path)
            diff = list(difflib.unified_diff((old or "").splitlines(), text.splitlines(),
                                             f"{path} (on disk)", f"{path} (generated)", lineterm=""))
            more = len(diff) - _DIFF_LINES
            diffs.append("\n".join(diff[:_DIFF_LINES]) + (f"\n... {more} more diff lines" if more > 0 else "")
                         if old is not None else f"{path}: missing")
            continue
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if stale:
        decl = declarations or lib.python_module
        raise StaleGeneratedFilesError(
            f"generated wrappers of {lib.namespace!r} are stale: {', '.join(map(str, stale))}\n"
            f"regenerate with: opbridge codegen --import {decl} --library {lib.namespace} --out {out}\n"
            + "\n".join(diffs),
            stale,
        )
    return paths
