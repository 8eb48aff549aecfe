"""MindSpore harness: gradients through ``mindspore.vjp``, graph mode through ``mindspore.jit``.

MindSpore 2.10 needs NumPy < 2 and clashes with Paddle's oneDNN, so it runs
in its own environment and process; :meth:`MindSporeHarness.skip_reason` says
when this one is not it.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class MindSporeHarness:
    """Drives the conformance matrix on ``mindspore.Tensor`` (CPU, PyNative and graph mode)."""

    name = "mindspore"
    dtypes = ("float64", "float32", "float16", "bfloat16", "int32", "int64")
    mutates_in_place = True

    def skip_reason(self) -> str | None:
        """None when MindSpore can run here, else why not."""
        if importlib.util.find_spec("mindspore") is None:
            return "mindspore is not installed"
        if int(np.__version__.split(".")[0]) >= 2:
            return (f"MindSpore 2.10 needs numpy<2, this environment has numpy {np.__version__}; "
                    "run the MindSpore tests in their own environment")
        if "paddle" in sys.modules:
            return "paddle is imported in this process, and its oneDNN clashes with MindSpore's"
        try:
            import mindspore  # noqa: F401
        except ImportError:
            return "mindspore is not installed"
        return None

    def from_numpy(self, a: np.ndarray, dtype: str | None) -> Any:
        """A MindSpore tensor holding *a* cast to *dtype* (the array's own dtype when None)."""
        import mindspore as ms

        a = np.ascontiguousarray(a)
        if dtype is None:
            return ms.Tensor(a)
        if dtype == "bfloat16":
            return ms.Tensor(a.astype(np.float32)).astype(ms.bfloat16)
        return ms.Tensor(a.astype(dtype))

    def to_numpy(self, x: Any) -> np.ndarray:
        """*x* as a NumPy array, 16-bit floats widened to float32."""
        import mindspore as ms

        if x.dtype in (ms.float16, ms.bfloat16):
            x = x.astype(ms.float32)
        return np.array(x.asnumpy())

    def vjp(self, fn: Callable[..., Any], args: Sequence[Any], argnums: Sequence[int],
            cotangent: np.ndarray) -> list[np.ndarray]:
        """Gradients of ``sum(fn(*args) * cotangent)`` w.r.t. ``args[i]`` for i in *argnums*."""
        import mindspore as ms

        fixed = list(args)

        def f(*diff: Any) -> Any:
            full = list(fixed)
            for i, d in zip(argnums, diff, strict=True):
                full[i] = d
            return fn(*full)

        out, pullback = ms.vjp(f, *(args[i] for i in argnums))
        cot = ms.Tensor(np.ascontiguousarray(cotangent)).astype(out.dtype)
        grads = pullback(cot)
        grads = grads if isinstance(grads, tuple) else (grads,)
        return [self.to_numpy(g) for g in grads]

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any] | None:
        """*fn* under ``mindspore.jit`` (opbridge ops run as ``ops.Custom`` aot primitives), or None.

        MindSpore compiles a function from its source. A public op callable
        has none (it is generated), so its graph substitute, which has, is
        compiled in its place; a lambda is re-emitted as a ``def`` (MindSpore
        cannot parse a lambda inside a call). Python scalars are compile-time
        constants. None for an op that graph mode cannot express (one that
        mutates its arguments, or takes optional/list/str arguments).
        """
        import mindspore as ms

        from opbridge.adapters import mindspore as adapter

        opdef = getattr(fn, "opdef", None)
        if opdef is not None and adapter.graph_unsupported_reason(opdef) is not None:
            return None  # e.g. an op that mutates its arguments: graphs cannot express it
        fn = adapter.graph_function(opdef) if opdef is not None else adapter.parseable(fn)
        jitted: Callable[..., Any] = ms.jit(fn)
        return jitted

    def data_ptr(self, x: Any) -> int:
        """Address of *x*'s first element."""
        return int(x.data_ptr())


HARNESS = MindSporeHarness()
