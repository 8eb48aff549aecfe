"""Compiling the native dispatcher shim (``shim.cc``) against the running torch, once, into the cache.

The shim depends on torch's C++ ABI, the Python ABI (it calls Python
kernels through pybind11), tvm-ffi's C ABI and its own source, so the cache
key hashes exactly those: torch's version and git revision, the extension
suffix of the running interpreter, tvm-ffi's version, the compiler named by
``OPBRIDGE_CXX``/``CXX`` and the source text. Computing the key reads the
shim's source files and runs no process, so looking for a built shim costs nothing
noticeable; building it (12 s of one core on a 2-core machine) happens only where
a :class:`Job` starts, in a detached child that finishes even if this process exits
(a background job starts none while another build of the shim is in flight).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from opbridge import _tvm, config
from opbridge.build import detached, housekeeping
from opbridge.build.cache import SHIMS_DIR, cache_root
from opbridge.build.progress import Progress, first_errors
from opbridge.errors import BuildError

SOURCE = Path(__file__).with_name("shim.cc")
#: opbridge's headers; the shim includes ``opbridge/host_buffers.h`` (the pool's interface),
#: ``opbridge/raised_error.h`` (a kernel's error, raised once) and ``opbridge/byte_rows.h`` (rows
#: at a stride, and whether two tensors share a byte).
INCLUDE_DIR = Path(__file__).resolve().parents[3] / "include"
#: Every file the shim is compiled from (``shim.cc`` includes the headers beside it): its cache key.
SOURCES = (SOURCE, *(SOURCE.with_name(h) for h in ("op_state.h", "python_calls.h", "kernel_call.h", "python_entry.h")),
           *(INCLUDE_DIR / "opbridge" / h for h in ("host_buffers.h", "raised_error.h", "byte_rows.h")))
#: The linker version script: the shim exports its ``opb_*`` C entries and nothing else (the file says why).
EXPORTS = SOURCE.with_name("exports.map")
LIB_NAME = "libopbridge_torch_native.so"


def _with_cuda() -> bool:
    """Whether to compile the CUDA branch: torch was built with CUDA. The branch reads torch's current
    stream through c10's device-generic interface, so it needs no CUDA toolkit or runtime headers."""
    return torch.version.cuda is not None


def _tvm_ffi_version() -> str:
    """tvm-ffi's version from its metadata: importing it just for that costs most of a second."""
    try:
        return importlib.metadata.version("apache-tvm-ffi")
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(_tvm.tvm_ffi(), "__version__", ""))


def _installs() -> list[str]:
    """Where torch and tvm-ffi are installed: the shim's RUNPATH names their library directories, so a
    shim built in one environment must not be loaded by another that shares the cache (it would load
    that environment's libraries beside this one's). Found without importing tvm_ffi."""
    spec = importlib.util.find_spec("tvm_ffi")
    tvm_dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    return [str(Path(torch.__file__).resolve().parent), *tvm_dirs]


def cache_key() -> str:
    """The content hash naming this process's shim in the cache."""
    parts = [torch.__version__, str(torch.version.git_version), str(torch.version.cuda),
             str(sysconfig.get_config_var("EXT_SUFFIX")), sys.implementation.cache_tag or "",
             _tvm_ffi_version(), config.cxx(), *_installs(), *(p.read_text() for p in (*SOURCES, EXPORTS))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def path() -> Path:
    """Where this process's shim is (or would be) cached."""
    return config.cache_dir() / SHIMS_DIR / cache_key() / LIB_NAME


def command(output: Path) -> list[str]:
    """The compiler command building the shim into *output*."""
    from torch.utils import cpp_extension

    libinfo = _tvm.libinfo()
    tvm_lib = Path(libinfo.find_libtvm_ffi())
    torch_lib = Path(torch.__file__).parent / "lib"
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"],
                libinfo.find_include_path(), libinfo.find_dlpack_include_path(), INCLUDE_DIR]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [config.cxx(), "-std=c++20", "-O2", "-fPIC", "-shared", "-fvisibility=hidden",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in includes), str(SOURCE), "-o", str(output),
           f"-L{torch_lib}", "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10",
           f"-L{tvm_lib.parent}", f"-l{tvm_lib.stem.removeprefix('lib')}",
           f"-Wl,-rpath,{torch_lib}", f"-Wl,-rpath,{tvm_lib.parent}",
           f"-Wl,--version-script={EXPORTS}", "-Wl,--exclude-libs,ALL"]
    if _with_cuda():
        cmd[1:1] = ["-DOPB_WITH_CUDA"]
    return cmd


class Job:
    """One compile of the shim into the cache, running from construction on.

    The compiler runs in a detached child (:mod:`opbridge.build.detached`)
    that writes a temporary file and renames it into place when done, under
    the shim's lock: a reader never sees half a library, a concurrent build
    waits for this one instead of compiling again, and a program that exits
    mid-build leaves the child to finish, so the next process finds the shim.
    With *background*, the child runs at a lower priority, and starts only
    where no build of the shim is in flight: where one is (another program's,
    still compiling), the job starts nothing (:attr:`joined`) and :meth:`wait`
    waits for that build, compiling itself only if that one installs nothing
    (it failed, or was killed: its lock went with it). A compile killed mid-way
    leaves its temporary: the next job removes it once no compile holds the
    lock (:func:`opbridge.build.housekeeping.remove_shim_temporaries`).
    """

    def __init__(self, background: bool = False, out: Path | None = None,
                 make_command: Callable[[Path], list[str]] | None = None) -> None:
        cache_root()  # the cache is private before anything is compiled into it
        self.out = path() if out is None else out
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.background = background
        self._make_command = command if make_command is None else make_command
        #: the compiler's output before it is renamed into place, and its command (none while joined)
        self.tmp: Path | None = None
        self.command: list[str] = []
        self.child: detached.Child | None = None
        housekeeping.remove_shim_temporaries(self.out.parent)
        #: whether another build of the shim was in flight: this job started nothing and waits for that one
        self.joined = not self._start()

    def _start(self) -> bool:
        """Start the compiler, unless (in the background) a build of the shim is in flight; whether it started."""
        if self.background and detached.in_flight(self.out):  # before making a temporary it would not use
            return False
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=self.out.parent)
        os.close(fd)
        self.tmp = Path(tmp)
        try:
            self.command = self._make_command(self.tmp)
            if config.verbose():
                print(" ".join(self.command), file=sys.stderr)
            self.child = detached.locked_compile(self.command, self.out, self.tmp, self.background)
        finally:
            if self.child is None:  # a build that took the lock since in_flight looked, or an error
                self.tmp.unlink(missing_ok=True)
        return self.child is not None

    def wait(self) -> Path:
        """The built shim's path, once the compiler (this job's or a concurrent one) is done.

        Raises
        ------
        BuildError
            With the command and the compiler's first errors, when compiling fails.
        """
        while self.child is None:  # joined a build in flight: its result, else (none installed) this job's own
            if detached.awaited(self.out):
                return self.out
            self._start()
        code, log = self.child.wait()
        # stopped by a foreground build that took its lock (build.preempt)? That one installs the shim
        if not (detached.installed(self.out) or (code != 0 and detached.awaited(self.out))):
            errors = first_errors(log)
            last = log.strip().splitlines()[-1:]
            why = f": {last[0]}" if last and not errors else ""  # not a compile error: say what it was
            raise BuildError(f"building the torch native shim failed{why}", " ".join(self.command), errors, log)
        return self.out

    def cancel(self) -> None:
        """Stop the compiler if it still runs and remove what it wrote (a build this job joined runs on)."""
        if self.child is not None:
            self.child.stop()
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)


def build() -> Path:
    """Compile the shim into the cache now, with a progress line.

    Raises
    ------
    BuildError
        With the command and the compiler's first errors, when compiling fails.
    """
    with Progress("the torch native dispatcher shim (once per torch version)", config.show_progress()) as progress:
        progress.status = "compiling shim.cc"
        job = Job()
        try:
            return job.wait()
        except BaseException:  # Ctrl-C in the foreground stops the compiler too
            job.cancel()
            raise
