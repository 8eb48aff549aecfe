"""NumPy's C entry (``entry.cc``): an op's public callable on plain ndarrays without DLPack.

The NumPy fast path (:mod:`opbridge.adapters.numpy`) hands a call to
tvm-ffi with ndarrays, which each cross through NumPy's DLPack export: about
107 ns per array, most of a small call (``ops.add`` on 8 float32 elements:
458 ns in the kernel call, 138 with tvm-ffi tensors). The C entry reads the
ndarray's fields, views it as a DLTensor on the stack and calls the kernel
through tvm-ffi's C API. A kernel's error it raises itself, as tvm-ffi's
binding would (``opbridge/raised_error.h``); for anything it does not take it
returns ``NotImplemented`` and the Python fast path runs as before.

When it is built
----------------
It depends on the interpreter's and NumPy's C ABIs, so it is compiled once
per Python and NumPy version into the opbridge cache (the JIT build, with
both versions in its key), never into an op's kernel module, and never in
the caller's way: :class:`opbridge.call.c_entry.CEntry` (:data:`ENTRY`)
builds it in the background on the first NumPy call and installs it once it
is loaded. :func:`library` with ``build_now=True`` builds (or waits for) it in
the foreground. ``OPBRIDGE_NUMPY_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from opbridge import config
from opbridge._tvm import load_library
from opbridge.call import c_entry

if TYPE_CHECKING:
    from opbridge.build.compile import BuildSpec
    from opbridge.declare import OpDef

SOURCE = Path(__file__).with_name("entry.cc")


class Library:
    """The loaded entry library."""

    def __init__(self, path: Path) -> None:
        lib = load_library(path, python_api=True)  # its entry points hold the GIL and may set Python errors
        lib.opb_np_init.restype = ctypes.c_int
        lib.opb_np_entry.argtypes = [ctypes.py_object, ctypes.c_void_p, ctypes.py_object, ctypes.py_object,
                                     ctypes.py_object, ctypes.py_object, ctypes.py_object, ctypes.py_object,
                                     ctypes.c_int, ctypes.py_object, ctypes.c_int64]
        lib.opb_np_entry.restype = ctypes.py_object
        lib.opb_np_calls.argtypes = [ctypes.py_object]
        lib.opb_np_calls.restype = ctypes.c_int64
        lib.opb_np_bfloat16.argtypes = [ctypes.py_object]
        lib.opb_np_bfloat16.restype = ctypes.c_int
        if lib.opb_np_init() != 0:
            raise OSError(f"NumPy's C API could not be imported by {path}")
        self.lib = lib
        self.path = path
        self.bfloat16 = False  # whether the entry takes ml_dtypes' bfloat16 (take_bfloat16)

    def entry(self, op: OpDef, kernel: Any, max_out_bytes: int) -> tuple[Callable[..., Any], Callable[..., Any], Any]:
        """*op*'s builtins (the call; the call with ``out=`` last) and the capsule of its state (for
        :meth:`calls`); new outputs of *max_out_bytes* or more are left to the Python path."""
        fn, fn_out, capsule = self.lib.opb_np_entry(kernel, kernel.__chandle__(),
                                                    *c_entry.op_facts(op, _dtype_name), max_out_bytes)
        return fn, fn_out, capsule

    def calls(self, capsule: Any) -> int:
        """How many calls the entry of *capsule*'s op completed itself."""
        return int(self.lib.opb_np_calls(capsule))

    def take_bfloat16(self) -> bool:
        """Let the entry take and make ``ml_dtypes.bfloat16`` arrays (NumPy has no bfloat16 of its own), where
        ml_dtypes is imported (a program with such arrays has imported it); whether it now does."""
        if self.bfloat16:
            return True
        ml_dtypes = sys.modules.get("ml_dtypes")
        bf16 = getattr(ml_dtypes, "bfloat16", None)
        if bf16 is None:
            return False
        dtype = np.dtype(bf16)
        if dtype.itemsize != 2 or dtype.name != "bfloat16":
            return False
        self.bfloat16 = self.lib.opb_np_bfloat16(dtype) == 0
        return self.bfloat16


def _dtype_name(d: Any) -> str:
    return str(np.dtype(d).name)


def takes(op: OpDef) -> bool:
    """Whether the C entry can run *op* (:func:`opbridge.call.c_entry.takes`)."""
    return c_entry.takes(op)


def spec() -> BuildSpec:
    """The entry's build: this interpreter's and NumPy's headers, both versions in its defines (its key)."""
    from opbridge.build.compile import BuildSpec

    # The extension suffix names the interpreter's ABI (version, debug and free-threaded builds), as
    # the torch shim's key does.
    abi = sysconfig.get_config_var("EXT_SUFFIX") or sys.implementation.cache_tag
    return BuildSpec(name="opbridge_numpy_entry", sources=(SOURCE,),
                     include_dirs=(Path(sysconfig.get_paths()["include"]), Path(np.get_include()), c_entry.SHARED_DIR),
                     cflags=(f"-DOPB_PYTHON_ABI={abi}", f"-DOPB_NUMPY_VERSION={np.__version__}"),
                     flags_for_sources_only=True)  # its runtime unit: the tensor entry's object


def enabled() -> bool:
    """Whether the C entry is used (``OPBRIDGE_NUMPY_NATIVE``, default on)."""
    return config.numpy_native()


#: When the entry is built and loaded.
ENTRY: c_entry.CEntry[Library] = c_entry.CEntry(
    "NumPy's C entry", __name__, spec, Library, enabled, "NumPy calls stay on the Python fast path",
    per="Python and NumPy version")


def loaded() -> Library | None:
    """The library if this process has loaded it (no build)."""
    return ENTRY.loaded()


def library(build_now: bool = False) -> Library | None:
    """The library: loaded, or built now with *build_now*; None while it is not there (or failed)."""
    return ENTRY.library(build_now)


def when_ready(op: OpDef, then: Callable[[Library], None]) -> None:
    """Run ``then(library)`` once the C entry is loaded (:meth:`opbridge.call.c_entry.CEntry.when_ready`)."""
    ENTRY.when_ready(op, then)
