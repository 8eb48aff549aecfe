"""Build a library's kernels into one module file that ships inside a wheel.

An ahead-of-time (AOT) build compiles the same :class:`~opbridge.build.BuildSpec`
the JIT path compiles (every kernel source of the library, one ninja build,
``OPBRIDGE_MAX_JOBS`` compiles in parallel) plus one generated translation
unit, ``__opbridge_build_info``, that records what the module was built from.
A CPU module also carries the host code a framework adapter would otherwise
compile into the opbridge cache on a user's machine (:data:`ADAPTER_SOURCES`:
JAX's argument-order handler), so that an installed wheel compiles nothing.
The module is named ``<name>.so`` (``.pyd`` on Windows): it is a tvm-ffi
module, not a CPython extension, so it must not carry a Python-version suffix,
and ``.so`` is one of ``importlib.machinery.EXTENSION_SUFFIXES`` on every
POSIX CPython, so ``importlib.util.find_spec("pkg._C_ops")`` -- what the
loader uses to find a prebuilt module -- finds it from any Python 3.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from opbridge.build.library import (  # some re-exported (__all__): the AOT stamp lives in the build stage
    INFO_SYMBOL,
    aot_spec,
    build_info,
    check_kernels,
    declared_kernels,
    exports,
    is_current,
    signatures,
)
from opbridge.build.ninja import run_ninja, write_ninja
from opbridge.errors import DeclarationError

if TYPE_CHECKING:
    from opbridge.declare import Library

#: Framework-free host code of the adapters, compiled into every AOT CPU module beside the kernels (the
#: adapter takes it from the loaded prebuilt module, else builds it into the cache once): the JAX adapter's
#: XLA handler shim (``opbridge_jax_handler``: kernel-order arguments, huge-page advice), without which
#: a JAX op whose kernel does not take XLA's argument order needs a C++ compiler at its first call.
ADAPTER_SOURCES = (Path(str(importlib.resources.files("opbridge.adapters") / "jax" / "handler.cc")),)

__all__ = ["DEFAULT_MODULE", "INFO_SYMBOL", "aot_spec", "build_aot", "build_info", "check_exports",
           "declared_kernels", "exports", "is_current", "module_filename", "module_name", "module_suffix"]

#: Default module name, as in the vLLM plugins: ``<package>._C_ops``.
DEFAULT_MODULE = "_C_ops"


def module_suffix() -> str:
    """File suffix of AOT modules on this platform (``.so``, or ``.pyd`` on Windows)."""
    return ".pyd" if sys.platform == "win32" else ".so"


def module_filename(name: str = DEFAULT_MODULE) -> str:
    """File name of the AOT module called *name*, e.g. ``_C_ops.so``."""
    return name + module_suffix()


def module_name(lib: Library, device: str = "cpu") -> str:
    """The AOT module's name for *device*: the last part of its prebuilt name, else ``_C_ops`` (``_C_ops_cuda``)."""
    prebuilt = lib.prebuilt_module(device)
    if prebuilt is not None:
        return prebuilt.rpartition(".")[2]
    return DEFAULT_MODULE if device == "cpu" else f"{DEFAULT_MODULE}_{device}"


def check_exports(lib: Library, path: str | Path, device: str = "cpu") -> None:
    """Check that the module at *path* exports every kernel *lib* declares for *device*.

    Raises
    ------
    DeclarationError
        Naming each op whose kernel no source exports, and the closest exported names
        (:func:`opbridge.build.library.check_kernels`); or each kernel whose C++ signature does not take
        what its op's schema passes (:func:`opbridge.loader.check_signature`, what the first call checks).
    """
    from opbridge._tvm import tvm_ffi
    from opbridge.loader import check_signature

    tvm_ffi()
    check_kernels(lib, device, path, "AOT-built")
    # What the first call would refuse (loader.check_signature), refused now: a wheel ships no such kernel.
    recorded = signatures(path)
    wrong = []
    for op in lib.ops.values():
        name = op.kernels.get(device)
        if name is not None and name in recorded:
            try:
                check_signature(op, name, recorded[name])
            except DeclarationError as e:
                wrong.append(str(e))
    if wrong:
        raise DeclarationError("\n".join(wrong) + f"\n  module: {path} (AOT-built)")


def build_aot(
    lib: Library,
    out_dir: str | Path,
    *,
    device: str = "cpu",
    name: str | None = None,
    build_dir: str | Path | None = None,
) -> Path:
    """Compile every kernel source of *lib* into one module file in *out_dir*.

    Parameters
    ----------
    lib
        The declared library; its sources and ops come from the registry's declarations.
    out_dir
        Directory for the module (created if missing), e.g. the package directory.
    device
        ``"cpu"`` or ``"cuda"``.
    name
        Module name; default :func:`module_name` (``_C_ops`` for ``prebuilt="pkg._C_ops"``, and
        ``_C_ops_cuda`` for CUDA, where the loader looks for it).
    build_dir
        Where ninja keeps objects between builds (setuptools' ``build_temp``). Without it
        the module is built in (or taken from) the content-addressed JIT cache.

    Returns
    -------
    Path
        The module, ``out_dir / <name>.so``; it replaces any previous one atomically.

    Raises
    ------
    BuildError
        If a source fails to compile (with the command and the first ``file:line`` errors).
    DeclarationError
        If a declared kernel is exported by no source.
    """
    from opbridge.build import jit

    spec = aot_spec(lib, device)
    if device == "cpu":
        spec = dataclasses.replace(spec, sources=(*spec.sources, *ADAPTER_SOURCES))
    if build_dir is None:
        built = jit.build(spec)
    else:
        bdir = Path(build_dir).resolve()
        (bdir / "obj").mkdir(parents=True, exist_ok=True)
        built = bdir / f"{spec.name}.so"
        write_ninja(spec, bdir, built)
        run_ninja(spec, bdir)
    check_exports(lib, built, device)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / module_filename(name or module_name(lib, device))
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.copyfile(built, tmp)
    os.chmod(tmp, 0o755)  # noqa: S103 - a shared library, read and mapped by every user
    os.replace(tmp, target)
    return target
