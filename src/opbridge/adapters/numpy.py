"""NumPy adapter: calls the CPU kernel on ``numpy.ndarray`` arguments (no autograd)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from opbridge import loader
from opbridge.adapters.base import check_no_alias, pack_results, validate_args

if TYPE_CHECKING:
    from opbridge.declare import OpDef


def _span(a: np.ndarray) -> tuple[int, int]:
    start = a.__array_interface__["data"][0]
    return start, start + a.nbytes


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray)


class NumpyAdapter:
    """Adapter for NumPy arrays."""

    name = "numpy"

    def make_call(self, op: OpDef, array_type: type) -> Callable[..., Any]:
        kern = loader.kernel(op, "cpu")
        mutating = op.schema.is_mutating
        like_idx = None
        if op.shape is not None and type(op.shape).__name__ == "like":
            names = [a.name for a in op.schema.arguments]
            like_idx = [names.index(n) for n in op.shape.names]  # type: ignore[union-attr]

        def call(*args: Any) -> Any:
            validate_args(op, args, _is_array, "a numpy.ndarray")
            if like_idx is not None:
                outs = [np.empty(args[i].shape, args[i].dtype) for i in like_idx]
            else:
                outs = [np.empty(s.shape, np.dtype(s.dtype)) for s in op.output_specs(args)]
            if mutating:
                check_no_alias(op, args, _span)
            kern(*outs, *args)
            return pack_results(op, args, outs)

        return call

    def call_with_out(self, op: OpDef, args: tuple[Any, ...], outs: tuple[Any, ...]) -> Any:
        """Run *op* into the caller's arrays *outs* (validated by the kernel)."""
        validate_args(op, args, _is_array, "a numpy.ndarray")
        check_no_alias(op, args, _span)
        loader.kernel(op, "cpu")(*outs, *args)
        return pack_results(op, args, outs)


ADAPTER = NumpyAdapter()
