"""``mindspore.ops.vmap`` of an op: one kernel call over the declared rows, else MindSpore's per-element rule.

MindSpore (2.10) asks each primitive of a graph it vectorises for a vmap rule:
first the primitive object itself, when it has a ``get_vmap_rule()`` method
(``PrimitivePy::GetVmapRuleFunction``), then the rules registered by primitive
name in ``mindspore.ops._vmap.vmap_rules_getters`` (every ``ops.Custom`` is
named "Custom" there), then its general rule, which unstacks the batch and
calls the primitive once per element. :class:`~.primitive.OpCustom` has the
method, so the rule below applies to opbridge's primitives alone; every other
``ops.Custom`` keeps MindSpore's general rule.

The rule asks :func:`opbridge.call.batching.one_call` while MindSpore
compiles (the batch dims are constants there). A batch over the op's declared
rows alone moves each batch dim to the front, broadcasts along it the row
arguments the batch leaves out, calls the primitive once on the whole batch
and returns batch dim 0; gradients of that call come from the primitive's
bprop (the declared backward, at the batched shapes). Any other batch goes to
MindSpore's general rule, as it would without this one. Ops that mutate their
arguments have no primitive: under ``vmap`` they raise, as in any graph.

:func:`make_rule`'s inner ``rule`` is graph code: MindSpore parses it from
this file, so it stays within MindSpore's Python subset.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mindspore.numpy as mnp
from mindspore.ops import constexpr
from mindspore.ops import functional as F  # noqa: N812 - MindSpore's own spelling, in graph code
from mindspore.ops._vmap.vmap_base import _broadcast_by_axis, vmap_general_preprocess
from mindspore.ops.function import _VmapGeneralRule

from opbridge.call import batching

if TYPE_CHECKING:
    from opbridge.declare import OpDef


def _front(x: Any, dim: Any, size: Any) -> Any:
    """*x* with its batch dim *dim* first, or broadcast along a new first dim of *size* (graph code)."""
    if dim is None:
        return _broadcast_by_axis(x, 0, size)
    if dim == 0:
        return x
    return mnp.moveaxis(x, dim, 0)


def plan(op: OpDef, dims: Sequence[int | None], shapes: Sequence[Sequence[int]]) -> tuple[int, tuple[bool, ...] | None]:
    """How a batch with dims *dims* (one per primitive input, None: unbatched) runs: ``(axis_size, front)``.

    *front*: per input, whether it goes to the one call with the batch as
    its leading dim (moved there, or broadcast along it); None: the batch runs
    once per element (MindSpore's general rule).
    """
    size = next(int(s[d]) for d, s in zip(dims, shapes, strict=True) if d is not None)
    inputs = range(len(op.schema.arguments))  # scalars too arrive as 0-d tensors: never rows, never broadcast
    broadcast = batching.one_call(op, [i for i in inputs if dims[i] is not None], inputs)
    if broadcast is None:
        return size, None
    return size, tuple(dims[i] is not None or i in broadcast for i in inputs)


def make_rule(prim: Any) -> Callable[..., Any]:
    """The vmap rule of *prim* (an :class:`~.primitive.OpCustom`), as MindSpore's ``get_vmap_rule`` returns it.

    MindSpore calls it with one ``(value, batch dim or None)`` pair per input
    and takes ``(output, batch dim)`` back (a pair per output for several).
    """
    op = prim.opdef
    several = op.n_outputs > 1

    # Evaluated while MindSpore compiles. Not reused: MindSpore's cache of constant results is keyed by name,
    # attributes and arguments, which the same helper of another op (or of a rebuilt primitive) shares.
    @constexpr(reuse_result=False)  # type: ignore[untyped-decorator]
    def how(dims: Any, shapes: Any) -> Any:
        return plan(op, dims, shapes)

    @constexpr(reuse_result=False)  # type: ignore[untyped-decorator]
    def per_element(size: Any) -> Any:
        return _VmapGeneralRule(prim, size)

    def rule(*args: Any) -> Any:
        unbatched, result = vmap_general_preprocess(prim, *args)
        if unbatched:
            return result
        dims = tuple([a[1] for a in args])
        size, front = how(dims, tuple([F.shape(a[0]) for a in args]))
        if front is None:
            return per_element(size)(*args)
        out = prim(*[_front(a[0], a[1], size) if f else a[0] for a, f in zip(args, front)])
        if several:
            return tuple([(o, 0) for o in out])
        return out, 0

    return rule
