"""References and the shape rule of the ops declared in ``activation.yaml``."""

from __future__ import annotations

from typing import Any

import numpy as np
from opbridge import Spec


def silu_and_mul_shape(x: Any) -> Spec:
    """``x`` is ``(..., 2d)``; the output is ``(..., d)``."""
    return Spec((*x.shape[:-1], x.shape[-1] // 2), x.dtype)


def _split(x: Any) -> tuple[Any, Any]:
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


def silu_and_mul(x: Any) -> Any:
    """SwiGLU's gate: ``silu(a) * b`` for ``x = [a, b]`` split in halves along the last dim.

    Parameters
    ----------
    x
        ``(..., 2d)`` floating tensor.

    Returns
    -------
    Tensor
        ``(..., d)``.
    """
    a, b = _split(x)
    return a / (1.0 + np.exp(-a)) * b


def silu_and_mul_backward(grad: Any, x: Any) -> Any:
    """Gradient of :func:`silu_and_mul` with respect to ``x``, given the output's gradient ``grad``.

    Parameters
    ----------
    grad
        ``(..., d)``.
    x
        ``(..., 2d)``, the forward's input.

    Returns
    -------
    Tensor
        ``(..., 2d)``.
    """
    a, b = _split(x)
    s = 1.0 / (1.0 + np.exp(-a))
    return np.concatenate([grad * b * s * (1.0 + a * (1.0 - s)), grad * a * s], axis=-1)
