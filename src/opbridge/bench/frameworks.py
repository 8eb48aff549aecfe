"""``opbridge bench frameworks``: one compiled module, every framework, next to its own ops.

Per-call time
    Each framework runs in a worker process of its own
    (``python -m opbridge.bench.fw_worker <framework>``, see
    :mod:`opbridge.bench.fw_worker`), which prints one JSON document. Every
    section times ``opbridge.ops.<op>`` next to the framework's own
    equivalent, interleaved, after checking that both compute the same:

    =========  ===================================================================
    numpy      ``ops.add`` vs ``np.add``, 8 x float32
    torch      ``ops.add`` vs ``torch.add``, 8 x float32
    jax        eager: ``ops.add`` vs a jitted ``jnp.add`` called eagerly (both
               ``block_until_ready``); inside ``jax.jit``: ``ops.add`` vs
               ``x + y``, ``ops.gelu`` / ``ops.rms_norm`` vs pure-``jnp``
               formulas, at (8,) and (1024, 1024)
    paddle     ``ops.add`` vs ``paddle.add``, 8 x float32
    mindspore  PyNative ``ops.add`` vs ``mindspore.ops.add``; ``ms.jit`` of both
               (skipped, with the reason, where the adapter has no graph mode).
               PyNative is asynchronous, so a sample is N calls plus one wait
               for MindSpore's pipeline, divided by N.
    =========  ===================================================================

    MindSpore runs in its own environment (NumPy 1.x): ``--ms-python``, else
    ``$OPBRIDGE_MS_PYTHON``, else ``<repo>/.venv-ms/bin/python``, else
    ``/tmp/msenv/bin/python``; without one it is skipped with the reason.

One module for all
    The built-in op library is first built cold (fresh process, empty
    ``OPBRIDGE_CACHE_DIR``; the median of ``--cold-repeat`` builds is
    reported), and every worker is handed that ``.so``: each reports the path
    it loaded, and the result says whether they are all the same file.

Builds (``--builds``; not with ``--quick``)
    The same single ``add`` op built cold, each in a fresh process and build
    directory, with Paddle's ``paddle.utils.cpp_extension.load``
    (``PD_BUILD_OP``) and MindSpore's ``ops.CustomOpBuilder(..., backend="CPU")
    .load()`` (``ms::pynative::PyboostRunner``); seconds and ratios against
    opbridge's cold build of its whole library. A build that fails here is
    reported with its error instead of a number.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from collections import deque
from pathlib import Path
from typing import Any

from opbridge.bench import BenchError
from opbridge.bench.timing import dist_version, machine_info

DESCRIPTION = (
    "Every framework, one compiled module, next to its own ops: opbridge.ops.add (and gelu/rms_norm "
    "under jax.jit) next to each framework's own op, in one "
    "worker process per framework (numpy, torch, jax, paddle, mindspore PyNative and ms.jit), timed "
    "interleaved after checking results; every worker loads the one cold-built op library; with "
    "--builds also the cold build of an equivalent add op with Paddle's cpp_extension.load and "
    "MindSpore's CustomOpBuilder."
)

FRAMEWORKS = ("numpy", "torch", "jax", "paddle", "mindspore")
_FULL = {"rounds": 100, "number": 400, "cold_repeat": 3}
_QUICK = {"rounds": 10, "number": 100, "cold_repeat": 1}
_TARGET_MS = 5.0
_WORKER_TIMEOUT_S = 900
_BUILD_TIMEOUT_S = 900
_TAIL_LINES = 25
#: Environment variables that change how kernels and frameworks use threads, reported when set.
_THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS", "XLA_FLAGS",
               "OPBRIDGE_MAX_JOBS")
_MS_FALLBACK = Path("/tmp/msenv/bin/python")  # noqa: S108 - a known path, only read
_SRC_ROOT = Path(__file__).resolve().parents[2]  # .../src (or site-packages) holding opbridge
_REPO_ROOT = _SRC_ROOT.parent

# -- measurement scripts run in fresh interpreters; each prints one JSON line last --

_CLOCK = """
import resource as _r, time as _t
def _clock():
    s, c = _r.getrusage(_r.RUSAGE_SELF), _r.getrusage(_r.RUSAGE_CHILDREN)
    return _t.perf_counter(), s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
"""

# Torch is hidden while tvm_ffi is imported (it would import torch, ~1 s, unused here).
_OPBRIDGE_COLD = _CLOCK + """
import json, sys
from opbridge import ops
sys.modules["torch"] = None
try:
    import tvm_ffi
finally:
    del sys.modules["torch"]
start, cpu0 = _clock()
path = ops.LIBRARY.build("cpu")
end, cpu1 = _clock()
print(json.dumps({"seconds": end - start, "cpu_seconds": cpu1 - cpu0, "path": str(path),
                  "ops": sorted(ops.LIBRARY.ops),
                  "sources": [p.name for p in ops.LIBRARY.sources_for("cpu")]}))
"""

# The same, for a library of the add kernel alone: like for like with the one-op builds below.
_OPBRIDGE_ADD_ONLY = _CLOCK + """
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

PADDLE_ADD_SRC = r"""// opbridge bench frameworks: x + y on float32 CPU tensors, as a Paddle custom op.
#include <vector>

#include "paddle/extension.h"

std::vector<paddle::Tensor> AddForward(const paddle::Tensor& x, const paddle::Tensor& y) {
  PD_CHECK(x.is_cpu() && y.is_cpu(), "add: CPU tensors expected");
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && y.dtype() == paddle::DataType::FLOAT32,
           "add: float32 expected");
  PD_CHECK(x.shape() == y.shape(), "add: shapes differ");
  auto out = paddle::empty(x.shape(), x.dtype(), x.place());
  const float* a = x.data<float>();
  const float* b = y.data<float>();
  float* o = out.data<float>();
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; ++i) o[i] = a[i] + b[i];
  return {out};
}

PD_BUILD_OP(opb_bench_add)
    .Inputs({"X", "Y"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(AddForward));
"""

MINDSPORE_ADD_SRC = r"""// opbridge bench frameworks: float32 x + y on CPU as a MindSpore CustomOpBuilder op.
#include "ms_extension/api.h"

class AddRunner : public ms::pynative::PyboostRunner {
 public:
  using PyboostRunner::PyboostRunner;
  void LaunchKernel() override {
    const float *a = inputs()[0].data_ptr<float>();
    const float *b = inputs()[1].data_ptr<float>();
    float *o = outputs()[0].data_ptr<float>();
    const size_t n = outputs()[0].numel();
    for (size_t i = 0; i < n; ++i) o[i] = a[i] + b[i];
  }
};

ms::Tensor add_impl(const ms::Tensor &x, const ms::Tensor &y) {
  if (x.data_type() != mindspore::kNumberTypeFloat32 || y.data_type() != mindspore::kNumberTypeFloat32) {
    MS_LOG(EXCEPTION) << "add: float32 expected";
  }
  if (x.shape() != y.shape()) {
    MS_LOG(EXCEPTION) << "add: shapes differ";
  }
  ms::Tensor out(x.data_type(), x.shape());
  auto runner = std::make_shared<AddRunner>("OpbBenchAdd");
  runner->Run({x, y}, {out});
  return out;
}

py::object add(const ms::Tensor &x, const ms::Tensor &y) {
  return ms::pynative::PyboostRunner::Call<1>(add_impl, x, y);
}

PYBIND11_MODULE(MS_EXTENSION_NAME, m) {
  m.def("add", &add, "x + y (float32, CPU)", pybind11::arg("x"), pybind11::arg("y"));
}
"""

_PADDLE_BUILD = _CLOCK + """
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

_MINDSPORE_BUILD = _CLOCK + """
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


# -- options ------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this benchmark's options to *parser*."""
    parser.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS),
                        metavar="NAME",
                        help=f"frameworks to measure (default: all of {', '.join(FRAMEWORKS)})")
    parser.add_argument("--builds", action="store_true",
                        help="also build an equivalent add op cold with Paddle's cpp_extension.load and "
                             "MindSpore's CustomOpBuilder (slow; skipped with --quick)")
    parser.add_argument("--ms-python", metavar="PATH", default=None,
                        help="python of the MindSpore environment (default: $OPBRIDGE_MS_PYTHON, else "
                             "<repo>/.venv-ms/bin/python, else /tmp/msenv/bin/python if they exist)")
    parser.add_argument("--rounds", type=int, metavar="N", default=None,
                        help=f"interleaved rounds per section (default {_FULL['rounds']}, "
                             f"{_QUICK['rounds']} with --quick)")
    parser.add_argument("--number", type=int, metavar="N", default=None,
                        help=f"most calls per candidate per round (default {_FULL['number']}, "
                             f"{_QUICK['number']} with --quick); slow candidates get fewer")
    parser.add_argument("--target-ms", type=float, metavar="MS", default=_TARGET_MS,
                        help=f"aim for samples of about this many ms (default {_TARGET_MS})")
    parser.add_argument("--cold-repeat", type=int, metavar="N", default=None,
                        help=f"cold builds of the op library, median reported "
                             f"(default {_FULL['cold_repeat']}, "
                             f"{_QUICK['cold_repeat']} with --quick)")
    parser.add_argument("--no-cold-build", action="store_true",
                        help="skip the cold build; the workers load the library from $OPBRIDGE_CACHE_DIR "
                             "(built there first if missing)")


def _progress(msg: str) -> None:
    print(f"bench frameworks: {msg}", file=sys.stderr, flush=True)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    d = _QUICK if args.quick else _FULL
    rounds = args.rounds if args.rounds is not None else d["rounds"]
    number = args.number if args.number is not None else d["number"]
    cold = args.cold_repeat if args.cold_repeat is not None else d["cold_repeat"]
    target = args.target_ms
    if rounds < 1 or number < 1 or cold < 1 or target <= 0:
        raise BenchError(f"--rounds, --number, --cold-repeat and --target-ms must be positive "
                         f"(got {rounds}, {number}, {cold}, {target})")
    return {"rounds": rounds, "number": number, "cold_repeat": cold, "target_sample_ms": target}


def ms_python(explicit: str | None = None, env: dict[str, str] | None = None,
              repo: Path | None = None) -> tuple[str | None, str]:
    """The MindSpore environment's python and where it came from, or ``(None, reason)``.

    Order: *explicit* (``--ms-python``), ``$OPBRIDGE_MS_PYTHON``,
    ``<repo>/.venv-ms/bin/python``, ``/tmp/msenv/bin/python``.
    """
    env = dict(os.environ) if env is None else env
    repo = _REPO_ROOT if repo is None else repo
    for origin, value in (("--ms-python", explicit), ("$OPBRIDGE_MS_PYTHON", env.get("OPBRIDGE_MS_PYTHON"))):
        if value:
            if Path(value).is_file() and os.access(value, os.X_OK):
                return value, origin
            return None, f"{origin} {value} is not an executable file"
    candidates = (("<repo>/.venv-ms", repo / ".venv-ms" / "bin" / "python"), ("fallback", _MS_FALLBACK))
    for origin, path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path), f"{origin} ({path})"
    return None, (f"no MindSpore environment: pass --ms-python or set OPBRIDGE_MS_PYTHON (neither "
                  f"{repo / '.venv-ms' / 'bin' / 'python'} nor {_MS_FALLBACK} exists)")


# -- subprocesses ---------------------------------------------------------------------


def _env(cache_dir: str | None, tmp: Path | None = None) -> dict[str, str]:
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


def _run(label: str, cmd: list[str], env: dict[str, str], timeout: float,
         forward: tuple[str, ...] = ()) -> tuple[int, str, str]:
    """Run *cmd*; forward stderr lines starting with *forward* live; return (exit, stdout, stderr tail)."""
    with tempfile.TemporaryFile("w+") as out, \
            subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.PIPE, text=True) as proc:
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            proc.kill()

        timer = threading.Timer(timeout, kill)
        timer.start()
        tail: deque[str] = deque(maxlen=_TAIL_LINES)
        try:
            assert proc.stderr is not None
            for line in proc.stderr:
                tail.append(line.rstrip("\n"))
                if forward and line.startswith(forward):
                    sys.stderr.write(line)
                    sys.stderr.flush()
            code = proc.wait()
        finally:
            timer.cancel()
        if timed_out.is_set():
            tail.append(f"{label}: killed after {timeout:.0f} s")
        out.seek(0)
        return code, out.read(), "\n".join(tail)


def _last_json(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                doc: dict[str, Any] = json.loads(line)
                return doc
            except json.JSONDecodeError:
                return None
    return None


def run_worker(framework: str, python: str, *, rounds: int, number: int, target_ms: float,
               module: str | None, cache_dir: str | None) -> dict[str, Any]:
    """Run one framework's worker under *python*; return its document (``failed`` on a crash)."""
    cmd = [python, "-m", "opbridge.bench.fw_worker", framework, "--rounds", str(rounds),
           "--number", str(number), "--target-ms", str(target_ms)]
    if module:
        cmd += ["--module", module]
    code, stdout, tail = _run(f"{framework} worker", cmd, _env(cache_dir), _WORKER_TIMEOUT_S,
                              forward=("bench frameworks", "opbridge: building"))
    doc = _last_json(stdout)
    if code != 0 or doc is None:
        failed = (doc or {}).get("failed") or f"exit {code}"
        return {"framework": framework, "executable": python, "failed": failed, "stderr_tail": tail}
    return doc


def _script(label: str, python: str, script: str, env: dict[str, str], *argv: str) -> dict[str, Any]:
    """Run a measurement *script*; its JSON, or ``{"error": ...}`` with the exact error."""
    code, stdout, tail = _run(label, [python, "-c", script, *argv], env, _BUILD_TIMEOUT_S)
    doc = _last_json(stdout)
    if code != 0 or doc is None:
        lines = [ln for ln in tail.splitlines() if ln.strip()]
        # The most specific line: the last exception line, else the last line.
        errs = [ln for ln in lines if "Error" in ln or "error:" in ln or "Exception" in ln]
        return {"error": (errs or lines or [f"exit {code}, no output"])[-1].strip(), "exit": code,
                "stderr_tail": tail}
    return doc


# -- builds -------------------------------------------------------------------------------


def _cold_builds(tmp: Path, repeat: int) -> dict[str, Any]:
    samples = []
    for i in range(repeat):
        _progress(f"cold build {i + 1}/{repeat} of the built-in op library (fresh process, fresh cache)")
        run_dir = tmp / f"opbridge-cold-{i}"
        run_dir.mkdir()
        res = _script("opbridge cold build", sys.executable, _OPBRIDGE_COLD,
                      _env(str(run_dir / "opbridge-cache"), run_dir))
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


def _foreign_build(label: str, python: str | None, unavailable: str | None, script: str, source: str,
                   filename: str, tmp: Path) -> dict[str, Any]:
    if python is None:
        return {"skipped": unavailable}
    _progress(f"cold build: {label} (fresh process, fresh build directory; slow)")
    work = tmp / filename.split(".")[0]
    build_dir = work / "build"
    build_dir.mkdir(parents=True)
    src = work / filename
    src.write_text(source)
    res = _script(label, python, script, _env(None, work), json.dumps([str(src), str(build_dir)]))
    if "error" in res:
        return {"error": res["error"], "exit": res["exit"], "stderr_tail": res["stderr_tail"],
                "python": python}
    return {"seconds": round(res["seconds"], 3), "cpu_seconds": round(res["cpu_seconds"], 3),
            "python": python}


def _builds(tmp: Path, frameworks: list[str], ms_py: str | None, ms_reason: str,
            opbridge_cold: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _progress("cold build: opbridge library of the add kernel alone (fresh process, fresh cache)")
    work = tmp / "opbridge-add-only"
    work.mkdir()
    row = _script("opbridge add-only cold build", sys.executable, _OPBRIDGE_ADD_ONLY,
                  _env(str(work / "opbridge-cache"), work))
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
            f"paddle is not installed for {sys.executable}", _PADDLE_BUILD, PADDLE_ADD_SRC, "pd_add.cc", tmp)
        out["paddle_cpp_extension_load"]["what"] = ("paddle.utils.cpp_extension.load of one float32 add op "
                                                    "(PD_BUILD_OP), fresh build directory, timer after "
                                                    "`import paddle`")
    if "mindspore" not in frameworks:
        out["mindspore_custom_op_builder"] = {"skipped": "mindspore not among --frameworks"}
    else:
        out["mindspore_custom_op_builder"] = _foreign_build(
            "mindspore.ops.CustomOpBuilder(..., backend='CPU').load() of a PyboostRunner add",
            ms_py, ms_reason,
            _MINDSPORE_BUILD, MINDSPORE_ADD_SRC, "ms_add.cpp", tmp)
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


# -- run ------------------------------------------------------------------------------------


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _python_for(framework: str, ms_py: str | None, ms_reason: str) -> tuple[str | None, str | None]:
    """(python to run *framework*'s worker with, or None and why)."""
    if framework == "mindspore":
        return ms_py, None if ms_py else ms_reason
    mod = {"paddle": "paddle"}.get(framework, framework)
    if importlib.util.find_spec(mod) is None:
        return None, f"{mod} is not installed for {sys.executable}"
    return sys.executable, None


def _summary(workers: dict[str, Any]) -> dict[str, dict[str, float]]:
    return {fw: {k: s["ratio"] for k, s in doc.get("sections", {}).items()} for fw, doc in workers.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; see the module docstring."""
    settings = _settings(args)
    frameworks = [f for f in FRAMEWORKS if f in args.frameworks]
    ms_py, ms_reason = ms_python(args.ms_python) if "mindspore" in frameworks else (None, "not selected")
    info = machine_info()
    info["loadavg_at_start"] = _loadavg()
    info["threading_env"] = {k: os.environ[k] for k in _THREAD_ENV if k in os.environ}
    info.update({d: dist_version(d) for d in ("jax", "jaxlib", "jax-tvm-ffi", "paddlepaddle")})
    result: dict[str, Any] = {
        "benchmark": "frameworks",
        "quick": bool(args.quick),
        "machine": info,
        "settings": {**settings, "frameworks": frameworks, "ms_python": ms_py,
                     "ms_python_origin": ms_reason if ms_py else None},
    }
    tmp = Path(tempfile.mkdtemp(prefix="opbridge-bench-frameworks-"))
    try:
        if args.no_cold_build:
            from opbridge.ops import LIBRARY

            _progress("using the op library in $OPBRIDGE_CACHE_DIR (no cold build)")
            module = str(LIBRARY.build("cpu"))
            cache_dir = None
            result["cold_build"] = {"skipped": "--no-cold-build", "path": module}
        else:
            cold = _cold_builds(tmp, settings["cold_repeat"])
            module, cache_dir = cold["path"], cold["cache_dir"]
            result["cold_build"] = cold
        workers: dict[str, Any] = {}
        for fw in frameworks:
            python, why = _python_for(fw, ms_py, ms_reason)
            if python is None:
                workers[fw] = {"framework": fw, "skipped": why}
                _progress(f"{fw}: skipped ({why})")
                continue
            _progress(f"{fw}: worker under {python}")
            doc = run_worker(fw, python, rounds=settings["rounds"], number=settings["number"],
                             target_ms=settings["target_sample_ms"], module=module, cache_dir=cache_dir)
            if "unavailable" in doc:
                doc["skipped"] = doc.pop("unavailable")
            workers[fw] = doc
        result["frameworks"] = workers
        loaded = {fw: d["module"]["loaded_path"] for fw, d in workers.items()
                  if "loaded_path" in d.get("module", {})}
        result["module"] = {
            "expected_path": module,
            "loaded_paths": loaded,
            "pinned": [fw for fw, d in workers.items() if d.get("module", {}).get("pinned")],
            "all_equal": bool(loaded) and all(p == module for p in loaded.values()),
        }
        result["ratios"] = _summary(workers)
        if not args.builds:
            result["builds"] = {"skipped": "needs --builds"}
        elif args.quick:
            result["builds"] = {"skipped": "--quick"}
        else:
            ref = result["cold_build"] if "seconds" in result["cold_build"] else {}
            result["builds"] = {"opbridge_cold": {k: ref.get(k) for k in ("seconds", "cpu_seconds", "ops")},
                                **_builds(tmp, frameworks, ms_py, ms_reason, ref)}
            if not ref:
                result["builds"]["note"] = "no opbridge cold build to compare with (--no-cold-build)"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    problems = [f"{fw}: {d['failed']}" for fw, d in result["frameworks"].items() if "failed" in d]
    problems += [f"{fw} {k}: {v}" for fw, d in result["frameworks"].items()
                 for k, v in d.get("errors", {}).items()]
    if result["module"]["loaded_paths"] and not result["module"]["all_equal"]:
        problems.append(f"workers loaded different modules: {result['module']['loaded_paths']}")
    result["problems"] = problems
    result["machine"]["loadavg_at_end"] = _loadavg()
    return result


# -- text ------------------------------------------------------------------------------------


def _f(x: float) -> str:
    return f"{x:.3g}" if x < 10 else f"{x:.1f}"


def _stats(row: dict[str, float]) -> str:
    return f"{_f(row['p20']):>7} {_f(row['p50']):>7} {_f(row['p80']):>7}"


def _versions(doc: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in doc.get("versions", {}).items() if v and k != "opbridge")


def format_text(result: dict[str, Any]) -> str:
    """Render *result* as a readable report."""
    m, s = result["machine"], result["settings"]
    load = m.get("loadavg_at_start")
    lines = [
        "opbridge bench frameworks: opbridge.ops.<op> vs each framework's own op, float32, CPU",
        f"machine: {m['cpu_model']}, {m['cpus_usable']} CPUs, python {m['python']}, tvm-ffi {m['tvm_ffi']}, "
        f"{m['date']}" + (f", load average {'/'.join(map(str, load))} at start" if load else ""),
        f"{s['rounds']} interleaved rounds per section; samples of ~{s['target_sample_ms']:g} ms "
        f"(at most {s['number']} calls); times are per call, µs",
        "",
    ]
    cold = result["cold_build"]
    if "seconds" in cold:
        samples = ", ".join(f"{x:.2f}" for x in cold["samples"])
        lines.append(f"op library: cold build {cold['seconds']:.2f} s wall, {cold['cpu_seconds']:.2f} s cpu "
                     f"(median of {len(cold['samples'])}: {samples} s; "
                     f"{len(cold['ops'])} ops, {len(cold['sources'])} sources)")
    else:
        lines.append(f"op library: cold build skipped ({cold['skipped']})")
    mod = result["module"]
    lines.append(f"  {mod['expected_path']}")
    for fw, path in mod["loaded_paths"].items():
        how = " (loaded explicitly: its own build key differs)" if fw in mod["pinned"] else ""
        lines.append(f"  {fw:<10} loaded {'that same file' if path == mod['expected_path'] else path}{how}")
    lines.append(f"  all workers loaded the same .so: {'yes' if mod['all_equal'] else 'NO'}")
    header = (f"  {'section':<24} {'calls':>5}   {'opbridge p20/p50/p80':>23}   "
              f"{'native p20/p50/p80':>23}   ratio")
    for fw, doc in result["frameworks"].items():
        lines.append("")
        if "skipped" in doc:
            lines.append(f"{fw}: skipped ({doc['skipped']})")
            continue
        if "failed" in doc:
            lines.append(f"{fw}: worker FAILED ({doc['failed']})")
            lines += [f"    {ln}" for ln in doc.get("stderr_tail", "").splitlines()[-8:]]
            continue
        lines.append(f"{fw} ({_versions(doc)}; {doc['executable']})")
        lines.append(header)
        natives = {}
        for key, row in doc["sections"].items():
            lines.append(f"  {key:<24} {row['number']:>5}   {_stats(row['stats_us']['opbridge'])}   "
                         f"{_stats(row['stats_us']['native'])}   {row['ratio']:.2f}x")
            natives[key] = row["candidates"]["native"]
        for key, reason in doc.get("skipped_sections", {}).items():
            lines.append(f"  {key:<24} skipped: {reason}")
        for key, err in doc.get("errors", {}).items():
            lines.append(f"  {key:<24} ERROR: {err}")
        for key, native in natives.items():
            lines.append(f"    native {key}: {native}")
        notes = {row["sync"] for row in doc["sections"].values() if "sync" in row}
        lines += [f"    note: {n}" for n in sorted(notes)]
    lines.append("")
    builds = result["builds"]
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
    if result["problems"]:
        lines.append("")
        lines.append("problems:")
        lines += [f"  {p}" for p in result["problems"]]
    return "\n".join(lines)
