"""The ``opbridge`` command line: list, build, doctor and bench.

Exit status: 0 on success, 1 when the requested work fails (a build error, a
benchmark failure, a missing toolchain for ``doctor``), 2 on a usage error.

This module imports no framework at import time: ``opbridge --help``,
``opbridge list`` and ``opbridge doctor`` never import torch, JAX, Paddle or
MindSpore (nor ``tvm_ffi``, which imports torch when it is installed).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opbridge import __version__, config
from opbridge.errors import CacheSecurityError, OpbridgeError

if TYPE_CHECKING:
    from opbridge.declare import Library, OpDef

PROG = "opbridge"
EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

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


class UsageError(OpbridgeError, ValueError):
    """The command line asks for something that does not exist (exit status 2)."""


# -- shared helpers -----------------------------------------------------------


def _err(msg: str) -> None:
    print(f"{PROG}: error: {msg}", file=sys.stderr)


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2))


def _import_file(path: Path) -> None:
    """Import the ``.py`` file at *path* as a top-level module named after it, as ``python FILE`` would."""
    name = path.stem
    if name in sys.modules:
        raise UsageError(f"--import {path}: a module named {name!r} is already imported; rename the file "
                         "or import it by its dotted name")
    mod_spec = importlib.util.spec_from_file_location(name, path)
    if mod_spec is None or mod_spec.loader is None:
        raise UsageError(f"--import {path}: cannot import this file")
    sys.path.insert(0, str(path.resolve().parent))  # its sibling modules are importable
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = module
    try:
        mod_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


def _import_user_module(spec: str) -> None:
    """Import *spec*, a dotted module name or a path to a ``.py`` file, to declare its libraries.

    Raises
    ------
    UsageError
        If the module or file does not exist.
    """
    path = Path(spec)
    if spec.endswith(".py") or path.is_file():
        if not path.is_file():
            raise UsageError(f"--import {spec}: no such file")
        _import_file(path)
        return
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # as `python -m` would
    try:
        importlib.import_module(spec)
    except ModuleNotFoundError as e:
        if e.name and (spec == e.name or spec.startswith(e.name + ".")):
            raise UsageError(f"--import {spec}: no module named {e.name!r}") from None
        raise


def _import_all(specs: Sequence[str] | None) -> None:
    for spec in specs or ():
        _import_user_module(spec)


def _add_import_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--import", dest="imports", action="append", metavar="MODULE", default=[],
        help="import MODULE (a dotted name, or a path to a .py file) first, so the libraries it "
             "declares are included; repeatable",
    )


def _libraries() -> list[Library]:
    from opbridge import registry

    return registry.libraries()


# -- opbridge list -------------------------------------------------------------


def _shape_rule(op: OpDef) -> str | None:
    rule = op.shape
    if rule is None:
        return None
    if type(rule).__name__ == "like":
        return repr(rule)
    name = getattr(rule, "__qualname__", None)
    module = getattr(rule, "__module__", None)
    return f"{module}.{name}" if name and module else repr(rule)


def op_info(op: OpDef) -> dict[str, Any]:
    """The ``opbridge list --json`` record of *op*."""
    return {
        "namespace": op.library.namespace,
        "name": op.name,
        "qualname": op.qualname,
        "schema": str(op.schema),
        "devices": sorted(op.kernels),
        "kernels": dict(op.kernels),
        "backward": op.backward is not None,
        "shape": _shape_rule(op),
        "module": op.library.python_module,
    }


def _cmd_list(args: argparse.Namespace) -> int:
    _import_all(args.imports)
    rows = [op_info(op) for lib in _libraries() for op in lib.ops.values()]
    if args.json:
        _print_json(rows)
        return EXIT_OK
    if not rows:
        print("no ops are declared")
        return EXIT_OK
    width = max(len(r["qualname"]) for r in rows)
    for r in rows:
        print(f"{r['qualname']:<{width}}  {r['schema']}")
        print(f"{'':<{width}}    devices: {', '.join(r['devices'])}; backward: "
              f"{'yes' if r['backward'] else 'no'}; shape: {r['shape']}")
    return EXIT_OK


# -- opbridge build ------------------------------------------------------------


def _selected_libraries(names: Sequence[str] | None) -> list[Library]:
    libs = _libraries()
    if not names:
        return libs
    by_name = {lib.namespace: lib for lib in libs}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise UsageError(f"no library {', '.join(map(repr, missing))}; declared: "
                         f"{', '.join(sorted(by_name)) or 'none'} (use --import MODULE for your own)")
    return [by_name[n] for n in names]


def _build_one(lib: Library, device: str, force: bool) -> bool:
    """Build *lib* and report it; return False (after printing why) if the build failed."""
    start = time.monotonic()
    try:
        path = lib.build(device, force=force)
    except (OpbridgeError, OSError) as e:  # BuildError, BackendUnavailableError, CacheSecurityError
        _err(f"library {lib.namespace!r} ({device}):\n{e}")
        return False
    print(f"{lib.namespace} ({device}): {path} ({time.monotonic() - start:.2f}s)")
    return True


def _cmd_build(args: argparse.Namespace) -> int:
    if args.verbose:
        os.environ["OPBRIDGE_VERBOSE"] = "1"
    _import_all(args.imports)
    libs = _selected_libraries(args.library)
    ok = True
    built = 0
    for lib in libs:
        if not lib.sources_for(args.device) and not args.library:
            print(f"{lib.namespace}: skipped (no {args.device} sources)", file=sys.stderr)
            continue
        ok = _build_one(lib, args.device, args.force) and ok
        built += 1
    if built == 0:
        print(f"nothing to build for {args.device}", file=sys.stderr)
    return EXIT_OK if ok else EXIT_FAILURE


# -- opbridge doctor -----------------------------------------------------------


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
    from opbridge.build.compile import nvcc_path

    path = nvcc_path()
    if path is None:
        return {"path": None, "version": "not found", "ok": False}
    return {**_tool(path, pick=_release_line), "command": "nvcc"}


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
    from opbridge.build.cache import cache_root

    info: dict[str, Any] = {"dir": str(config.cache_dir())}
    try:
        root = cache_root(create=False)
    except CacheSecurityError as e:
        return {**info, "exists": True, "private": False, "error": str(e)}
    info["exists"] = root.exists()
    info["private"] = True if root.exists() else None  # created 0700 on first build
    return info


def _ascend() -> dict[str, Any]:
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        value = os.environ.get(var)
        if value and Path(value).is_dir():
            return {"found": True, "path": value, "detail": f"${var}"}
    for cand in (Path("/usr/local/Ascend/ascend-toolkit"), Path.home() / "Ascend" / "ascend-toolkit"):
        if cand.is_dir():
            return {"found": True, "path": str(cand), "detail": "ascend-toolkit directory"}
    return {"found": False, "path": None, "detail": "not found"}


def _frameworks() -> dict[str, dict[str, Any]]:
    from opbridge.bench.timing import dist_version

    out: dict[str, dict[str, Any]] = {}
    for name, dist in FRAMEWORKS.items():
        version = dist_version(dist)
        out[name] = {"distribution": dist, "installed": version is not None, "version": version}
    return out


def doctor_report() -> dict[str, Any]:
    """Everything ``opbridge doctor`` checks, as one JSON-serialisable dict."""
    cxx = _tool(config.cxx())
    ninja = _tool(_ninja_exe())
    tvm = _tvm_ffi()
    return {
        "ok": bool(cxx["ok"] and ninja["ok"] and tvm["ok"]),
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "opbridge": {"version": __version__, "path": str(Path(__file__).resolve().parent)},
        "tvm_ffi": tvm,
        "cxx": cxx,
        "ninja": ninja,
        "nvcc": _nvcc(),
        "cuda_gpu": _cuda_gpu(),
        "ascend": _ascend(),
        "cache": _cache(),
        "frameworks": _frameworks(),
    }


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
        f"{mark(r['cxx']['ok'])} c++         {r['cxx']['command']}: {r['cxx']['version']}",
        f"{mark(r['ninja']['ok'])} ninja       {r['ninja']['path']}: {r['ninja']['version']}",
        f"{mark(r['nvcc']['ok'])} nvcc        {r['nvcc']['path'] or ''} {r['nvcc']['version']}".rstrip(),
        f"{mark(gpu['present'])} cuda gpu    {gpus}",
        f"{mark(r['ascend']['found'])} ascend/cann {r['ascend']['path'] or r['ascend']['detail']}",
        f"{mark(cache['private'] is not False)} cache       {cache['dir']} ({private})",
    ]
    if "error" in cache:
        lines.append(f"      {cache['error']}")
    for name, fw in r["frameworks"].items():
        lines.append(f"{mark(fw['installed'])} {name:<11} {fw['version'] or 'not installed'}")
    verdict = "core toolchain usable" if r["ok"] else "core toolchain NOT usable (needs c++, ninja, tvm-ffi)"
    lines.append(verdict)
    return lines


def _cmd_doctor(args: argparse.Namespace) -> int:
    report = doctor_report()
    if args.json:
        _print_json(report)
    else:
        print("\n".join(_doctor_lines(report)))
    return EXIT_OK if report["ok"] else EXIT_FAILURE


# -- opbridge bench --------------------------------------------------------------


def _cmd_bench(args: argparse.Namespace) -> int:
    from opbridge import bench

    mod = bench.load(args.bench)
    result = mod.run(args)
    if args.json:
        _print_json(result)
    else:
        print(mod.format_text(result))
    return EXIT_OK


def _add_bench_parsers(sub: Any) -> None:
    from opbridge import bench

    bench_parser = sub.add_parser(
        "bench", help="run a benchmark",
        description="Run one of opbridge's benchmarks; `opbridge bench NAME --help` describes each.",
    )
    names = bench_parser.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name in bench.BENCHES:
        mod = bench.load(name)
        p = names.add_parser(name, help=mod.DESCRIPTION.split(":")[0], description=mod.DESCRIPTION)
        p.add_argument("--json", action="store_true", help="print one JSON document")
        p.add_argument("--quick", action="store_true", help="a short run (smoke test; numbers are rough)")
        mod.add_arguments(p)
        p.set_defaults(func=_cmd_bench)


# -- parser and entry point ----------------------------------------------------------


def _cmd_demo(args: argparse.Namespace) -> int:
    from opbridge import demo

    return demo.main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    """The ``opbridge`` argument parser."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="opbridge: declare a kernel once, use it as an op in every framework. "
                    "Exit status: 0 ok, 1 the requested work failed, 2 usage error.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("list", help="list the declared ops",
                       description="List every declared op: namespace, name, canonical schema, devices "
                                   "with kernels, whether it has a backward, and its shape rule.")
    p.add_argument("--json", action="store_true", help="print one JSON document (a list of objects)")
    _add_import_option(p)
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("build", help="build the declared libraries",
                       description="Compile (or fetch from the JIT cache) every declared library's module "
                                   "and print its path and the seconds it took. A compile error prints "
                                   "the failing command and the compiler's first file:line errors.")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="target device (default cpu)")
    p.add_argument("--force", action="store_true", help="rebuild even when the cache has the module")
    p.add_argument("-v", "--verbose", action="store_true", help="show compiler commands (OPBRIDGE_VERBOSE=1)")
    p.add_argument("--library", action="append", metavar="NS",
                   help="build only the library with namespace NS; repeatable")
    _add_import_option(p)
    p.set_defaults(func=_cmd_build)

    p = sub.add_parser("doctor", help="check the toolchain and installed frameworks",
                       description="Report Python, opbridge and tvm-ffi versions, the C++ compiler, ninja, "
                                   "nvcc, CUDA GPUs, Ascend CANN, the JIT cache and installed frameworks "
                                   "(without importing them). Exits 1 unless the core toolchain (C++ "
                                   "compiler, ninja, tvm-ffi) is usable.")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=_cmd_doctor)

    from opbridge.aot import cli as aot_cli
    from opbridge.codegen import cli as codegen_cli
    from opbridge.scaffold import cli as scaffold_cli

    aot_cli.register(sub)  # adds --aot / --out to `build`
    codegen_cli.register(sub)  # `codegen`
    scaffold_cli.register(sub)  # `new`
    p = sub.add_parser("demo", help="the main job: build, check and time every op in every framework",
                       description="Build the built-in library, run every op in each installed framework, "
                                   "check it against its reference and time it against the framework's own op.",
                       add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of python -m opbridge.demo (see --help)")
    p.set_defaults(func=_cmd_demo)
    _add_bench_parsers(sub)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace | int:
    """Parse *argv*; an int is the exit status argparse chose (``--help``: 0, a usage error: 2)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``opbridge`` command line; return its exit status."""
    parser = build_parser()
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args
    try:
        status: int = args.func(args)
    except UsageError as e:
        _err(str(e))
        return EXIT_USAGE
    except OpbridgeError as e:
        _err(str(e))
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    return status


if __name__ == "__main__":
    sys.exit(main())
