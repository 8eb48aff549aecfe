"""Gradient checks: a framework's autograd against finite differences of an op's float64 reference."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from opbridge.testing.generate import case_rng
from opbridge.testing.kits import dtype_str

if TYPE_CHECKING:
    from opbridge.testing.runner import Runner

__all__ = ["check_directional", "directional_check"]

_FD_STEP = 1e-6


def check_directional(r: Runner, index: int, full: Sequence[Any], ref_in: Sequence[Any]) -> None:
    """The framework's gradients of case *index* against central differences of the float64 reference.

    For a random cotangent ``g`` and, per differentiable input, a random
    direction ``u``, compares ``<grad, u>`` from the framework's autograd
    (its kit's ``vjp``: ``torch.autograd``, ``jax.vjp``, ``paddle.grad``,
    ``mindspore.vjp``) with ``<g, J u>`` from central differences (step
    ``1e-6``) of the reference evaluated on *ref_in*, within ``r.grad_rtol``
    of the terms' scale plus the op's float32 ``atol`` times ``|u|``.
    """
    kit = r.kit
    rng = case_rng(r.seed, r.op.qualname, "grad", index)
    diff = [i for i in r.op.differentiable
            if full[i] is not None and kit.is_float(full[i])]
    if not diff:
        r.report.skipped.append(f"grad: {r.where}: no floating differentiable input")
        return
    outs, _ = r.call(full)
    gs = [kit.from_np(rng.standard_normal(kit.shape(o)), dtype_str(o.dtype)) if kit.is_float(o) else None
          for o in outs]
    grads = kit.vjp(lambda *a: r.call(a)[0], full, diff, gs)
    g64 = {j: kit.to_np64(g) for j, g in enumerate(gs) if g is not None}
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
        got = np.asarray(grad, np.float64)
        if got.shape != base.shape:
            raise AssertionError(f"gradient of '{name}' has shape {got.shape}, the input {base.shape}")
        ad = float(np.sum(got * u))
        scale = abs(fd) + float(np.sqrt(fd_norm)) + float(np.linalg.norm(got * u))
        tol = r.grad_rtol * scale + atol * float(np.linalg.norm(u))
        if not abs(ad - fd) <= tol:
            raise AssertionError(
                f"gradient of '{name}' disagrees with finite differences: for a random direction u "
                f"and cotangent g, <g, J u> by central differences (h={_FD_STEP:g}) of the float64 "
                f"reference = {fd:.8g}, {kit.name} autograd <grad_{name}, u> = {ad:.8g}; |diff| = "
                f"{abs(ad - fd):.3g} > tolerance {tol:.3g} (rtol={r.grad_rtol:g}, atol={atol:g})"
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

