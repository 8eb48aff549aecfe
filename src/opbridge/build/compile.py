"""Compile a set of sources into one tvm-ffi module with ninja.

The build is described by a :class:`BuildSpec` (an options object); this
module turns it into a ``build.ninja``, runs it with progress, and converts a
failure into :class:`~opbridge.errors.BuildError` with the compiler's first
``file:line`` errors.
"""

from __future__ import annotations

import functools
import hashlib
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from opbridge import config
from opbridge.declare import SOURCE_SUFFIXES
from opbridge.errors import BackendUnavailableError, BuildError

INCLUDE_DIR = Path(__file__).resolve().parent.parent / "include"
CPU_SUFFIXES = SOURCE_SUFFIXES["cpu"]
CUDA_SUFFIXES = SOURCE_SUFFIXES["cuda"]
TEMPLATES = Path(__file__).resolve().parent / "templates"


@functools.cache
def exports_tu() -> str:
    """The translation unit compiled into every module (exported-kernel list, threading policy)."""
    return (TEMPLATES / "exports.cc").read_text()
_ERROR_RE = re.compile(r"^(?P<loc>[^\s:][^:]*:\d+(?::\d+)?): (?:fatal )?error[:\s]", re.M)
_NVCC_ERROR_RE = re.compile(r"^(?P<loc>[^\s(][^(]*\(\d+\)): error", re.M)


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


def _tvm_ffi_paths() -> tuple[list[str], Path]:
    from opbridge._tvm import tvm_ffi

    libinfo = tvm_ffi().libinfo

    includes = [libinfo.find_include_path(), libinfo.find_dlpack_include_path()]
    return includes, Path(libinfo.find_libtvm_ffi())


@functools.cache
def _compiler_version(compiler: str) -> str:
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
    import os

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


def _cuda_arch_key(arch: str) -> int:
    digits = re.match(r"\d+", arch)
    return int(digits.group()) if digits else 0


def toolchain_fingerprint(device: str) -> str:
    """Describe the compilers a build for *device* uses (part of the cache key)."""
    parts = [_compiler_version(config.cxx())]
    if device == "cuda":
        nvcc = nvcc_path()
        parts.append(_compiler_version(nvcc) if nvcc else "no-nvcc")
        parts.append(";".join(config.cuda_archs()))
    return "\n".join(parts)


def _default_flags(spec: BuildSpec) -> tuple[list[str], list[str], list[str]]:
    tvm_includes, _ = _tvm_ffi_paths()
    includes = [str(INCLUDE_DIR), *map(str, spec.include_dirs), *tvm_includes]
    inc = [f"-I{p}" for p in includes]
    cxx = ["-std=c++17", "-O3", "-fPIC", "-fopenmp", "-fvisibility=hidden", *inc, *spec.cflags]
    cuda: list[str] = []
    if spec.device == "cuda":
        cuda = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC,-fvisibility=hidden", "--expt-relaxed-constexpr"]
        archs = config.cuda_archs()
        for arch in archs:
            cuda += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        if archs:
            # PTX of the newest architecture as well, so that a newer GPU can
            # JIT-compile it instead of failing with "no kernel image".
            newest = max(archs, key=_cuda_arch_key)
            cuda += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]
        cuda += [*inc, *spec.cflags]
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
    ld += list(spec.ldflags)
    return cxx, cuda, ld


def fingerprint(spec: BuildSpec, extra: str = "") -> str:
    """Hash the *contents* of every input to the build, plus flags and toolchain."""
    from opbridge._tvm import tvm_ffi
    from opbridge._version import __version__

    h = hashlib.sha256()

    def feed(label: str, data: bytes) -> None:
        h.update(label.encode() + b"\0" + len(data).to_bytes(8, "little") + data)

    feed("name", spec.name.encode())
    feed("device", spec.device.encode())
    for src in spec.sources:
        feed("src", src.read_bytes())
    for gname, text in spec.generated:
        feed("gen:" + gname, text.encode())
    for inc_dir in (INCLUDE_DIR, *spec.include_dirs):
        for hdr in sorted(Path(inc_dir).rglob("*")):
            if hdr.is_file() and hdr.suffix in (".h", ".hpp", ".cuh", ".inc"):
                feed("hdr:" + str(hdr.relative_to(inc_dir)), hdr.read_bytes())
    cxx, cuda, ld = _default_flags(spec)
    feed("flags", "\0".join(_portable_flags([*cxx, "|", *cuda, "|", *ld], spec)).encode())
    feed("toolchain", toolchain_fingerprint(spec.device).encode())
    feed("versions", f"opbridge={__version__};tvm_ffi={tvm_ffi().__version__};{sys.platform}".encode())
    feed("exports_tu", exports_tu().encode())
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


def _ninja_escape(s: str) -> str:
    return s.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def write_ninja(spec: BuildSpec, build_dir: Path, output: Path) -> Path:
    """Write ``build.ninja`` for *spec* into *build_dir*; return its path."""
    cxx_flags, cuda_flags, ld_flags = _default_flags(spec)
    sources = list(spec.sources)
    for gname, text in (*spec.generated, ("_opbridge_exports.cc", exports_tu())):
        gpath = build_dir / gname
        gpath.write_text(text)
        sources.append(gpath)
    lines = [
        "ninja_required_version = 1.3",
        f"cxx = {config.cxx()}",
        f"cxxflags = {' '.join(shlex.quote(f) for f in cxx_flags)}",
        f"ldflags = {' '.join(shlex.quote(f) for f in ld_flags)}",
        "rule cxx",
        "  command = $cxx -MMD -MF $out.d $cxxflags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = compile $in",
        "rule link",
        "  command = $cxx $in $ldflags -o $out",
        "  description = link $out",
    ]
    if any(s.suffix in CUDA_SUFFIXES for s in sources):
        nvcc = nvcc_path()
        if nvcc is None:
            raise BackendUnavailableError(
                f"opbridge: cannot build {spec.name} for cuda: nvcc was not found on PATH "
                "(install the CUDA toolkit or build for cpu only)"
            )
        lines += [
            f"nvcc = {nvcc}",
            f"cudaflags = {' '.join(shlex.quote(f) for f in cuda_flags)}",
            "rule nvcc",
            "  command = $nvcc $cudaflags -c $in -o $out",
            "  description = nvcc $in",
        ]
    objects = []
    for i, src in enumerate(sources):
        obj = f"obj/{i:03d}_{src.stem}.o"
        rule = "nvcc" if src.suffix in CUDA_SUFFIXES else "cxx"
        lines.append(f"build {obj}: {rule} {_ninja_escape(str(src.resolve()))}")
        objects.append(obj)
    lines.append(f"build {_ninja_escape(str(output))}: link {' '.join(objects)}")
    lines.append(f"default {_ninja_escape(str(output))}")
    path = build_dir / "build.ninja"
    path.write_text("\n".join(lines) + "\n")
    return path


def _first_errors(log: str, limit: int = 5) -> list[str]:
    found: list[str] = []
    for line in log.splitlines():
        if _ERROR_RE.match(line) or _NVCC_ERROR_RE.match(line):
            found.append(line.strip())
        if len(found) >= limit:
            break
    return found


class _Progress:
    """Prints one updating status line once a build has run for a second."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled
        self.status = "starting"
        self.start = time.monotonic()
        self.shown = False
        self.tty = sys.stderr.isatty()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Progress:
        if self.enabled:
            self._thread.start()
        return self

    def _line(self) -> str:
        return f"\ropbridge: building {self.label}: {self.status} ({time.monotonic() - self.start:.1f}s)"

    def _run(self) -> None:
        if self._stop.wait(1.0):
            return
        self.shown = True
        if not self.tty:
            # A log file gets one line when the build turns slow, one when it ends.
            sys.stderr.write(f"opbridge: building {self.label} ({self.status})...\n")
            sys.stderr.flush()
            self._stop.wait()
            return
        while not self._stop.is_set():
            sys.stderr.write(self._line() + "\033[K")
            sys.stderr.flush()
            self._stop.wait(0.25)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.enabled:
            self._thread.join()
        if self.shown:
            done = "failed" if exc[0] else "done"
            lead, tail = ("\r", "\033[K") if self.tty else ("", "")
            sys.stderr.write(f"{lead}opbridge: building {self.label}: {done} in "
                             f"{time.monotonic() - self.start:.1f}s{tail}\n")
            sys.stderr.flush()


def run_ninja(spec: BuildSpec, build_dir: Path) -> None:
    """Run ninja in *build_dir*, with progress; raise BuildError on failure."""
    ninja = shutil.which("ninja")
    if ninja is None:
        try:
            import ninja as ninja_pkg

            ninja = str(Path(ninja_pkg.BIN_DIR) / "ninja")
        except ImportError as e:
            raise BackendUnavailableError("opbridge: the `ninja` build tool was not found") from e
    cmd = [ninja, "-j", str(config.max_jobs())]
    if config.verbose():
        cmd.append("-v")
    env = {"NINJA_STATUS": "[%f/%t done, %r running] "}
    import os

    log: list[str] = []
    label = f"{spec.name} ({spec.device})"
    with subprocess.Popen(cmd, cwd=build_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env={**os.environ, **env}) as proc, \
            _Progress(label, config.show_progress()) as progress:
        assert proc.stdout is not None  # guaranteed by stdout=PIPE
        for line in proc.stdout:
            log.append(line)
            if config.verbose():
                sys.stderr.write(line)
            m = re.match(r"\[(\d+)/(\d+) done, (\d+) running\] (\w+) (.*)", line)
            if m:
                progress.status = (f"{m.group(1)}/{m.group(2)} steps done, {m.group(3)} running, "
                                   f"last: {m.group(4)} {Path(m.group(5).strip()).name}")
        rc = proc.wait()
    if rc != 0:
        text = "".join(log)
        failed = re.search(r"^FAILED: .*\n(.*)$", text, re.M)
        command = failed.group(1).strip() if failed else " ".join(cmd)
        errors = _first_errors(text)
        raise BuildError(f"opbridge: building {label} failed (ninja exit {rc})",
                         command=command, errors=errors, log=text)
