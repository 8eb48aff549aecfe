"""``opbridge bench build``: cold build and warm start times.

Every measurement runs in a fresh Python subprocess with fresh temporary
cache and build directories, so nothing is cached in memory or on disk:

``opbridge_cold``
    ``opbridge.ops.LIBRARY.build("cpu")`` into an empty ``OPBRIDGE_CACHE_DIR``.
``tvm_ffi_cold``
    ``tvm_ffi.cpp.build`` of the same sources (plus opbridge's generated
    export-list file) with the same flags, the raw tvm-ffi baseline.
``torch_load_inline``
    ``torch.utils.cpp_extension.load_inline`` of one equivalent op (``add``)
    written against ``torch/extension.h`` with pybind bindings (skipped by
    ``--quick``: it takes tens of seconds).

``opbridge_rebuild_one``
    after the library was built once from copies of its sources (untimed),
    one copy at a time gets a comment appended and the library is rebuilt: the
    object cache recompiles that unit alone, then links (skipped by
    ``--quick``).

Builds report wall seconds and CPU seconds (of the process and all its
finished descendants, i.e. the compilers), which other load on the machine
disturbs far less. The opbridge and tvm-ffi builds are repeated, alternating
which goes first, and their medians compared (a single cold build on a busy
two-core machine can be off by a factor of two); load_inline is built once.

The build timers start after ``import tvm_ffi`` / ``import torch`` (done
before the clock in every case; the two tvm-ffi builds hide torch, which
they do not use), so they compare the builds alone. Then the
warm start, with the cache populated as a program's first run leaves it
(``opbridge build``: the library, torch's dispatcher shim, NumPy's C
entry): ``import opbridge``, ``from opbridge
import ops`` and the first ``ops.add(x, y)``, on torch tensors (torch
imported before the clock) and on NumPy arrays (torch not imported), and the
cost of ``import tvm_ffi`` on its own.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opbridge.bench import POSITIVE_INT, BenchError, subproc
from opbridge.bench import build_scripts as scripts
from opbridge.bench.report import say
from opbridge.bench.subproc import OPBRIDGE_COLD, peer_source, script_or_raise
from opbridge.bench.timing import machine_info

DESCRIPTION = (
    "Cold build of the built-in op library (opbridge JIT) against tvm_ffi.cpp.build of the same "
    "sources and torch.utils.cpp_extension.load_inline of an equivalent op, each in a fresh "
    "subprocess and cache; then warm-start times (import opbridge + first call) and the cost of "
    "`import tvm_ffi`."
)

_NOTE = ("build timers start after `import tvm_ffi` (opbridge, tvm_ffi; torch hidden) or `import torch` "
         "(load_inline) in a fresh process; warm-start times exclude creating the inputs")
_FULL_REPEAT = 5
_FULL_COLD_REPEAT = 3
_QUICK_COLD_REPEAT = 1
_QUICK_REPEAT = 2
_TIMEOUT_S = 600
_FLAGS = ["-O3", "-fopenmp", "-fvisibility=hidden"]

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this benchmark's options to *parser*."""
    parser.add_argument("--repeat", type=POSITIVE_INT, metavar="N", default=None,
                        help=f"warm-start repetitions, each a fresh process (default {_FULL_REPEAT}, "
                             f"{_QUICK_REPEAT} with --quick); the median is reported")
    parser.add_argument("--cold-repeat", type=POSITIVE_INT, metavar="N", default=None,
                        help=f"cold builds of opbridge and of tvm-ffi, alternated (default "
                             f"{_FULL_COLD_REPEAT}, {_QUICK_COLD_REPEAT} with --quick); the median is "
                             "reported. load_inline is built once.")


def _progress(msg: str) -> None:
    say("build", msg)


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of a measurement subprocess: private caches under *tmp*, no progress lines."""
    env = dict(os.environ)
    env.update({
        "OPBRIDGE_CACHE_DIR": str(tmp / "opbridge-cache"),
        "OPBRIDGE_NO_PROGRESS": "1",
        "TVM_FFI_CACHE_DIR": str(tmp / "tvm-ffi-cache"),
        "TORCH_EXTENSIONS_DIR": str(tmp / "torch-extensions"),
        "MAX_JOBS": str(os.cpu_count() or 1),
    })
    env.pop("OPBRIDGE_VERBOSE", None)
    env.update(extra)
    return env


def _opbridge_cold(run_dir: Path) -> dict[str, Any]:
    res = script_or_raise("opbridge cold build", OPBRIDGE_COLD, _env(run_dir), timeout=_TIMEOUT_S)
    return {"seconds": res["seconds"], "cpu_seconds": res["cpu_seconds"], "path": res["path"]}


def _tvm_ffi_cold(run_dir: Path) -> dict[str, Any]:
    build_dir = run_dir / "tvm-ffi-build"
    build_dir.mkdir()
    payload = json.dumps([str(build_dir), _FLAGS])
    res = script_or_raise("tvm_ffi cold build", scripts.TVM_FFI_COLD, _env(run_dir), payload, timeout=_TIMEOUT_S)
    return {"seconds": res["seconds"], "cpu_seconds": res["cpu_seconds"], "sources": res["sources"],
            "flags": _FLAGS}


_COLD: dict[str, Callable[[Path], dict[str, Any]]] = {
    "opbridge_cold": _opbridge_cold,
    "tvm_ffi_cold": _tvm_ffi_cold,
}


def _cold_builds(tmp: Path, repeat: int) -> tuple[dict[str, Any], Path]:
    """Alternate the opbridge and tvm-ffi cold builds *repeat* times, each in a fresh directory.

    Returns the median (and every sample) per builder, and the first opbridge
    run's directory, whose cache the warm-start measurements reuse.
    """
    names = list(_COLD)
    samples: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for i in range(repeat):
        for name in names[i % 2:] + names[:i % 2]:  # alternate who goes first
            _progress(f"cold build {i + 1}/{repeat}: {name} (fresh process, fresh cache)")
            run_dir = tmp / f"{name}-{i}"
            run_dir.mkdir()
            samples[name].append(_COLD[name](run_dir))
    out: dict[str, Any] = {}
    for name, runs in samples.items():
        wall = [r.pop("seconds") for r in runs]
        cpu = [r.pop("cpu_seconds") for r in runs]
        out[name] = {"seconds": round(statistics.median(wall), 3), "samples": [round(x, 3) for x in wall],
                     "cpu_seconds": round(statistics.median(cpu), 3),
                     "cpu_samples": [round(x, 3) for x in cpu], **runs[0]}
    return out, tmp / "opbridge_cold-0"


def _rebuild_one(tmp: Path) -> dict[str, Any]:
    """Rebuild times after editing one source, each source in turn (median and worst)."""
    _progress("rebuild after editing one source, each in turn (one untimed cold build first)")
    work = tmp / "rebuild-sources"
    work.mkdir()
    res = script_or_raise("opbridge one-source rebuilds", scripts.REBUILD_ONE, _env(tmp), str(work), timeout=_TIMEOUT_S)
    runs = res["runs"]
    wall = [r["seconds"] for r in runs]
    cpu = [r["cpu_seconds"] for r in runs]
    return {"seconds": round(statistics.median(wall), 3), "cpu_seconds": round(statistics.median(cpu), 3),
            "max_seconds": round(max(wall), 3), "samples": [round(x, 3) for x in wall],
            "per_source": {r["source"]: {"seconds": round(r["seconds"], 3),
                                         "cpu_seconds": round(r["cpu_seconds"], 3),
                                         "compiled": r["compiled"]} for r in runs}}


def _torch_cold(tmp: Path) -> dict[str, Any]:
    _progress("cold build: torch.utils.cpp_extension.load_inline of one add op (fresh build dir; ~40 s)")
    build_dir = tmp / "torch-build"
    build_dir.mkdir()
    payload = json.dumps([peer_source("torch_add"), str(build_dir), ["-O3", "-fopenmp"]])
    res = script_or_raise("torch load_inline cold build", scripts.TORCH_LOAD_INLINE, _env(tmp), payload,
                          timeout=_TIMEOUT_S)
    return {"seconds": round(res["seconds"], 3), "cpu_seconds": round(res["cpu_seconds"], 3),
            "op": "add (float32, torch/extension.h + pybind)"}


def _medians(label: str, script: str, env: dict[str, str], repeat: int) -> dict[str, Any]:
    """Run *script* *repeat* times; median of each numeric field (ms), last value of each flag."""
    runs = [script_or_raise(label, script, env, timeout=_TIMEOUT_S) for _ in range(repeat)]
    out: dict[str, Any] = {}
    for key, value in runs[-1].items():
        if isinstance(value, bool):
            out[key] = value
        else:
            out[f"{key}_ms"] = round(statistics.median(r[key] for r in runs) * 1e3, 2)
    out["runs"] = repeat
    return out


def _populate(env: dict[str, str]) -> float:
    """``opbridge build`` into the warm-start cache, untimed by the warm starts; its wall seconds.

    It adds what a program's first run builds beside it (torch's dispatcher
    shim, NumPy's C entry), so the warm starts measure a second run. Were they
    left to the warm starts, those would start the builds in the background:
    each would then compete with the next measurement for the CPUs, and could
    still be writing into the cache when this benchmark removes it.
    """
    start = time.monotonic()
    code, _, tail = subproc.run("opbridge build", [sys.executable, "-m", "opbridge", "build"], env, _TIMEOUT_S)
    if code != 0:
        raise BenchError(f"bench build: `opbridge build` into the warm-start cache failed (exit {code}):\n{tail}")
    return round(time.monotonic() - start, 3)


def _warm(tmp: Path, repeat: int) -> dict[str, Any]:
    env = _env(tmp)
    _progress("populating the cache as a first run would (opbridge build: torch shim, NumPy C entry)")
    populate = _populate(env)
    has_torch = importlib.util.find_spec("torch") is not None
    if not has_torch:
        torch_warm: dict[str, Any] = {"skipped": "torch is not installed"}
        _progress("warm start on torch tensors: skipped (torch is not installed)")
    else:
        _progress(f"warm start on torch tensors (torch preimported), {repeat} fresh process(es)")
        torch_warm = _medians("warm start (torch)", scripts.WARM_TORCH, env, repeat)
    _progress(f"warm start on numpy arrays (torch not imported), {repeat} fresh process(es)")
    numpy_warm = _medians("warm start (numpy)", scripts.WARM_NUMPY, env, repeat)
    _progress(f"`import tvm_ffi` alone, with and without torch preimported, {repeat} process(es) each")
    bare = _medians("import tvm_ffi", scripts.IMPORT_TVM_FFI.replace("PRE_IMPORT_TORCH", "False"), env, repeat)
    pre = (_medians("import tvm_ffi", scripts.IMPORT_TVM_FFI.replace("PRE_IMPORT_TORCH", "True"), env, repeat)
           if has_torch else {"import_tvm_ffi_ms": None, "import_torch_ms": None})
    return {
        "populate_seconds": populate,
        "torch": torch_warm,
        "numpy": numpy_warm,
        "import_tvm_ffi": {
            "without_torch_preimported_ms": bare["import_tvm_ffi_ms"],
            "with_torch_preimported_ms": pre["import_tvm_ffi_ms"],
            "import_torch_ms": pre["import_torch_ms"],
            "tvm_ffi_imports_torch": bare["torch_in_sys_modules"],
        },
    }


def _repeats(args: argparse.Namespace) -> tuple[int, int]:
    """(cold-build repetitions, warm-start repetitions) for *args*."""
    cold: int = args.cold_repeat if args.cold_repeat is not None else (
        _QUICK_COLD_REPEAT if args.quick else _FULL_COLD_REPEAT)
    warm: int = args.repeat if args.repeat is not None else (_QUICK_REPEAT if args.quick else _FULL_REPEAT)
    return cold, warm


def _ratio(num: dict[str, Any], den: dict[str, Any], key: str = "seconds") -> float | None:
    """``num[key] / den[key]``, or None when either was skipped."""
    if key not in num or key not in den:
        return None
    return round(float(num[key]) / float(den[key]), 3)


def _ratios(cold: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for num, den in (("opbridge_cold", "tvm_ffi_cold"), ("torch_load_inline", "opbridge_cold")):
        out[f"{num}/{den}"] = _ratio(cold[num], cold[den])
        out[f"{num}/{den} (cpu)"] = _ratio(cold[num], cold[den], "cpu_seconds")
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; see the module docstring."""
    cold_repeat, repeat = _repeats(args)
    # Where `opbridge build` could not build the shim or entry (it only warns), a warm start tries again in
    # the background and may still be writing here: never fail on cleanup.
    with tempfile.TemporaryDirectory(prefix="opbridge-bench-build-", ignore_cleanup_errors=True) as name:
        tmp = Path(name)
        cold, populated = _cold_builds(tmp, cold_repeat)
        if args.quick:
            cold["torch_load_inline"] = {"skipped": "--quick"}
            cold["opbridge_rebuild_one"] = {"skipped": "--quick"}
        else:
            torch_dir = tmp / "torch_load_inline"
            torch_dir.mkdir()
            cold["torch_load_inline"] = _torch_cold(torch_dir)
            rebuild_dir = tmp / "opbridge_rebuild_one"
            rebuild_dir.mkdir()
            cold["opbridge_rebuild_one"] = _rebuild_one(rebuild_dir)
        warm = _warm(populated, repeat)
    return {
        "benchmark": "build",
        "quick": bool(args.quick),
        "machine": machine_info(),
        "note": _NOTE,
        "cold_repeat": cold_repeat,
        "cold_seconds": {k: v.get("seconds") for k, v in cold.items()},
        "cold_cpu_seconds": {k: v.get("cpu_seconds") for k, v in cold.items()},
        "cold": cold,
        "ratios": _ratios(cold),
        "warm_start": warm,
    }


def format_text(result: dict[str, Any]) -> str:
    """Render *result* as a readable report."""
    m = result["machine"]
    cold, ratios, warm = result["cold"], result["ratios"], result["warm_start"]
    lines = [
        "opbridge bench build",
        f"machine: {m['cpu_model']}, {m['cpus_usable']} CPUs, python {m['python']}, torch {m['torch']}, "
        f"tvm-ffi {m['tvm_ffi']}, {m['date']}",
        "",
        f"cold builds (fresh process, fresh cache; median of {result['cold_repeat']} where repeated):",
    ]
    for name, row in cold.items():
        value = (f"{row['seconds']:6.2f} s wall {row['cpu_seconds']:6.2f} s cpu" if "seconds" in row
                 else f"skipped ({row['skipped']})")
        if "samples" in row:
            value += f"  (wall samples: {', '.join(f'{x:.2f}' for x in row['samples'])})"
        if "max_seconds" in row:
            value += f"  (median over sources; worst {row['max_seconds']:.2f} s)"
        lines.append(f"  {name:<20} {value}")
    for name, value in ratios.items():
        lines.append(f"  {name:<40} {'-' if value is None else f'{value:.2f}x'}")
    lines.append("")
    lines.append(f"warm start, cache populated by `opbridge build` ({warm['populate_seconds']:.1f} s; median of "
                 f"{warm['numpy']['runs']} fresh process(es)):")
    for kind in ("torch", "numpy"):
        w = warm[kind]
        if "skipped" in w:
            lines.append(f"  {kind:<6} skipped: {w['skipped']}")
            continue
        lines.append(f"  {kind:<6} total {w['total_ms']:8.1f} ms = import opbridge "
                     f"{w['import_opbridge_ms']:.1f} + from opbridge import ops {w['import_ops_ms']:.1f}"
                     f" + first ops.add {w['first_call_ms']:.1f}")
    after = warm["numpy"]["torch_in_sys_modules_after"]
    lines.append(f"  torch in sys.modules after the numpy warm start: {after}")
    t = warm["import_tvm_ffi"]
    after_torch = ("no torch here" if t["with_torch_preimported_ms"] is None else
                   f"{t['with_torch_preimported_ms']:.1f} ms after import torch ({t['import_torch_ms']:.1f} ms)")
    lines.append(f"  import tvm_ffi: {t['without_torch_preimported_ms']:.1f} ms alone, {after_torch}; "
                 f"imports torch itself: {t['tvm_ffi_imports_torch']}")
    return "\n".join(lines)
