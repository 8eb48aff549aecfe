"""Shared fixtures: a throwaway kernel library factory and optional-framework skips."""

from __future__ import annotations

import itertools
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

import opbridge

_COUNTER = itertools.count()


@pytest.fixture
def make_library(tmp_path: Path) -> Callable[..., opbridge.Library]:
    """Return ``make(sources: dict[filename, C++ text]) -> Library`` with a unique namespace."""

    def make(sources: dict[str, str], prefix: str = "t") -> opbridge.Library:
        paths = []
        for name, text in sources.items():
            p = tmp_path / name
            p.write_text(textwrap.dedent(text))
            paths.append(str(p))
        return opbridge.Library(f"{prefix}_{next(_COUNTER)}_{tmp_path.name[-8:].replace('-', '_')}",
                                sources=paths, root=tmp_path)

    return make
