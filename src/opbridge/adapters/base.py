"""The interface every framework adapter implements, and helpers they share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from opbridge.declare import OpDef


class Adapter(Protocol):
    """A framework adapter.

    ``make_call(op, array_type)`` returns a function taking the op's arguments
    positionally, in schema order, and returning the op's results as that
    framework's arrays. It is called once per (op, array type) and cached, so
    it should front-load all lookups.
    """

    name: str

    def make_call(self, op: OpDef, array_type: type) -> Callable[..., Any]: ...


def check_no_alias(op: OpDef, args: Sequence[Any], span: Callable[[Any], tuple[int, int]]) -> None:
    """Reject a mutated argument whose memory overlaps another tensor argument.

    *span* maps a tensor to ``(start, end)`` byte addresses (``end == start`` when empty).
    """
    tensors = [(a.name, args[i], a.is_mutated) for i, a in enumerate(op.schema.arguments)
               if a.type.is_tensor and args[i] is not None]
    for i, (name, t, mutated) in enumerate(tensors):
        if not mutated:
            continue
        s0, e0 = span(t)
        if s0 == e0:
            continue
        for j, (other, u, _) in enumerate(tensors):
            if i == j:
                continue
            s1, e1 = span(u)
            if s1 < e0 and s0 < e1:
                raise ValueError(f"{op.name}: mutated argument '{name}' overlaps argument "
                                 f"'{other}' in memory; pass separate tensors")


def pack_results(op: OpDef, args: Sequence[Any], outs: Sequence[Any]) -> Any:
    """Map allocated outputs (and aliased inputs) onto the schema's returns."""
    returns = op.schema.returns
    if not returns:
        return None
    alias_of = {a.type.alias.set: i for i, a in enumerate(op.schema.arguments) if a.type.alias}
    res = []
    it = iter(outs)
    for r in returns:
        if r.type.alias is None:
            res.append(next(it))
        else:
            res.append(args[alias_of[r.type.alias.set]])
    return res[0] if len(res) == 1 else tuple(res)


def validate_args(op: OpDef, args: Sequence[Any], is_array: Callable[[Any], bool], kind: str) -> None:
    """Check each argument's Python type against the schema, naming the op and argument."""
    from opbridge.schema import check_value

    for a, v in zip(op.schema.arguments, args):
        if a.type.is_tensor:
            if v is None and a.type.optional:
                continue
            if not is_array(v):
                raise TypeError(f"{op.name}: argument '{a.name}' must be {kind}, got {type(v).__name__}")
        else:
            check_value(op.name, a, v)
