"""The toolchain a build uses: the C++ compiler's and nvcc's identity, nvcc and the CUDA runtime's
location, CUDA architectures. :func:`toolchain_fingerprint` is part of every build's cache key.

Every compiler opbridge starts is run through :func:`run_compiler` (or checked first with
:func:`require_compiler` where another program starts it: ninja, a detached build), so a compiler
that is not installed is one :class:`~opbridge.errors.BuildError` saying how to get one.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

from opbridge import config
from opbridge.errors import BuildError

__all__ = ["CompilerGroup", "compiler_version", "cuda_arch_key", "cuda_lib_dir", "missing_compiler", "nvcc_path",
           "require_compiler", "run_compiler", "toolchain_fingerprint"]


def missing_compiler(compiler: str) -> BuildError:
    """The error for a *compiler* that is not there: what was looked for, where from, how to fix it."""
    if compiler != config.cxx():
        return BuildError(f"cannot run {compiler}: No such file or directory")
    origin = next((f"from ${v}" for v in ("OPBRIDGE_CXX", "CXX") if os.environ.get(v)),
                  "the default when neither OPBRIDGE_CXX nor CXX is set")
    where = "" if os.sep in compiler else " on PATH"
    return BuildError(f"no C++ compiler found: looked for {compiler!r}{where} ({origin}). "
                      "Install one (g++ or clang++, e.g. `apt-get install g++`), or set OPBRIDGE_CXX "
                      "to the compiler to use (a name on PATH or a full path)")


def require_compiler(compiler: str) -> None:
    """Raise :func:`missing_compiler`'s error unless *compiler* can be run (before another program runs it)."""
    if shutil.which(compiler) is None:
        raise missing_compiler(compiler)


class GroupStoppedError(Exception):
    """A compile its :class:`CompilerGroup` refused: the group was stopped before it started."""


class CompilerGroup:
    """The compilers of one build, which :meth:`stop` ends at once, those still to start included.

    Each runs in a session of its own: a terminal's Ctrl-C reaches the program, which stops the group.

    A build's compile threads start compilers while its caller waits. On Ctrl-C the caller learns of it
    only once it holds the GIL again, and a thread that finished a compile meanwhile has started the next:
    a compiler started after the signal never got it, and a build that then waited for its threads waited
    for that whole compile (``opbridge build`` stayed 7-17 s after SIGINT here while another thread imported
    torch). Stopping the group kills what runs and refuses what would start.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen[str]] = set()
        self._stopped = False

    def run(self, command: list[str]) -> subprocess.CompletedProcess[str]:
        """Run *command*, output captured, unless the group is stopped (:class:`GroupStoppedError`)."""
        with self._lock:
            if self._stopped:
                raise GroupStoppedError(command[0])
            # a session of its own, so that stop() can kill the driver's compiler and assembler too (they
            # hold the output pipe): killing the driver alone left communicate() waiting for them
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
            self._running.add(proc)
        try:
            out, err = proc.communicate()
        finally:
            with self._lock:
                self._running.discard(proc)
        return subprocess.CompletedProcess(command, proc.returncode, out, err)

    def stop(self) -> None:
        """Kill every compiler of the group that runs, and start none from now on."""
        with self._lock:
            self._stopped = True
            for proc in self._running:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:  # exited meanwhile
                    pass


def run_compiler(command: Sequence[str], group: CompilerGroup | None = None) -> subprocess.CompletedProcess[str]:
    """Run the compiler *command*, its output captured, as one of *group* where given; a missing compiler
    raises BuildError.

    Raises
    ------
    BuildError
        If ``command[0]`` cannot be started (not installed, not executable).
    GroupStoppedError
        If *group* was stopped before the compiler started.
    """
    try:
        if group is not None:
            return group.run(list(command))
        return subprocess.run(list(command), capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise missing_compiler(command[0]) from None
    except OSError as e:
        raise BuildError(f"cannot run the compiler {command[0]!r}: {e}",
                         command=" ".join(command)) from None


@functools.cache
def compiler_version(compiler: str) -> str:
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return "missing"
    return (out.stdout or out.stderr).strip()


def nvcc_path() -> str | None:
    """Return the ``nvcc`` executable, or None when CUDA is not installed.

    Looked up on ``PATH``, then in ``$CUDA_HOME/bin`` and ``$CUDA_PATH/bin``
    (the variables CUDA installers and PyTorch use), then in ``/usr/local/cuda/bin``.
    """
    found = shutil.which("nvcc")
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for root in roots:
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


@functools.cache
def cuda_lib_dir(nvcc: str) -> Path | None:
    """The directory holding the CUDA runtime libraries of *nvcc*'s toolkit.

    ``<toolkit>/lib64`` next to ``bin/nvcc`` when *nvcc* is (a link to) the real
    compiler; otherwise (a wrapper script on ``PATH``, a conda layout) the
    library directories nvcc itself reports with ``--dryrun``.
    """
    static = "libcudart_static.a"
    root = Path(nvcc).resolve().parent.parent
    for cand in (root / "lib64", root / "lib", root / "targets" / "x86_64-linux" / "lib"):
        if (cand / static).is_file():
            return cand
    try:
        out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", "/dev/null", "-o", "/dev/null"],
                             capture_output=True, text=True, check=False, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in (out.stdout + out.stderr).splitlines():
        if "LIBRARIES=" in line:
            for m in re.finditer(r'-L"?([^"\s]+)"?', line):
                cand = Path(m.group(1))
                if (cand / static).is_file():
                    return cand.resolve()
    return None


def cuda_arch_key(arch: str) -> int:
    digits = re.match(r"\d+", arch)
    return int(digits.group()) if digits else 0


def toolchain_fingerprint(device: str) -> str:
    """Describe the compilers a build for *device* uses (part of the cache key)."""
    parts = [compiler_version(config.cxx())]
    if device == "cuda":
        nvcc = nvcc_path()
        parts.append(compiler_version(nvcc) if nvcc else "no-nvcc")
        parts.append(";".join(config.cuda_archs()))
    return "\n".join(parts)
