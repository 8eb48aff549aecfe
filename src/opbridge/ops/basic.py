"""Built-in elementwise and normalisation ops: add, gelu, rms_norm (and their backward ops)."""

from __future__ import annotations

from typing import Any

import numpy as np

from opbridge.cases import elementwise_hint, last_dim_hint
from opbridge.declare import like
from opbridge.ops._library import LIBRARY

_SQRT_2_OVER_PI = float(np.sqrt(2.0 / np.pi))


@LIBRARY.op(
    "add(Tensor x, Tensor y) -> Tensor",
    shape=like("x"),
    backward=lambda grad, x, y: (grad, grad),
    hints=elementwise_hint("x", "y"),
    dtypes=("float32", "float16", "bfloat16", "float64", "int32", "int64"),  # integers wrap, as in NumPy
    rows=("x", "y"),
)
def add(x: Any, y: Any) -> Any:
    """Elementwise ``x + y`` of two tensors of one shape and dtype (no broadcasting)."""
    return x + y


@LIBRARY.op(
    "gelu(Tensor x) -> Tensor",
    shape=like("x"),
    backward=lambda grad, x: (gelu_backward(grad, x),),  # type: ignore[has-type]  # declared below
    tolerances={"float32": (1e-5, 2e-6)},
    hints=elementwise_hint("x"),
    rows=("x",),
)
def gelu(x: Any) -> Any:
    """GELU, tanh approximation: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
    return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x**3)))


@LIBRARY.op("gelu_backward(Tensor grad, Tensor x) -> Tensor", shape=like("x"),
            tolerances={"float32": (1e-5, 2e-6)}, hints=elementwise_hint("grad", "x"), rows=("grad", "x"))
def gelu_backward(grad: Any, x: Any) -> Any:
    """Gradient of :func:`gelu` with respect to ``x``, times ``grad``."""
    u = _SQRT_2_OVER_PI * (x + 0.044715 * x**3)
    t = np.tanh(u)
    du = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x**2)
    return grad * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du)


def _rms_norm_backward(grad: Any, x: Any, weight: Any, eps: float) -> tuple[Any, Any]:
    return rms_norm_backward(grad, x, weight, eps)  # type: ignore[no-any-return]


@LIBRARY.op(
    "rms_norm(Tensor x, Tensor weight, float eps=1e-6) -> Tensor",
    shape=like("x"),
    backward=_rms_norm_backward,
    hints=last_dim_hint(("x",), ("weight",)),
    row_strided=("x",),  # vLLM's q/k-norm: per-head views of query and key sliced out of qkv
    rows=("x",),
)
def rms_norm(x: Any, weight: Any, eps: float = 1e-6) -> Any:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``."""
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * r * weight


@LIBRARY.op(
    "rms_norm_backward(Tensor grad, Tensor x, Tensor weight, float eps=1e-6) -> (Tensor, Tensor)",
    shape=like("x", "weight"),
    tolerances={"float32": (1e-4, 1e-5), "float16": (1e-2, 1e-2), "bfloat16": (5e-2, 5e-2)},
    hints=last_dim_hint(("grad", "x"), ("weight",)),
)
def rms_norm_backward(grad: Any, x: Any, weight: Any, eps: float = 1e-6) -> tuple[Any, Any]:
    """Gradients of :func:`rms_norm` with respect to ``x`` and ``weight``."""
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    xhat = x * r
    gx = grad * weight
    dx = r * (gx - xhat * np.mean(gx * xhat, axis=-1, keepdims=True))
    dw = np.sum(grad * xhat, axis=tuple(range(x.ndim - 1)))  # over every row; also for 0 columns
    return dx, dw

