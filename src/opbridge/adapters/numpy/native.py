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
both versions in its key), never into an op's kernel module. Never at
import and never in the caller's way: the first NumPy fast path installed
for an op of a JIT-built library starts the build in a background thread
(a few seconds of one core, in a detached child at a lower priority that
finishes and fills the cache even if the program exits first:
:mod:`opbridge.build.detached`), and once it is loaded every NumPy op so far,
and every later one, calls its entry first. A process that finds it in the
cache loads it at once (a hash of its sources and a ``dlopen``). A library
loaded from an AOT build compiles nothing here. :func:`library` with ``build_now=True``
builds (or waits for) it in the foreground. A failed build warns once and
leaves the Python path in place; ``OPBRIDGE_NUMPY_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import sys
import sysconfig
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from opbridge import config, loader
from opbridge.errors import BuildError, OpbridgeError

if TYPE_CHECKING:
    from opbridge.build.detached import Child
    from opbridge.declare import OpDef

SOURCE = Path(__file__).with_name("entry.cc")
_KINDS = {"int": 2, "float": 1, "bool": 3}


class Library:
    """The loaded entry library."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.PyDLL(str(path))  # its entry points hold the GIL and may set Python errors
        lib.opb_np_init.restype = ctypes.c_int
        lib.opb_np_entry.argtypes = [ctypes.py_object, ctypes.c_void_p, ctypes.py_object, ctypes.py_object,
                                     ctypes.py_object, ctypes.py_object, ctypes.py_object, ctypes.py_object,
                                     ctypes.c_int, ctypes.py_object, ctypes.c_int64]
        lib.opb_np_entry.restype = ctypes.py_object
        lib.opb_np_calls.argtypes = [ctypes.py_object]
        lib.opb_np_calls.restype = ctypes.c_int64
        if lib.opb_np_init() != 0:
            raise OSError(f"NumPy's C API could not be imported by {path}")
        self.lib = lib
        self.path = path

    def entry(self, op: OpDef, kernel: Any, dtypes: Any, max_out_bytes: int) -> tuple[Callable[..., Any], Any]:
        """*op*'s builtin and the capsule of its state (for :meth:`calls`).

        *dtypes* are the NumPy dtypes the op declares; outputs of *max_out_bytes*
        or more are left to the Python path.
        """
        from opbridge.call import core

        args = op.schema.arguments
        kinds = [(4 if a.type.optional else 0) if a.type.is_tensor else _KINDS[a.type.base] for a in args]
        like = core.like_indices(op)
        rule = None if like is not None or not op.n_outputs else _rule(op)
        returns = list(op.return_sources)
        mutated = [i for i, a in enumerate(args) if a.is_mutated]
        nums = sorted({np.dtype(dt).num for dt in dtypes})
        fn, capsule = self.lib.opb_np_entry(kernel, kernel.__chandle__(), kinds, like or [], rule, returns,
                                            mutated, list(op.row_strided), op.dtype_arg, nums, max_out_bytes)
        return fn, capsule

    def calls(self, capsule: Any) -> int:
        """How many calls the entry of *capsule*'s op completed itself."""
        return int(self.lib.opb_np_calls(capsule))


def _rule(op: OpDef) -> Callable[[tuple[Any, ...]], list[tuple[tuple[int, ...], int]]]:
    """*op*'s shape rule as the entry asks it (once per argument signature): outputs' shapes and type numbers."""

    def rule(args: tuple[Any, ...]) -> list[tuple[tuple[int, ...], int]]:
        return [(tuple(int(d) for d in s.shape), np.dtype(s.dtype).num) for s in op.output_specs(args)]

    return rule


def takes(op: OpDef) -> bool:
    """Whether the C entry can run *op*: tensor returns (new outputs, shaped by ``like`` or a shape rule,
    or the arguments it writes); arguments tensors (optional too, not lists) or int, float, bool
    scalars; a CPU kernel."""
    args, returns = op.schema.arguments, op.schema.returns
    if "cpu" not in op.kernels or (op.n_outputs and op.shape is None):
        return False
    if not all(r.type.is_tensor and not r.type.is_list for r in returns):
        return False
    if len(args) + op.n_outputs > 16:  # the entry's kMaxArgs
        return False
    return all((a.type.is_tensor and not a.type.is_list)
               or (not a.type.is_tensor and not a.type.optional and not a.type.is_list and a.type.base in _KINDS)
               for a in args)


def spec() -> Any:
    """The entry's build: this interpreter's and NumPy's headers, both versions in its defines (its key)."""
    from opbridge.build.compile import BuildSpec

    # The extension suffix names the interpreter's ABI (version, debug and free-threaded builds), as
    # the torch shim's key does.
    abi = sysconfig.get_config_var("EXT_SUFFIX") or sys.implementation.cache_tag
    return BuildSpec(name="opbridge_numpy_entry", sources=(SOURCE,),
                     include_dirs=(Path(sysconfig.get_paths()["include"]), Path(np.get_include())),
                     cflags=(f"-DOPB_PYTHON_ABI={abi}", f"-DOPB_NUMPY_VERSION={np.__version__}"))


_LOCK = threading.RLock()
_LIB: Library | None = None
_FAILED = False
_BUILDER: threading.Thread | None = None
#: what runs once the library is loaded (the NumPy adapter's prelude installs)
_WAITING: list[Callable[[Library], None]] = []


def loaded() -> Library | None:
    """The library if this process has loaded it (no build)."""
    return _LIB


def enabled() -> bool:
    """Whether the C entry is used (``OPBRIDGE_NUMPY_NATIVE``, default on)."""
    return config.numpy_native()


def library(build_now: bool = False) -> Library | None:
    """The library: loaded, or built now with *build_now*; None while it is not there (or failed)."""
    builder = _BUILDER
    if _LIB is None and build_now and builder is not None:
        builder.join()
    if _LIB is None and build_now and not _FAILED:
        path, error = _build()
        with _LOCK:
            if _LIB is None and not _FAILED:
                _finish(path, error)
    return _LIB


def _build() -> tuple[Path | None, Exception | None]:
    """Compile the library (or find it in the cache); the path, or what went wrong. Takes no lock."""
    from opbridge.build import jit

    try:
        return jit.build(spec()), None
    except (OpbridgeError, OSError) as e:
        return None, e


def _finish(path: Path | None, error: Exception | None) -> None:
    """Load the built library and run what waited for it, or warn once. Holds _LOCK."""
    global _LIB, _FAILED
    if path is not None:
        try:
            _LIB = Library(path)
        except OSError as e:
            error = e
    if _LIB is None:
        _FAILED = True
        _WAITING.clear()
        warnings.warn(f"opbridge: NumPy calls stay on the Python fast path: its C entry could not be built "
                      f"or loaded ({error})", RuntimeWarning, stacklevel=3)
        return
    waiting = list(_WAITING)
    _WAITING.clear()
    for then in waiting:
        then(_LIB)


def _load_cached() -> None:
    """Load the library now if this Python and NumPy's build is in the cache (no compiling). Holds _LOCK."""
    from opbridge.build import jit

    path = jit.cached_artifact(spec())
    if path is not None:
        _finish(path, None)


# The background build's child (opbridge.build.detached): argv is its niceness.
_CHILD = """\
import os, sys
os.nice(int(sys.argv[1]))
from opbridge.adapters.numpy import native
path, error = native._build()
if error is not None:
    print(error)
    sys.exit(1)
"""


def _start_child() -> Child:
    """:func:`_build` in a detached child at a lower priority (it finishes if this process exits first).

    Started before the caller returns, not from the thread that waits for it:
    a script that exits at once would otherwise end before the thread spawned it.
    """
    from opbridge.build import detached

    return detached.Child([sys.executable, "-c", _CHILD, str(detached.niceness(True))], detached.python_env())


def _background(child: Child) -> None:
    """The background build: waits for *child* without the lock (a first call of another op must not wait
    for the compiler), then loads under it."""
    from opbridge.build import jit
    from opbridge.build.progress import first_errors

    code, log = child.wait()
    path = jit.cached_artifact(spec())
    error: Exception | None = None
    if path is None:
        last = log.strip().splitlines()[-1:] or [f"its build process exited with status {code}"]
        error = BuildError(f"building NumPy's C entry failed: {last[0]}", errors=first_errors(log), log=log)
    with _LOCK:
        if _LIB is None and not _FAILED:
            _finish(path, error)


def when_ready(op: OpDef, then: Callable[[Library], None]) -> None:
    """Run ``then(library)`` once the C entry is loaded: now, or from the background build it starts.

    Nothing runs while the entry is off (``OPBRIDGE_NUMPY_NATIVE=0``) or for
    an op it cannot run. An op of a library loaded from an AOT build (which
    compiles nothing at run time and touches no cache) gets the entry only
    once another library's op, or :func:`library` (``opbridge build``), has
    loaded it.
    """
    global _BUILDER
    if not (enabled() and takes(op)) or _FAILED:
        return
    with _LOCK:
        if _LIB is not None:
            then(_LIB)
            return
        if _FAILED:
            return
        # An AOT-built library compiles nothing and touches no cache: its ops wait for an entry that a
        # JIT-built library's first op loads or builds.
        prebuilt = loader.loaded_prebuilt(op.library, "cpu")
        if not prebuilt and _BUILDER is None:
            _load_cached()
            if _LIB is not None:
                then(_LIB)
                return
            if _FAILED:
                return
        _WAITING.append(then)
        if prebuilt or _BUILDER is not None:
            return
        try:
            child = _start_child()
        except OSError as e:
            _finish(None, e)
            return
        _BUILDER = threading.Thread(target=_background, args=(child,), name="opbridge-numpy-entry-build",
                                    daemon=True)
        _BUILDER.start()
    if config.show_progress():
        print("opbridge: building NumPy's C entry in the background (once per Python and NumPy version; it "
              "finishes even if this program exits first); "
              "until it is ready, NumPy calls take the Python fast path", file=sys.stderr)
