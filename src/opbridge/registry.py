"""The one list of libraries and ops. AOT builds, the CLI, tests and benchmarks read it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from opbridge.errors import DeclarationError

if TYPE_CHECKING:
    from opbridge.declare import Library, OpDef

_LIBRARIES: dict[str, Library] = {}


def add_library(lib: Library) -> None:
    """Record *lib*; a namespace may be declared only once per process."""
    if lib.namespace in _LIBRARIES:
        raise DeclarationError(f"library namespace {lib.namespace!r} is already declared "
                               f"(by {_LIBRARIES[lib.namespace].python_module})")
    _LIBRARIES[lib.namespace] = lib


def libraries() -> list[Library]:
    """All libraries declared so far, in declaration order.

    The built-in library is declared by importing :mod:`opbridge.ops`; callers
    that list everything (the CLI, AOT builds, benchmarks) import it first.
    """
    return list(_LIBRARIES.values())


def library(namespace: str) -> Library:
    """Return the library declared under *namespace*."""
    try:
        return _LIBRARIES[namespace]
    except KeyError:
        raise DeclarationError(f"no library {namespace!r}; declared: {sorted(_LIBRARIES)}") from None


def all_ops() -> Iterator[OpDef]:
    """Every declared op of every library."""
    for lib in libraries():
        yield from lib.ops.values()
