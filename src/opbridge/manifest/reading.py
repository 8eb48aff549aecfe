"""The manifest's YAML as read: mappings that know their line, and ``file:line`` errors.

What both halves of :mod:`opbridge.manifest` read through: the op entries
(:func:`opbridge.manifest.load`) and the ``derivatives`` entries
(:mod:`opbridge.manifest.derivatives`). Every mistake they find is a
:class:`~opbridge.DeclarationError` made by :meth:`Where.error`, naming the
file and the line of the mapping it is about.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from opbridge.errors import DeclarationError

__all__ = ["Loader", "Map", "Where"]


class Map(dict[str, Any]):
    """A YAML mapping that remembers the line it starts on."""

    line = 0


class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """Safe YAML loader whose mappings are :class:`Map`\\ s."""


def _construct_map(loader: yaml.SafeLoader, node: yaml.MappingNode) -> Map:
    out = Map(loader.construct_mapping(node, deep=True))
    out.line = node.start_mark.line + 1
    return out


Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_map)


class Where:
    """``file:line`` prefixes for error messages."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def error(self, node: Any, message: str) -> DeclarationError:
        line = getattr(node, "line", 0)
        return DeclarationError(f"{self.path}:{line}: {message}" if line else f"{self.path}: {message}")

    def mapping(self, node: Any, what: str, keys: Sequence[str] | None = None) -> Map:
        if not isinstance(node, dict):
            raise self.error(node, f"{what} must be a mapping, got {type(node).__name__}")
        if keys is not None:
            unknown = [k for k in node if k not in keys]
            if unknown:
                raise self.error(node, f"{what}: unknown key(s) {', '.join(map(repr, unknown))} "
                                       f"(expected {', '.join(keys)})")
        return node if isinstance(node, Map) else Map(node)
