"""``torch.func.vmap`` of an op: one kernel call over the declared rows, else one per batch element.

Registered for every op (``torch.library.register_vmap``), so torch's slow
batching fallback, and its warning that asks users to file an issue with
PyTorch, never runs for an opbridge op. :func:`opbridge.call.batching.one_call`
says how a batch runs: over the arguments the op declares ``rows`` alone, as
one call with the batch as one more leading dim (each row argument the batch
leaves out is expanded along it, a weight stays as it is); otherwise the op
runs once per batch element and its results are stacked. A mutating op writes
its batched arguments in place; writing an argument the batch leaves out
raises, as torch's own in-place ops do under ``vmap``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from opbridge.call import batching, core

if TYPE_CHECKING:
    from opbridge.declare import OpDef


def register(op: OpDef, overload: Any, lib: torch.library.Library) -> None:
    """Register *op*'s vmap rule in *lib*; an op with a Tensor[] or keyword-only Tensor argument keeps torch's
    fallback (``register_vmap`` takes neither)."""
    args = op.schema.arguments
    if any(a.type.is_tensor_list or (a.type.is_tensor and a.name in op.schema.keyword_names) for a in args):
        return
    torch.library.register_vmap(op.qualname, make_rule(op, overload), lib=lib)


def make_rule(op: OpDef, overload: Callable[..., Any]) -> Callable[..., Any]:
    """The vmap rule of *op*, calling *overload* (``torch.ops.<ns>.<op>.default``) below the batching level."""
    tensor_idx = core.tensor_indices(op)
    mutated = [i for i, a in enumerate(op.schema.arguments) if a.is_mutated]
    returns = op.return_sources  # k >= 0: new output k; k < 0: argument -1 - k (aliased, mutated)

    def rule(info: Any, in_dims: Sequence[int | None], *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        size = info.batch_size
        dims = list(in_dims) + [None] * (len(args) - len(in_dims))
        for i in mutated:
            if i < len(args) and args[i] is not None and dims[i] is None:
                raise RuntimeError(
                    f"{op.name}: vmap: the op writes {op.schema.arguments[i].name!r} in place, and the batch "
                    f"leaves it out (in_dims None): it cannot hold a result per batch element; batch it too")
        front = [a.movedim(d, 0) if d is not None else a for a, d in zip(args, dims, strict=True)]
        plan = batching.one_call(op, [i for i in tensor_idx if i < len(front) and dims[i] is not None],
                                 [i for i in tensor_idx if i < len(front) and front[i] is not None])
        if plan is not None:
            call = [a.expand(size, *a.shape) if i in plan else a for i, a in enumerate(front)]
            out = overload(*call, **kwargs)
        else:
            per = [overload(*[a[b] if dims[i] is not None else a for i, a in enumerate(front)], **kwargs)
                   for b in range(size)]
            out = _stack(per, returns, front)
        if not returns:
            return out, None
        return out, (0 if len(returns) == 1 else (0,) * len(returns))

    return rule


def _stack(per: list[Any], returns: Sequence[int], args: Sequence[Any]) -> Any:
    """The per-element results *per* as one result with the batch in front (aliased returns: the argument)."""
    if not returns:
        return None
    outs = []
    for k, src in enumerate(returns):
        if src < 0:
            outs.append(args[-1 - src])  # written in place through its per-element views
        else:
            outs.append(torch.stack([p if len(returns) == 1 else p[k] for p in per]))
    return outs[0] if len(returns) == 1 else tuple(outs)
