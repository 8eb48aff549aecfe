"""Import tvm-ffi without dragging torch in.

``import tvm_ffi`` imports torch whenever torch is installed (about a second),
even for a user who only touches NumPy or JAX. opbridge imports it with torch
hidden when torch is not already loaded; torch tensors still take tvm-ffi's
fast path later, because torch >= 2.10 exposes ``__dlpack_c_exchange_api__``
itself.
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType

_LOCK = threading.Lock()


def tvm_ffi() -> ModuleType:
    """Return the ``tvm_ffi`` module, importing it without importing torch."""
    mod = sys.modules.get("tvm_ffi")
    if mod is not None:
        return mod
    with _LOCK:
        if "torch" in sys.modules:
            import tvm_ffi as mod
            return mod
        sys.modules["torch"] = None  # type: ignore[assignment]  # makes `import torch` fail fast
        try:
            import tvm_ffi as mod
        finally:
            if sys.modules.get("torch", 0) is None:
                del sys.modules["torch"]
        return mod
