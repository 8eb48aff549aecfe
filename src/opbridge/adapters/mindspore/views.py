"""MindSpore tensors as kernel arguments, and new outputs, without a copy or a per-tensor wait.

MindSpore's own export (``Tensor.to_dlpack``) costs 0.5-1 ms per tensor on
the CPU whatever its size (measured: 484 µs at best, 6.6 ms median on a
loaded 2-core machine, against 1.2 µs for a pipeline sync), which made a
PyNative call 1.5-3x the NumPy call at (1024, 4096). So a CPU tensor is
handed to the kernel as a NumPy view of its memory instead (address from
``data_ptr()``, which already includes the storage offset; strides from
``stride()``), after one wait for MindSpore's queued work per call
(:func:`sync`). NumPy has no bfloat16: a bfloat16 tensor is viewed as
uint16, and the DLPack tensor NumPy exports for it is relabelled bfloat16
before tvm-ffi imports it. New outputs are NumPy buffers shared with a
MindSpore tensor (``Tensor.from_numpy``; bfloat16 ones ``ml_dtypes``
arrays where it is installed, see :func:`alloc`), so results are MindSpore
tensors in the memory the kernel wrote.

Only CPU tensors are viewed: a tensor on another device (GPU, Ascend)
raises :class:`NotOnHostError`, which the caller turns into an error naming op,
framework and device, so a CPU kernel never receives a device pointer.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor
from mindspore.graph.api import _pynative_executor

from opbridge._tvm import bfloat16_tensor
from opbridge.call import memory
from opbridge.call.layout import row_strided

#: MindSpore dtype -> NumPy dtype of a view of its memory (bfloat16 as its bits)
NUMPY: dict[Any, np.dtype[Any]] = {
    ms.float32: np.dtype(np.float32),
    ms.float16: np.dtype(np.float16),
    ms.float64: np.dtype(np.float64),
    ms.bfloat16: np.dtype(np.uint16),
    ms.int8: np.dtype(np.int8),
    ms.int16: np.dtype(np.int16),
    ms.int32: np.dtype(np.int32),
    ms.int64: np.dtype(np.int64),
    ms.uint8: np.dtype(np.uint8),
    ms.bool_: np.dtype(np.bool_),
}

#: Wait for every queued MindSpore op (1.2 µs when nothing is queued).
sync = _pynative_executor.sync


class NotOnHostError(Exception):
    """A tensor argument lives on a device (GPU, Ascend) that the CPU kernel cannot read."""

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.device = device


class _Interface:
    """Carries an ``__array_interface__``: the cheapest way to make NumPy view foreign memory."""

    __slots__ = ("__array_interface__",)

    def __init__(self, interface: dict[str, Any]) -> None:
        self.__array_interface__ = interface


def host_view(t: Tensor) -> np.ndarray:
    """A NumPy view of CPU tensor *t*'s memory (bfloat16 as uint16); raises :class:`NotOnHostError` otherwise.

    The caller waits for MindSpore's queued work first (:func:`sync`) and
    keeps *t* alive while the view is used. A tensor made with ``init=`` gets
    its memory here (``init_data``). A dtype NumPy cannot view raises ``KeyError``.
    """
    if t.has_init:
        t.init_data()
    device = t.device
    if device != "CPU":
        raise NotOnHostError(str(device))
    npd = NUMPY[t.dtype]
    shape = tuple(t.shape)
    strides = None if t.is_contiguous() else tuple(s * npd.itemsize for s in t.stride())
    return np.asarray(_Interface({"data": (t.data_ptr(), False), "shape": shape, "typestr": npd.str,
                                  "strides": strides, "version": 3}))


def kernel_arg(t: Tensor) -> Any:
    """CPU tensor *t* as a kernel argument (a NumPy view; bfloat16 relabelled); see :func:`host_view`."""
    view = host_view(t)
    return bfloat16_tensor(view) if t.dtype == ms.bfloat16 else view


def relabel(view: np.ndarray, dtype: Any) -> Any:
    """A (possibly dense-copied) view of a tensor of MindSpore *dtype*, as a kernel argument."""
    return bfloat16_tensor(view) if dtype == ms.bfloat16 else view


@functools.cache
def _numpy_bfloat16() -> np.dtype[Any] | None:
    """``ml_dtypes.bfloat16`` (NumPy's bfloat16 where ml_dtypes is installed), else None."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return bf16


def alloc(shape: Sequence[int], dtype: Any) -> tuple[Tensor, Any]:
    """A new MindSpore tensor of *shape* and *dtype*, and the kernel argument aliasing its memory.

    A bfloat16 output is an ``ml_dtypes.bfloat16`` NumPy buffer, which
    ``Tensor.from_numpy`` shares as it is. Without ml_dtypes it is a uint16
    buffer relabelled by ``Tensor.view(bfloat16)``, which MindSpore runs as a
    copy: 0.6-0.9 ms at (1024, 4096), the whole difference between the
    bfloat16 and float16 calls.
    """
    npd = NUMPY.get(dtype)
    if npd is None:
        raise TypeError(f"opbridge: cannot allocate a MindSpore output of dtype {dtype}")
    buf = memory.empty_ndarray(tuple(shape), npd)
    return share(buf, dtype), (bfloat16_tensor(buf) if dtype == ms.bfloat16 else buf)


def share(buf: np.ndarray, dtype: Any) -> Tensor:
    """A MindSpore tensor of *dtype* on NumPy buffer *buf*, which has its host view's dtype (bfloat16 as
    uint16; see :func:`alloc`)."""
    if dtype == ms.bfloat16:
        bf16 = _numpy_bfloat16()
        return Tensor.from_numpy(buf.view(bf16)) if bf16 is not None else Tensor.from_numpy(buf).view(ms.bfloat16)
    return Tensor.from_numpy(buf)


@functools.cache
def _new_dtypes() -> dict[int, np.dtype[Any]]:
    """TypeCode (:func:`opbridge.call.c_entry.dl_code`) -> the NumPy dtype of a new output's buffer, for
    every dtype :func:`new_tensor` makes (bfloat16 only with ml_dtypes: see :func:`alloc`)."""
    from opbridge.adapters.mindspore.support import dtype_name
    from opbridge.call.c_entry import dl_code

    found = {dl_code(dtype_name(d)): npd for d, npd in NUMPY.items() if d != ms.bfloat16}
    bf16 = _numpy_bfloat16()
    if bf16 is not None:
        found[dl_code("bfloat16")] = bf16
    return found


def new_tensor(shape: tuple[int, ...], code: int) -> Tensor | None:
    """A new contiguous CPU tensor for the tensor C entry (:mod:`opbridge.call.exchange`): *code* its
    TypeCode; None for a dtype made only on the Python path. The entry makes outputs below the pool's
    threshold only, so the buffer is NumPy's own."""
    npd = _new_dtypes().get(code)
    return None if npd is None else Tensor.from_numpy(np.empty(shape, npd))


def span(t: Tensor) -> tuple[int, int]:
    """``(start, end)`` byte addresses of *t*'s memory, for the alias check of mutating ops."""
    p = int(t.data_ptr())
    return p, p + int(t.nbytes)


def rows(t: Tensor) -> bool:
    """Whether a kernel takes *t* as rows at a stride, where its op declares it ``row_strided``."""
    return row_strided(tuple(t.shape), t.stride())


def dense_copy(t: Tensor) -> Tensor:
    """A new contiguous CPU tensor holding strided *t*'s values, through NumPy (MindSpore's own
    ``contiguous()`` and a wait for it took 108 us here); raises as :func:`host_view` does."""
    return share(np.ascontiguousarray(host_view(t)), t.dtype)


def copy_back(original: Tensor, copy: Tensor) -> None:
    """Write dense *copy*'s values into *original*, through its strides."""
    np.copyto(host_view(original), host_view(copy))
