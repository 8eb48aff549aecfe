"""The manifest's YAML as read: mappings that know their line, and ``file:line`` errors.

What both halves of :mod:`opbridge.manifest` read through: the op entries
(:func:`opbridge.manifest.load`) and the ``derivatives`` entries
(:mod:`opbridge.manifest.derivatives`). Every mistake they find is a
:class:`~opbridge.DeclarationError` made by :meth:`Where.error`, naming the
file and the line of the mapping it is about, or, for a value that is not a
mapping (a string or a list where a mapping belongs), the line of that value.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from opbridge.errors import DeclarationError

__all__ = ["Loader", "Map", "Seq", "Where", "kind", "line_of"]


class Map(dict[str, Any]):
    """A YAML mapping that remembers the line it starts on, and each value's (``lines``)."""

    line = 0
    lines: dict[Any, int] = {}  # each instance gets its own from the loader


class Seq(list[Any]):
    """A YAML sequence that remembers the line it starts on, and each item's (``lines``)."""

    line = 0
    lines: list[int] = []  # each instance gets its own from the loader


def line_of(container: Any, key: Any) -> int:
    """The line of *container*'s item *key* (a :class:`Map`'s key or a :class:`Seq`'s index); 0 if unknown.

    A string, a number or None keeps no line of its own: its container does.
    """
    lines = getattr(container, "lines", None)
    if isinstance(lines, dict):
        return int(lines.get(key, 0))
    if isinstance(lines, list) and isinstance(key, int) and 0 <= key < len(lines):
        return int(lines[key])
    return 0


class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """Safe YAML loader whose mappings are :class:`Map`\\ s and sequences :class:`Seq`\\ s."""


def kind(value: Any) -> str:
    """The YAML value's Python type for a message: ``list`` for a :class:`Seq`, ``dict`` for a :class:`Map`."""
    return next(t.__name__ for t in type(value).__mro__ if t.__module__ == "builtins")


def _construct_map(loader: yaml.SafeLoader, node: yaml.MappingNode) -> Map:
    out = Map(loader.construct_mapping(node, deep=True))
    out.line = node.start_mark.line + 1
    out.lines = {loader.construct_object(k, deep=True): v.start_mark.line + 1 for k, v in node.value
                 if isinstance(k, yaml.ScalarNode)}
    return out


def _construct_seq(loader: yaml.SafeLoader, node: yaml.SequenceNode) -> Seq:
    out = Seq(loader.construct_sequence(node, deep=True))
    out.line = node.start_mark.line + 1
    out.lines = [item.start_mark.line + 1 for item in node.value]
    return out


Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_map)
Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_seq)


class Where:
    """``file:line`` prefixes for error messages."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def error(self, node: Any, message: str, line: int = 0) -> DeclarationError:
        """The error about *node*, at its line, else at *line* (where its container saw it)."""
        line = getattr(node, "line", 0) or line
        return DeclarationError(f"{self.path}:{line}: {message}" if line else f"{self.path}: {message}")

    def mapping(self, node: Any, what: str, keys: Sequence[str] | None = None, line: int = 0) -> Map:
        """*node* as a :class:`Map`, else the error at its line (or *line*: see :func:`line_of`)."""
        if not isinstance(node, dict):
            raise self.error(node, f"{what} must be a mapping, got {kind(node)}", line)
        if keys is not None:
            unknown = [k for k in node if k not in keys]
            if unknown:
                raise self.error(node, f"{what}: unknown key(s) {', '.join(map(repr, unknown))} "
                                       f"(expected {', '.join(keys)})")
        return node if isinstance(node, Map) else Map(node)
