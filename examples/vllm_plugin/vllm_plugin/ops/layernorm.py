"""fused_add_rms_norm: residual add + RMSNorm, in place (kernel: csrc/layernorm.cc)."""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_plugin.ops._library import LIBRARY


@LIBRARY.op(
    "fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps=1e-6) -> ()",
    tolerances={"float32": (1e-5, 1e-5)},
)
def fused_add_rms_norm(x: Any, residual: Any, weight: Any, eps: float = 1e-6) -> None:
    """Add ``x`` into ``residual``, then RMS-normalise the sum into ``x``, both in place.

    Parameters
    ----------
    x
        ``(..., H)``; overwritten with ``rms_norm(x + residual) * weight``.
    residual
        Same shape and dtype as ``x``; overwritten with ``x + residual``.
    weight
        ``(H,)``, the same dtype.
    eps
        Added to the mean square before the square root.
    """
    total = x + residual
    residual[...] = total
    x[...] = total / np.sqrt(np.mean(total * total, axis=-1, keepdims=True) + eps) * weight
