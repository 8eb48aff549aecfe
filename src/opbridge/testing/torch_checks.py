"""The torch-only checks of the test matrix: ``torch.library.opcheck`` and ``torch.autograd.gradcheck``.

(Graph mode, ``torch.compile`` included, is every framework's: :mod:`opbridge.testing.graph`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opbridge.cases import Case
from opbridge.testing.runner import Runner, as_tuple, describe

__all__ = ["run_gradcheck", "run_opcheck"]


def run_opcheck(r: Runner, case: Case, test_utils: Sequence[str] | None) -> None:
    import torch

    op = r.op
    r.where = describe(op, case) + " (opcheck)"
    with r.checking("setup"):
        full, _ = r.materialize(case)
    grad = r.dtype == "float32" and op.backward is not None and not op.schema.is_mutating
    if grad:
        full = [v.detach().requires_grad_()
                if i in op.differentiable and v is not None and v.is_floating_point() else v
                for i, v in enumerate(full)]
    overload = getattr(getattr(torch.ops, op.library.namespace), op.name).default
    pos, kw = r.op.schema.split(full)
    extra: dict[str, Any] = {} if test_utils is None else {"test_utils": tuple(test_utils)}
    with r.checking("opcheck"):
        torch.library.opcheck(overload, tuple(pos), kw or None, **extra)


def run_gradcheck(r: Runner, case: Case) -> None:
    """``torch.autograd.gradcheck`` of the op's registered backward on *case*, in float64.

    Checks the kernel's backward numerically (finite differences of the op's
    own float64 forward kernel, not the reference), on top of the
    reference-based ``grad`` check. Uses gradcheck's fast mode (one random
    projection of the Jacobian), so its cost does not grow with the case's
    size; tolerances are gradcheck's defaults or the op's float64 ones,
    whichever is looser.
    """
    import torch

    op = r.op
    r.where = describe(op, case) + " (torch.autograd.gradcheck, float64, fast_mode)"
    with r.checking("setup"):
        full, _ = r.materialize(case)
    diff = [i for i in op.differentiable if full[i] is not None and full[i].is_floating_point()]
    n_returns = len(op.schema.returns)

    def fn(*leaves: Any) -> tuple[Any, ...]:
        args = list(full)
        for i, leaf in zip(diff, leaves, strict=True):
            args[i] = leaf
        pos, kw = r.op.schema.split(args)
        return tuple(o for o in as_tuple(op.call(*pos, **kw), n_returns, op.name) if o.is_floating_point())

    rtol, atol = op.tolerance("float64")
    leaves = tuple(full[i].detach().clone().requires_grad_() for i in diff)
    with r.checking("gradcheck"):
        torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=max(atol, 1e-5), rtol=max(rtol, 1e-3),
                                 fast_mode=True)
