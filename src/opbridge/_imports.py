"""Run a function right after a module is imported, without importing it.

opbridge must not import a framework the user did not import (torch alone
takes about a second), yet some work has to happen as soon as the user does:
registering the built-in ops under ``torch.ops.opbridge`` once torch is in
use, or telling Dynamo about opbridge's callables once ``torch._dynamo`` is
imported. :func:`after_import` runs a callback at once if the module is
already imported, else right after its import finishes.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import importlib.machinery

_LOCK = threading.Lock()
_PENDING: dict[str, list[Callable[[], None]]] = {}


def after_import(name: str, callback: Callable[[], None]) -> None:
    """Call *callback* now if module *name* is imported, else right after it is."""
    if sys.modules.get(name) is not None:
        callback()
        return
    with _LOCK:
        first = name not in _PENDING
        _PENDING.setdefault(name, []).append(callback)
        if first:
            sys.meta_path.insert(0, _Hook(name))


class _Hook:
    """Finds *name* through the other finders and wraps its loader to run the callbacks.

    A plain class with ``find_spec`` is a meta path finder; deriving from
    ``importlib.abc.MetaPathFinder`` would import ``importlib.resources`` and
    ``tempfile`` (17 ms) into every ``import opbridge``.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            _PENDING.pop(fullname, None)
            return spec
        exec_module = spec.loader.exec_module

        def run_then_callbacks(module: Any) -> None:
            exec_module(module)
            with _LOCK:
                callbacks = _PENDING.pop(fullname, [])
            for cb in callbacks:
                cb()

        spec.loader.exec_module = run_then_callbacks  # type: ignore[method-assign]
        return spec
