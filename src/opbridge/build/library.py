"""A declared library's builds: its build spec per device, and the stamp an AOT module carries.

One :class:`~opbridge.build.compile.BuildSpec` describes a library's module for
a device; the JIT path (:mod:`opbridge.build.jit`) and the AOT path
(:mod:`opbridge.aot`) both compile it, the AOT one with a generated
translation unit (:func:`aot_spec`) recording what the module was built from,
so that the loader can tell a current prebuilt module from a stale one
(:func:`is_current`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import difflib
import functools
import json
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING, Any

from opbridge._tvm import load_library
from opbridge._version import __version__
from opbridge.build.compile import TEMPLATES, BuildSpec, fingerprint
from opbridge.errors import BackendUnavailableError, DeclarationError

if TYPE_CHECKING:
    from opbridge.declare import Library, OpDef

#: Devices opbridge has a toolchain for.
KNOWN_DEVICES = ("cpu", "cuda")
#: The C symbol of an AOT module that returns its build stamp (JSON).
INFO_SYMBOL = "__opbridge_build_info"
_INFO_TU = "_opbridge_build_info.cc"


def build_spec(lib: Library, device: str, native_isa: bool = True) -> BuildSpec:
    """The build description of *lib*'s module for *device*.

    *native_isa* (the JIT build's default) compiles CPU code for this machine
    (:attr:`~opbridge.build.compile.BuildSpec.native_isa`); the AOT build
    (:func:`aot_spec`) turns it off.
    """
    if device not in KNOWN_DEVICES:
        raise BackendUnavailableError(
            f"no toolchain for device {device!r} on this machine (supported: "
            f"{', '.join(KNOWN_DEVICES)}); Ascend NPUs need CANN's compiler, which is not installed"
        )
    sources = lib.sources_for(device)
    # Without sources for *device*, a missing file of any device is the likelier cause (a misspelt .cu).
    if missing := [str(s) for s in (sources or lib.sources) if not s.is_file()]:
        raise DeclarationError(f"library {lib.namespace!r} ({device}): no source file "
                               f"{', '.join(missing)} (Library(sources=...) resolves relative paths against "
                               f"{lib.root})")
    if not sources:
        raise BackendUnavailableError(f"library {lib.namespace!r} has no {device} sources")
    return BuildSpec(
        name=f"{lib.namespace}_{device}",
        sources=sources,
        device=device,
        include_dirs=lib.include_dirs,
        cflags=lib.cflags,
        ldflags=lib.ldflags,
        native_isa=native_isa and device == "cpu",
    )


def declared_kernels(lib: Library, device: str = "cpu") -> list[str]:
    """Sorted names of the kernels *lib*'s ops declare for *device* (what the module must export)."""
    return sorted({op.kernels[device] for op in lib.ops.values() if device in op.kernels})


@functools.cache
def _info_template() -> Template:
    return Template((TEMPLATES / "build_info.cc.tmpl").read_text())


def aot_spec(lib: Library, device: str = "cpu") -> BuildSpec:
    """The build spec of *lib* plus the generated build-stamp translation unit."""
    base = build_spec(lib, device, native_isa=False)
    info = {
        "namespace": lib.namespace,
        "device": device,
        "fingerprint": fingerprint(base),
        "kernels": declared_kernels(lib, device),
        "opbridge": __version__,
    }
    tu = _info_template().substitute(symbol=INFO_SYMBOL, info=json.dumps(info, sort_keys=True))
    return dataclasses.replace(base, name=f"{lib.namespace}_{device}_aot",
                               generated=(*base.generated, (_INFO_TU, tu)))


def build_info(path: str | Path) -> dict[str, Any]:
    """What the AOT module at *path* was built from (namespace, fingerprint, kernels, versions).

    Raises
    ------
    OSError
        If *path* cannot be loaded or was not built by :func:`opbridge.aot.build_aot`.
    """
    try:
        fn = load_library(path)[INFO_SYMBOL]
    except AttributeError:
        raise OSError(f"{path} is not an opbridge AOT module (no {INFO_SYMBOL})") from None
    fn.restype = ctypes.c_char_p
    info: dict[str, Any] = json.loads(fn().decode())
    return info


def is_current(lib: Library, path: str | Path, device: str = "cpu") -> bool:
    """Whether the AOT module at *path* was built from *lib*'s present sources, headers and flags.

    Meant for source trees (an editable install whose kernels were edited after
    the build); an installed wheel has no sources to compare with. Never raises.
    """
    try:
        info = build_info(path)
        return bool(info["fingerprint"] == fingerprint(build_spec(lib, device, native_isa=False))
                    and info["kernels"] == declared_kernels(lib, device))
    except (OSError, KeyError, ValueError, DeclarationError, BackendUnavailableError):
        return False


def signatures(path: str | Path) -> dict[str, str]:
    """Each exported kernel's signature (``"v:TTd"``: see ``export.h``'s ``signature_of``) in the module at *path*.

    Empty for a module built before opbridge recorded signatures.
    """
    try:
        fn = load_library(path)["__opbridge_signatures"]
    except AttributeError:
        return {}
    fn.restype = ctypes.c_char_p
    raw: bytes = fn()
    return dict(entry.split("=", 1) for entry in raw.decode().split(",") if "=" in entry)


def exports(path: str | Path) -> list[str]:
    """The kernel names exported (with ``OPBRIDGE_EXPORT``) by the opbridge-built module at *path*."""
    fn = load_library(path)["__opbridge_exports"]
    fn.restype = ctypes.c_char_p
    raw: bytes = fn()
    return [n for n in raw.decode().split(",") if n]


def missing_kernel(op: OpDef, device: str, exported: list[str], module: str = "built") -> str:
    """One line saying that *op*'s *device* kernel is not among *exported*, with the closest names.

    *module* says which module: ``"built"`` (JIT), ``"prebuilt"`` (an installed AOT module), ``"AOT-built"``.
    """
    name = op.kernels[device]
    close = difflib.get_close_matches(name, exported, n=3, cutoff=0.75)  # the export list follows anyway
    hint = f"did you mean {' or '.join(map(repr, close))}?" if close else "it exports no similar name"
    where = f"; declared at {op.origin}" if op.origin else ""
    return (f"{op.library.namespace}: op {op.name!r} names kernel {name!r} for {device}, which the {module} "
            f"{device} module does not export ({hint}){where}")


def check_kernels(lib: Library, device: str, path: str | Path, module: str = "built") -> None:
    """Check that the module at *path* exports the *device* kernel of every op of *lib* that declares one.

    Run once per module build or load (JIT, ``opbridge build``, AOT), so that a misspelt kernel
    name fails there, not at the op's first call. Ops without a *device* kernel are not checked,
    nor is a module that lists no exports (not built by opbridge: its kernels are looked up by
    name at their first call).

    Raises
    ------
    DeclarationError
        One line per op whose kernel the module does not export (naming the op, the kernel,
        where the op was declared and the closest exported names), then the module and what it exports.
    """
    wanted = [op for op in lib.ops.values() if device in op.kernels]
    if not wanted:
        return
    from opbridge._tvm import tvm_ffi

    tvm_ffi()  # the module links libtvm_ffi; have it loaded first
    try:
        exported = exports(path)
    except (AttributeError, OSError):  # no __opbridge_exports: not an opbridge-built module
        return
    have = set(exported)
    missing = [missing_kernel(op, device, exported, module) for op in wanted if op.kernels[device] not in have]
    if missing:
        names = sorted(exported)
        shown = ", ".join(names[:40]) + (", ..." if len(names) > 40 else "") if names else "nothing"
        raise DeclarationError("\n".join(missing) + f"\n  module: {path}\n  it exports: {shown}\n  (a kernel is "
                               f"exported with OPBRIDGE_EXPORT(<kernel>) in a source file listed in the "
                               f"Library's sources)")
