"""The checked call of an op on MindSpore tensors: every check, strided tensors through dense copies.

The generated eager call (:mod:`.eager`) and the tensor C entry take the common case; anything unusual
comes here (:func:`run_checked`, :func:`run_with_out` for ``out=``), which raises the named error or
completes the call: each tensor as a NumPy view of its memory (:mod:`.views`), on the CPU only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from mindspore import Tensor
from mindspore.graph.api import _pynative_executor

from opbridge.adapters.mindspore.support import dtype_name, ms_dtype
from opbridge.adapters.mindspore.views import NUMPY, NotOnHostError, alloc, host_view, relabel, sync
from opbridge.call import unpassable
from opbridge.call.core import alloc_outputs, check_lead_dtype, check_outs, pack_results, validate_args
from opbridge.call.layout import NDARRAY_SHARES, NDARRAY_WRITTEN, dense_ndarray, ndarray_rows
from opbridge.call.overlap import check_no_alias, dense_args, dense_outputs, outputs_overlap
from opbridge.errors import BackendUnavailableError

if TYPE_CHECKING:
    from opbridge.declare import OpDef

requires_grad: Callable[[], bool] = _pynative_executor._executor.requires_grad


def is_tensor(x: Any) -> bool:
    """Whether *x* is a MindSpore tensor (``Parameter`` included)."""
    return isinstance(x, Tensor)


def not_on_host_error(op: OpDef, args: Sequence[Any]) -> BackendUnavailableError | None:
    """The error for a tensor argument that is not on the CPU, naming op, framework and device; else None."""
    for a, v in zip(op.schema.arguments, args):
        if a.type.is_tensor and isinstance(v, Tensor) and str(v.device) != "CPU":
            return BackendUnavailableError(
                f"{op.name}: argument '{a.name}' is a MindSpore tensor on {v.device}, and opbridge has no "
                f"{v.device} kernel for MindSpore tensors (they run on the CPU kernel, which cannot read "
                f"device memory); move it with .move_to(\"CPU\")")
    return None


def host_views(op: OpDef, args: Sequence[Any]) -> list[Any]:
    """*args* with each tensor replaced by a NumPy view of its memory; a device tensor raises, named."""
    out = []
    for a, v in zip(op.schema.arguments, args):
        if not a.type.is_tensor or v is None:
            out.append(v)
            continue
        try:
            out.append(host_view(v))
        except NotOnHostError:
            raise not_on_host_error(op, args) or RuntimeError(f"{op.name}: '{a.name}' left the CPU") from None
        except KeyError:  # a dtype NumPy cannot view it as: the op's TypeError naming it, as in every framework
            unpassable.check(op, args, unpassable_tensor)
            raise TypeError(f"{op.name}: argument '{a.name}' has dtype {v.dtype}, which opbridge cannot pass to a "
                            f"kernel") from None
    return out


def unpassable_tensor(t: Any, lead: Any) -> unpassable.Unpassable | None:
    """A CPU tensor of a dtype opbridge cannot view as NumPy (:data:`.views.NUMPY`: complex, uint16 and
    wider unsigned, float8, ...), for :func:`opbridge.call.unpassable.check`; None for any other. The hint
    converts it to the lead argument's dtype."""
    if not isinstance(t, Tensor) or t.dtype in NUMPY:
        return None
    return unpassable.Unpassable(f"dtype {dtype_name(t.dtype)}", f"opbridge hands a kernel MindSpore tensors of "
                                 f"{', '.join(dtype_name(d) for d in NUMPY)} only",
                                 f'astype("{dtype_name(lead.dtype)}")')  # a kernel checks the others' against it


def _is_dense(view: np.ndarray) -> bool:
    return bool(view.flags.c_contiguous)


def view_span(v: np.ndarray) -> tuple[int, int]:
    """``(start, end)`` byte addresses of everything host view *v* reaches, strides included."""
    bounds = getattr(np.lib, "array_utils", np).byte_bounds  # NumPy 2 moved it; MindSpore's is 1.x
    lo, hi = bounds(v)
    return (lo, lo) if v.size == 0 else (lo, hi)


def _new_output(shape: tuple[int, ...], dtype: Any, lead: Any) -> tuple[Tensor, Any]:
    return alloc(shape, ms_dtype(dtype))


def run_checked(op: OpDef, kernel: Callable[..., Any], args: Sequence[Any],
                outs: Sequence[Any] | None = None) -> Any:
    """Run *op* on MindSpore tensors with every check; strided tensors through dense copies.

    *outs* are the caller's output tensors (``out=``), else new outputs are
    allocated. Mutated arguments and outputs that are not dense are computed
    in a dense copy and copied back into the caller's memory; one whose
    elements share memory (a broadcast view), and two outputs that share an
    element, raise ValueError before the kernel runs.
    """
    validate_args(op, args, is_tensor, "a mindspore.Tensor")
    check_lead_dtype(op, args, lambda t: dtype_name(t.dtype))
    if outs is not None:
        check_outs(op, args, outs, lambda t: dtype_name(t.dtype))
    sync()
    views = host_views(op, args)
    dense, back = dense_args(op, views, _is_dense, np.ascontiguousarray, ndarray_rows, written=NDARRAY_WRITTEN)
    if op.schema.is_mutating:  # on the host views, whose strides say which elements each reaches
        check_no_alias(op, views, view_span, NDARRAY_SHARES)
    if outs is None:
        new = alloc_outputs(op, args, _new_output)
        results, out_args = [t for t, _ in new], [a for _, a in new]
    else:
        results = list(outs)
        out_views = host_views_of(op, outs)
        fresh = outputs_overlap(op, views, out_views, np.may_share_memory, NDARRAY_SHARES, written=NDARRAY_WRITTEN,
                                is_dense=_is_dense)
        out_dense, out_back = dense_outputs(out_views, _is_dense, dense_ndarray, fresh=fresh)
        back += out_back
        out_args = [relabel(d, o.dtype) for d, o in zip(out_dense, outs)]
    kargs = [relabel(d, v.dtype) if a.type.is_tensor and v is not None else d
             for a, v, d in zip(op.schema.arguments, args, dense)]
    kernel(*out_args, *kargs)
    for original, copy in back:
        np.copyto(original, copy)
    return pack_results(op, args, results)


def host_views_of(op: OpDef, outs: Sequence[Tensor]) -> list[np.ndarray]:
    """NumPy views of the caller's output tensors (``out=``); a device tensor raises, named."""
    try:
        return [host_view(o) for o in outs]
    except NotOnHostError as e:
        raise BackendUnavailableError(
            f"{op.name}: out= holds a MindSpore tensor on {e.device}, and opbridge has no {e.device} kernel "
            f"for MindSpore tensors; pass CPU tensors") from None


def run_with_out(op: OpDef, kernel: Callable[..., Any], args: tuple[Any, ...], outs: tuple[Any, ...]) -> Any:
    """*op* into the caller's tensors *outs* (``out=``) with every check: PyNative only, no gradients."""
    validate_args(op, args, is_tensor, "a mindspore.Tensor")
    for i, o in enumerate(outs):
        if not isinstance(o, Tensor):
            raise TypeError(f"{op.name}: out[{i}] must be a mindspore.Tensor, got {type(o).__name__}")
    if requires_grad():
        raise RuntimeError(f"{op.name}: out= writes into existing tensors, which MindSpore cannot "
                           f"differentiate; call it outside mindspore.grad / value_and_grad or "
                           f"without out=")
    return run_checked(op, kernel, args, outs)
