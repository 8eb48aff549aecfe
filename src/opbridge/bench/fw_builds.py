"""Cold builds of ``opbridge bench frameworks``: opbridge's op library, and an equivalent ``add`` op
built with Paddle's ``cpp_extension.load`` and MindSpore's ``CustomOpBuilder`` (``--builds``).

Each build runs in a fresh process with a fresh cache or build directory
(:mod:`opbridge.bench.subproc`); the peers' C++ is ``bench/peer_paddle_add.cc``
and ``bench/peer_mindspore_add.cc``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from opbridge.bench import BenchError, subproc
from opbridge.bench.report import say
from opbridge.bench.subproc import CLOCK

_BUILD_TIMEOUT_S = 900
_SRC_ROOT = Path(__file__).resolve().parents[2]  # .../src (or site-packages) holding opbridge

# -- measurement scripts run in fresh interpreters; each prints one JSON line last --

# The same, for a library of the add kernel alone: like for like with the one-op builds below.
_OPBRIDGE_ADD_ONLY = CLOCK + """
import json, sys
import opbridge
from opbridge.ops._library import CSRC
lib = opbridge.Library("opb_bench_add_only", sources=[CSRC / "add.cc"])
sys.modules["torch"] = None
try:
    import tvm_ffi
finally:
    del sys.modules["torch"]
start, cpu0 = _clock()
path = lib.build("cpu")
end, cpu1 = _clock()
assert "add_cpu" in opbridge.loader.exports(path), "add_cpu not exported"
print(json.dumps({"seconds": end - start, "cpu_seconds": cpu1 - cpu0}))
"""

_PADDLE_BUILD = CLOCK + """
import json, sys
import numpy as np
import paddle
from paddle.utils.cpp_extension import load
src, build_dir = json.loads(sys.argv[1])
start, cpu0 = _clock()
mod = load(name="opb_bench_pd_add", sources=[src], build_directory=build_dir, verbose=False)
end, cpu1 = _clock()
x = paddle.to_tensor(np.random.rand(8).astype("float32"))
y = paddle.to_tensor(np.random.rand(8).astype("float32"))
assert np.array_equal(mod.opb_bench_add(x, y).numpy(), paddle.add(x, y).numpy()), "paddle custom add is wrong"
print(json.dumps({"seconds": end - start, "cpu_seconds": cpu1 - cpu0}))
"""

_MINDSPORE_BUILD = CLOCK + """
import json, sys
import numpy as np
import mindspore as ms
from mindspore import ops
src, build_dir = json.loads(sys.argv[1])
start, cpu0 = _clock()
mod = ops.CustomOpBuilder("opb_bench_ms_add", [src], backend="CPU", build_dir=build_dir).load()
end, cpu1 = _clock()
x = ms.Tensor(np.random.rand(8).astype(np.float32))
y = ms.Tensor(np.random.rand(8).astype(np.float32))
assert np.array_equal(mod.add(x, y).asnumpy(), ops.add(x, y).asnumpy()), "mindspore custom add is wrong"
print(json.dumps({"seconds": end - start, "cpu_seconds": cpu1 - cpu0}))
"""


def _progress(msg: str) -> None:
    say("frameworks", msg)


def worker_env(cache_dir: str | None, tmp: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_SRC_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("OPBRIDGE_VERBOSE", None)
    if cache_dir is not None:
        env["OPBRIDGE_CACHE_DIR"] = cache_dir
    if tmp is not None:
        env.update({"OPBRIDGE_NO_PROGRESS": "1", "TVM_FFI_CACHE_DIR": str(tmp / "tvm-ffi-cache"),
                    "MS_COMPILER_CACHE_PATH": str(tmp / "ms-cache"),
                    "PADDLE_EXTENSION_DIR": str(tmp / "pd-ext"),
                    "MAX_JOBS": str(os.cpu_count() or 1)})
    return env



def cold_builds(tmp: Path, repeat: int) -> dict[str, Any]:
    samples = []
    for i in range(repeat):
        _progress(f"cold build {i + 1}/{repeat} of the built-in op library (fresh process, fresh cache)")
        run_dir = tmp / f"opbridge-cold-{i}"
        run_dir.mkdir()
        res = subproc.script("opbridge cold build", sys.executable, subproc.OPBRIDGE_COLD,
                      worker_env(str(run_dir / "opbridge-cache"), run_dir))
        if "error" in res:
            raise BenchError(f"the cold build of opbridge's op library failed: {res['error']}\n"
                             f"{res['stderr_tail']}")
        samples.append(res)
    wall = [s["seconds"] for s in samples]
    cpu = [s["cpu_seconds"] for s in samples]
    first = samples[0]
    return {"seconds": round(statistics.median(wall), 3), "samples": [round(x, 3) for x in wall],
            "cpu_seconds": round(statistics.median(cpu), 3), "cpu_samples": [round(x, 3) for x in cpu],
            "path": first["path"], "cache_dir": str(tmp / "opbridge-cold-0" / "opbridge-cache"),
            "ops": first["ops"], "sources": first["sources"], "python": sys.executable,
            "what": "opbridge.ops.LIBRARY.build('cpu') into an empty OPBRIDGE_CACHE_DIR, fresh process, "
                    "timer after `import tvm_ffi`; the workers load this module (the temporary cache is "
                    "removed after the run)"}


def _foreign_build(label: str, python: str | None, unavailable: str | None, script: str, peer: str,
                   filename: str, tmp: Path) -> dict[str, Any]:
    """Build the peer op ``bench/peer_<peer>.cc`` (copied to *filename*) cold with *script* under *python*."""
    if python is None:
        return {"skipped": unavailable}
    _progress(f"cold build: {label} (fresh process, fresh build directory; slow)")
    work = tmp / filename.split(".")[0]
    build_dir = work / "build"
    build_dir.mkdir(parents=True)
    src = work / filename
    src.write_text(subproc.peer_source(peer))
    res = subproc.script(label, python, script, worker_env(None, work), json.dumps([str(src), str(build_dir)]),
                         timeout=_BUILD_TIMEOUT_S)
    if "error" in res:
        return {"error": res["error"], "exit": res["exit"], "stderr_tail": res["stderr_tail"],
                "python": python}
    return {"seconds": round(res["seconds"], 3), "cpu_seconds": round(res["cpu_seconds"], 3),
            "python": python}


def builds(tmp: Path, frameworks: list[str], ms_py: str | None, ms_reason: str,
            opbridge_cold: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _progress("cold build: opbridge library of the add kernel alone (fresh process, fresh cache)")
    work = tmp / "opbridge-add-only"
    work.mkdir()
    row = subproc.script("opbridge add-only cold build", sys.executable, _OPBRIDGE_ADD_ONLY,
                  worker_env(str(work / "opbridge-cache"), work))
    if "seconds" in row:
        row = {"seconds": round(row["seconds"], 3), "cpu_seconds": round(row["cpu_seconds"], 3)}
    row["what"] = ("opbridge.Library('opb_bench_add_only', sources=[csrc/add.cc]).build('cpu') into an empty "
                   "OPBRIDGE_CACHE_DIR, fresh process, timer after `import tvm_ffi`")
    out["opbridge_cold_add_only"] = row
    if "paddle" not in frameworks:
        out["paddle_cpp_extension_load"] = {"skipped": "paddle not among --frameworks"}
    else:
        have = importlib.util.find_spec("paddle") is not None
        out["paddle_cpp_extension_load"] = _foreign_build(
            "paddle.utils.cpp_extension.load of a PD_BUILD_OP add", sys.executable if have else None,
            f"paddle is not installed for {sys.executable}", _PADDLE_BUILD, "paddle_add", "pd_add.cc", tmp)
        out["paddle_cpp_extension_load"]["what"] = ("paddle.utils.cpp_extension.load of one float32 add op "
                                                    "(PD_BUILD_OP), fresh build directory, timer after "
                                                    "`import paddle`")
    if "mindspore" not in frameworks:
        out["mindspore_custom_op_builder"] = {"skipped": "mindspore not among --frameworks"}
    else:
        out["mindspore_custom_op_builder"] = _foreign_build(
            "mindspore.ops.CustomOpBuilder(..., backend='CPU').load() of a PyboostRunner add",
            ms_py, ms_reason,
            _MINDSPORE_BUILD, "mindspore_add", "ms_add.cpp", tmp)
        out["mindspore_custom_op_builder"]["what"] = (
            "mindspore.ops.CustomOpBuilder(name, sources, backend='CPU', build_dir=<fresh>).load() of one "
            "float32 add op (ms::pynative::PyboostRunner), timer after `import mindspore`")
    ratios: dict[str, float | None] = {}
    refs = {"opbridge_cold": opbridge_cold, "opbridge_cold_add_only": out["opbridge_cold_add_only"]}
    for name in ("paddle_cpp_extension_load", "mindspore_custom_op_builder"):
        row = out[name]
        for ref_name, ref in refs.items():
            for key, suffix in (("seconds", ""), ("cpu_seconds", " (cpu)")):
                ok = key in row and ref.get(key)
                ratios[f"{name}/{ref_name}{suffix}"] = round(row[key] / ref[key], 3) if ok else None
    out["ratios"] = ratios
    return out


def format_builds(builds: dict[str, Any]) -> list[str]:
    """The ``builds`` part of ``bench frameworks``' result as text lines."""
    lines: list[str] = []
    if "skipped" in builds:
        lines.append(f"builds of an equivalent add op: skipped ({builds['skipped']})")
    else:
        lines.append("cold builds (fresh process and build directory; timer after importing the framework):")
        ref = builds["opbridge_cold"]
        if ref.get("seconds") is not None:
            lines.append(f"  {'opbridge JIT, whole op library':<44} {ref['seconds']:7.2f} s wall "
                         f"{ref['cpu_seconds']:7.2f} s cpu  ({len(ref['ops'])} ops: {', '.join(ref['ops'])})")
        labels = {"opbridge_cold_add_only": "opbridge JIT, library of the add kernel only",
                  "paddle_cpp_extension_load": "paddle cpp_extension.load, add only",
                  "mindspore_custom_op_builder": "mindspore CustomOpBuilder.load, add only"}
        for name, label in labels.items():
            row = builds[name]
            if "seconds" in row:
                rel = ""
                ratios = builds["ratios"]
                if ratios.get(f"{name}/opbridge_cold") is not None:
                    rel = (f"  = {ratios[f'{name}/opbridge_cold']:.2f}x "
                           f"({ratios[f'{name}/opbridge_cold (cpu)']:.2f}x cpu) whole library")
                if ratios.get(f"{name}/opbridge_cold_add_only") is not None:
                    rel += (f", {ratios[f'{name}/opbridge_cold_add_only']:.2f}x "
                            f"({ratios[f'{name}/opbridge_cold_add_only (cpu)']:.2f}x cpu) add-only")
                lines.append(f"  {label:<44} {row['seconds']:7.2f} s wall "
                             f"{row['cpu_seconds']:7.2f} s cpu{rel}")
            elif "error" in row:
                lines.append(f"  {label:<44} FAILED: {row['error']}")
            else:
                lines.append(f"  {label:<44} skipped ({row['skipped']})")
    return lines
