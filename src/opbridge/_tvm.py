"""Import tvm-ffi without dragging torch in.

``import tvm_ffi`` imports torch whenever torch is installed (about a second),
even for a user who only touches NumPy or JAX. opbridge imports it with torch
hidden when torch is not already loaded; torch tensors still take tvm-ffi's
fast path later, because torch >= 2.10 exposes ``__dlpack_c_exchange_api__``
itself.
"""

from __future__ import annotations

import importlib
import sys
import threading
from types import ModuleType

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
