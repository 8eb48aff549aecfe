"""Test values placed in memory the way callers place them: :class:`Memory` and its layouts.

A :class:`Memory` makes, for one framework (its harness) and device, the
view an op is called with inside a larger buffer filled with a sentinel: at
an odd element offset (no vector alignment), every other element, padded
rows, column-major, reversed rows (NumPy), a broadcast row (stride 0) or
read-only (NumPy). After the call it checks that nothing outside the view
was written. NumPy and torch take any of them through ``as_strided``; Paddle
and MindSpore take slices of a wider last dimension; JAX arrays have no
layout. :mod:`opbridge.testing.fuzz` draws from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["READ_LAYOUTS", "WRITE_LAYOUTS", "Memory", "Placed", "np_dtype", "rounded"]

#: Layouts of an argument an op reads; the ones it writes (mutated arguments, ``out=``) take
#: every layout but the read-only and broadcast ones.
READ_LAYOUTS = ("contiguous", "offset", "every_other", "padded_rows", "column_major", "reversed",
                "broadcast", "readonly")
WRITE_LAYOUTS = ("contiguous", "offset", "every_other", "padded_rows", "column_major", "reversed")
#: The layouts each framework's views can take: any strides (NumPy; torch has no negative ones),
#: slices of a wider last dimension (Paddle, MindSpore); JAX's arrays have none.
_FRAMEWORK_LAYOUTS = {
    "numpy": READ_LAYOUTS,
    "torch": tuple(x for x in READ_LAYOUTS if x != "reversed"),
    "paddle": ("contiguous", "every_other", "padded_rows"),
    "mindspore": ("contiguous", "every_other", "padded_rows"),
}
_FILL = -777.0  # the fill around views of float buffers (NaN would hide a kernel's NaN)
_INT_FILL = -7


def np_dtype(name: str) -> np.dtype[Any]:
    """NumPy's dtype for an opbridge dtype name (bfloat16 from ``ml_dtypes``, as JAX spells it)."""
    if name == "bfloat16":
        import ml_dtypes

        bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
        return bf16
    return np.dtype(name)


def rounded(w: Any, dtype: str) -> np.ndarray:
    """A float64 reference value rounded to *dtype* and back (integers as they are)."""
    w = np.asarray(w)
    if w.dtype.kind != "f":
        same: np.ndarray = w
        return same
    with np.errstate(over="ignore", invalid="ignore"):
        out: np.ndarray = w.astype(np_dtype(dtype)).astype(np.float64)
    return out


@dataclass
class Placed:
    """One tensor argument (or ``out=``) as placed in memory: the view the op gets, inside its buffer."""

    name: str
    layout: str
    view: Any
    buffer: Any = None  # the whole buffer the view lives in (None: the view is the whole array)
    footprint: np.ndarray | None = None  # which (flattened) buffer elements the view covers
    before: np.ndarray | None = None  # the buffer's contents before the call, widened


def _layout_spec(shape: tuple[int, ...], layout: str) -> tuple[int, tuple[int, ...], int]:
    """(element offset, element strides, buffer length) of a view of *shape* in *layout*."""
    n = int(np.prod(shape)) if shape else 1
    nd = len(shape)
    c = [1] * nd
    for i in range(nd - 2, -1, -1):
        c[i] = c[i + 1] * max(shape[i + 1], 1)
    if layout in ("contiguous", "readonly"):
        return 0, tuple(c), n
    if layout == "offset":
        return 1, tuple(c), n + 2
    if layout == "every_other":
        return 0, tuple(2 * s for s in c), 2 * n + 1
    if layout == "padded_rows":  # a slice of a wider row-major buffer: contiguous rows, row stride > width
        wide = (*shape[:-1], shape[-1] + 3)
        w = [1] * nd
        for i in range(nd - 2, -1, -1):
            w[i] = w[i + 1] * wide[i + 1]
        return 0, tuple(w), int(np.prod(wide))
    if layout == "column_major":
        f = [1] * nd
        for i in range(1, nd):
            f[i] = f[i - 1] * max(shape[i - 1], 1)
        return 0, tuple(f), n
    s = list(c)
    if layout == "reversed":  # rows in reverse order: a negative stride on the first axis
        s[0] = -c[0]
        return (shape[0] - 1) * c[0], tuple(s), n
    if layout == "broadcast":  # every row is the first one (stride 0 on the first axis)
        s[0] = 0
        return 0, tuple(s), max(c[0], 1)
    raise ValueError(f"unknown layout {layout!r}")


class Memory:
    """Places test values for one framework's harness (:mod:`opbridge.testing.harness`) on *device*."""

    def __init__(self, harness: Any, device: str = "cpu") -> None:
        self.h = harness
        self.framework = harness.name
        self.device = device
        self.layouts = _FRAMEWORK_LAYOUTS.get(self.framework, ("contiguous",))
        self.strided = self.framework in ("numpy", "torch")

    def array(self, a: np.ndarray, dtype: str | None) -> Any:
        """*a* (cast to float *dtype*) as a contiguous array of the framework, on the device."""
        x = self.h.from_numpy(a, dtype)
        return x.to(self.device) if self.framework == "torch" else x

    def np64(self, x: Any) -> np.ndarray:
        """A framework array as NumPy, floats widened to float64 (a copy)."""
        a = self.h.to_numpy(x)
        return a.astype(np.float64) if a.dtype.kind in "fV" or a.dtype.name == "bfloat16" else np.array(a, copy=True)

    def usable(self, layout: str, shape: tuple[int, ...]) -> bool:
        """Whether a view of *shape* can take *layout* in this framework."""
        if layout not in self.layouts:
            return False
        if layout in ("contiguous", "offset"):
            return True
        if not shape or 0 in shape:
            return layout == "readonly"
        if layout in ("padded_rows", "every_other", "readonly"):
            return True
        if layout == "column_major":
            return len(shape) >= 2 and shape[-1] > 1 and shape[-2] > 1
        return layout in ("reversed", "broadcast") and shape[0] > 1

    def place(self, name: str, values: np.ndarray, dtype: str | None, layout: str) -> Placed:
        """*values* (floats cast to *dtype*) as a view in *layout*, inside a buffer filled with a sentinel."""
        shape = tuple(values.shape)
        if layout == "broadcast":
            values = np.broadcast_to(values[:1], shape)
        if layout == "contiguous":
            return Placed(name, layout, self.array(np.array(values, copy=True), dtype))
        if not self.strided:
            return self._sliced(name, values, dtype, layout)
        offset, strides, length = _layout_spec(shape, layout)
        np_dt = np_dtype(dtype) if dtype is not None else values.dtype
        fill = _FILL if np_dt.kind in "fV" or dtype == "bfloat16" else (True if np_dt.kind == "b" else _INT_FILL)
        footprint = np.zeros(length, bool)
        if length and int(np.prod(shape)):
            index = np.lib.stride_tricks.as_strided(np.arange(length)[offset:], shape, [s * 8 for s in strides])
            footprint[index.ravel()] = True
        if self.framework == "numpy":
            buf = np.full(length, fill, dtype=np_dt)
            at = [s * buf.itemsize for s in strides]
            np.lib.stride_tricks.as_strided(buf[offset:], shape, at)[...] = values.astype(np_dt)
            view = np.lib.stride_tricks.as_strided(buf[offset:], shape, at,
                                                   writeable=layout not in ("broadcast", "readonly"))
            return Placed(name, layout, view, buf, footprint, self.np64(buf))
        import torch

        tdt = getattr(torch, dtype) if dtype is not None else torch.from_numpy(values[:0].copy()).dtype
        tbuf = torch.full((length,), fill, dtype=tdt, device=self.device)
        tview = torch.as_strided(tbuf, shape, strides, offset)
        src = torch.from_numpy(np.ascontiguousarray(values)).to(device=self.device, dtype=tdt)
        if layout == "broadcast":  # as_strided gives a writable view with overlapping rows: write row 0 once
            tview[:1].copy_(src[:1])
        else:
            tview.copy_(src)
        return Placed(name, layout, tview, tbuf, footprint, self.np64(tbuf))

    def _sliced(self, name: str, values: np.ndarray, dtype: str | None, layout: str) -> Placed:
        """*values* as a slice of a wider last dimension of a framework tensor (its own basic indexing)."""
        n = values.shape[-1]
        width = 2 * n if layout == "every_other" else n + 3
        cols = slice(0, 2 * n, 2) if layout == "every_other" else slice(0, n)
        wide = np.full((*values.shape[:-1], width), _FILL if values.dtype.kind == "f" else _INT_FILL, values.dtype)
        wide[..., cols] = values
        buf = self.array(wide, dtype)
        footprint = np.zeros(wide.shape, bool)
        footprint[..., cols] = True
        view = buf[..., ::2] if layout == "every_other" else buf[..., :n]
        return Placed(name, layout, view, buf, footprint.ravel(), self.np64(buf).ravel())

    def check_around(self, p: Placed, what: str) -> None:
        """Raise AssertionError if a buffer element outside *p*'s view changed."""
        if p.buffer is None or p.footprint is None or p.before is None:
            return
        now = self.np64(p.buffer).ravel()
        changed = ~p.footprint & (now != p.before) & ~(np.isnan(now) & np.isnan(p.before))
        if changed.any():
            first = int(np.flatnonzero(changed)[0])
            raise AssertionError(f"{what} '{p.name}' ({p.layout}): {int(changed.sum())} element(s) of its buffer "
                                 f"outside the view were written (first at buffer element {first}: "
                                 f"{p.before[first]!r} -> {now[first]!r})")

    def shared(self, values: list[np.ndarray], dtype: str, shift: int) -> list[Any] | None:
        """Views of one buffer: ``values[0]`` at element 0, each next one *shift* elements on (overlapping).

        None where the framework's reshape of a slice copies instead of viewing.
        """
        n = values[0].size
        flat = np.zeros(n + shift * (len(values) - 1), np.float64)
        flat[:n] = values[0].ravel()
        buf = self.place("shared", flat, dtype, "offset" if self.strided else "contiguous").view
        views = [buf[k * shift:k * shift + n].reshape(values[0].shape) for k in range(len(values))]
        apart = self.h.data_ptr(views[-1]) - self.h.data_ptr(views[0])
        return views if apart == shift * (len(values) - 1) * np_dtype(dtype).itemsize else None

    def side_by_side(self, a: np.ndarray, b: np.ndarray, dtype: str) -> tuple[Any, Any, Placed]:
        """*a* and *b* (one shape) as column blocks ``[..., :n]`` and ``[..., n:2n]`` of one buffer.

        The views' byte spans interleave row by row, but they share no element:
        the ``query`` and ``key`` slices of one ``qkv`` tensor. The buffer's last
        column holds the sentinel; the returned :class:`Placed` checks it.
        """
        n = a.shape[-1]
        wide = np.full((*a.shape[:-1], 2 * n + 1), _FILL, np.float64)
        wide[..., :n], wide[..., n:2 * n] = a, b
        buf = self.array(wide, dtype)
        footprint = np.zeros(wide.shape, bool)
        footprint[..., :2 * n] = True
        whole = Placed("the buffer of both", "side_by_side", buf, buf, footprint.ravel(), self.np64(buf).ravel())
        return buf[..., :n], buf[..., n:2 * n], whole

