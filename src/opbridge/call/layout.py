"""Memory layouts of tensors, framework-free: which bytes a tensor's elements take.

Two tensors sharing an element (:func:`shares_memory`, exact with strides), one tensor whose
elements share memory (:func:`self_overlaps`), rows at a stride (:func:`byte_rows`,
:func:`row_strided`) and the check of a tensor an op writes (:func:`written_check`).
:mod:`opbridge.call.overlap` decides from these what a call may do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opbridge.declare import OpDef


class _Interface:
    """An array interface over memory nothing reads: :func:`shares_memory`'s view of a tensor."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> None:
        self.__array_interface__ = {"data": (address, True), "shape": shape, "strides": strides,
                                    "typestr": f"|V{itemsize}", "version": 3}


ByteRows = tuple[int, int, int, int]


def byte_rows(address: int, shape: Sequence[int], strides: Sequence[int], itemsize: int) -> ByteRows | None:
    """A tensor's memory as ``(begin, rows, bytes per row, bytes between rows)`` when it is contiguous
    or rows at a stride (*strides* in bytes; :func:`row_strided`), else None: ``opbridge::rows::of``
    (``include/opbridge/byte_rows.h``), which the kernels' checks and the C entries use."""
    row = itemsize
    for k in range(len(shape) - 1, 0, -1):
        if shape[k] != 1 and strides[k] != row:
            return None
        row *= shape[k]
    n = shape[0] if shape else 1
    if n <= 1 or row == 0 or strides[0] == row:
        return address, 1, n * row, n * row
    if strides[0] < row:
        return None
    return address, n, row, strides[0]


def rows_meet(a: ByteRows, b: ByteRows) -> bool:
    """Whether two :func:`byte_rows` share a byte (``opbridge::rows::meet``): O(1) at equal row steps."""
    (a0, an, ab, astep), (b0, bn, bb, bstep) = a, b
    if ab == 0 or bb == 0 or a0 + (an - 1) * astep + ab <= b0 or b0 + (bn - 1) * bstep + bb <= a0:
        return False
    if an == 1 and bn == 1:
        return True
    if astep == bstep:  # row i of a meets row j of b iff -bb < d + (j - i) step < ab
        d = b0 - a0
        k = max((-bb - d) // astep + 1, -(an - 1))
        return k <= bn - 1 and d + k * astep < ab
    if an > bn:
        (a0, an, ab, astep), (b0, bn, bb, bstep) = b, a
    for i in range(an):
        start = a0 + i * astep
        if max((start - bb - b0) // bstep + 1, 0) <= min(-((b0 - start - ab) // bstep) - 1, bn - 1):
            return True
    return False


def shares_memory(describe: Callable[[Any], tuple[int, tuple[int, ...], tuple[int, ...], int]],
                  ) -> Callable[[Any, Any], bool]:
    """An exact test of whether two tensors share an element of memory, strides included.

    *describe* gives a tensor's ``(address, shape, byte strides, itemsize)``.
    Two tensors that are each contiguous or rows at a stride (vLLM's ``query``
    and ``key`` slices of one ``qkv``) are compared by arithmetic
    (:func:`rows_meet`); other layouts by ``numpy.shares_memory`` over array
    interfaces built from them (nothing is read or copied, so the address may
    be a device's). A case too hard for it within its work bound counts as
    overlapping.
    """
    import numpy as np

    too_hard = getattr(np, "exceptions", np).TooHardError

    def test(a: Any, b: Any) -> bool:
        da, db = describe(a), describe(b)
        ra, rb = byte_rows(*da), byte_rows(*db)
        if ra is not None and rb is not None:
            return rows_meet(ra, rb)
        va, vb = (np.asarray(_Interface(*d)) for d in (da, db))
        try:
            # a bound on the candidates it tries (the stubs know only -1 and 0; any count is valid)
            return bool(np.shares_memory(va, vb, max_work=1 << 20))  # type: ignore[arg-type]
        except too_hard:
            return True

    return test


def ndarray_layout(a: Any) -> tuple[int, tuple[int, ...], tuple[int, ...], int]:
    """An ndarray's ``(address, shape, byte strides, itemsize)``, as :func:`shares_memory` takes it."""
    return a.__array_interface__["data"][0], a.shape, a.strides, a.itemsize


#: Whether two ndarrays share an element (NumPy's arrays, MindSpore's host views): the alias check's verdict.
NDARRAY_SHARES = shares_memory(ndarray_layout)


Layout = tuple[int, tuple[int, ...], tuple[int, ...], int]

#: Elements of a layout whose byte offsets :func:`self_overlaps` lists and sorts, where no nesting of its
#: dims shows them apart; a larger one (no view NumPy or a framework makes) counts as overlapping.
SELF_OVERLAP_WORK = 1 << 22


def self_overlaps(address: int, shape: Sequence[int], strides: Sequence[int], itemsize: int) -> bool:
    """Whether two elements of a tensor share a byte: a broadcast (stride 0) dim, rows closer than their
    width, any layout some of whose elements meet (*strides* in bytes, as :func:`shares_memory`'s
    *describe* gives them). A kernel that writes such a tensor (through a dense copy: one result per
    element) would leave whichever element it wrote last.

    Dims sorted by stride, each one's stride at least the reach of those below it, are apart (every
    C-contiguous, transposed, sliced or row-strided layout): no element is listed. Other layouts are
    decided by their elements' sorted byte offsets, up to :data:`SELF_OVERLAP_WORK` elements.
    """
    if 0 in shape:
        return False
    dims = sorted(zip(map(abs, strides), shape))
    reach = itemsize  # bytes one block of the dims so far spans
    for s, n in dims:
        if n != 1:
            if s < reach:
                break
            reach += s * (n - 1)
    else:
        return False
    dims = [(s, n) for s, n in dims if n != 1]
    if dims[0][0] == 0 or math.prod(n for _, n in dims) > SELF_OVERLAP_WORK:
        return True
    import numpy as np

    offsets = np.zeros(1, np.int64)
    for s, n in dims:
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * s).ravel()
    offsets.sort()
    return bool((np.diff(offsets) < itemsize).any())


#: ``check(op, what, tensor)``: raise ValueError, naming *op* and *what* (``"argument 'x'"``, ``"out[1]"``),
#: where the op cannot write *tensor* (:func:`written_check`).
WrittenCheck = Callable[["OpDef", str, Any], None]


def written_check(describe: Callable[[Any], Layout], writable: Callable[[Any], bool] | None = None) -> WrittenCheck:
    """The check of a tensor an op writes through a dense copy (a strided mutated argument, an ``out=``
    buffer), run before any kernel does: read-only (where *writable* says so: NumPy's flag, a broadcast
    array's too), or elements that share memory (:func:`self_overlaps` of *describe*'s layout). The
    copy itself would take either, and the copy back fail, or keep one result per shared element, after
    the kernel wrote the call's other tensors. A dense tensor needs no check: it cannot overlap itself,
    and a read-only one fails the kernel's argument conversion before anything runs."""
    def check(op: OpDef, what: str, t: Any) -> None:
        if writable is not None and not writable(t):
            raise ValueError(f"{op.name}: {what} is read-only, and {op.name} writes it")
        if self_overlaps(*describe(t)):
            raise ValueError(f"{op.name}: {what} has elements that share memory (a broadcast or overlapping "
                             f"view), and {op.name} writes it; pass a tensor whose elements are apart (a copy)")

    return check


def _ndarray_writable(a: Any) -> bool:
    return bool(a.flags.writeable)


def _ndarray_strides(a: Any) -> Layout:
    return 0, a.shape, a.strides, a.itemsize  # no address: :func:`self_overlaps` needs none (0.9 µs to read)


#: :func:`written_check` of an ndarray (NumPy's arrays, MindSpore's host views): its flag, its strides.
NDARRAY_WRITTEN = written_check(_ndarray_strides, _ndarray_writable)


def dense_ndarray(a: Any) -> Any:
    """A new C-contiguous ndarray of *a*'s shape and dtype (``empty_like`` would keep *a*'s strides)."""
    import numpy as np

    return np.empty(a.shape, a.dtype)


def accepted_rows(address: int, shape: Sequence[int], strides: Sequence[int], itemsize: int) -> ByteRows | None:
    """:func:`byte_rows` of a tensor a kernel takes as an argument its op declares ``row_strided``
    (``opbridge::rows::accepts``): contiguous, or of at least two dims (a kernel's rows lie within the
    dims after the first); None for any other layout (*strides* in bytes)."""
    rows = byte_rows(address, shape, strides, itemsize)
    return rows if rows is not None and (rows[1] == 1 or len(shape) >= 2) else None


def row_strided(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a tensor of *shape* and element *strides* is rows at a stride, as a kernel takes an
    argument its op declares ``row_strided`` (``opbridge::row_stride``): contiguous, or of at least
    two dims, those after the first C-contiguous (dims of size 1 have any stride), the first any
    stride at least that block apart (:func:`accepted_rows`). Negative strides and overlapping rows
    are not."""
    return accepted_rows(0, shape, strides, 1) is not None


def ndarray_rows(a: Any) -> bool:
    """:func:`row_strided` of a ``numpy.ndarray`` (or a host view): whether a kernel takes it as rows."""
    size = a.itemsize
    if any(s % size for s in a.strides):
        return False
    return row_strided(a.shape, [s // size for s in a.strides])
