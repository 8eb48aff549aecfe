"""Configuration, read lazily from ``OPBRIDGE_*`` environment variables.

Nothing here is evaluated at import time: every accessor reads the
environment when it is called, so changing a variable takes effect on the
next build or load.

=========================  =============================================  ======================
variable                   meaning                                        default
=========================  =============================================  ======================
``OPBRIDGE_CACHE_DIR``     where JIT builds are cached                    ``~/.cache/opbridge``
``OPBRIDGE_VERBOSE``       ``1`` prints every compiler command            ``0``
``OPBRIDGE_MAX_JOBS``      parallel compile jobs                          CPU count
``OPBRIDGE_NO_PROGRESS``   ``1`` hides the build progress line            ``0``
``OPBRIDGE_CXX``           C++ compiler                                   ``$CXX`` or ``c++``
``OPBRIDGE_CXX_FLAGS``     more C++ compiler flags, on every C++ unit and  none
                           every module's link, split as a shell would
                           (part of the cache key): ``-g``, or a
                           sanitizer build (``scripts/sanitize.sh``)
``OPBRIDGE_CUDA_ARCHS``    CUDA architectures for ``.cu`` sources         ``80;90``
``OPBRIDGE_CUDA_FLAGS``    more ``nvcc`` flags for ``.cu`` sources, split  none
                           as a shell would (part of the cache key): a
                           launch policy tried in the product's kernels
                           (``-DOPB_RMS_NORM_STAGES=3``,
                           ``include/opbridge/cuda_norm_staged.h``)
``OPBRIDGE_AOT_DEVICES``   devices ``pip install .`` builds a plugin's   CPU, and CUDA where
                           modules for, comma-separated (``cpu``,          the library has
                           ``cpu,cuda``): a device named here that         ``.cu`` sources and
                           cannot be built fails the build                 ``nvcc`` is found
``OPBRIDGE_CUDA_SYNC_CHECKS`` ``1``: CUDA kernels sync to raise device-side ``0``
                           argument errors (bad positions / block ids)
                           in the offending call, not the next one
``OPBRIDGE_HUGEPAGES``     ``0``: no transparent-huge-page advice on      ``1``
                           fresh CPU outputs of 4 MiB and more
                           (:mod:`opbridge.call.memory`); read once per process
``OPBRIDGE_OUTPUT_CACHE_MB`` bound of the pool that recycles freed CPU   ``256``
                           outputs of 4 MiB and more (``0``: no
                           recycling; :mod:`opbridge.call.memory`); read
                           once per process
``OPBRIDGE_OUTPUT_CACHE_IDLE_MS`` a recycled buffer unused this long goes     ``1000``
                           back to the OS
``OPBRIDGE_THREADING``     which threads run a parallel CPU kernel:       ``omp``
                           ``omp`` (the process's OpenMP team; torch's
                           own in a torch process) or ``pool`` (a private
                           caller-runs pool: lower p99 beside busy
                           neighbours, slower otherwise); read once per
                           process
``OPBRIDGE_NUMPY_NATIVE``  ``0``: NumPy calls keep the Python fast path    ``1``
                           (no C entry is built or loaded;
                           :mod:`opbridge.adapters.numpy.native`)
``OPBRIDGE_EXCHANGE_ENTRY`` ``0``: Paddle and MindSpore calls keep the ``1``
                           Python fast path (no tensor C entry is built
                           or loaded; :mod:`opbridge.call.exchange`)
``OPBRIDGE_TORCH_NATIVE``  ``0``: torch ops keep their Python dispatcher  ``1``
                           kernels (no C++ shim is built or loaded;
                           :mod:`opbridge.adapters.torch.native`)
``OPBRIDGE_OBJECT_CACHE_MB`` size bound of the build cache, pruned least   ``1024``
                           recently used first after a build
                           (``opbridge cache info|prune``)
=========================  =============================================  ======================

``nvcc`` is found on ``PATH``, then under ``$CUDA_HOME`` / ``$CUDA_PATH``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_YES, _NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
#: What both readers trim from a yes/no value: C's isspace, as settings.h reads it in the kernels (str.strip()
#: would also trim "\x1c"-"\x1f", "\x85" and "\xa0", which C refuses).
_BLANK = " \t\n\v\f\r"


def _flag(name: str, default: bool = False) -> bool:
    """A yes/no setting: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``, in any case; unset or
    empty means *default*. Anything else raises ValueError naming the setting: a misspelt value must not
    silently mean the default."""
    raw = os.environ.get(name, "").strip(_BLANK).lower()
    if not raw:
        return default
    if raw in _YES or raw in _NO:
        return raw in _YES
    raise ValueError(f"{name} must be one of {', '.join(_YES + _NO)} (any case), got {os.environ[name]!r}")


def cache_dir() -> Path:
    """Return the JIT cache directory (not created here)."""
    raw = os.environ.get("OPBRIDGE_CACHE_DIR")
    if raw:
        return Path(raw).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "opbridge"


def verbose() -> bool:
    """Whether to echo compiler commands (``OPBRIDGE_VERBOSE=1``)."""
    return _flag("OPBRIDGE_VERBOSE")


def show_progress() -> bool:
    """Whether builds may print a progress line (off with ``OPBRIDGE_NO_PROGRESS=1``)."""
    return not _flag("OPBRIDGE_NO_PROGRESS")


def max_jobs() -> int:
    """Parallel compile jobs (``OPBRIDGE_MAX_JOBS``, default: CPU count)."""
    return _whole("OPBRIDGE_MAX_JOBS", os.cpu_count() or 1, "of compile jobs, at least 1", least=1)


def cxx() -> str:
    """The C++ compiler to use."""
    return os.environ.get("OPBRIDGE_CXX") or os.environ.get("CXX") or "c++"


def cuda_archs() -> list[str]:
    """CUDA architectures to compile for, e.g. ``["80", "90"]``."""
    raw = os.environ.get("OPBRIDGE_CUDA_ARCHS", "").strip() or "80;90"  # unset or empty: the default
    archs = [a.strip() for a in raw.replace(",", ";").split(";") if a.strip()]
    if not archs or any(re.fullmatch(r"\d+[af]?", a) is None for a in archs):
        raise ValueError(f"OPBRIDGE_CUDA_ARCHS must list compute capabilities such as 80;90 (or 90a), got {raw!r}")
    return archs


def _shell_words(name: str) -> list[str]:
    import shlex

    raw = os.environ.get(name, "")
    try:
        return shlex.split(raw)
    except ValueError as e:
        raise ValueError(f"{name} must split as shell words ({e}), got {raw!r}") from None


def cuda_flags() -> list[str]:
    """More ``nvcc`` flags for ``.cu`` sources (``OPBRIDGE_CUDA_FLAGS``, split as a shell would).

    Raises
    ------
    ValueError
        If the value does not split (an unclosed quote).
    """
    return _shell_words("OPBRIDGE_CUDA_FLAGS")


def cxx_flags() -> list[str]:
    """More C++ compiler flags (``OPBRIDGE_CXX_FLAGS``, split as a shell would), passed when compiling every
    C++ unit and linking every module: ``-fsanitize=address,undefined`` needs both.

    Raises
    ------
    ValueError
        If the value does not split (an unclosed quote).
    """
    return _shell_words("OPBRIDGE_CXX_FLAGS")


AOT_DEVICE_CHOICES = ("cpu", "cuda")


def aot_devices() -> tuple[str, ...] | None:
    """The devices named by ``OPBRIDGE_AOT_DEVICES`` (e.g. ``("cpu", "cuda")``), or None when unset.

    None means: CPU, and CUDA where the library has CUDA sources and ``nvcc``
    is found (:func:`opbridge.aot.setuptools.opbridge_extensions`).
    """
    raw = os.environ.get("OPBRIDGE_AOT_DEVICES", "").strip()
    if not raw:
        return None
    names = tuple(dict.fromkeys(d.strip().lower() for d in raw.split(",") if d.strip()))
    bad = [d for d in names if d not in AOT_DEVICE_CHOICES]
    if bad or not names:
        raise ValueError(f"OPBRIDGE_AOT_DEVICES must list devices among {', '.join(AOT_DEVICE_CHOICES)}, "
                         f"got {raw!r}")
    return names


THREADING_CHOICES = ("omp", "pool")


def threading() -> str:
    """The CPU threading policy (``OPBRIDGE_THREADING``: ``omp``, the default, or ``pool``).

    The kernels read the variable themselves, once per process; this accessor
    exists so that a misspelt value fails loudly when a module is loaded
    instead of silently meaning the default.
    """
    raw = os.environ.get("OPBRIDGE_THREADING") or "omp"
    if raw not in THREADING_CHOICES:
        raise ValueError(f"OPBRIDGE_THREADING must be one of {', '.join(THREADING_CHOICES)}, got {raw!r}")
    return raw


def hugepages() -> bool:
    """Whether fresh CPU outputs get transparent-huge-page advice (``OPBRIDGE_HUGEPAGES``, default on)."""
    return _flag("OPBRIDGE_HUGEPAGES", True)


def _whole(name: str, default: int, what: str, least: int = 0) -> int:
    """A whole-number setting (unset or empty: *default*); a value that is not one, or is under *least*,
    raises ValueError naming the setting."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit():
        raise ValueError(f"{name} must be a whole number ({what}), got {raw!r}")
    if int(raw) < least:
        raise ValueError(f"{name} must be at least {least}, got {int(raw)}")
    return int(raw)


def output_cache_bytes() -> int:
    """Bytes the pool of freed large CPU outputs may hold (``OPBRIDGE_OUTPUT_CACHE_MB``, default 256).

    A value that is not a whole number of MiB raises ValueError, when the
    pool is first configured (the first large output) or by ``opbridge doctor``.
    """
    return _whole("OPBRIDGE_OUTPUT_CACHE_MB", 256, "of MiB; 0 turns recycling off") << 20


def object_cache_mb() -> float | None:
    """The build cache's size bound in MiB (``OPBRIDGE_OBJECT_CACHE_MB``; None: unset, the default of
    :func:`opbridge.build.housekeeping.size_bound`). A value that is not a positive number raises ValueError,
    at the prune after a build or by ``opbridge doctor``."""
    raw = os.environ.get("OPBRIDGE_OBJECT_CACHE_MB", "").strip()
    if not raw:
        return None
    try:
        mib = float(raw)
    except ValueError:
        mib = float("nan")
    if not 0 < mib < float("inf"):
        raise ValueError(f"OPBRIDGE_OBJECT_CACHE_MB must be a positive number (of MiB), got {raw!r}")
    return mib


def output_cache_idle_ms() -> int:
    """How long a recycled output buffer may sit unused (``OPBRIDGE_OUTPUT_CACHE_IDLE_MS``, default 1000)."""
    return _whole("OPBRIDGE_OUTPUT_CACHE_IDLE_MS", 1000, "of milliseconds, at least 1", least=1)


def numpy_native() -> bool:
    """Whether NumPy calls go through opbridge's C entry (``OPBRIDGE_NUMPY_NATIVE``, default on)."""
    return _flag("OPBRIDGE_NUMPY_NATIVE", True)


def exchange_entry() -> bool:
    """Whether calls on Paddle's and MindSpore's tensors go through opbridge's tensor C entry
    (``OPBRIDGE_EXCHANGE_ENTRY``, default on)."""
    return _flag("OPBRIDGE_EXCHANGE_ENTRY", True)


def torch_native() -> bool:
    """Whether torch ops get the native (C++) dispatcher kernels (``OPBRIDGE_TORCH_NATIVE``, default on)."""
    return _flag("OPBRIDGE_TORCH_NATIVE", True)


#: The settings the accessors above read (the table in this module's docstring), each with its accessor where a
#: value can be wrong: :func:`problems` calls those.
SETTINGS: dict[str, object] = {
    "OPBRIDGE_CACHE_DIR": None, "OPBRIDGE_VERBOSE": verbose, "OPBRIDGE_MAX_JOBS": max_jobs,
    "OPBRIDGE_NO_PROGRESS": show_progress, "OPBRIDGE_CXX": None, "OPBRIDGE_CXX_FLAGS": cxx_flags,
    "OPBRIDGE_CUDA_ARCHS": cuda_archs, "OPBRIDGE_CUDA_FLAGS": cuda_flags, "OPBRIDGE_AOT_DEVICES": aot_devices,
    "OPBRIDGE_CUDA_SYNC_CHECKS": None, "OPBRIDGE_HUGEPAGES": hugepages, "OPBRIDGE_OUTPUT_CACHE_MB": output_cache_bytes,
    "OPBRIDGE_OUTPUT_CACHE_IDLE_MS": output_cache_idle_ms, "OPBRIDGE_THREADING": threading,
    "OPBRIDGE_NUMPY_NATIVE": numpy_native, "OPBRIDGE_EXCHANGE_ENTRY": exchange_entry,
    "OPBRIDGE_TORCH_NATIVE": torch_native, "OPBRIDGE_OBJECT_CACHE_MB": object_cache_mb,
}
#: Read by opbridge's scripts, test suite and benchmarks, not by the library.
TOOL_SETTINGS = ("OPBRIDGE_FRAMEWORK", "OPBRIDGE_FUZZ_DEVICE", "OPBRIDGE_FUZZ_EXAMPLES", "OPBRIDGE_MS_PYTHON",
                 "OPBRIDGE_MINDSPORE_PYTHON", "OPBRIDGE_NO_UV", "OPBRIDGE_UV", "OPBRIDGE_SANITIZE_CACHE_DIR",
                 "OPBRIDGE_SKIP_MINDSPORE", "OPBRIDGE_SKIP_WHEEL", "OPBRIDGE_CI_WORK", "OPBRIDGE_CI_KEEP",
                 "OPBRIDGE_CI_TORCH", "OPBRIDGE_CI_PIP_ARGS")


def problems() -> tuple[list[str], dict[str, list[str]]]:
    """What is wrong with the ``OPBRIDGE_*`` settings now: each misspelt value's error (a call would raise it),
    and each ``OPBRIDGE_*`` name no setting has, with the closest names (a misspelt name is silently unset)."""
    import difflib

    errors = []
    for read in SETTINGS.values():
        if callable(read):
            try:
                read()
            except ValueError as e:
                errors.append(str(e))
    names = [*SETTINGS, *TOOL_SETTINGS]
    tails = [n.removeprefix("OPBRIDGE_") for n in names]  # the prefix alone would make every name close
    unknown = {name: ["OPBRIDGE_" + t for t in difflib.get_close_matches(name.removeprefix("OPBRIDGE_"), tails, 2)]
               for name in sorted(os.environ) if name.startswith("OPBRIDGE_") and name not in names}
    return errors, unknown
