"""Compile generated Python so that tracebacks show its lines.

opbridge generates small functions from parsed schemas (the public callables,
the adapters' fast paths, alias checks) because a function specialised to one
op costs a fraction of a generic one per call. Every such ``exec`` goes
through :func:`compile_source`, which registers the source with
:mod:`linecache` under its file name, so an error raised inside generated code
shows the generated line like any other.
"""

from __future__ import annotations

import itertools
import linecache
from typing import Any

_SERIAL = itertools.count()


def compile_source(source: str, filename: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """Execute *source* in *namespace* and return it, with the source kept for tracebacks.

    Parameters
    ----------
    source
        Python source (one or more definitions).
    filename
        A readable name such as ``"<opbridge op opbridge::add>"``; a serial
        number is appended, since one name may be compiled again with
        different source (an adapter installing a fast path).
    namespace
        Globals for the generated code; filled with its definitions.
    """
    name = f"{filename[:-1]} #{next(_SERIAL)}>" if filename.endswith(">") else f"{filename}#{next(_SERIAL)}"
    lines = source.splitlines(keepends=True)
    linecache.cache[name] = (len(source), None, lines, name)
    exec(compile(source, name, "exec"), namespace)  # noqa: S102 - opbridge's own generated source
    return namespace
