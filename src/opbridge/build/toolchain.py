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
import subprocess
from collections.abc import Sequence
from pathlib import Path

from opbridge import config
from opbridge.errors import BuildError

__all__ = ["compiler_version", "cuda_arch_key", "cuda_lib_dir", "missing_compiler", "nvcc_path",
           "require_compiler", "run_compiler", "toolchain_fingerprint"]


def missing_compiler(compiler: str) -> BuildError:
    """The error for a *compiler* that is not there: what was looked for, where from, how to fix it."""
    if compiler != config.cxx():
        return BuildError(f"opbridge: cannot run {compiler}: No such file or directory")
    origin = next((f"from ${v}" for v in ("OPBRIDGE_CXX", "CXX") if os.environ.get(v)),
                  "the default when neither OPBRIDGE_CXX nor CXX is set")
    where = "" if os.sep in compiler else " on PATH"
    return BuildError(f"opbridge: no C++ compiler found: looked for {compiler!r}{where} ({origin}). "
                      "Install one (g++ or clang++, e.g. `apt-get install g++`), or set OPBRIDGE_CXX "
                      "to the compiler to use (a name on PATH or a full path)")


def require_compiler(compiler: str) -> None:
    """Raise :func:`missing_compiler`'s error unless *compiler* can be run (before another program runs it)."""
    if shutil.which(compiler) is None:
        raise missing_compiler(compiler)


def run_compiler(command: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """Run the compiler *command*, its output captured; a missing compiler raises BuildError.

    Raises
    ------
    BuildError
        If ``command[0]`` cannot be started (not installed, not executable).
    """
    try:
        return subprocess.run(list(command), capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise missing_compiler(command[0]) from None
    except OSError as e:
        raise BuildError(f"opbridge: cannot run the compiler {command[0]!r}: {e}",
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
