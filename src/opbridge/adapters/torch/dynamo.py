"""Dynamo traces an op's public callable as the registered torch op.

Dynamo must not trace into opbridge's Python dispatch (dict lookups, lazy
builds, the fast path). ``substitute_in_graph`` imports ``torch._dynamo``
(about a second), so it is deferred until Dynamo is imported anyway, which
``torch.compile`` does before tracing anything.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

import torch

from opbridge.adapters.torch.dispatcher import packet

if TYPE_CHECKING:
    from opbridge.declare import OpDef

_PENDING: list[OpDef] = []


def substitute(op: OpDef) -> None:
    """Make Dynamo trace *op*'s public callable as ``torch.ops.<ns>.<op>`` (now, or once Dynamo is imported)."""
    if "torch._dynamo" in sys.modules:
        _substitute_now(op)
    else:
        _PENDING.append(op)
        _DynamoImportHook.install()


def _substitute_now(op: OpDef) -> None:
    overload = packet(op)

    def traced(*args: Any, out: Any = None, **kwargs: Any) -> Any:
        result = overload(*args, **kwargs)
        if out is None:
            return result
        outs = out if isinstance(out, (tuple, list)) else (out,)
        results = result if isinstance(result, tuple) else (result,)
        for o, r in zip(outs, results):
            o.copy_(r)
        return out

    torch.compiler.substitute_in_graph(op.call, skip_signature_check=True)(traced)


class _DynamoImportHook(importlib.abc.MetaPathFinder):
    """Runs the pending substitutions right after ``torch._dynamo`` is imported."""

    _installed = False

    @classmethod
    def install(cls) -> None:
        if not cls._installed:
            sys.meta_path.insert(0, cls())
            cls._installed = True

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        type(self)._installed = False
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            loader_exec(module)
            while _PENDING:
                _substitute_now(_PENDING.pop())

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
