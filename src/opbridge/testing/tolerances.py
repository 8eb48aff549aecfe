"""How close a result must be to its reference: the op's declared tolerance, grown for reductions.

One rule for every comparison opbridge makes (``check_op``, ``fuzz_op``, the
benchmarks' verification): a result smaller than the op's lead input (a
weight gradient of shape ``(H,)`` from ``x`` of ``(R, H)``) sums over
``R`` rows, and its rounding error grows with that.
"""

from __future__ import annotations

import math
from typing import Any


def reduction_length(result_numel: int, lead_numel: int) -> int:
    """How many input elements each element of a result sums over, at least: ``lead / result``.

    A result smaller than the op's lead input (a weight gradient of shape
    ``(H,)`` from ``x`` of ``(R, H)``) is a sum over ``R`` rows; a result of
    the lead input's size reduces over nothing more than the op's own
    tolerance already covers (1).
    """
    if result_numel <= 0:
        return 1
    return max(1, lead_numel // result_numel)


def reduction_tolerance(rtol: float, atol: float, n: int) -> tuple[float, float]:
    """Tolerances for a result summed over *n* terms: both grow with ``sqrt(n)``.

    Rounding errors of a sum of *n* terms of random sign grow like
    ``sqrt(n)`` (``n`` in the worst case, which blocked and tree-shaped GPU
    reductions do not approach); the sum's own magnitude grows like
    ``sqrt(n)`` too, so the absolute tolerance, which covers the elements
    that cancel to near zero, grows alike.
    """
    g = math.sqrt(max(1, n))
    return rtol * g, atol * g


def numel(x: Any) -> int:
    """Elements of an array (1 for a scalar)."""
    return int(math.prod(tuple(x.shape))) if hasattr(x, "shape") else 1


def result_tolerance(op: Any, dtype: str, result: Any, lead: Any) -> tuple[float, float]:
    """``(rtol, atol)`` for *op*'s *result* of *dtype* against its reference, *lead* being the call's
    dispatching tensor: the op's tolerance, grown by :func:`reduction_tolerance` for a smaller result."""
    rtol, atol = op.tolerance(dtype)
    return reduction_tolerance(rtol, atol, reduction_length(numel(result), numel(lead)))
