"""Shared fixtures: a throwaway kernel library factory and optional-framework skips."""

from __future__ import annotations

import importlib.util
import itertools
import os
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import opbridge
from opbridge import _tvm

_COUNTER = itertools.count()

#: faulthandler's SIGSEGV action (pytest enables it), taken before any test module loads tvm-ffi, whose
#: library installs its own handler (no Python traceback, no alternate stack). A test module that imports
#: tvm-ffi directly (``jax_tvm_ffi`` does) bypasses opbridge's import, which keeps the handler; so the
#: action is put back before every test, and a native crash names its test and line (gpu-check's logs).
_FAULT_ACTION = _tvm.fault_action()


def pytest_runtest_setup(item: pytest.Item) -> None:
    _tvm.restore_fault_action(_FAULT_ACTION)


@pytest.fixture
def script_module() -> Callable[[str], Any]:
    """``load(name)``: ``scripts/<name>.py`` imported by path (``scripts/`` is no package)."""

    def load(name: str) -> Any:
        path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


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


@pytest.fixture
def kernel_args(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """The arguments each checked call hands its kernel after the core's dense copies
    (``call.overlap.dense_args``), in call order: a test asserts which tensors arrived as they were."""
    from opbridge.call import overlap

    seen: list[list[Any]] = []
    dense_args = overlap.dense_args

    def spy(*a: Any, **k: Any) -> Any:
        full, back = dense_args(*a, **k)
        seen.append(full)
        return full, back

    monkeypatch.setattr(overlap, "dense_args", spy)
    return seen


@pytest.fixture(scope="module")
def mindspore_om_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """MindSpore writes ``rank_0/om/analyze_fail.ir`` for each failed compile, by default into the cwd: into a
    temporary directory instead, for a module's tests (``MS_OM_PATH``)."""
    old = os.environ.get("MS_OM_PATH")
    os.environ["MS_OM_PATH"] = str(tmp_path_factory.mktemp("ms_om"))
    yield
    if old is None:
        os.environ.pop("MS_OM_PATH", None)
    else:
        os.environ["MS_OM_PATH"] = old
