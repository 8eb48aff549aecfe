"""``opbridge bench frameworks``: one compiled module, every framework, next to its own ops.

Per-call time
    Each framework runs in a worker process of its own
    (``python -m opbridge.bench.fw_worker <framework>``, see
    :mod:`opbridge.bench.fw_worker`), which prints one JSON document. Every
    section (:mod:`opbridge.bench.fw_sections`) times ``opbridge.ops.<op>``
    next to the framework's own equivalent (:mod:`opbridge.bench.natives`),
    interleaved, after checking that both compute the same. ``--ops`` picks
    the ops (default all of them, ``add`` with ``--quick``): ``add`` on 8
    float32 elements; ``gelu``, ``rms_norm``, ``fused_add_rms_norm``,
    ``rotary_embedding``, ``silu_and_mul``, ``gelu_and_mul`` at the serving
    size 8 x 64 (rotary: 8 tokens, one head of 64 in query and key, NeoX;
    the gated ops give 8 x 32); ``rotary_embedding_qkv``, the same rotary on
    query and key column slices of one ``qkv`` tensor as vLLM passes them,
    and ``rms_norm_qkv``, rms_norm of such a query slice (not in JAX, which
    has no views); ``add_out`` and ``silu_and_mul_out``, the same calls with
    ``out=`` an array made once, against the framework's own op with ``out=``
    (NumPy, torch, Paddle). Ops that mutate their arguments are checked
    on fresh copies, every written argument compared, and timed in place:

    =========  ===================================================================
    numpy      eager: ``np.add`` and NumPy formulas (in place with ``out=`` for
               the mutating ops)
    torch      eager: ``torch.add``, ``F.gelu``, ``F.rms_norm``, and the formulas
               ``bench kernels`` times (in place for the mutating ops)
    jax        eager: each op vs its jitted ``jnp`` formula called eagerly (both
               waited for; a mutating op returns its arguments' new values,
               rotary_embedding's positions int32, as JAX makes them without
               x64); inside ``jax.jit``:
               ``ops.add`` vs ``x + y``, ``ops.gelu`` / ``ops.rms_norm`` vs
               pure-``jnp`` formulas, at (8,) and (1024, 1024)
    paddle     eager: ``paddle.add``, ``F.gelu``, ``F.swiglu`` and formulas
               (``paddle.assign(..., output=)`` for the mutating ops)
    mindspore  PyNative: ``mindspore.ops.add``, ``ops.gelu`` and formulas
               (``Tensor.copy_`` into the mutated arguments); ``ms.jit`` of
               ``add`` (skipped, with the reason, where the adapter has no
               graph mode). PyNative is asynchronous, so a sample is N calls
               plus one wait for MindSpore's pipeline, divided by N.
    =========  ===================================================================

    MindSpore runs in its own environment (NumPy 1.x): ``--ms-python``, else
    ``$OPBRIDGE_MS_PYTHON``, else, when opbridge runs from a checkout,
    ``<repo>/.venv-ms/bin/python`` (``scripts/envs.sh`` makes it), else
    ``/tmp/msenv/bin/python``; without one it is skipped with the reason.

One module for all
    The built-in op library is first built cold (fresh process, empty
    ``OPBRIDGE_CACHE_DIR``; the median of ``--cold-repeat`` builds is
    reported), and every worker is handed that ``.so``: each reports the path
    it loaded, and the result says whether they are all the same file.

Parity (``--parity``, instead of the per-call sections)
    Every op at (1024, 4096) and (4096, 4096), float32 and bfloat16, in every
    framework's worker: the NumPy path, the framework path and the
    framework's own formula timed interleaved, with ratios and minor page
    faults per call (:mod:`opbridge.bench.parity`); ``--out DIR`` writes the
    rows to ``results.csv`` beside ``results.json``.

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
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from opbridge.bench import POSITIVE_FLOAT, POSITIVE_INT, ListOption, UsageError, fw_builds, parity_report, subproc
from opbridge.bench.fw_report import format_text
from opbridge.bench.fw_sections import PER_CALL_OPS
from opbridge.bench.report import say, write_json, write_results
from opbridge.bench.timing import dist_version, machine_info

DESCRIPTION = (
    "Every framework, one compiled module, next to its own ops: per call, opbridge.ops.<op> next to each "
    "framework's own op or formula, in one worker process per framework (numpy, torch, jax, paddle, "
    "mindspore PyNative, plus jax.jit and ms.jit sections), timed interleaved after checking results: add "
    "on 8 float32 elements, gelu and the serving ops (rms_norm, fused_add_rms_norm, rotary_embedding, "
    "silu_and_mul, gelu_and_mul; rotary_embedding_qkv and rms_norm_qkv on column slices of one qkv; "
    "add_out and silu_and_mul_out with out=) at 8 x 64, "
    "chosen with "
    "--ops (--quick: add only); every worker loads the "
    "one cold-built op library; with --builds also the cold build of an equivalent add op with Paddle's "
    "cpp_extension.load and MindSpore's CustomOpBuilder; with --parity instead the parity table (each op "
    "at (1024, 4096) and (4096, 4096), float32 and bfloat16: framework path / NumPy path, / the framework's "
    "own formula, page faults per call)."
)

FRAMEWORKS = ("numpy", "torch", "jax", "paddle", "mindspore")
_FULL = {"rounds": 100, "number": 400, "cold_repeat": 3}
_QUICK = {"rounds": 10, "number": 100, "cold_repeat": 1}
#: --parity: calls take milliseconds, so fewer rounds and calls, longer samples.
_PARITY = {"rounds": 15, "number": 10, "cold_repeat": 1, "target_ms": 20.0, "row_s": 3.0}
_PARITY_QUICK = {"rounds": 5, "number": 4, "cold_repeat": 1, "target_ms": 20.0, "row_s": 1.0}
_TARGET_MS = 5.0
_WORKER_TIMEOUT_S = 900
_BUILD_TIMEOUT_S = 900
_TAIL_LINES = 25
#: Environment variables that change how kernels and frameworks use threads, reported when set.
_THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS", "XLA_FLAGS",
               "OPBRIDGE_MAX_JOBS")
_MS_FALLBACK = Path("/tmp/msenv/bin/python")  # noqa: S108 - a known path, only read
_SRC_ROOT = Path(__file__).resolve().parents[2]  # .../src (or site-packages) holding opbridge


def _checkout(src: Path) -> Path | None:
    """The checkout whose *src* holds opbridge (``src/`` beside ``pyproject.toml``); None for an installed package."""
    return src.parent if src.name == "src" and (src.parent / "pyproject.toml").is_file() else None


_CHECKOUT = _checkout(_SRC_ROOT)

# -- options ------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this benchmark's options to *parser*."""
    parser.add_argument("--frameworks", action=ListOption, choices=FRAMEWORKS, default=list(FRAMEWORKS),
                        metavar="NAME",
                        help=f"frameworks to measure (default: all of {', '.join(FRAMEWORKS)})")
    parser.add_argument("--ops", action=ListOption, metavar="OP", default=None,
                        help=f"per-call ops to time, each in every framework's eager (PyNative) mode and "
                             f"the graph modes that have it (default: all of {', '.join(PER_CALL_OPS)}; "
                             f"add with --quick); not with --parity")
    parser.add_argument("--builds", action="store_true",
                        help="also build an equivalent add op cold with Paddle's cpp_extension.load and "
                             "MindSpore's CustomOpBuilder (slow; skipped with --quick)")
    parser.add_argument("--ms-python", metavar="PATH", default=None,
                        help=f"python of the MindSpore environment (default: $OPBRIDGE_MS_PYTHON, else "
                             f"{''.join(f'{p}, else ' for _, p in _ms_candidates(_CHECKOUT)[:-1])}"
                             f"{_MS_FALLBACK}, where they exist)")
    parser.add_argument("--rounds", type=POSITIVE_INT, metavar="N", default=None,
                        help=f"interleaved rounds per section (default {_FULL['rounds']}, "
                             f"{_QUICK['rounds']} with --quick)")
    parser.add_argument("--number", type=POSITIVE_INT, metavar="N", default=None,
                        help=f"most calls per candidate per round (default {_FULL['number']}, "
                             f"{_QUICK['number']} with --quick); slow candidates get fewer")
    parser.add_argument("--target-ms", type=POSITIVE_FLOAT, metavar="MS", default=None,
                        help=f"aim for samples of about this many ms (default {_TARGET_MS}, "
                             f"{_PARITY['target_ms']:g} with --parity)")
    parser.add_argument("--cold-repeat", type=POSITIVE_INT, metavar="N", default=None,
                        help=f"cold builds of the op library, median reported "
                             f"(default {_FULL['cold_repeat']}, "
                             f"{_QUICK['cold_repeat']} with --quick)")
    parser.add_argument("--parity", action="store_true",
                        help="time the parity table instead of the per-call sections: each op at "
                             "(1024, 4096) and (4096, 4096), float32 and bfloat16, on NumPy arrays, on the "
                             "framework's arrays and as the framework's own formula, with page faults per "
                             "call (opbridge.bench.parity)")
    parser.add_argument("--row-seconds", type=POSITIVE_FLOAT, metavar="S", default=None,
                        help=f"--parity: about S seconds of timing per row (default {_PARITY['row_s']}, "
                             f"{_PARITY_QUICK['row_s']} with --quick)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="also write results.json and results.csv (the parity rows, else the sections) "
                             "into DIR")
    parser.add_argument("--no-cold-build", action="store_true",
                        help="skip the cold build; the workers load the library from $OPBRIDGE_CACHE_DIR "
                             "(built there first if missing)")


def _progress(msg: str) -> None:
    say("frameworks", msg)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    parity = bool(getattr(args, "parity", False))
    d: dict[str, Any] = (_PARITY_QUICK if args.quick else _PARITY) if parity else _QUICK if args.quick else _FULL
    rounds = args.rounds if args.rounds is not None else d["rounds"]
    number = args.number if args.number is not None else d["number"]
    cold = args.cold_repeat if args.cold_repeat is not None else d["cold_repeat"]
    target = args.target_ms if args.target_ms is not None else d.get("target_ms", _TARGET_MS)
    if getattr(args, "row_seconds", None) is not None and not parity:
        raise UsageError("--row-seconds times the rows of the parity table: add --parity, or drop --row-seconds")
    row_s = getattr(args, "row_seconds", None) or d.get("row_s")
    return {"rounds": rounds, "number": number, "cold_repeat": cold, "target_sample_ms": target,
            "parity_row_s": row_s if parity else None, "ops": _ops(args, parity)}


def _ops(args: argparse.Namespace, parity: bool) -> list[str] | None:
    """The per-call ops to time (None with --parity); UsageError naming unknown ones."""
    asked = getattr(args, "ops", None)
    if parity:
        if asked:
            raise UsageError("--ops picks the per-call sections, which --parity does not run: give one or the other")
        return None
    if not asked:
        return ["add"] if args.quick else list(PER_CALL_OPS)
    unknown = [op for op in asked if op not in PER_CALL_OPS]
    if unknown:
        raise UsageError(f"--ops: no per-call section for {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(PER_CALL_OPS)}")
    return list(dict.fromkeys(asked))


def _ms_candidates(repo: Path | None) -> list[tuple[str, Path]]:
    """Where a MindSpore environment's python is looked for: the checkout's ``.venv-ms`` where it has one."""
    venv = [] if repo is None else [("<repo>/.venv-ms", repo / ".venv-ms" / "bin" / "python")]
    return [*[(o, p) for o, p in venv if p.is_file()], ("fallback", _MS_FALLBACK)]


def ms_python(explicit: str | None = None, env: dict[str, str] | None = None,
              repo: Path | None = None) -> tuple[str | None, str]:
    """The MindSpore environment's python and where it came from, or ``(None, reason)``.

    Order: *explicit* (``--ms-python``), ``$OPBRIDGE_MS_PYTHON``,
    ``<repo>/.venv-ms/bin/python`` (*repo*: default the checkout opbridge runs
    from; none when it runs from an installed package), ``/tmp/msenv/bin/python``.
    """
    env = dict(os.environ) if env is None else env
    repo = _CHECKOUT if repo is None else repo
    for origin, value in (("--ms-python", explicit), ("$OPBRIDGE_MS_PYTHON", env.get("OPBRIDGE_MS_PYTHON"))):
        if value:
            if Path(value).is_file() and os.access(value, os.X_OK):
                return value, origin
            return None, f"{origin} {value} is not an executable file"
    for origin, path in _ms_candidates(repo):
        if path.is_file() and os.access(path, os.X_OK):
            return str(path), f"{origin} ({path})"
    how = ("no MindSpore environment: pass --ms-python PATH, the python of an environment where MindSpore is "
           "installed, or set OPBRIDGE_MS_PYTHON")
    if repo is None:
        return None, f"{how} ({_MS_FALLBACK}, the default, does not exist)"
    return None, (f"{how} (neither {repo / '.venv-ms' / 'bin' / 'python'} nor {_MS_FALLBACK} exists; in this "
                  f"checkout scripts/envs.sh makes .venv-ms)")


# -- subprocesses ---------------------------------------------------------------------


def run_worker(framework: str, python: str, *, rounds: int, number: int, target_ms: float,
               module: str | None, cache_dir: str | None, parity_row_s: float | None = None,
               ops: list[str] | None = None) -> dict[str, Any]:
    """Run one framework's worker under *python*; return its document (``failed`` on a crash)."""
    cmd = [python, "-m", "opbridge.bench.fw_worker", framework, "--rounds", str(rounds),
           "--number", str(number), "--target-ms", str(target_ms)]
    if parity_row_s is not None:
        cmd += ["--parity", str(parity_row_s)]
    if ops:
        cmd += ["--ops", *ops]
    if module:
        cmd += ["--module", module]
    code, stdout, tail = subproc.run(f"{framework} worker", cmd, fw_builds.worker_env(cache_dir), _WORKER_TIMEOUT_S,
                              forward=("bench frameworks", "opbridge: building"))
    doc = subproc.last_json(stdout)
    if code != 0 or doc is None:
        failed = (doc or {}).get("failed") or f"exit {code}"
        return {"framework": framework, "executable": python, "failed": failed, "stderr_tail": tail}
    return doc



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
    if args.ms_python and ms_py is None and "mindspore" in frameworks:  # named, not found: not a skip
        raise UsageError(ms_reason)
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
            cold = fw_builds.cold_builds(tmp, settings["cold_repeat"])
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
                             target_ms=settings["target_sample_ms"], module=module, cache_dir=cache_dir,
                             parity_row_s=settings["parity_row_s"], ops=settings["ops"])
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
                                **fw_builds.builds(tmp, frameworks, ms_py, ms_reason, ref)}
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
    if settings["parity_row_s"] is not None:
        result["parity"] = [r for d in result["frameworks"].values() for r in d.get("parity", [])]
        result["parity_misses"] = [f"{r['framework']} {r['op']} {'x'.join(map(str, r['shape']))} {r['dtype']}: "
                                   f"{', '.join(parity_report.misses(r))}"
                                   for r in result["parity"] if parity_report.misses(r)]
    if args.out:
        rows = (parity_report.csv_rows(result["parity"]) if "parity" in result else
                [{"framework": fw, "section": k, "ratio": v} for fw, d in result["ratios"].items()
                 for k, v in d.items()])
        fields = parity_report.CSV_FIELDS if "parity" in result else ("framework", "section", "ratio")
        result["files"] = write_results(result, Path(args.out), fields, rows, None, bench="frameworks")
        write_json(result, result["files"]["json"])
    return result


__all__ = ["DESCRIPTION", "FRAMEWORKS", "add_arguments", "format_text", "ms_python", "run", "run_worker"]
