"""The test matrix's kits for JAX, Paddle and MindSpore, over their harnesses, and :func:`make_kit`.

Each converts through its harness (:mod:`opbridge.testing.harness`), which
also differentiates (``vjp``) and compiles (``jax.jit``,
``paddle.jit.to_static``, ``mindspore.jit``). Buffers are made in NumPy and
converted whole, so a view never has to be written through (a MindSpore
view that is written gets its own memory); a view is checked to share its
buffer's memory before the kernel writes through it. Importing this module
imports no framework.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from opbridge.testing.kits import INTEGER_DTYPES, NumpyKit, TorchKit, dtype_str, is_float_np, sentinel_value

if TYPE_CHECKING:
    from opbridge.declare import OpDef

__all__ = ["FRAMEWORKS", "HarnessKit", "JaxKit", "MindSporeKit", "PaddleKit", "make_kit", "unavailable"]

#: The frameworks check_op runs in.
FRAMEWORKS = ("torch", "numpy", "jax", "paddle", "mindspore")
#: The Python modules each framework's kit needs, for the message when one is missing.
_MODULES = {"torch": ("torch",), "jax": ("jax", "jax_tvm_ffi"), "paddle": ("paddle",), "mindspore": ("mindspore",)}


class HarnessKit(NumpyKit):
    """A kit whose arrays are made and read back through the framework's harness."""

    differentiates = True

    @property
    def dtypes(self) -> tuple[str, ...]:  # type: ignore[override]
        """The harness's dtypes, and the narrow integers, which every framework here holds."""
        have = self.h.dtypes
        return (*have, *(d for d in INTEGER_DTYPES if d not in have and d != "int64"))

    def dtype(self, d: Any) -> Any:
        return dtype_str(d)

    def empty_filled(self, n: int, dtype: Any) -> Any:
        return self._from_filled(np.full(n, np.nan), dtype_str(dtype))

    def _from_filled(self, a: np.ndarray, name: str) -> Any:
        """Float64 *a*, its NaNs the sentinel, as a framework array of dtype *name*."""
        if name.startswith(("float", "bfloat")):
            return self.h.from_numpy(a, name)
        kind = np.dtype(name).kind
        ints = np.where(np.isnan(a), sentinel_value(kind, np.dtype(name).itemsize), a).astype(name)
        return self.h.from_numpy(ints, None)

    def from_np(self, v: np.ndarray, dtype: str) -> Any:
        return self.h.from_numpy(np.ascontiguousarray(v), dtype if is_float_np(v) else None)

    def guarded(self, x: Any, lo: int, total: int) -> tuple[Any, Any]:
        n = self.numel(x)
        whole = np.full(total, np.nan)
        whole[lo:lo + n] = self.to_np64(x).ravel()
        buf = self._from_filled(whole, dtype_str(x.dtype))
        return buf, self.flat(buf, lo, lo + n, self.shape(x))

    def flat(self, buf: Any, lo: int, hi: int, shape: tuple[int, ...]) -> Any:
        view = buf[lo:hi].reshape(shape)
        if hi > lo:
            name = dtype_str(buf.dtype)
            itemsize = 2 if name == "bfloat16" else np.dtype(name).itemsize
            if self.h.data_ptr(view) != self.h.data_ptr(buf) + lo * itemsize:
                raise RuntimeError(f"{self.name}: a reshaped slice of a buffer is a copy here, not a view; "
                                   f"the sentinel check needs views (pass sentinel=False)")
        return view

    def every_other(self, x: Any) -> Any:
        values = self.to_np64(x)
        wide = np.zeros((*values.shape[:-1], 2 * values.shape[-1]), values.dtype)
        wide[..., ::2] = values
        name = dtype_str(x.dtype)
        buf = self.h.from_numpy(wide, name if is_float_np(values) else None)
        return buf[..., ::2]

    def to_np64(self, x: Any) -> np.ndarray:
        a = self.h.to_numpy(x)
        return a.astype(np.float64) if is_float_np(a) else np.array(a, copy=True)

    def round_to(self, v: np.ndarray, like: Any) -> np.ndarray:
        back = self.h.from_numpy(np.asarray(v, dtype=np.float64), dtype_str(like.dtype))
        return self.h.to_numpy(back).astype(np.float64)


class JaxKit(HarnessKit):
    """JAX: immutable arrays (a mutated argument comes back as a result), no views, ``jax.vmap``."""

    name = "jax"
    writes_in_place = False
    views = False
    graph_name = "jax.jit"
    vmap_name = "jax.vmap"

    def dtype_note(self, dtype: str) -> str:
        if dtype in ("float64", "int64"):
            return " without 64-bit types (set JAX_ENABLE_X64=1, or jax.config.update('jax_enable_x64', True))"
        return ""

    def graph_unsupported(self, op: OpDef) -> str | None:
        return None

    def vmap(self, fn: Callable[..., Any]) -> Callable[..., Any] | None:
        import jax

        batched: Callable[..., Any] = jax.vmap(fn)
        return batched


class PaddleKit(HarnessKit):
    name = "paddle"
    graph_name = "paddle.jit.to_static(full_graph=True)"

    def graph_unsupported(self, op: OpDef) -> str | None:
        from opbridge.adapters.paddle import static

        reason = static.unsupported_reason(op)  # what the op's traced call raises
        return None if reason is None else f"paddle.jit.to_static cannot run it: {reason}"


class MindSporeKit(HarnessKit):
    name = "mindspore"
    graph_name = "mindspore.jit"

    def kernel_arg(self, x: Any) -> Any:
        from opbridge.adapters.mindspore import views

        return views.kernel_arg(x)

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any] | None:
        """The harness's ``mindspore.jit`` of the op's graph substitute, which has the schema's signature:
        keyword-only arguments are passed by keyword."""
        jitted = self.h.compile(fn)
        op: OpDef | None = getattr(fn, "opdef", None)
        if jitted is None or op is None or not op.schema.keyword_names:
            return jitted
        graph = jitted

        def by_schema(*full: Any) -> Any:
            pos, kw = op.schema.split(full)
            return graph(*pos, **kw)

        return by_schema

    def graph_unsupported(self, op: OpDef) -> str | None:
        from opbridge.adapters import mindspore as adapter

        reason = adapter.graph_unsupported_reason(op)
        return None if reason is None else f"mindspore.jit cannot run it: {reason}"


def unavailable(framework: str) -> str | None:
    """Why :func:`~opbridge.testing.check_op` cannot run in *framework* here (not installed, or unusable in
    this process: MindSpore beside NumPy 2 or after Paddle), or None when it can. Imports the framework."""
    try:
        make_kit(framework)
    except (ModuleNotFoundError, RuntimeError) as e:
        return str(e).removeprefix("check_op: ")
    return None


def make_kit(framework: str, compile_backend: str = "aot_eager") -> NumpyKit:
    """The kit of *framework*; a clear error where it is unknown, not installed, or cannot run here."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"check_op: framework must be one of {', '.join(map(repr, FRAMEWORKS))}, got {framework!r}")
    if framework == "numpy":
        return NumpyKit()
    for module in _MODULES[framework]:
        if importlib.util.find_spec(module) is None:
            default = " (the default)" if framework == "torch" else ""
            raise ModuleNotFoundError(f"check_op: framework={framework!r}{default} needs {module}, which is not "
                                      f"installed here; pass framework='numpy' (or pip install "
                                      f"'opbridge[{framework}]')", name=module)
    if framework == "torch":
        import opbridge.adapters.torch  # noqa: F401 - registers torch.ops.<ns>.<op>

        return TorchKit(compile_backend)
    kit = {"jax": JaxKit, "paddle": PaddleKit, "mindspore": MindSporeKit}[framework]()
    reason = kit.h.skip_reason()
    if reason is not None:
        raise RuntimeError(f"check_op: framework={framework!r} cannot run here: {reason}")
    return kit
