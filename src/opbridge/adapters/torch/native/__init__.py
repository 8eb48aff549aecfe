"""Native (C++) dispatcher kernels: ``torch.ops.<ns>.<op>`` without a Python frame.

One shim (``shim.cc``), independent of any op, is compiled against the
running torch, once per torch version, Python ABI, tvm-ffi version and
compiler, into ``<cache>/torch-native/<key>/`` (:mod:`.build`). It registers
boxed kernels for an op with torch's dispatcher: a device kernel on ``CPU``
(and ``CUDA`` when the shim was compiled against a CUDA torch) and an
``Autograd`` kernel. For dense tensors of a declared dtype on one device the
device kernel allocates the outputs (new, contiguous: the op-call core's
layout rule), calls the op's compiled tvm-ffi kernel on DLTensor views and
packs the schema's returns; anything else goes to the op's Python kernel
(:func:`..dispatcher.make_impl`), which gives today's results and messages.
The autograd kernel hands a call to the Python autograd kernel (the declared
backward, through ``torch.library``'s own machinery) only when grad mode is on
and a tensor argument requires grad.

When it is built
----------------
Never at import. Registering an op only *looks* for a built shim (a hash of
a few strings and the shim's source files, then ``import tvm_ffi``, 43 ms
after torch's import, and ``dlopen``). If there is one, the
op's device and autograd kernels are the native ones from the start. If
there is none, the op gets its Python kernels, and the first time a compiled
kernel is loaded for torch (:func:`kernel_loaded`, from
:func:`..calls.kernel`) the shim starts building in the background (one
line on stderr says so; about 12 s of one core, so a user's first call
does not wait for it; the compiler runs in a detached child at a lower
priority, which finishes and installs the shim even if the program exits
first: :mod:`opbridge.build.detached`). A process started meanwhile starts
no second build: it keeps its Python kernels and waits for that one on a
thread (its line on stderr says so; both lines add that ``opbridge build``
builds it now, taking over a build that gets no CPU). At the
next kernel load or op registration after it is done, every op registered so
far gets its native kernels registered over its Python ones (torch keeps
those listed beneath, so one that is running stays alive); every later
process is native from the start. :func:`shim` with ``build_now=True``
builds (or waits for) it in the foreground, with a progress line. A failed build warns once and
leaves the Python kernels in place. ``OPBRIDGE_TORCH_NATIVE=0`` turns all of
it off (read when an op is registered).

The public callable's C entry
-----------------------------
The shim also makes one builtin per op (and one for ``out=``,
:meth:`Shim.entry`) that ``opbridge.ops.<op>`` calls before its Python fast
path (:mod:`..fast`) once the op has native kernels (:func:`when_native`):
for plain tensors, outside any mode, transform or tracer, it runs the same
kernel call as the device kernel (``kernel_call.h``) with no Python frame,
dispatcher or argument parser, and returns ``NotImplemented`` for anything
else, so the Python path takes the call with today's results and messages.

Ops with an argument type other than ``Tensor``, ``Tensor?``, ``int``,
``float``, ``bool`` (optional or not), or returns other than tensors, keep
their Python kernels.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opbridge import _tvm, config, loader
from opbridge.adapters.torch.native import build
from opbridge.build import detached
from opbridge.call import core, memory
from opbridge.errors import BuildError

if TYPE_CHECKING:
    from opbridge.declare import OpDef

#: The shim's device numbers.
_DEVICE_INDEX = {"cpu": 0, "cuda": 1}
_SCALAR_BASES = {"int", "float", "bool"}


@dataclass(frozen=True)
class PythonKernels:
    """An op's Python kernels: what the native kernels hand calls to.

    Attributes
    ----------
    impls
        The dispatcher kernel per device (``"cpu"``, ``"cuda"``).
    autograd
        The autograd kernel.
    autograd_keyset
        Whether *autograd* takes the dispatch key set first (``torch.library``'s generated ones do).
    rule
        For an op whose shape rule is not ``like``: the argument tuple to one
        ``meta`` tensor per output (asked once per argument signature).
    fresh
        Huge-page advice for a new CPU output of at least :data:`opbridge.call.memory.MIN_BYTES`,
        where the pool is not there (modules built before it); with it, such outputs come from
        the pool (``kernel_call.h``'s ``PoolAllocator``).
    """

    impls: dict[str, Callable[..., Any]]
    autograd: Callable[..., Any]
    autograd_keyset: bool
    rule: Callable[[tuple[Any, ...]], list[Any]] | None
    fresh: Callable[[Any], None]


class Shim:
    """The loaded shim library."""

    def __init__(self, path: Path) -> None:
        import torch  # the shim links against it; imported already wherever ops register with torch

        lib = _tvm.load_library(path, python_api=True)  # its entry points hold the GIL and may raise Python errors
        try:
            os.utime(path)  # its last use, for `opbridge cache prune` (build/housekeeping.py)
        except OSError:
            pass
        lib.opb_register.argtypes = [ctypes.py_object]
        lib.opb_register.restype = ctypes.py_object
        lib.opb_set_kernel.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        lib.opb_set_kernel.restype = None
        lib.opb_native_calls.argtypes = [ctypes.c_void_p]
        lib.opb_native_calls.restype = ctypes.c_int64
        lib.opb_entry_calls.argtypes = [ctypes.c_void_p]
        lib.opb_entry_calls.restype = ctypes.c_int64
        lib.opb_entry.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.opb_entry.restype = ctypes.py_object
        lib.opb_has_cuda.restype = ctypes.c_int
        lib.opb_set_parameter_type.argtypes = [ctypes.py_object]
        lib.opb_set_parameter_type.restype = None
        lib.opb_pool_empty.argtypes = [ctypes.py_object, ctypes.py_object]
        lib.opb_pool_empty.restype = ctypes.py_object
        lib.opb_set_parameter_type(torch.nn.Parameter)  # the C entries take Parameters beside plain tensors
        self.lib = lib
        self.path = path
        self.devices = ("cpu", "cuda") if lib.opb_has_cuda() else ("cpu",)

    def register(self, spec: dict[str, Any]) -> int:
        """Register the native kernels of one op; its handle."""
        handle: int = self.lib.opb_register(spec)
        return handle

    def set_kernel(self, handle: int, device: str, kernel: Any) -> None:
        """Hand *kernel* (a ``tvm_ffi.Function``) to the op's native kernels for *device*."""
        self.lib.opb_set_kernel(handle, _DEVICE_INDEX[device], kernel.__chandle__())

    def pool_empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A new contiguous CPU tensor on a pool buffer, with a resizable storage; None without the pool."""
        return self.lib.opb_pool_empty(shape, dtype)

    def native_calls(self, handle: int) -> int:
        """How many calls of the op the native kernels completed themselves."""
        return int(self.lib.opb_native_calls(handle))

    def entry(self, handle: int, with_out: bool = False) -> Callable[..., Any]:
        """The op's C entry for its public callable (``shim.cc``'s ``python_entry.h``).

        A builtin taking the schema's arguments in order (then ``out`` with
        *with_out*); it returns the op's result, or ``NotImplemented`` having
        written nothing where the Python fast path must take the call.
        """
        fn: Callable[..., Any] = self.lib.opb_entry(handle, int(with_out))
        return fn

    def entry_calls(self, handle: int) -> int:
        """How many calls of the op its C entry completed itself."""
        return int(self.lib.opb_entry_calls(handle))


_SHIM: Shim | None = None
_LOOKED = False
_BUILD_FAILED = False
#: qualname -> the shim's handle of an op with native kernels.
HANDLES: dict[str, int] = {}
#: Ops registered with Python kernels while no shim existed: native ones follow once it is built.
_PENDING: dict[str, tuple[OpDef, PythonKernels]] = {}
#: Compiled kernels loaded so far, by (qualname, device); also keeps them alive.
_LOADED: dict[tuple[str, str], Any] = {}
#: qualname -> what runs once the op has native kernels (:func:`when_native`).
_WAITING: dict[str, Callable[[Shim, int], None]] = {}


def enabled() -> bool:
    """Whether native kernels are used (``OPBRIDGE_TORCH_NATIVE``, default on)."""
    return config.torch_native()


def describable(op: OpDef) -> bool:
    """Whether the shim can run *op*: tensor, int, float and bool arguments, tensor returns, a CPU/CUDA kernel."""
    for a in op.schema.arguments:
        if a.type.is_list or not (a.type.is_tensor or a.type.base in _SCALAR_BASES):
            return False
    if any(r.type.is_list or not r.type.is_tensor for r in op.schema.returns):
        return False
    return any(d in op.kernels for d in _DEVICE_INDEX)


class _Background:
    """The shim's build, running beside the program at a lower priority; it finishes if the program exits first.
    Where another process's build is in flight, this waits for that one on its thread instead."""

    def __init__(self) -> None:
        # the compiler starts here, unless a build is in flight (job.joined); OSError: no cache or no process
        self.job = build.Job(background=True)
        self.result: Path | None = None
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._wait, name="opbridge-torch-native-build", daemon=True)
        self.thread.start()

    def _wait(self) -> None:
        try:
            self.result = self.job.wait()
        except (BuildError, OSError) as e:
            self.error = e


_BUILDER: _Background | None = None


def loaded() -> Shim | None:
    """The shim if this process has loaded it (no lookup, no build)."""
    return _SHIM


def shim(build_now: bool = False) -> Shim | None:
    """The shim: from the cache or a finished background build; with *build_now*, built first.

    Returns None while it is not available (never built, still building, or failed).
    """
    global _SHIM, _LOOKED, _BUILD_FAILED
    if _SHIM is not None:
        return _SHIM
    if not _LOOKED:
        _LOOKED = True
        try:
            path = build.path()
        except OSError:  # an installation without the shim's sources: Python kernels only
            _BUILD_FAILED = True
            return None
        if detached.installed(path):  # a library cut short is rebuilt, never loaded (SIGBUS)
            _SHIM = _load(path)
    if _SHIM is None and _BUILDER is not None and not _BUILDER.thread.is_alive():
        _BUILDER.thread.join()
        _finish(_BUILDER)
    if _SHIM is None and build_now and not _BUILD_FAILED:  # takes over a background build that gets no CPU
        try:
            _SHIM = _load(build.build())
        except (BuildError, OSError) as e:
            _failed(e)
    if _SHIM is not None and _PENDING:  # the ops registered on Python kernels meanwhile become native now
        _flush(_SHIM)
    return _SHIM


def _finish(builder: _Background) -> None:
    global _SHIM, _BUILDER
    _BUILDER = None
    if builder.result is not None:
        _SHIM = _load(builder.result)
    elif builder.error is not None:
        _failed(builder.error)


def _failed(error: Exception) -> None:
    global _BUILD_FAILED
    _BUILD_FAILED = True
    warnings.warn(f"opbridge: torch.ops calls stay on Python kernels: {error}", RuntimeWarning, stacklevel=3)


def _start_background() -> None:
    """Start building the shim beside the program (once), or join the build in flight, saying so in one line."""
    global _BUILDER
    if _BUILDER is not None or _BUILD_FAILED:
        return
    try:
        _BUILDER = _Background()
    except OSError as e:
        _failed(e)
        return
    if config.show_progress():
        print(_BUILDING_JOINED if _BUILDER.job.joined else _BUILDING, file=sys.stderr)


#: The line a program prints when it starts the shim's background build, and when it finds one in flight.
_BUILDING = ("opbridge: building the torch native dispatcher shim in the background (once per torch version; it "
             "finishes even if this program exits first); until it is ready, torch.ops calls run Python kernels; "
             "`opbridge build` builds it now")
_BUILDING_JOINED = ("opbridge: the torch native dispatcher shim is being built in the background by another process "
                    "(once per torch version); until it is ready, torch.ops calls run Python kernels; "
                    "`opbridge build` builds it now")


def _load(path: Path) -> Shim | None:
    try:
        return Shim(path)
    except (OSError, ImportError) as e:  # ImportError: tvm-ffi's own import, which Shim() makes first
        _failed(OSError(f"could not load the torch native shim {path} ({e})"))
        return None


def register(op: OpDef, kernels: PythonKernels) -> tuple[str, ...] | None:
    """Register *op*'s native kernels if the shim is built; else remember the op for when it is.

    Returns the devices whose device kernel is now native (the caller
    registers the Python kernels of the others; the autograd kernel is native
    too), or None when the caller must register every Python kernel.
    """
    if not (enabled() and describable(op)):
        return None
    sh = shim()
    if sh is None:
        _PENDING[op.qualname] = (op, kernels)
        return None
    _flush(sh)
    return _register(sh, op, kernels)


def _register(sh: Shim, op: OpDef, kernels: PythonKernels) -> tuple[str, ...] | None:
    devices = tuple(d for d in sh.devices if d in kernels.impls)
    spec = {
        "qualname": op.qualname, "devices": list(devices),
        "dispatch_arg": op.dispatch_arg, "dtype_arg": op.dtype_arg, "dtypes": list(op.dtypes),
        "row_strided": list(op.row_strided),
        "n_outputs": op.n_outputs, "like": core.like_indices(op), "rule": kernels.rule,
        "fresh": kernels.fresh, "fresh_min": memory.MIN_BYTES,
        "impl": {d: kernels.impls[d] for d in devices},
        "autograd": kernels.autograd, "autograd_keyset": kernels.autograd_keyset,
    }
    try:
        handle = HANDLES[op.qualname] = sh.register(spec)
    except TypeError:  # an argument type the shim's schema reading does not take: stay Python
        return None
    for device in devices:
        k = _LOADED.get((op.qualname, device))
        if k is not None:
            sh.set_kernel(handle, device, k)
    then = _WAITING.pop(op.qualname, None)
    if then is not None:
        then(sh, handle)
    return devices


def when_native(op: OpDef, then: Callable[[Shim, int], None]) -> None:
    """Run ``then(shim, handle)`` once *op* has native kernels: now, or when it gets them.

    It never runs while native kernels are off (``OPBRIDGE_TORCH_NATIVE=0``)
    or for an op the shim cannot run.
    """
    handle = HANDLES.get(op.qualname)
    if handle is not None and _SHIM is not None:
        then(_SHIM, handle)
    elif enabled() and describable(op):
        _WAITING[op.qualname] = then


def _flush(sh: Shim) -> None:
    """Native kernels for the ops registered before the shim existed (over their Python ones)."""
    pending = list(_PENDING.values())
    _PENDING.clear()
    for op, kernels in pending:
        _register(sh, op, kernels)


def kernel_loaded(op: OpDef, device: str, kernel: Any) -> None:
    """*op*'s compiled *device* kernel was loaded: hand it to the native kernels.

    Ops registered before the shim existed get their native kernels here
    once it is built; the first such load of a JIT-built library starts
    building it. A library loaded from an installed AOT build compiles
    nothing, the shim included (``opbridge build`` builds it). The pool of
    large output buffers that the loaded module brings is configured here,
    before the native kernels first allocate from it.
    """
    _LOADED[(op.qualname, device)] = kernel
    memory.host_ready()
    if _PENDING and enabled():
        sh = shim()
        if sh is None:
            if not loader.loaded_prebuilt(op.library, device):
                _start_background()
        else:
            _flush(sh)
    handle = HANDLES.get(op.qualname)
    if handle is not None and _SHIM is not None and device in _SHIM.devices:
        _SHIM.set_kernel(handle, device, kernel)


def native_calls(op: OpDef) -> int | None:
    """How many calls of *op* its native kernels completed (None: it has none)."""
    handle = HANDLES.get(op.qualname)
    return None if handle is None or _SHIM is None else _SHIM.native_calls(handle)


def entry_calls(op: OpDef) -> int | None:
    """How many calls of *op*'s public callable its C entry completed (None: it has none)."""
    handle = HANDLES.get(op.qualname)
    return None if handle is None or _SHIM is None else _SHIM.entry_calls(handle)
