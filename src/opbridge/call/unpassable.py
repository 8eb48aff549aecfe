"""Tensors a framework cannot hand a kernel: the op's TypeError naming the argument, in every framework.

A kernel takes dense tensors of the dtypes DLPack can name (or, for MindSpore, the dtypes opbridge can
view as NumPy). A tensor beyond that reaches an adapter as its framework's own error, raised while the
arguments are converted, which names neither the op nor the argument: NumPy's ``BufferError`` ("DLPack
only supports ..."), torch's ``RuntimeError`` ("QUInt/QInt types are not supported by dlpack", or the
dispatcher's ``NotImplementedError`` for the ``QuantizedCPU`` backend), Paddle's ``RuntimeError`` reading a
sparse tensor's dims. The lead argument's dtype check (:func:`opbridge.call.core.check_lead_dtype`) names
most of them where the lead is one; :func:`check` names the others, with one message in every framework.

An adapter calls it where a call failed (never on the hot path: a fast path, a C entry or the checked
call hands the failure here), with its framework's :data:`Probe`, and re-raises the original error when
no argument is the cause. The C entries return ``NotImplemented`` for such a tensor (they cannot view
it), so the error is always raised from Python, here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from opbridge.declare import OpDef


class Unpassable(NamedTuple):
    """What a framework's probe says of a tensor no kernel can be handed."""

    #: What the tensor is, as its framework names it: ``"dtype quint8"``, ``"a sparse COO layout"``.
    got: str
    #: Why no kernel takes it, in the framework's words where it has them.
    reason: str
    #: The method call that converts it, on the argument: ``"dequantize()"``, ``'astype("float32")'``.
    convert: str


#: ``probe(tensor, lead)`` -> :class:`Unpassable`, or None where the framework can pass *tensor* to a kernel
#: (*lead* is the op's dtype argument, whose dtype a conversion hint may name).
Probe = Callable[[Any, Any], "Unpassable | None"]


def error(op: OpDef, arg: str, found: Unpassable) -> TypeError:
    """The error for the tensor argument *arg* of *op*, which its framework cannot hand a kernel."""
    return TypeError(f"{op.name}: argument '{arg}' has {found.got}, which no kernel takes ({found.reason}); "
                     f"convert it first, e.g. {arg}.{found.convert}")


def check(op: OpDef, args: Sequence[Any], probe: Probe) -> None:
    """Raise :func:`error` for the first tensor argument in *args* (schema order) that *probe* finds its
    framework cannot hand a kernel; return where there is none (the caller re-raises its own error).

    A probe that fails on an argument (not a tensor of its framework) counts as finding nothing there.
    """
    lead = args[op.dtype_arg]
    for a, v in zip(op.schema.arguments, args):
        if a.type.is_tensor and v is not None:
            try:
                found = probe(v, lead)
            except Exception:  # the caller's own error is the one to raise then
                found = None
            if found is not None:
                raise error(op, a.name, found)
