"""LLM-serving ops with vLLM's semantics: the gated activations and fused residual + RMSNorm
(``rotary_embedding`` is in :mod:`.rotary`, ``advance_step_flashattn`` in :mod:`.advance_step`).

The functions below are the NumPy references (they are the declarations); the
kernels live in ``opbridge/csrc/{activation_and_mul,fused_add_rms_norm}.{cc,cu}``.
Mutating ops (``Tensor(a!)``) update their arguments in place in torch, NumPy
and Paddle, and return the new values of the mutated arguments in JAX (whose
arrays are immutable).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opbridge.cases import gated_hint, last_dim_hint
from opbridge.declare import Spec, like
from opbridge.ops._library import LIBRARY

_SQRT_2_OVER_PI = float(np.sqrt(2.0 / np.pi))
_INT32_MAX = int(np.iinfo(np.int32).max)
_INT64_MAX = int(np.iinfo(np.int64).max)

# ---------------------------------------------------------------------------
# gated activations: act(a) * b with x = [a | b] along the last dim
# ---------------------------------------------------------------------------


def _halves(op: str, x: Any) -> int:
    """The half width d of x's last dim (2d); ValueError naming the op and x when odd or 0-d."""
    shape = x.shape
    if not shape or shape[-1] % 2:
        raise ValueError(f"{op}: x's last dim must be even (it holds the halves [a | b]), got shape {tuple(shape)}")
    return shape[-1] // 2  # type: ignore[no-any-return]


def _halve_last(op: str) -> Any:
    def rule(x: Any) -> Spec:
        return Spec((*x.shape[:-1], _halves(op, x)), x.dtype)

    rule.__name__ = f"{op}_shape"
    rule.__doc__ = "x's shape with the last dim halved, in x's dtype."
    return rule


def _sigmoid(a: Any) -> Any:
    with np.errstate(over="ignore"):  # exp(-a) = inf gives sigmoid 0, as it should
        return 1.0 / (1.0 + np.exp(-a))


def _gelu_tanh(a: Any) -> tuple[Any, Any]:
    """gelu_tanh(a) = 0.5 a (1 + tanh(u)), u = sqrt(2/pi) (a + 0.044715 a^3), and its derivative.

    Evaluated as ``a * sigmoid(2u)`` (the same function): ``1 + tanh(u)``
    cancels for a < -5 even in float64, leaving no correct digits by a = -8.
    """
    z = 2.0 * _SQRT_2_OVER_PI * (a + 0.044715 * a**3)
    dz = 2.0 * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * a**2)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(-z)
        s = 1.0 / (1.0 + e)
        one_minus_s = np.where(np.isinf(e), 1.0, e * s)
    return a * s, s + a * dz * one_minus_s * s


def _silu_and_mul_grad(grad: Any, x: Any) -> tuple[Any]:
    return (silu_and_mul_backward(grad, x),)


def _gelu_and_mul_grad(grad: Any, x: Any) -> tuple[Any]:
    return (gelu_and_mul_backward(grad, x),)


@LIBRARY.op("silu_and_mul(Tensor x) -> Tensor", shape=_halve_last("silu_and_mul"),
            backward=_silu_and_mul_grad, hints=gated_hint(("x",)), rows=("x",))
def silu_and_mul(x: Any) -> Any:
    """vLLM's SiluAndMul: ``silu(a) * b`` for ``x = [a | b]`` split along the last dim; shape ``(..., d)``."""
    d = _halves("silu_and_mul", x)
    a, b = x[..., :d], x[..., d:]
    return a * _sigmoid(a) * b


@LIBRARY.op("silu_and_mul_backward(Tensor grad, Tensor x) -> Tensor", shape=like("x"),
            hints=gated_hint(("x",), half=("grad",)), rows=("grad", "x"))
def silu_and_mul_backward(grad: Any, x: Any) -> Any:
    """Gradient of :func:`silu_and_mul` w.r.t. ``x`` (shape of x): ``[grad b silu'(a) | grad silu(a)]``."""
    d = _halves("silu_and_mul_backward", x)
    a, b = x[..., :d], x[..., d:]
    s = _sigmoid(a)
    return np.concatenate([grad * b * s * (1.0 + a * (1.0 - s)), grad * a * s], axis=-1)


@LIBRARY.op("gelu_and_mul(Tensor x) -> Tensor", shape=_halve_last("gelu_and_mul"),
            backward=_gelu_and_mul_grad, hints=gated_hint(("x",)), rows=("x",))
def gelu_and_mul(x: Any) -> Any:
    """vLLM's GeluAndMul(approximate="tanh") (gelu_tanh_and_mul): ``gelu_tanh(a) * b`` for ``x = [a | b]``."""
    d = _halves("gelu_and_mul", x)
    a, b = x[..., :d], x[..., d:]
    return _gelu_tanh(a)[0] * b


@LIBRARY.op("gelu_and_mul_backward(Tensor grad, Tensor x) -> Tensor", shape=like("x"),
            hints=gated_hint(("x",), half=("grad",)), rows=("grad", "x"))
def gelu_and_mul_backward(grad: Any, x: Any) -> Any:
    """Gradient of :func:`gelu_and_mul` w.r.t. ``x`` (shape of x): ``[grad b gelu'(a) | grad gelu(a)]``."""
    d = _halves("gelu_and_mul_backward", x)
    a, b = x[..., :d], x[..., d:]
    g, dg = _gelu_tanh(a)
    return np.concatenate([grad * b * dg, grad * g], axis=-1)


# ---------------------------------------------------------------------------
# fused_add_rms_norm
# ---------------------------------------------------------------------------


@LIBRARY.op("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps=1e-6) -> ()",
            hints=last_dim_hint(("input", "residual"), ("weight",)), rows=("input", "residual"))
def fused_add_rms_norm(input: Any, residual: Any, weight: Any, eps: float = 1e-6) -> None:
    """vLLM's fused_add_rms_norm, in place: ``residual += input``; ``input = rms_norm(residual) * weight``.

    The norm is over the last dim, ``residual / sqrt(mean(residual^2) + eps)``,
    of the new residual as stored (kernels round it to its dtype first, as
    vLLM does). An inference op: no backward.
    """
    residual += input
    r = 1.0 / np.sqrt(np.mean(residual * residual, axis=-1, keepdims=True) + eps)
    input[...] = residual * r * weight
