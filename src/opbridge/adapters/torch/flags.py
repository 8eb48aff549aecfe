"""Tensor flags a kernel reading raw memory must not miss: the negative and conjugate bits (a view whose memory
holds the values before negation or conjugation), inference tensors written outside inference mode, and
quantized tensors, which DLPack cannot carry.

The fast paths (:mod:`.fast`, the native entry) hand a tensor with either bit to the dispatcher, whose
paths read it resolved (:func:`resolved`); an argument the op writes with either bit, or an inference
tensor written outside inference mode, raises on every path before anything is written. A quantized
argument is the op's TypeError naming it on every path (:func:`check_passable`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from opbridge.call import unpassable

if TYPE_CHECKING:
    from opbridge.declare import OpDef


def math_bits(t: Any) -> bool:
    """Whether *t* is a tensor with the negative or conjugate bit: a view whose memory holds the values
    before negation or conjugation, which a kernel reading raw memory must not see as it is."""
    return isinstance(t, torch.Tensor) and (t.is_neg() or t.is_conj())


def resolved(t: Any) -> Any:
    """*t* with its negative and conjugate bits resolved (a new tensor where one is set), else *t*."""
    return t.resolve_conj().resolve_neg() if math_bits(t) else t


def check_written_bits(op: OpDef, written: Sequence[tuple[str, Any]]) -> None:
    """Raise RuntimeError if a tensor the op writes in place (``(name, value)`` pairs) has the negative or
    conjugate bit: opbridge writes such an argument through no path (torch's fallback for those bits
    cannot give back the writes of an op that does not return them)."""
    for name, t in written:
        if math_bits(t):
            raise RuntimeError(f"{op.name}: argument '{name}' has the negative (or conjugate) bit set; the op "
                               f"writes it in place: call .resolve_neg() / .resolve_conj() first")


#: torch's own message for a write to an inference tensor outside inference mode (c10's VariableVersion::bump).
INFERENCE_WRITE = ("Inplace update to inference tensor outside InferenceMode is not allowed."
                   "You can make a clone to get a normal tensor before doing inplace update."
                   "See https://github.com/pytorch/rfcs/pull/17 for more details.")


def check_inference_writes(op: OpDef, written: Sequence[tuple[str, Any]]) -> None:
    """Raise torch's RuntimeError if, outside inference mode, a tensor the op writes (``(name, value)``
    pairs: mutated arguments, ``out=``) is an inference tensor, as torch's own in-place ops do."""
    if torch.is_inference_mode_enabled():
        return
    for name, t in written:
        if isinstance(t, torch.Tensor) and t.is_inference():
            raise RuntimeError(f"{op.name}: argument '{name}': {INFERENCE_WRITE}")


def unpassable_tensor(t: Any, lead: Any) -> unpassable.Unpassable | None:
    """A quantized tensor, which DLPack cannot carry (:func:`opbridge.call.unpassable.check`'s probe): its
    conversion raises "QUInt/QInt types are not supported by dlpack", and the dispatcher, which sends a call
    with one to its quantized backend, "Could not run ... from the 'QuantizedCPU' backend"."""
    if isinstance(t, torch.Tensor) and t.is_quantized:
        return unpassable.Unpassable(f"dtype {str(t.dtype).removeprefix('torch.')} (a quantized tensor)",
                                     "DLPack has no quantized types", "dequantize()")
    return None


def check_passable(op: OpDef, args: Sequence[Any]) -> None:
    """Raise the op's TypeError naming a tensor argument DLPack cannot carry (:func:`unpassable_tensor`), if any:
    where a call failed (the fast path's, ``out=``'s), and as the dispatcher's quantized backends' kernel."""
    unpassable.check(op, args, unpassable_tensor)
