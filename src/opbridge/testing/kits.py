"""Framework kits: how the test matrix makes, copies and inspects one framework's arrays.

:class:`NumpyKit` needs nothing but NumPy; :class:`TorchKit` imports torch
when it is created.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opbridge.testing.compare import to_numpy

__all__ = ["NumpyKit", "TorchKit", "dtype_str", "is_float_np"]

#: Integer dtypes an op may declare (float case values are truncated to them).
_INTEGER_DTYPES = ("int8", "int16", "int32", "int64", "uint8")


def is_float_np(v: np.ndarray) -> bool:
    return v.dtype.kind in "fc"


class NumpyKit:
    name = "numpy"
    dtypes: tuple[str, ...] = ("float64", "float32", "float16", *_INTEGER_DTYPES)

    def dtype(self, d: Any) -> Any:
        return np.dtype(d if isinstance(d, np.dtype) else str(d))

    def is_float(self, x: Any) -> bool:
        return bool(x.dtype.kind in "fc")

    def numel(self, x: Any) -> int:
        return int(x.size)

    def empty_filled(self, n: int, dtype: Any) -> Any:
        dt = self.dtype(dtype)
        return np.full(n, _sentinel_value(dt.kind, dt), dtype=dt)

    def from_np(self, v: np.ndarray, dtype: str) -> Any:
        target = self.dtype(dtype) if is_float_np(v) else v.dtype
        return np.array(v, dtype=target, copy=True, order="C")

    def flat(self, buf: Any, lo: int, hi: int, shape: tuple[int, ...]) -> Any:
        return buf[lo:hi].reshape(shape)

    def write(self, dst: Any, src: Any) -> None:
        dst[...] = src

    def widen_last(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return np.empty((*shape[:-1], 2 * shape[-1]), dtype=dtype)

    def to_np64(self, x: Any) -> np.ndarray:
        a = np.asarray(x)
        return a.astype(np.float64) if self.is_float(a) else a.copy()

    def round_to(self, v: np.ndarray, like: Any) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore"):  # out-of-range values become inf, as in the kernel
            return np.asarray(v).astype(np.asarray(like).dtype).astype(np.float64)

    def clone(self, x: Any) -> Any:
        return np.array(x, copy=True)

    def shape(self, x: Any) -> tuple[int, ...]:
        return tuple(x.shape)

    def dtype_of(self, x: Any) -> Any:
        return x.dtype


class TorchKit(NumpyKit):
    name = "torch"
    dtypes = ("float64", "float32", "float16", "bfloat16", *_INTEGER_DTYPES)

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def dtype(self, d: Any) -> Any:
        return d if isinstance(d, self.torch.dtype) else getattr(self.torch, str(d))

    def is_float(self, x: Any) -> bool:
        return bool(x.dtype.is_floating_point or x.dtype.is_complex)

    def numel(self, x: Any) -> int:
        return int(x.numel())

    def empty_filled(self, n: int, dtype: Any) -> Any:
        dt = self.dtype(dtype)
        kind = "f" if dt.is_floating_point else ("b" if dt == self.torch.bool else "i")
        return self.torch.full((n,), _sentinel_value(kind, dt), dtype=dt)

    def from_np(self, v: np.ndarray, dtype: str) -> Any:
        t = self.torch.from_numpy(np.ascontiguousarray(v))
        return t.to(self.dtype(dtype) if is_float_np(v) else t.dtype, copy=True)

    def flat(self, buf: Any, lo: int, hi: int, shape: tuple[int, ...]) -> Any:
        return buf[lo:hi].view(shape)

    def write(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def widen_last(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return self.torch.empty((*shape[:-1], 2 * shape[-1]), dtype=dtype)

    def to_np64(self, x: Any) -> np.ndarray:
        a = to_numpy(x)
        return a.astype(np.float64) if is_float_np(a) else a.copy()

    def round_to(self, v: np.ndarray, like: Any) -> np.ndarray:
        t = self.torch.from_numpy(np.ascontiguousarray(np.asarray(v, dtype=np.float64)))
        return to_numpy(t.to(like.dtype)).astype(np.float64)

    def clone(self, x: Any) -> Any:
        return x.detach().clone()


def _sentinel_value(kind: str, dt: Any) -> Any:
    if kind in "fc":
        return float("nan")
    if kind == "b":
        return True
    if kind == "u":
        return 0xA5
    return -7919  # a prime that no index or count computed here is likely to equal


def dtype_str(d: Any) -> str:
    """``"float32"`` for ``"float32"``, ``numpy.float32``, ``numpy.dtype("float32")`` or ``torch.float32``."""
    if isinstance(d, str):
        return d
    if type(d).__module__.partition(".")[0] == "torch":
        return str(d).rpartition(".")[2]
    return str(np.dtype(d).name)
