"""``opbridge doctor``: the toolchain, GPUs, the JIT cache, the installed frameworks and torch's native kernels.

Nothing here imports a framework or ``tvm_ffi`` (which imports torch when it is
installed): versions come from distribution metadata, and tools (and where the
torch native shim is cached, which needs torch) are probed as subprocesses.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import opbridge
from opbridge import config
from opbridge.cli.common import EXIT_FAILURE, EXIT_OK, print_json
from opbridge.errors import CacheSecurityError

#: framework -> distribution whose metadata gives its version (``doctor``)
FRAMEWORKS: dict[str, str] = {
    "torch": "torch",
    "jax": "jax",
    "jax_tvm_ffi": "jax-tvm-ffi",
    "paddle": "paddlepaddle",
    "mindspore": "mindspore",
    "numpy": "numpy",
}
_PROBE_TIMEOUT_S = 15


def _probe(cmd: Sequence[str]) -> tuple[int, str]:
    """Run *cmd*; return its exit status (127 when missing or hung) and combined output."""
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return 127, str(e)
    return proc.returncode, (proc.stdout or proc.stderr).strip()


def _tool(exe: str | None, version_args: Sequence[str] = ("--version",),
          pick: Callable[[list[str]], str] = lambda lines: lines[0]) -> dict[str, Any]:
    """Describe a command-line tool: path, version line, usable."""
    path = shutil.which(exe) if exe else None
    if path is None:
        return {"command": exe, "path": None, "version": "not found", "ok": False}
    rc, out = _probe([path, *version_args])
    lines = [line for line in out.splitlines() if line.strip()]
    ok = rc == 0 and bool(lines)
    return {"command": exe, "path": path, "version": pick(lines) if ok else f"not working: {out[:200]}",
            "ok": ok}


def _ninja_exe() -> str | None:
    """The ninja opbridge builds with: on PATH, else the ``ninja`` Python package's binary."""
    found = shutil.which("ninja")
    if found:
        return found
    if importlib.util.find_spec("ninja") is None:
        return None
    import ninja as ninja_pkg

    candidate = Path(ninja_pkg.BIN_DIR) / "ninja"
    return str(candidate) if candidate.exists() else None


def _release_line(lines: list[str]) -> str:
    """The ``Cuda compilation tools, release X.Y, ...`` line of ``nvcc --version``."""
    return next((line for line in lines if "release" in line), lines[-1])


def _nvcc() -> dict[str, Any]:
    """nvcc, and what CUDA builds pass it: ``OPBRIDGE_CUDA_ARCHS`` and ``OPBRIDGE_CUDA_FLAGS``."""
    from opbridge.build.toolchain import nvcc_path

    try:
        flags: list[str] | str = config.cuda_flags()
    except ValueError as e:
        flags = f"error: {e}"
    try:
        archs: list[str] | str = config.cuda_archs()
    except ValueError as e:
        archs = f"error: {e}"
    settings = {"archs": archs, "flags": flags}
    path = nvcc_path()
    if path is None:
        return {"path": None, "version": "not found", "ok": False, **settings}
    tool = _tool(path, pick=_release_line)
    return {**tool, "command": "nvcc", **settings, "ok": tool["ok"] and not isinstance(archs, str)}


def _cuda_gpu() -> dict[str, Any]:
    smi = shutil.which("nvidia-smi")
    gpus: list[str] = []
    if smi:
        rc, out = _probe([smi, "-L"])
        gpus = [line for line in out.splitlines() if line.startswith("GPU")] if rc == 0 else []
    dev = Path("/dev/nvidia0").exists()
    return {"present": bool(gpus) or dev, "nvidia_smi": smi, "dev_nvidia0": dev, "gpus": gpus}


def _tvm_ffi() -> dict[str, Any]:
    """Find tvm-ffi's headers and runtime library without importing it (it would import torch)."""
    from opbridge.bench.timing import dist_version

    version = dist_version("apache-tvm-ffi")
    spec = importlib.util.find_spec("tvm_ffi")
    if version is None or spec is None or not spec.submodule_search_locations:
        return {"version": version or "not installed", "path": None, "ok": False}
    root = Path(next(iter(spec.submodule_search_locations)))
    libs = sorted((root / "lib").glob("libtvm_ffi.*"))
    header = root / "include" / "tvm" / "ffi" / "function.h"
    return {"version": version, "path": str(root), "library": str(libs[0]) if libs else None,
            "headers": header.is_file(), "ok": bool(libs) and header.is_file()}


def _cache() -> dict[str, Any]:
    """The JIT cache directory: where it is, whether it is private, and whether a build can use it (``ok``)."""
    from opbridge.build.cache import cache_root, unusable

    info: dict[str, Any] = {"dir": str(config.cache_dir())}
    try:
        root = cache_root(create=False)
    except CacheSecurityError as e:
        return {**info, "exists": True, "private": False, "ok": False, "error": str(e)}
    info["exists"] = root.exists()
    info["private"] = True if root.exists() else None  # created 0700 on first build
    problem = unusable(root)
    if problem is not None:
        return {**info, "ok": False, "error": problem}
    return {**info, "ok": True}


def _ascend() -> dict[str, Any]:
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        value = os.environ.get(var)
        if value and Path(value).is_dir():
            return {"found": True, "path": value, "detail": f"${var}"}
    for cand in (Path("/usr/local/Ascend/ascend-toolkit"), Path.home() / "Ascend" / "ascend-toolkit"):
        if cand.is_dir():
            return {"found": True, "path": str(cand), "detail": "ascend-toolkit directory"}
    return {"found": False, "path": None, "detail": "not found"}


#: Run in a subprocess (it imports torch): where this Python's torch native shim is cached, and whether it is there.
_TORCH_NATIVE_PROBE = ("from opbridge.adapters.torch.native import build; p = build.path(); "
                       "print(p); print(int(p.is_file()))")


def _torch_native(torch_installed: bool) -> dict[str, Any]:
    """The torch native kernels (``adapters/torch/native``): built, not built yet, or turned off."""
    if not torch_installed:
        return {"state": "no torch", "path": None, "built": False}
    if not config.torch_native():
        return {"state": "off (OPBRIDGE_TORCH_NATIVE=0): torch.ops runs the Python kernels", "path": None,
                "built": False}
    rc, out = _probe([sys.executable, "-c", _TORCH_NATIVE_PROBE])
    lines = out.splitlines()
    if rc != 0 or len(lines) < 2:
        return {"state": f"unknown: {lines[-1] if lines else 'the probe printed nothing'}", "path": None,
                "built": False}
    from opbridge.build.cache import build_lock, lock_held

    built = lines[-1] == "1"
    if built:
        state = "built"
    elif lock_held(build_lock(Path(lines[-2]))):
        state = ("being built in the background now (by a detached compiler that finishes even if the program "
                 "that started it has exited, on idle CPU only: `opbridge build` takes it over if it gets none); "
                 "until then torch.ops runs the Python kernels")
    else:
        state = ("not built yet: `opbridge build` compiles it (10-60 s of one core); the first kernel load "
                 "also starts it in the background, and until then torch.ops runs the Python kernels")
    return {"state": state, "path": lines[-2], "built": built}


def _c_entry(module: str, off: str | None, first: str) -> dict[str, Any]:
    """A C entry (:mod:`opbridge.call.c_entry`): built for this Python, not yet, or off (*off* says how;
    None: on). *first* says which calls start its build."""
    if off is not None:
        return {"state": off, "path": None, "built": False}
    if not config.cache_dir().exists():  # looking must not create the cache
        path = None
    else:
        from opbridge.call import c_entry
        from opbridge.errors import OpbridgeError

        try:
            path = c_entry.module_entry(module).cached()
        except (OpbridgeError, OSError) as e:
            return {"state": f"unknown: {e}", "path": None, "built": False}
    if path is None:
        return {"state": f"not built yet: `opbridge build` compiles it (a few seconds); the first {first} call also "
                         "starts it in the background, in a process that finishes even if the program exits first",
                "path": None, "built": False}
    return {"state": "built", "path": str(path), "built": True}


def _numpy_entry() -> dict[str, Any]:
    """NumPy's C entry (``adapters/numpy/native.py``)."""
    off = None if config.numpy_native() else "off (OPBRIDGE_NUMPY_NATIVE=0): NumPy calls take the Python fast path"
    return _c_entry("opbridge.adapters.numpy.native", off, "NumPy")


def _exchange_entry(frameworks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The tensor entry (``call/exchange.py``), which Paddle's and MindSpore's calls go through first: said
    only of the frameworks installed here; with neither, it is not used (``applies`` false)."""
    users = [name for key, name in (("paddle", "Paddle"), ("mindspore", "MindSpore")) if frameworks[key]["installed"]]
    if not users:
        return {"state": "not used: only Paddle and MindSpore calls use it, and neither is installed", "path": None,
                "built": False, "applies": False}
    who = " and ".join(users)
    off = (None if config.exchange_entry()
           else f"off (OPBRIDGE_EXCHANGE_ENTRY=0): {who} calls take the Python fast path")
    return {**_c_entry("opbridge.call.exchange", off, " or ".join(users)), "applies": True}


def _outputs() -> dict[str, Any]:
    """What a large new CPU output gets (:mod:`opbridge.call.memory`): recycling bounds and huge pages."""
    from opbridge.call import memory

    try:
        cache_mb = config.output_cache_bytes() >> 20
        idle_ms = config.output_cache_idle_ms()
        advise = config.hugepages()
    except ValueError as e:
        return {"min_bytes": memory.MIN_BYTES, "error": str(e), "state": f"misconfigured: {e}"}
    if not advise:
        pages = "huge-page advice off (OPBRIDGE_HUGEPAGES=0)"
    elif memory.advise_enabled():
        pages = "huge pages advised (THP in [madvise] mode)"
    else:
        try:
            mode = memory._THP_MODE.read_text().strip()
        except OSError:
            mode = "not available"
        pages = f"no huge-page advice (transparent huge pages: {mode})"
    recycling = (f"recycled, up to {cache_mb} MiB held, released after {idle_ms} ms unused" if cache_mb else
                 "not recycled (OPBRIDGE_OUTPUT_CACHE_MB=0)")
    return {"min_bytes": memory.MIN_BYTES, "cache_bytes": cache_mb << 20,
            "idle_ms": idle_ms, "recycling": bool(cache_mb), "pages": pages,
            "state": f"{memory.MIN_BYTES >> 20} MiB and more: 2 MiB-aligned, {recycling}; {pages}"}


def _frameworks() -> dict[str, dict[str, Any]]:
    from opbridge.bench.timing import dist_version

    out: dict[str, dict[str, Any]] = {}
    for name, dist in FRAMEWORKS.items():
        version = dist_version(dist)
        out[name] = {"distribution": dist, "installed": version is not None, "version": version}
    return out


def _settled(section: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A native entry's section, or, where a setting it reads is misspelt (ValueError), what is wrong."""
    try:
        return section()
    except ValueError as e:
        return {"state": f"misconfigured: {e}", "path": None, "built": False, "error": str(e)}


def doctor_report() -> dict[str, Any]:
    """Everything ``opbridge doctor`` checks, as one JSON-serialisable dict."""
    cxx = _tool(config.cxx())
    try:
        cxx["flags"] = config.cxx_flags()
    except ValueError as e:
        cxx["flags"], cxx["ok"] = f"error: {e}", False
    ninja = _tool(_ninja_exe())
    tvm = _tvm_ffi()
    frameworks = _frameworks()
    errors, unknown = config.problems()
    cache = _cache()
    return {
        "ok": bool(cxx["ok"] and ninja["ok"] and tvm["ok"] and cache["ok"] and not errors),
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "opbridge": {"version": opbridge.__version__, "path": str(Path(opbridge.__file__).resolve().parent)},
        "tvm_ffi": tvm,
        "cxx": cxx,
        "ninja": ninja,
        "nvcc": _nvcc(),
        "cuda_gpu": _cuda_gpu(),
        "ascend": _ascend(),
        "cache": cache,
        "frameworks": frameworks,
        "torch_native": _settled(lambda: _torch_native(frameworks["torch"]["installed"])),
        "numpy_entry": _settled(_numpy_entry),
        "exchange_entry": _settled(lambda: _exchange_entry(frameworks)),
        "outputs": _outputs(),
        "settings": {"errors": errors, "unknown": unknown},
    }


def _cxx_settings(cxx: dict[str, Any]) -> str:
    """The c++ line's tail: OPBRIDGE_CXX_FLAGS where set (they change every module)."""
    flags = cxx.get("flags") or []
    shown = flags if isinstance(flags, str) else " ".join(flags)
    return f" (OPBRIDGE_CXX_FLAGS {shown})" if shown else ""


def _cuda_settings(nvcc: dict[str, Any]) -> str:
    """The nvcc line's tail: the architectures, and OPBRIDGE_CUDA_FLAGS where set (they change the kernels)."""
    flags = nvcc.get("flags") or []
    shown = flags if isinstance(flags, str) else " ".join(flags)
    archs = nvcc.get("archs", [])
    return (f" (archs {archs if isinstance(archs, str) else ';'.join(archs)}"
            + (f"; OPBRIDGE_CUDA_FLAGS {shown}" if shown else "") + ")")


def _doctor_lines(r: dict[str, Any]) -> list[str]:
    def mark(ok: bool) -> str:
        return "ok " if ok else "-- "

    cache = r["cache"]
    private = {True: "private", False: "NOT PRIVATE", None: "not created yet"}[cache["private"]]
    gpu = r["cuda_gpu"]
    gpus = ", ".join(gpu["gpus"]) or ("yes" if gpu["present"] else "none")
    lines = [
        f"    python      {r['python']['version']} ({r['python']['executable']})",
        f"    opbridge    {r['opbridge']['version']} ({r['opbridge']['path']})",
        f"{mark(r['tvm_ffi']['ok'])} tvm-ffi     {r['tvm_ffi']['version']} ({r['tvm_ffi']['path']})",
        f"{mark(r['cxx']['ok'])} c++         {r['cxx']['command']}: {r['cxx']['version']}" + _cxx_settings(r["cxx"]),
        f"{mark(r['ninja']['ok'])} ninja       {r['ninja']['path']}: {r['ninja']['version']}",
        f"{mark(r['nvcc']['ok'])} nvcc        {r['nvcc']['path'] or ''} {r['nvcc']['version']}".rstrip()
        + _cuda_settings(r["nvcc"]),
        f"{mark(gpu['present'])} cuda gpu    {gpus}",
        f"{mark(r['ascend']['found'])} ascend/cann {r['ascend']['path'] or r['ascend']['detail']}",
        f"{mark(cache['ok'])} cache       {cache['dir']} ({private})",
    ]
    if "error" in cache:
        lines.append(f"      {cache['error']}")
    for name, fw in r["frameworks"].items():
        lines.append(f"{mark(fw['installed'])} {name:<11} {fw['version'] or 'not installed'}")
    native = r["torch_native"]
    where = f" ({native['path']})" if native["built"] else ""
    lines.append(f"{mark(native['built'])} torch shim  {native['state']}{where}")
    for key, label in (("numpy_entry", "numpy entry"), ("exchange_entry", "tensor entry")):
        entry = r[key]
        where = f" ({entry['path']})" if entry["built"] else ""
        flag = mark(entry["built"]) if entry.get("applies", True) else "   "  # not used here: neither ok nor amiss
        lines.append(f"{flag} {label} {entry['state']}{where}")
    out = r["outputs"]
    lines.append(f"{'-- ' if 'error' in out else '   '} outputs     {out['state']}")
    settings = r["settings"]
    for error in settings["errors"]:
        lines.append(f"-- settings    {error}")
    for name, close in settings["unknown"].items():
        lines.append(f"   settings    {name} is no opbridge setting, so it does nothing"
                     + (f" (did you mean {' or '.join(close)}?)" if close else ""))
    wrong = []  # the verdict: each reason doctor fails, else that the core toolchain is usable
    if settings["errors"]:
        wrong.append("settings NOT valid: whatever reads them (a build, an op's first call) raises the error above")
    if not (r["tvm_ffi"]["ok"] and r["cxx"]["ok"] and r["ninja"]["ok"]):
        wrong.append("core toolchain NOT usable (needs c++, ninja, tvm-ffi)")
    if not cache["ok"]:
        wrong.append("cache directory NOT usable: every build, and so an op's first call, fails (the cache line "
                     "above says why)")
    lines.append("; ".join(wrong) or "core toolchain usable")
    return lines


def _cmd_doctor(args: argparse.Namespace) -> int:
    report = doctor_report()
    if args.json:
        print_json(report)
    else:
        print("\n".join(_doctor_lines(report)))
    return EXIT_OK if report["ok"] else EXIT_FAILURE


def register(sub: Any) -> None:
    """Add ``opbridge doctor`` to the subcommands *sub*."""
    p = sub.add_parser("doctor", help="check the toolchain and installed frameworks",
                       description="Report Python, opbridge and tvm-ffi versions, the C++ compiler, ninja, "
                                   "nvcc, CUDA GPUs, Ascend CANN, the JIT cache, installed frameworks "
                                   "(without importing them) and whether torch's native kernels are built. "
                                   "Exits 1 unless the core toolchain (C++ compiler, ninja, tvm-ffi) and the "
                                   "cache directory (OPBRIDGE_CACHE_DIR) are usable and the OPBRIDGE_* settings "
                                   "valid.")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=_cmd_doctor)
