"""Framework kits: what the test matrix needs from one framework, and nothing else.

The matrix (:class:`~opbridge.testing.runner.Runner` and its checks) is the
same in every framework. A kit says how to make, view, read back and round
that framework's arrays, and what the framework can do with them: write
into caller buffers (``writes_in_place``), view memory (``views``: sliced,
strided and sentinel-guarded arrays), differentiate (:meth:`Kit.vjp`),
compile a graph (:meth:`Kit.compile`) and batch (:meth:`Kit.vmap`), each
``None`` or ``False`` where it cannot, with the reason the report gives.
Differentiation and graph mode go through the framework's harness
(:mod:`opbridge.testing.harness`), the conformance matrix's interface.

:class:`NumpyKit` needs nothing but NumPy; :class:`TorchKit` imports torch
when it is created; JAX's, Paddle's and MindSpore's kits are in
:mod:`opbridge.testing.kits_frameworks`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from opbridge.testing import harness
from opbridge.testing.compare import to_numpy

if TYPE_CHECKING:
    from opbridge.declare import OpDef

__all__ = ["INTEGER_DTYPES", "NumpyKit", "TorchKit", "dtype_str", "is_float_np", "sentinel_value"]

#: Integer dtypes an op may declare (float case values are truncated to them).
INTEGER_DTYPES = ("int8", "int16", "int32", "int64", "uint8")


def is_float_np(v: np.ndarray) -> bool:
    return v.dtype.kind in "fc" or v.dtype.name == "bfloat16"


class NumpyKit:
    """NumPy's arrays, and the base of every kit: the matrix's view of a framework.

    Attributes a framework sets: ``name`` (its harness's), ``dtypes``,
    ``writes_in_place`` (False: a mutated argument comes back as a result,
    JAX), ``views`` (slices and strided views share memory, so sliced,
    non-contiguous and sentinel-guarded cases can run), ``differentiates``,
    ``graph_name`` and ``vmap_name`` (how graph mode and batching are called
    there, for messages; empty where the framework has none).
    """

    name = "numpy"
    dtypes: tuple[str, ...] = ("float64", "float32", "float16", *INTEGER_DTYPES)
    writes_in_place = True
    views = True
    differentiates = False
    graph_name = ""
    vmap_name = ""
    #: graph mode must give eager's bits (False: within the op's tolerance)
    graph_exact = True

    @property
    def h(self) -> harness.Harness:
        """The framework's harness (conversions, vjp, graph mode)."""
        return harness.get(self.name)

    # -- arrays -------------------------------------------------------------------

    def dtype(self, d: Any) -> Any:
        return np.dtype(d if isinstance(d, np.dtype) else str(d))

    def is_float(self, x: Any) -> bool:
        return dtype_str(x.dtype).startswith(("float", "bfloat", "complex"))

    def numel(self, x: Any) -> int:
        return int(np.prod(self.shape(x)))

    def shape(self, x: Any) -> tuple[int, ...]:
        return tuple(int(s) for s in x.shape)

    def dtype_of(self, x: Any) -> Any:
        return x.dtype

    def empty_filled(self, n: int, dtype: Any) -> Any:
        dt = self.dtype(dtype)
        return np.full(n, sentinel_value(dt.kind, dt.itemsize), dtype=dt)

    def from_np(self, v: np.ndarray, dtype: str) -> Any:
        """*v* as a new contiguous array: floats in *dtype*, integers in their own dtype."""
        target = self.dtype(dtype) if is_float_np(v) else v.dtype
        return np.array(v, dtype=target, copy=True, order="C")

    def flat(self, buf: Any, lo: int, hi: int, shape: tuple[int, ...]) -> Any:
        """A view of elements ``[lo, hi)`` of 1-D *buf* in *shape*."""
        return buf[lo:hi].reshape(shape)

    def write(self, dst: Any, src: Any) -> None:
        dst[...] = src

    def guarded(self, x: Any, lo: int, total: int) -> tuple[Any, Any]:
        """(buffer, view): *total* sentinel elements of *x*'s dtype, holding *x* at ``[lo, lo + size)``."""
        buf = self.empty_filled(total, self.dtype_of(x))
        view = self.flat(buf, lo, lo + self.numel(x), self.shape(x))
        self.write(view, x)
        return buf, view

    def every_other(self, x: Any) -> Any:
        """*x* as a view of every other element of the last dim of a twice-as-wide array."""
        shape = self.shape(x)
        wide = np.empty((*shape[:-1], 2 * shape[-1]), dtype=self.dtype_of(x))
        view = wide[..., ::2]
        self.write(view, x)
        return view

    def to_np64(self, x: Any) -> np.ndarray:
        """A NumPy copy of *x*, floats widened to float64."""
        a = np.asarray(x)
        return a.astype(np.float64) if is_float_np(a) else a.copy()

    def round_to(self, v: np.ndarray, like: Any) -> np.ndarray:
        """Float64 *v* rounded to *like*'s dtype, and back to float64."""
        with np.errstate(over="ignore", invalid="ignore"):  # out-of-range values become inf, as in the kernel
            return np.asarray(v).astype(np.asarray(like).dtype).astype(np.float64)

    def dtype_note(self, dtype: str) -> str:
        """Why the framework lacks *dtype* here, where it could have it (appended to the report's note)."""
        return ""

    def kernel_arg(self, x: Any) -> Any:
        """*x* as a kernel takes it (tvm-ffi imports it through DLPack)."""
        return x

    # -- what the framework can do ------------------------------------------------

    def vjp(self, fn: Callable[..., Sequence[Any]], args: Sequence[Any], argnums: Sequence[int],
            cotangents: Sequence[Any]) -> list[np.ndarray]:
        """Gradients of ``sum_j <cotangents[j], fn(*args)[j]>`` with respect to ``args[i]``, i in *argnums*.

        *fn* returns a tuple; a ``None`` cotangent leaves its result out (an
        integer output). One call of the harness's ``vjp`` on that scalar.
        """
        def scalar(*a: Any) -> Any:
            total = None
            for out, g in zip(fn(*a), cotangents, strict=True):
                if g is not None:
                    term = (out * g).sum()
                    total = term if total is None else total + term
            return total

        return self.h.vjp(scalar, args, argnums, np.ones((), np.float32))

    def graph_unsupported(self, op: OpDef) -> str | None:
        """Why *op* cannot run in this framework's graph mode, or None."""
        return f"{self.name} has no graph mode"

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any] | None:
        """*fn* (a public op callable) compiled in graph mode; called with the schema's arguments in order."""
        return self.h.compile(fn)

    @contextmanager
    def graph_scope(self) -> Iterator[None]:
        """Around the graph-mode checks of one case (torch resets Dynamo before and after)."""
        yield

    def vmap(self, fn: Callable[..., Any]) -> Callable[..., Any] | None:
        """``vmap(fn)`` over the leading dim of every argument, or None where the framework has no vmap."""
        return None


class TorchKit(NumpyKit):
    name = "torch"
    dtypes = ("float64", "float32", "float16", "bfloat16", *INTEGER_DTYPES)
    differentiates = True
    vmap_name = "torch.func.vmap"

    def __init__(self, compile_backend: str = "aot_eager") -> None:
        import torch

        self.torch = torch
        self.backend = compile_backend
        self.graph_name = f"torch.compile(fullgraph=True, backend={compile_backend!r})"
        self.graph_exact = compile_backend in ("eager", "aot_eager")

    def dtype(self, d: Any) -> Any:
        return d if isinstance(d, self.torch.dtype) else getattr(self.torch, str(d))

    def empty_filled(self, n: int, dtype: Any) -> Any:
        dt = self.dtype(dtype)
        kind = "f" if dt.is_floating_point else ("b" if dt == self.torch.bool else "u" if dt == self.torch.uint8
                                                 else "i")
        return self.torch.full((n,), sentinel_value(kind, dt.itemsize), dtype=dt)

    def from_np(self, v: np.ndarray, dtype: str) -> Any:
        t = self.torch.from_numpy(np.ascontiguousarray(v))
        return t.to(self.dtype(dtype) if is_float_np(v) else t.dtype, copy=True)

    def flat(self, buf: Any, lo: int, hi: int, shape: tuple[int, ...]) -> Any:
        return buf[lo:hi].view(shape)

    def write(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def every_other(self, x: Any) -> Any:
        wide = self.torch.empty((*x.shape[:-1], 2 * x.shape[-1]), dtype=x.dtype)
        view = wide[..., ::2]
        view.copy_(x)
        return view

    def to_np64(self, x: Any) -> np.ndarray:
        a = to_numpy(x)
        return a.astype(np.float64) if is_float_np(a) else a.copy()

    def round_to(self, v: np.ndarray, like: Any) -> np.ndarray:
        t = self.torch.from_numpy(np.ascontiguousarray(np.asarray(v, dtype=np.float64)))
        return to_numpy(t.to(like.dtype)).astype(np.float64)

    def graph_unsupported(self, op: OpDef) -> str | None:
        if any(k < 0 for k in op.return_sources):
            return ("the op returns an argument it writes (-> Tensor(a!)), which torch.compile and opcheck refuse "
                    "for custom ops (they cannot functionalize it); declare -> () as vLLM's in-place ops do")
        return None

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any] | None:
        compiled: Callable[..., Any] = self.torch.compile(fn, fullgraph=True, backend=self.backend)
        return compiled

    @contextmanager
    def graph_scope(self) -> Iterator[None]:
        self.torch._dynamo.reset()  # each check compiles afresh: one op under many shapes and dtypes
        try:
            yield
        finally:
            self.torch._dynamo.reset()

    def vmap(self, fn: Callable[..., Any]) -> Callable[..., Any] | None:
        batched: Callable[..., Any] = self.torch.func.vmap(fn)
        return batched


def sentinel_value(kind: str, itemsize: int = 8) -> Any:
    """The fill of guard regions and new outputs, by NumPy dtype kind and item size: NaN for floats, an
    unlikely integer that the dtype holds."""
    if kind in "fcV":
        return float("nan")
    if kind == "b":
        return True
    if kind == "u":
        return 0xA5
    # primes that no index or count computed here is likely to equal
    return -79 if itemsize == 1 else -7919


def dtype_str(d: Any) -> str:
    """The plain name of a dtype: ``"float32"`` for ``"float32"``, ``numpy.float32``, ``numpy.dtype("float32")``,
    ``torch.float32``, ``paddle.float32`` or ``mindspore.float32``."""
    if isinstance(d, str):
        return d
    if type(d).__module__.partition(".")[0] in ("torch", "paddle", "mindspore"):
        return str(d).rpartition(".")[2].lower()  # torch.float32, paddle.float32, Float32
    return str(np.dtype(d).name)
