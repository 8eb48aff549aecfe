"""The torch-only checks of the test matrix: ``opcheck``, ``gradcheck`` and ``torch.compile`` against eager."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from opbridge.cases import LAYOUT, NONCONTIGUOUS, Case
from opbridge.declare import OpDef
from opbridge.testing.compare import assert_close, dtype_name, to_numpy
from opbridge.testing.generate import case_rng
from opbridge.testing.runner import Runner, as_tuple, describe

__all__ = ["run_compile", "run_gradcheck", "run_opcheck", "small_case"]


def small_case(op: OpDef, cases: Sequence[Case]) -> Case | None:
    """The smallest contiguous non-empty case, preferring ones whose tensors are at least 2-D."""
    def tensors(c: Case) -> list[np.ndarray]:
        return [to_numpy(c[a.name]) for a in op.schema.arguments
                if a.type.is_tensor and c[a.name] is not None]

    ok = [c for c in cases if c.get(NONCONTIGUOUS) is None and c.get(LAYOUT, "contiguous") == "contiguous"
          and all(t.size > 0 for t in tensors(c))]
    if not ok:
        return None
    wide = [c for c in ok if any(t.ndim >= 2 for t in tensors(c))]
    return min(wide or ok, key=lambda c: sum(t.size for t in tensors(c)))


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


def run_compile(r: Runner, case: Case, backend: str) -> None:
    import torch

    op = r.op
    r.where = describe(op, case) + f" (torch.compile, backend={backend!r}, fullgraph=True)"
    exact = backend in ("eager", "aot_eager")
    with r.checking("setup"):
        full, _ = r.materialize(case)
    fn = op.call

    def run_op(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def same(got: Sequence[Any], want: Sequence[Any], what: str) -> None:
        for j, (g, w) in enumerate(zip(got, want, strict=True)):
            name = f"{what} {j}" if len(want) > 1 else what
            if exact:
                assert_close(g, w, rtol=0.0, atol=0.0, name=f"{name} (compiled vs eager, must be identical)")
            else:
                rtol, atol = op.tolerance(dtype_name(w))
                assert_close(g, w, rtol=rtol, atol=atol, name=f"{name} (compiled vs eager)")

    def copies() -> list[Any]:  # each run gets its own inputs: mutating ops change them
        return [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in full]

    torch._dynamo.reset()
    try:
        with r.checking("compile"):
            compiled = torch.compile(run_op, fullgraph=True, backend=backend)
            full_c, full_e = copies(), copies()
            pos, kw = r.op.schema.split(full_c)
            got = as_tuple(compiled(*pos, **kw), len(op.schema.returns), op.name)
            want = r.call(full_e)
            same(got, want, "output")
            for i, a in enumerate(op.schema.arguments):
                if a.is_mutated and full_c[i] is not None:
                    same([full_c[i]], [full_e[i]], f"mutated argument '{a.name}'")
        if r.dtype == "float32" and op.backward is not None and not op.schema.is_mutating:
            with r.checking("compile_grad"):
                diff = [i for i in op.differentiable if full[i] is not None and full[i].is_floating_point()]
                rng = case_rng(r.seed, op.qualname, "compile_grad")
                gs = [torch.from_numpy(rng.standard_normal(tuple(w.shape))).to(w.dtype)
                      for w in want if w.dtype.is_floating_point]
                results = []
                for runner in (compiled, run_op):
                    leaves = {i: full[i].detach().clone().requires_grad_() for i in diff}
                    args = [leaves.get(i, v) for i, v in enumerate(full)]
                    p, k = r.op.schema.split(args)
                    outs = [o for o in as_tuple(runner(*p, **k), len(op.schema.returns), op.name)
                            if o.dtype.is_floating_point]
                    gr = torch.autograd.grad(outs, [leaves[i] for i in diff], gs, allow_unused=True)
                    results.append([torch.zeros_like(leaves[i]) if g is None else g
                                    for i, g in zip(diff, gr, strict=True)])
                same(results[0], results[1], "gradient")
    finally:
        torch._dynamo.reset()


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
