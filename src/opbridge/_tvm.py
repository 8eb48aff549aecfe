"""Import tvm-ffi without dragging torch in.

``import tvm_ffi`` imports torch whenever torch is installed (about a second),
even for a user who only touches NumPy or JAX. opbridge imports it with torch
hidden when torch is not already loaded; torch tensors still take tvm-ffi's
fast path later, because torch >= 2.10 exposes ``__dlpack_c_exchange_api__``
itself.
"""

from __future__ import annotations

import ctypes
import importlib
import sys
import threading
from types import ModuleType
from typing import Any

_LOCK = threading.Lock()


def tvm_ffi() -> ModuleType:
    """Return the ``tvm_ffi`` module, importing it without importing torch."""
    loaded = sys.modules.get("tvm_ffi")
    if loaded is not None:
        return loaded
    with _LOCK:
        if "torch" in sys.modules:
            return importlib.import_module("tvm_ffi")
        sys.modules["torch"] = None  # type: ignore[assignment]  # makes `import torch` fail fast
        try:
            return importlib.import_module("tvm_ffi")
        finally:
            if sys.modules.get("torch", 0) is None:
                del sys.modules["torch"]


#: ``PyCapsule_GetPointer(capsule, name)`` with a prototype of its own (setting ``ctypes.pythonapi``'s
#: ``restype``/``argtypes`` would change them for every other user of ``ctypes.pythonapi``).
capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))

# DLPack's DLTensor starts {void* data; int32 device_type, device_id; int32 ndim; uint8 code, ...};
# kDLBfloat is type code 4.
_DL_CODE_OFFSET = 8 + 4 + 4 + 4
_DL_BFLOAT = 4


def bfloat16_tensor(bits: Any) -> Any:
    """*bits*, an array of 16-bit elements over bfloat16 memory (a ``uint16`` ndarray view), as a
    tvm-ffi bfloat16 tensor on the same memory: its DLPack capsule's type code relabelled, no copy.
    For arrays whose own DLPack export has no bfloat16 (NumPy's)."""
    capsule = bits.__dlpack__()
    head = capsule_pointer(capsule, b"dltensor")
    ctypes.c_uint8.from_address(head + _DL_CODE_OFFSET).value = _DL_BFLOAT
    return tvm_ffi().from_dlpack(capsule)
