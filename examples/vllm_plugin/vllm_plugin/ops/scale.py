"""scale_: multiply a tensor by a scalar, in place (kernel: csrc/scale.cc)."""

from __future__ import annotations

from typing import Any

from vllm_plugin.ops._library import LIBRARY


@LIBRARY.op("scale_(Tensor(a!) x, float alpha) -> ()")
def scale_(x: Any, alpha: float) -> None:
    """Multiply ``x`` by ``alpha`` in place.

    Parameters
    ----------
    x
        Floating tensor, contiguous; overwritten with ``x * alpha``.
    alpha
        The factor.
    """
    x *= alpha
