"""What compiles a set of sources into one tvm-ffi module: the :class:`BuildSpec` (an options object),
its compile and link commands, its generated units and its cache key.

The JIT path runs the commands through the object store (:mod:`opbridge.build.incremental`), the
ahead-of-time path through ninja (:mod:`opbridge.build.ninja`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from opbridge import config
from opbridge.build.isa import NATIVE_FLAGS, native_isa_id, uses_native_isa
from opbridge.build.toolchain import (
    cuda_arch_key,
    cuda_lib_dir,
    nvcc_path,
    toolchain_fingerprint,
)
from opbridge.declare import HEADER_SUFFIXES, SOURCE_SUFFIXES
from opbridge.errors import BackendUnavailableError

INCLUDE_DIR = Path(__file__).resolve().parent.parent / "include"
CPU_SUFFIXES = SOURCE_SUFFIXES["cpu"]
CUDA_SUFFIXES = SOURCE_SUFFIXES["cuda"]
TEMPLATES = Path(__file__).resolve().parent / "templates"


@functools.cache
def exports_tu() -> str:
    """The translation unit compiled into every module (exported-kernel list, threading policy)."""
    return (TEMPLATES / "exports.cc").read_text()


@functools.cache
def runtime_tu() -> str:
    """The translation unit defining what ``opbridge.h`` declares under ``OPB_SEPARATE_RUNTIME``.

    The argument checks, the error stream and ``OPBRIDGE_EXPORT``'s typed-call
    helpers, compiled once per module (and, through the object store, once per
    machine and flags) instead of once per kernel source.
    """
    return (TEMPLATES / "runtime.cc").read_text()


#: The translation units opbridge compiles into every module: the export list and the runtime.
OPBRIDGE_UNITS = ("_opbridge_exports.cc", "_opbridge_runtime.cc")


def generated_sources(spec: BuildSpec) -> list[tuple[str, str]]:
    """The ``(file name, text)`` translation units compiled beside *spec*'s sources."""
    return [*spec.generated, *zip(OPBRIDGE_UNITS, (exports_tu(), runtime_tu()))]


@dataclass(frozen=True)
class BuildSpec:
    """Everything that determines one compiled module.

    Parameters
    ----------
    name
        Module name (also the ``.so`` file's stem).
    sources
        C++ (``.cc``/``.cpp``) or CUDA (``.cu``) files.
    device
        ``"cpu"`` or ``"cuda"``: which toolchain and flags to use.
    include_dirs, cflags, ldflags
        Extra include directories and flags.
    """

    name: str
    sources: tuple[Path, ...]
    device: str = "cpu"
    include_dirs: tuple[Path, ...] = ()
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    generated: tuple[tuple[str, str], ...] = field(default=())
    """Extra generated sources as ``(file name, text)`` pairs."""
    native_isa: bool = False
    """Compile C++ for this machine's CPU (``-march=native -DOPB_NATIVE_ISA``: one code path
    per hot loop instead of ``OPB_TARGET_CLONES``' three). For JIT builds, which only ever
    run where they were built; the cache keys then include what ``native`` resolved to
    (:func:`native_isa_id`). AOT builds keep it off: a wheel must run on any x86-64 CPU."""
    flags_for_sources_only: bool = False
    """``include_dirs`` and ``cflags`` skip the units opbridge adds (:data:`OPBRIDGE_UNITS`), which then
    compile as a plain spec's, one object for every such module. For the C entries, whose flags find
    Python's and NumPy's headers and key the build; a library's reach every unit (a define may change
    what its units share)."""

    def unit_spec(self, name: str) -> BuildSpec:
        """The spec the unit *name* compiles under (see :attr:`flags_for_sources_only`)."""
        if self.flags_for_sources_only and name in OPBRIDGE_UNITS:
            return dataclasses.replace(self, include_dirs=(), cflags=())
        return self


def _tvm_ffi_paths() -> tuple[list[str], Path]:
    from opbridge._tvm import libinfo as tvm_libinfo

    libinfo = tvm_libinfo()  # no import of tvm_ffi: a cache key needs only the paths
    includes = [libinfo.find_include_path(), libinfo.find_dlpack_include_path()]
    return includes, Path(libinfo.find_libtvm_ffi())


#: Defined for every C++ unit: ``opbridge.h`` then only declares its runtime (:func:`runtime_tu`).
SEPARATE_RUNTIME = "OPB_SEPARATE_RUNTIME"


def _default_flags(spec: BuildSpec) -> tuple[list[str], list[str], list[str]]:
    tvm_includes, _ = _tvm_ffi_paths()
    includes = [str(INCLUDE_DIR), *map(str, spec.include_dirs), *tvm_includes]
    inc = [f"-I{p}" for p in includes]
    user = config.cxx_flags()  # OPBRIDGE_CXX_FLAGS: last, so that they override ours
    cxx = ["-std=c++17", "-O3", "-fPIC", "-fopenmp", "-fvisibility=hidden", f"-D{SEPARATE_RUNTIME}",
           *inc, *spec.cflags, *user]
    if uses_native_isa(spec):
        cxx[6:6] = NATIVE_FLAGS
    cuda: list[str] = []
    if spec.device == "cuda":
        cuda = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC,-fvisibility=hidden", "--expt-relaxed-constexpr"]
        archs = config.cuda_archs()
        for arch in archs:
            cuda += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        if archs:
            # PTX of the newest architecture as well, so that a newer GPU can
            # JIT-compile it instead of failing with "no kernel image".
            newest = max(archs, key=cuda_arch_key)
            cuda += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]
        cuda += [*inc, *spec.cflags, *config.cuda_flags()]
    _, lib = _tvm_ffi_paths()
    ld = ["-shared", "-fopenmp", f"-L{lib.parent}", f"-l{lib.stem.removeprefix('lib')}"]
    if spec.device == "cuda":
        # The CUDA runtime is linked statically: the module then needs no
        # libcudart.so.<toolkit major> at load time (a CUDA build of torch
        # ships a different major), loads on machines without a driver (the
        # runtime opens libcuda.so.1 on its first call, which then fails with a
        # clear error), and keeps its cuda* symbols to itself.
        nvcc = nvcc_path()
        cuda_lib = cuda_lib_dir(nvcc) if nvcc else None
        if cuda_lib is not None:
            ld.append(f"-L{cuda_lib}")
        ld += ["-lcudart_static", "-ldl", "-lpthread", "-lrt", "-Wl,--exclude-libs,libcudart_static.a"]
    ld += [*spec.ldflags, *user]
    return cxx, cuda, ld


_INCLUDE_FLAGS = ("-I", "-iquote")  # a user's own headers; -isystem / -idirafter trees are not hashed


def hashed_include_dirs(spec: BuildSpec) -> list[Path]:
    """The directories whose headers are part of *spec*'s cache key: opbridge's, the spec's ``include_dirs``,
    and those its ``cflags`` name with ``-I`` or ``-iquote`` (``-Idir``, ``-I dir``). A tree passed with
    ``-isystem`` is not hashed: a library's own version, not its files, should key a build on it."""
    dirs = [INCLUDE_DIR, *spec.include_dirs]
    flags = list(spec.cflags)
    for i, flag in enumerate(flags):
        for prefix in _INCLUDE_FLAGS:
            if flag == prefix and i + 1 < len(flags):
                dirs.append(Path(flags[i + 1]))
            elif flag.startswith(prefix) and len(flag) > len(prefix):
                dirs.append(Path(flag[len(prefix):]))
    return [d.resolve() for d in dirs if d.is_dir()]


_QUOTE_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"\n]+)"', re.MULTILINE)


def local_headers(spec: BuildSpec, sources: Sequence[bytes] | None = None) -> list[tuple[str, bytes]]:
    """The headers the sources include with quotes from beside themselves, followed transitively.

    ``#include "my_op.h"`` finds ``my_op.h`` next to the including file before
    any include directory, so a kernel's own headers need no ``include_dirs``
    and were in no include directory that :func:`fingerprint` hashed. Returns
    (the name as written, the header's contents), each header once, in a
    stable order; headers under opbridge's or the spec's include directories
    are left to their directory's hash. *sources*: the sources' contents, where
    the caller has read them.
    """
    hashed = hashed_include_dirs(spec)
    seen: set[Path] = set()
    found: list[tuple[str, bytes]] = []
    texts: list[bytes | None] = list(sources) if sources is not None else [None] * len(spec.sources)
    todo = list(zip(spec.sources, texts))
    while todo:
        including, text = todo.pop(0)
        if text is None:
            try:
                text = including.read_bytes()
            except OSError:
                continue
        for m in _QUOTE_INCLUDE.finditer(text):
            name = m.group(1).decode("utf-8", "replace")
            path = including.parent / name
            if not path.is_file():
                continue  # found on an include directory (hashed there), or missing: the compiler says
            path = path.resolve()
            if path in seen or any(path.is_relative_to(d) for d in hashed):
                continue
            seen.add(path)
            data = path.read_bytes()
            found.append((name, data))
            todo.append((path, data))
    return found


def fingerprint(spec: BuildSpec, extra: str = "") -> str:
    """Hash the *contents* of every input to the build, plus flags and toolchain."""
    from opbridge._tvm import version as tvm_ffi_version
    from opbridge._version import __version__

    h = hashlib.sha256()

    def feed(label: str, data: bytes) -> None:
        h.update(label.encode() + b"\0" + len(data).to_bytes(8, "little") + data)

    feed("name", spec.name.encode())
    feed("device", spec.device.encode())
    sources = [src.read_bytes() for src in spec.sources]
    for data in sources:
        feed("src", data)
    for gname, text in spec.generated:
        feed("gen:" + gname, text.encode())
    for inc_dir in hashed_include_dirs(spec):
        for hdr in sorted(inc_dir.rglob("*")):
            if hdr.is_file() and hdr.suffix in HEADER_SUFFIXES:
                feed("hdr:" + str(hdr.relative_to(inc_dir)), hdr.read_bytes())
    for name, data in local_headers(spec, sources):
        feed("local:" + name, data)
    cxx, cuda, ld = _default_flags(spec)
    feed("flags", "\0".join(_portable_flags([*cxx, "|", *cuda, "|", *ld], spec)).encode())
    feed("toolchain", toolchain_fingerprint(spec.device).encode())
    feed("versions", f"opbridge={__version__};tvm_ffi={tvm_ffi_version()};{sys.platform}".encode())
    feed("exports_tu", exports_tu().encode())
    feed("runtime_tu", runtime_tu().encode())
    if spec.flags_for_sources_only:
        feed("flags_for_sources_only", b"1")
    if uses_native_isa(spec):
        feed("native_isa", native_isa_id().encode())
    feed("extra", extra.encode())
    return h.hexdigest()


def _portable_flags(flags: list[str], spec: BuildSpec) -> list[str]:
    """*flags* with install locations replaced by names, for the cache key.

    The same sources, headers and tvm-ffi version build the same module in
    every virtualenv; hashing where tvm-ffi or opbridge happen to be
    installed would give each environment its own copy. Header *contents*
    are hashed separately, and tvm-ffi's through its version.
    """
    tvm_includes, lib = _tvm_ffi_paths()
    names = {str(INCLUDE_DIR): "<opbridge>", str(lib.parent): "<tvm_ffi_lib>"}
    names.update({p: "<tvm_ffi_include>" for p in tvm_includes})
    names.update({str(d): f"<include_{i}>" for i, d in enumerate(spec.include_dirs)})
    out = []
    for f in flags:
        for prefix in ("-I", "-L"):
            if f.startswith(prefix) and f[2:] in names:
                f = prefix + names[f[2:]]
        out.append(f)
    return out


def _nvcc_or_raise(spec: BuildSpec) -> str:
    nvcc = nvcc_path()
    if nvcc is None:
        raise BackendUnavailableError(
            f"cannot build {spec.name} for cuda: nvcc was not found on PATH "
            "(install the CUDA toolkit or build for cpu only)"
        )
    return nvcc


def compile_command(spec: BuildSpec, source: Path) -> list[str]:
    """The command compiling *source* of *spec*, without output and depfile arguments.

    :func:`compile_args` appends those; the object store hashes this part.
    """
    cxx_flags, cuda_flags, _ = _default_flags(spec)
    if source.suffix in CUDA_SUFFIXES:
        return [_nvcc_or_raise(spec), *cuda_flags, "-c", str(source)]
    return [config.cxx(), *cxx_flags, "-c", str(source)]


def compile_args(command: list[str], obj: Path | str, depfile: Path | str) -> list[str]:
    """*command* (from :func:`compile_command`) writing *obj* and its make-style *depfile*.

    gcc/clang take ``-MMD`` (project headers only), nvcc ``-MD`` (it has no
    ``-MMD`` that works on every toolkit); both write the ``-MF`` file.
    """
    deps = "-MD" if Path(command[0]).name.startswith("nvcc") else "-MMD"
    return [*command, "-o", str(obj), deps, "-MF", str(depfile)]


def link_command(spec: BuildSpec, objects: list[Path], output: Path) -> list[str]:
    """The command linking *objects* into the module *output*."""
    _, _, ld_flags = _default_flags(spec)
    return [config.cxx(), *map(str, objects), *ld_flags, "-o", str(output)]
