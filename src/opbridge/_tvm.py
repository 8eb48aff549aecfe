"""Import tvm-ffi without dragging torch in.

``import tvm_ffi`` imports torch whenever torch is installed (about a second),
even for a user who only touches NumPy or JAX. opbridge imports it with torch
hidden when torch is not already loaded; torch tensors still take tvm-ffi's
fast path later, because torch >= 2.10 exposes ``__dlpack_c_exchange_api__``
itself.

Loading tvm-ffi's library also replaces the process's SIGSEGV handler with its
own (``TVM_FFI_BACKTRACE_ON_SEGFAULT``, a constructor in ``libtvm_ffi``), which
has no alternate stack and dumps no Python traceback: where Python's
:mod:`faulthandler` was enabled (``-X faulthandler``, ``PYTHONFAULTHANDLER``,
pytest), a native fault then left no traceback, and a stack overflow left no
output at all. Importing it here keeps the handler that was there
(:func:`fault_action`, :func:`restore_fault_action`).
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

_LOCK = threading.Lock()


def libinfo() -> ModuleType:
    """tvm-ffi's ``libinfo`` (where its headers and library are), without loading tvm-ffi.

    ``libinfo.py`` needs the standard library alone, while ``import tvm_ffi``
    loads ``libtvm_ffi`` (and a signal handler, above): a cache key computed
    where no op runs (``opbridge doctor``, ``opbridge list``) needs only the
    paths. The loaded package's own module where tvm-ffi is already imported.
    """
    return _submodule("libinfo")


def version() -> str:
    """``tvm_ffi.__version__``, without loading tvm-ffi (its ``_version.py``, as :func:`libinfo`)."""
    if "tvm_ffi" not in sys.modules:
        try:
            return str(_submodule("_version").__version__)
        except (ImportError, OSError, AttributeError):
            pass  # as tvm_ffi's __init__ has it then
    return str(tvm_ffi().__version__)


def _submodule(name: str) -> ModuleType:
    """``tvm_ffi.<name>``, a module of the standard library's imports alone, run from its file unless tvm-ffi
    is loaded (then the package's own). Kept here, not in ``sys.modules``."""
    if "tvm_ffi" in sys.modules:
        return importlib.import_module(f"tvm_ffi.{name}")
    with _LOCK:
        if (mod := _STANDALONE.get(name)) is not None:
            return mod
        found = importlib.util.find_spec("tvm_ffi")
        if found is None or not found.submodule_search_locations:
            return importlib.import_module(f"tvm_ffi.{name}")  # its own error
        package = Path(next(iter(found.submodule_search_locations)))
        spec = importlib.util.spec_from_file_location(f"opbridge._tvm_ffi.{name}", package / f"{name}.py")
        if spec is None or spec.loader is None:
            raise ImportError(f"tvm_ffi.{name}: no {name}.py in {package}")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _STANDALONE[name] = mod
        return mod


#: What :func:`_submodule` ran from tvm-ffi's files, by name.
_STANDALONE: dict[str, ModuleType] = {}


def tvm_ffi() -> ModuleType:
    """Return the ``tvm_ffi`` module, importing it without importing torch."""
    loaded = sys.modules.get("tvm_ffi")
    if loaded is not None:
        return loaded
    with _LOCK:
        saved = fault_action()
        try:
            if "torch" in sys.modules:
                return importlib.import_module("tvm_ffi")
            sys.modules["torch"] = None  # type: ignore[assignment]  # makes `import torch` fail fast
            try:
                return importlib.import_module("tvm_ffi")
            finally:
                if sys.modules.get("torch", 0) is None:
                    del sys.modules["torch"]
        finally:
            restore_fault_action(saved)


def load_library(path: str | Path, *, python_api: bool = False) -> ctypes.CDLL:
    """Load an opbridge-built shared library (a kernel module, a C entry, a shim) with ``ctypes``.

    Every such library links ``libtvm_ffi``; tvm-ffi is imported first (:func:`tvm_ffi`), as ``import
    tvm_ffi`` loads it (``RTLD_GLOBAL``, faulthandler's SIGSEGV handler kept). Left to the dynamic
    loader as a dependency instead, it would be looked for on the library's run path, resolve its C++
    runtime in the library's scope (torch's shim's ``exports.map`` says what that did on an H200) and
    replace faulthandler's handler. Cache keys and paths need no import (:func:`libinfo`,
    :func:`version`); a load does. *python_api*: a ``PyDLL``, whose calls hold the GIL and may set
    Python errors.
    """
    tvm_ffi()
    return (ctypes.PyDLL if python_api else ctypes.CDLL)(str(path))


_SIGSEGV = 11
#: glibc's ``struct sigaction`` is 152 bytes on x86-64 and AArch64: room for it, read and written whole.
_SIGACTION_BYTES = 256
_HANDLER = ctypes.sizeof(ctypes.c_void_p)


def fault_action() -> Any:
    """The process's SIGSEGV action while :mod:`faulthandler` is enabled (Linux), else None.

    For :func:`restore_fault_action` after loading a library that installs its own handler.
    """
    if not sys.platform.startswith("linux") or not faulthandler.is_enabled():
        return None
    buf = ctypes.create_string_buffer(_SIGACTION_BYTES)
    if ctypes.CDLL(None).sigaction(_SIGSEGV, None, buf) != 0:
        return None
    return buf


def restore_fault_action(saved: Any) -> bool:
    """Put back the SIGSEGV action *saved* by :func:`fault_action` if another replaced it; whether it did."""
    if saved is None:
        return False
    now = ctypes.create_string_buffer(_SIGACTION_BYTES)
    libc = ctypes.CDLL(None)
    # the handler (the struct's first member) decides: glibc copies the mask's unused words from its stack
    if libc.sigaction(_SIGSEGV, None, now) != 0 or now.raw[:_HANDLER] == saved.raw[:_HANDLER]:
        return False
    return bool(libc.sigaction(_SIGSEGV, saved, None) == 0)


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
