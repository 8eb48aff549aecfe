"""NumPy adapter: calls the CPU kernel on ``numpy.ndarray`` arguments (no autograd)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from opbridge import loader
from opbridge.call.callable import install_prelude
from opbridge.call.core import make_alias_check, pack_results, validate_args
from opbridge.declare import like

if TYPE_CHECKING:
    from opbridge.declare import OpDef


def _span(a: np.ndarray) -> tuple[int, int]:
    start = a.__array_interface__["data"][0]
    return start, start + a.nbytes


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray)


def _fast_prelude(op: OpDef) -> str | None:
    """Inline fast path for plain ndarrays: allocate like the input, call the kernel.

    Only for functional ops whose outputs are shaped ``like`` inputs. A
    TypeError from the kernel's argument conversion falls back to the checked
    path, which names the offending argument.
    """
    args = op.schema.arguments
    if op.schema.is_mutating or not isinstance(op.shape, like) or any(
            (a.type.is_tensor and a.type.optional) or a.type.is_tensor_list for a in args):
        return None
    names = [a.name for a in args]
    outs = [f"_o{i}" for i in range(op.n_outputs)]
    conds = " and ".join(f"type({a.name}) is _np_nd" for a in args if a.type.is_tensor)
    slow = f"_np_slow({', '.join(names)})"
    lines = [f"    if {conds}:", "        try:"]
    lines += [f"            {o} = _np_empty_like({n})" for o, n in zip(outs, op.shape.names)]
    lines += [f"            _np_k({', '.join([*outs, *names])})", "        except TypeError:",
              f"            return {slow}"]
    ret = outs[0] if len(op.schema.returns) == 1 else f"({', '.join(outs)},)"
    lines.append(f"        return {ret}")
    return "\n".join(lines) + "\n"


class NumpyAdapter:
    """Adapter for NumPy arrays."""

    name = "numpy"

    def make_call(self, op: OpDef, array_type: type) -> Callable[..., Any]:
        kern = loader.kernel(op, "cpu")
        mutating = op.schema.is_mutating
        check_alias = make_alias_check(op, _span)
        like_idx = None
        if isinstance(op.shape, like):
            names = [a.name for a in op.schema.arguments]
            like_idx = [names.index(n) for n in op.shape.names]

        def call(*args: Any) -> Any:
            validate_args(op, args, _is_array, "a numpy.ndarray")
            if like_idx is not None:
                outs = [np.empty(args[i].shape, args[i].dtype) for i in like_idx]
            else:
                outs = [np.empty(s.shape, np.dtype(s.dtype)) for s in op.output_specs(args)]
            if mutating:
                check_alias(args)
            kern(*outs, *args)
            return pack_results(op, args, outs)

        prelude = _fast_prelude(op)
        if prelude is not None:
            install_prelude(op, "numpy", prelude, {
                "_np_nd": np.ndarray, "_np_empty_like": np.empty_like, "_np_k": kern, "_np_slow": call,
            })
        return call

    def call_with_out(self, op: OpDef, args: tuple[Any, ...], outs: tuple[Any, ...]) -> Any:
        """Run *op* into the caller's arrays *outs* (validated by the kernel)."""
        validate_args(op, args, _is_array, "a numpy.ndarray")
        make_alias_check(op, _span)(args)
        loader.kernel(op, "cpu")(*outs, *args)
        return pack_results(op, args, outs)


ADAPTER = NumpyAdapter()
