"""Comparing an op's outputs with a reference, with per-dtype tolerances.

:func:`assert_close` accepts NumPy arrays and PyTorch tensors (and anything
``numpy.asarray`` understands), compares them in float64 and, on failure,
raises an :class:`AssertionError` that says where and by how much they differ.
Importing this module imports no framework.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opbridge.declare import TOLERANCES as _DECLARED_TOLERANCES

__all__ = ["TOLERANCES", "assert_close", "dtype_name", "to_numpy"]

#: Default comparison tolerances per dtype, ``{dtype name: (rtol, atol, reason)}``: the one
#: table, :data:`opbridge.declare.TOLERANCES` (the same object), which
#: :meth:`opbridge.OpDef.tolerance` falls back to and whose reasons say why each value is
#: what it is. An element passes when ``|actual - expected| <= atol + rtol * |expected|``.
TOLERANCES = _DECLARED_TOLERANCES

_MAX_SHOWN = 5


def dtype_name(x: Any) -> str:
    """The dtype of array *x* as a plain name (``"float32"``, ``"bfloat16"``, ...).

    Works for NumPy arrays, PyTorch tensors and anything with a ``dtype``;
    Python scalars and lists give ``"float64"`` / NumPy's name for them.
    """
    dt = getattr(x, "dtype", None)
    if dt is None:
        return str(np.asarray(x).dtype)
    name = getattr(dt, "name", None)
    if isinstance(name, str):
        return name
    text = str(dt)
    return text.rpartition(".")[2]  # torch.float32 -> float32


def to_numpy(x: Any) -> np.ndarray:
    """Host NumPy copy (or view) of array *x*.

    PyTorch tensors are detached and moved to the CPU; 16-bit floating
    tensors (which NumPy cannot always hold, e.g. bfloat16) are widened to
    float32 first, which is exact.
    """
    if type(x).__module__.partition(".")[0] == "torch":
        t = x.detach()
        if t.dtype.is_floating_point and t.element_size() == 2:
            t = t.float()
        return np.asarray(t.cpu().numpy())
    return np.asarray(x)


def _fmt_index(idx: tuple[Any, ...]) -> str:
    return "[" + ", ".join(str(int(i)) for i in idx) + "]"


def assert_close(
    actual: Any,
    expected: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    dtype: str | None = None,
    name: str = "output",
) -> None:
    """Check that *actual* matches *expected* elementwise within tolerances.

    Both are converted to float64 NumPy arrays and must have the same shape
    (no broadcasting). An element passes when
    ``|actual - expected| <= atol + rtol * |expected|``, when both are NaN,
    or when both are the same infinity.

    Parameters
    ----------
    actual, expected
        NumPy arrays, PyTorch tensors or array-likes.
    rtol, atol
        Tolerances; each one not given comes from :data:`TOLERANCES` for
        *dtype* (``(0, 0)``, i.e. exact, for dtypes not in the table).
    dtype
        Dtype name used to pick default tolerances; default: *actual*'s dtype.
    name
        What is compared, used in the failure message.

    Raises
    ------
    AssertionError
        On a shape mismatch, or when any element differs. The message gives
        the shapes, how many elements mismatch out of how many, the first
        (up to 5) bad indices with actual/expected/absolute difference, the
        largest absolute and relative errors, and the NaN/Inf counts of both.
    """
    dname = dtype if dtype is not None else dtype_name(actual)
    default_rtol, default_atol, _ = TOLERANCES.get(dname, (0.0, 0.0, ""))
    rtol = default_rtol if rtol is None else float(rtol)
    atol = default_atol if atol is None else float(atol)

    a = to_numpy(actual)
    e = to_numpy(expected)
    if a.shape != e.shape:
        raise AssertionError(
            f"{name}: shape mismatch: actual has shape {tuple(a.shape)}, "
            f"expected {tuple(e.shape)} ({dname})"
        )
    try:
        a = a.astype(np.float64)
        e = e.astype(np.float64)
    except (TypeError, ValueError) as exc:
        raise AssertionError(
            f"{name}: cannot compare values of dtype {a.dtype} with {e.dtype}: {exc}"
        ) from None

    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a - e)
        ok = diff <= atol + rtol * np.abs(e)
        ok |= np.isnan(a) & np.isnan(e)
        ok |= np.isinf(a) & (a == e)
    if ok.all():
        return

    bad = np.argwhere(~ok)
    total = a.size
    lines = [
        f"{name}: {len(bad)} of {total} elements mismatch "
        f"({dname}, rtol={rtol:g}, atol={atol:g}; shape {tuple(a.shape)})",
        f"  first bad {'index' if min(len(bad), _MAX_SHOWN) == 1 else 'indices'}:",
    ]
    for idx in bad[:_MAX_SHOWN]:
        t = tuple(int(i) for i in idx)
        lines.append(
            f"    {_fmt_index(t)}: actual={float(a[t])!r} expected={float(e[t])!r} "
            f"abs diff={float(diff[t])!r}"
        )
    finite = np.isfinite(a) & np.isfinite(e)
    if finite.any():
        fd = np.where(finite, diff, 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(finite, fd / np.abs(e), 0.0)
        rel = np.where(finite & (fd == 0), 0.0, rel)  # 0/0
        ia = np.unravel_index(int(np.argmax(fd)), a.shape)
        ir = np.unravel_index(int(np.argmax(rel)), a.shape)
        lines.append(
            f"  max abs error: {fd[ia]:.6g} at {_fmt_index(ia)}; "
            f"max rel error: {rel[ir]:.6g} at {_fmt_index(ir)} (over elements finite in both)"
        )
    else:
        lines.append("  max abs error: n/a (no element is finite in both)")
    lines.append(
        f"  NaN: actual {int(np.isnan(a).sum())}, expected {int(np.isnan(e).sum())}; "
        f"Inf: actual {int(np.isinf(a).sum())}, expected {int(np.isinf(e).sum())}"
    )
    raise AssertionError("\n".join(lines))
