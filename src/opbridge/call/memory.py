"""Large new CPU outputs: opbridge's pool of recycled, aligned huge-page buffers, and huge-page advice.

Every framework whose outputs opbridge allocates takes a new CPU output of
:data:`MIN_BYTES` or more from one pool per process (:func:`host_empty`,
:func:`empty_ndarray`; the pool itself is C++, ``include/opbridge/host_buffers_impl.h``):
2 MiB-aligned and a whole number of huge pages, and, once freed, handed to
the next output of its size, so the OS neither maps nor zeroes it again
(``opbridge bench outputs``: 1.7-3.6x faster at (4096, 4096) than the
allocation below, within 6% of an existing buffer). Bounded by
``OPBRIDGE_OUTPUT_CACHE_MB`` and ``OPBRIDGE_OUTPUT_CACHE_IDLE_MS``.
Outputs something else allocates (XLA under ``jax.jit``; modules built
before the pool) get the advice of :func:`advise_fresh`, which is what every
output got before the pool:

A new output of a large CPU op is a fresh ``mmap`` of untouched pages (glibc
maps every allocation of 32 MiB and more, and unmaps it on free), so the
kernel's first write to each 4 KiB page faults into the OS. At (4096, 4096)
float32 that costs more than the kernel itself: ``add`` into an existing
buffer takes 5.7 ms, with a new output 26 ms, and torch's own ``torch.add``
pays the same 26 ms. Asking for transparent huge pages on the fresh buffer
(``madvise(MADV_HUGEPAGE)`` before the kernel touches it) makes those faults
2 MiB at a time: 26 -> 10.9 ms (measured on this 2-core machine, interleaved).
NumPy does the same for its own arrays of 4 MiB and more.

The advice is only given where it changes anything: on Linux, when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``[madvise]`` (with
``[always]`` the kernel does it anyway; with ``[never]`` it cannot), for
buffers of at least :data:`MIN_BYTES`, and only on their 2 MiB-aligned
interior. Under ``defrag=madvise`` a fault on advised memory may compact
memory synchronously; ``OPBRIDGE_HUGEPAGES=0`` turns the advice off.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from opbridge import config

#: Buffers smaller than this get no advice (a 2 MiB-aligned huge page must fit with room to spare).
MIN_BYTES = 4 << 20
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_madvise: Callable[[int, int, int], int] | None = None
_resolved = False


def _load() -> Callable[[int, int, int], int] | None:
    if not config.hugepages() or not sys.platform.startswith("linux"):
        return None
    try:
        if "[madvise]" not in _THP_MODE.read_text():
            return None
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def advise_fresh(ptr: int, nbytes: int) -> bool:
    """Ask for huge pages on a fresh, untouched CPU buffer of *nbytes* at address *ptr*.

    Call it before anything writes the buffer. Returns whether advice was
    given. Never raises: a refused ``madvise`` leaves the buffer as it was.
    The environment and the THP mode are read on the first call of the process.
    """
    if nbytes < MIN_BYTES or not advise_enabled():
        return False
    assert _madvise is not None
    start = (ptr + _HUGE - 1) & ~(_HUGE - 1)
    end = (ptr + nbytes) & ~(_HUGE - 1)
    return end > start and _madvise(start, end - start, _MADV_HUGEPAGE) == 0


# --- large outputs from opbridge's pool (include/opbridge/host_buffers_impl.h) -------------------

_POOL = "opbridge.host_buffers.v1."  # the prefix of the pool's tvm-ffi globals
_host: list[Any] = []  # [empty] once a loaded module has registered the pool and it is configured
_idle: list[int] = []  # [ms] where keep_idle_buffers set this process's idle time


def _pool_fn(name: str) -> Any:
    """The pool's global function *name* (``empty``, ``configure``, ``stats``, ``trim``), None if not registered."""
    from opbridge._tvm import tvm_ffi

    return tvm_ffi().get_global_func(_POOL + name, allow_missing=True)


def _host_fn() -> Any | None:
    """The pool's ``empty``, configured on first sight; None until a module providing it is loaded."""
    if _host:
        return _host[0]
    empty = _pool_fn("empty")
    if empty is None:  # no module loaded yet, or only modules built before the pool existed
        return None
    _configure()
    _host.append(empty)
    return empty


def _configure() -> None:
    _pool_fn("configure")(advise_enabled(), config.output_cache_bytes(), idle_ms())


def idle_ms() -> int:
    """How long this process's pool keeps a recycled buffer unused: :func:`keep_idle_buffers`'s time, else
    ``OPBRIDGE_OUTPUT_CACHE_IDLE_MS``'s."""
    return _idle[0] if _idle else config.output_cache_idle_ms()


@contextlib.contextmanager
def keep_idle_buffers(ms: int) -> Iterator[None]:
    """Within the block, keep a recycled output buffer *ms* milliseconds unused before giving it back, in this
    process only, instead of ``OPBRIDGE_OUTPUT_CACHE_IDLE_MS``.

    For a benchmark whose rounds leave an op's calls further apart than that (``bench kernels`` interleaves
    NumPy references that run over a second at 4096²): each new output would otherwise map fresh memory,
    which a loop calling the op does not.
    """
    before = list(_idle)
    _set_idle([int(ms)])
    try:
        yield
    finally:
        _set_idle(before)


def _set_idle(ms: list[int]) -> None:
    _idle[:] = ms
    if _host:  # configured already: again, with the new idle time
        _configure()


def host_ready() -> bool:
    """Whether the pool is there (a loaded module registered it); configures it on first sight."""
    return _host_fn() is not None


def advise_enabled() -> bool:
    """Whether fresh large outputs get huge-page advice in this process (read once)."""
    global _madvise, _resolved
    if not _resolved:
        _madvise, _resolved = _load(), True
    return _madvise is not None


def host_empty(shape: tuple[int, ...], dtype: str, nbytes: int) -> Any | None:
    """A new CPU buffer from opbridge's pool for an output of *nbytes* >= :data:`MIN_BYTES`, else None.

    Returns a ``tvm_ffi.Tensor`` of *shape* and *dtype* (a tvm-ffi dtype
    string) that any framework takes through DLPack without a copy; its
    memory goes back to the pool when the last framework array on it dies.
    The buffer is 2 MiB-aligned and a whole number of huge pages (advised
    under the rules above), and a recently freed buffer of the same size is
    reused, not mapped and zeroed again (``OPBRIDGE_OUTPUT_CACHE_MB``,
    default 256; ``0`` turns recycling off). None for a small output, before
    any opbridge module is loaded, or with modules built before the pool
    existed: the caller then allocates as it always has.
    """
    if nbytes < MIN_BYTES:
        return None
    empty = _host_fn()
    return None if empty is None else empty(shape, dtype)


def host_stats() -> dict[str, int] | None:
    """The pool's counters (bytes and buffers cached, reused, newly mapped, released idle, live); None without it."""
    if _host_fn() is None:
        return None
    vals = list(_pool_fn("stats")())
    return dict(zip(("cached_bytes", "cached", "reused", "mapped", "released_idle", "live"), vals, strict=True))


def host_trim() -> None:
    """Give every cached output buffer back to the OS now (a no-op without the pool)."""
    if _host_fn() is not None:
        _pool_fn("trim")()


class _HostArray:
    """Holds a pool buffer (a ``tvm_ffi.Tensor``) and describes it to NumPy as writable memory.

    Not ``numpy.from_dlpack``: before NumPy 2 it marks what it imports
    read-only, and it refuses dtypes it does not know (ml_dtypes' bfloat16).
    """

    __slots__ = ("__array_interface__", "buffer")

    def __init__(self, buffer: Any, shape: tuple[int, ...], typestr: str) -> None:
        self.buffer = buffer
        self.__array_interface__ = {"data": (buffer.data_ptr(), False), "shape": shape, "typestr": typestr,
                                    "version": 3}


def empty_ndarray(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A new C-contiguous ``numpy.ndarray`` of *shape* and NumPy *dtype*, uninitialised.

    Of :data:`MIN_BYTES` and more, a writable view of a :func:`host_empty`
    buffer (the pool owns the memory: ``flags.owndata`` is False) where the
    pool is there; otherwise, and below that size, ``numpy.empty``.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= MIN_BYTES:
        t = host_empty(shape, f"uint{8 * dtype.itemsize}", nbytes)
        if t is not None:
            a: np.ndarray = np.asarray(_HostArray(t, shape, f"<u{dtype.itemsize}"))
            return a if a.dtype == dtype else a.view(dtype)
    return np.empty(shape, dtype)
