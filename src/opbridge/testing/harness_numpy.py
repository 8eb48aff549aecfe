"""NumPy harness: eager calls only (no autograd, no graph mode)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class NumpyHarness:
    name = "numpy"
    dtypes = ("float64", "float32", "float16", "int32", "int64")
    mutates_in_place = True

    def skip_reason(self) -> str | None:
        return None

    def from_numpy(self, a: np.ndarray, dtype: str | None) -> Any:
        return np.ascontiguousarray(a if dtype is None else a.astype(dtype))

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def vjp(self, fn: Callable[..., Any], args: Sequence[Any], argnums: Sequence[int],
            cotangent: np.ndarray) -> list[np.ndarray]:
        raise NotImplementedError("numpy has no autograd")

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any] | None:
        return None

    def data_ptr(self, x: Any) -> int:
        return int(x.__array_interface__["data"][0])


HARNESS = NumpyHarness()
