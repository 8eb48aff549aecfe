"""Gradient checks of the test matrix (torch): autograd against finite differences of the reference."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from opbridge.testing.generate import case_rng

if TYPE_CHECKING:
    from opbridge.testing.runner import Runner

__all__ = ["check_directional", "directional_check"]

_FD_STEP = 1e-6


def check_directional(r: Runner, index: int, full: Sequence[Any], ref_in: Sequence[Any]) -> None:
    """Autograd gradients of case *index* against central differences of the float64 reference.

    For a random cotangent ``g`` and, per differentiable input, a random
    direction ``u``, compares ``<grad, u>`` from autograd with ``<g, J u>``
    from central differences (step ``1e-6``) of the reference evaluated on
    *ref_in*, within ``r.grad_rtol`` of the terms' scale plus the op's float32
    ``atol`` times ``|u|``.
    """
    torch = r.kit.torch  # type: ignore[attr-defined]
    rng = case_rng(r.seed, r.op.qualname, "grad", index)
    diff = [i for i in r.op.differentiable
            if full[i] is not None and r.kit.is_float(full[i])]
    if not diff:
        r.report.skipped.append(f"grad: {r.where}: no floating differentiable input")
        return
    leaves = {i: full[i].detach().requires_grad_() for i in diff}
    call_args = [leaves.get(i, v) for i, v in enumerate(full)]
    outs = r.call(call_args)
    float_outs = [(j, o) for j, o in enumerate(outs) if o.dtype.is_floating_point]
    gs = {j: torch.from_numpy(rng.standard_normal(tuple(o.shape))).to(o.dtype) for j, o in float_outs}
    grads = torch.autograd.grad([o for _, o in float_outs], [leaves[i] for i in diff],
                                grad_outputs=[gs[j] for j, _ in float_outs], allow_unused=True)
    g64 = {j: g.double().numpy() for j, g in gs.items()}
    _, atol = r.op.tolerance("float32")
    for i, grad in zip(diff, grads, strict=True):
        name = r.args[i].name
        base = np.asarray(ref_in[i], dtype=np.float64)
        u = rng.standard_normal(base.shape)
        plus = list(ref_in)
        minus = list(ref_in)
        plus[i] = base + _FD_STEP * u
        minus[i] = base - _FD_STEP * u
        f_plus, _ = r.reference(plus)
        f_minus, _ = r.reference(minus)
        fd = 0.0
        fd_norm = 0.0
        for j in g64:
            ju = (np.asarray(f_plus[j], np.float64) - np.asarray(f_minus[j], np.float64)) / (2 * _FD_STEP)
            fd += float(np.sum(g64[j] * ju))
            fd_norm += float(np.sum((g64[j] * ju) ** 2))
        got = np.zeros(base.shape) if grad is None else grad.detach().double().numpy()
        if got.shape != base.shape:
            raise AssertionError(f"gradient of '{name}' has shape {got.shape}, the input {base.shape}")
        ad = float(np.sum(got * u))
        scale = abs(fd) + float(np.sqrt(fd_norm)) + float(np.linalg.norm(got * u))
        tol = r.grad_rtol * scale + atol * float(np.linalg.norm(u))
        if not abs(ad - fd) <= tol:
            raise AssertionError(
                f"gradient of '{name}' disagrees with finite differences: for a random direction u "
                f"and cotangent g, <g, J u> by central differences (h={_FD_STEP:g}) of the float64 "
                f"reference = {fd:.8g}, autograd <grad_{name}, u> = {ad:.8g}; |diff| = "
                f"{abs(ad - fd):.3g} > tolerance {tol:.3g} (rtol={r.grad_rtol:g}, atol={atol:g})"
                + (" [autograd returned no gradient]" if grad is None else "")
            )


def directional_check(op: Any, base: Sequence[Any], grads: Sequence[Any], diff: Sequence[int], cotangent: np.ndarray,
                      rng: np.random.Generator, *, rtol: float, label: str) -> None:
    """A framework's gradients of a one-output op against central differences of its float64 reference.

    *base* holds the call's arguments as float64 NumPy (others as they were),
    *grads* the framework's gradient of ``<cotangent, op(...)>`` for each
    argument in *diff*. For a random direction ``u`` per argument, ``<grad, u>``
    must match ``<cotangent, J u>`` within *rtol* of the summed terms'
    magnitude (rounding grows with the terms, not with their cancelling sum).
    """
    for i, grad in zip(diff, grads, strict=True):
        u = rng.standard_normal(np.shape(base[i]))

        def f_at(t: float, i: int = i, u: np.ndarray = u) -> float:
            a = list(base)
            a[i] = np.asarray(base[i], np.float64) + t * u
            return float(np.sum(op.reference(*a) * cotangent))

        fd = (f_at(_FD_STEP) - f_at(-_FD_STEP)) / (2 * _FD_STEP)
        terms = np.asarray(grad, np.float64) * u
        got = float(np.sum(terms))
        tol = rtol * max(1.0, abs(fd), float(np.sum(np.abs(terms))))
        if not abs(got - fd) <= tol:
            raise AssertionError(f"{label} d{op.name}/d{op.schema.arguments[i].name}: <grad, u> = {got}, finite "
                                 f"differences of the reference give {fd} (tolerance {tol:.3g})")

