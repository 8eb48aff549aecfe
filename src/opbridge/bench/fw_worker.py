"""Worker of ``opbridge bench frameworks``: time one framework, in its own process.

Run as::

    python -m opbridge.bench.fw_worker FRAMEWORK [--rounds N] [--number N]
                                      [--target-ms MS] [--module PATH]

It prints **one JSON document** on stdout (progress goes to stderr) and exits
0, also when the framework is not installed (the document then says
``"unavailable": "<reason>"``); a non-zero exit means the worker itself broke.
Each framework runs in a process of its own because Paddle and MindSpore
cannot be imported into one process (oneDNN symbol clash), and MindSpore
lives in another virtual environment (NumPy 1.x).

Every *section* compares ``opbridge.ops.<op>`` with the framework's own
equivalent on the same inputs: the results are checked (``add`` exactly,
``gelu`` / ``rms_norm`` within the op's declared float32 tolerance) before
anything is timed, then both are timed interleaved
(:func:`opbridge.bench.timing.interleaved`). A section that cannot run (a
mode the adapter does not support) is listed under ``skipped_sections`` with the
reason; one whose results differ is listed under ``errors`` and not timed.

``--module PATH`` names the compiled op library that every worker must use
(the parent's cold build). A worker whose own build key leads to that same
file simply loads it from the shared cache. One whose key differs (the
MindSpore environment: tvm-ffi's include directory, part of the key, lies in
another virtualenv) loads that file explicitly instead, before the first
call, and says so (``"pinned": true``). Either way the document reports the
path of the module opbridge actually loaded (``module.loaded_path``).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opbridge.bench.timing import dist_version, interleaved, summary

#: Bumped when the document's layout changes.
PROTOCOL = 1
FRAMEWORKS = ("numpy", "torch", "jax", "paddle", "mindspore")
#: Distributions whose versions each worker reports, per framework.
_DISTS: dict[str, tuple[str, ...]] = {
    "numpy": ("numpy",),
    "torch": ("torch", "numpy"),
    "jax": ("jax", "jaxlib", "jax-tvm-ffi", "numpy"),
    "paddle": ("paddlepaddle", "numpy"),
    "mindspore": ("mindspore", "numpy"),
}
_IMPORT = {"numpy": "numpy", "torch": "torch", "jax": "jax", "paddle": "paddle", "mindspore": "mindspore"}
_SMALL = (8,)
_LARGE = (1024, 1024)
_EPS = 1e-6
_C = 0.7978845608028654  # sqrt(2/pi)
#: Asynchronous sections (MindSpore) aim at samples this many times longer.
_ASYNC_TARGET_FACTOR = 10
#: Calls in the batch that estimates an asynchronous candidate's per-call cost.
_ASYNC_PROBE = 50


def _progress(framework: str, msg: str) -> None:
    print(f"bench frameworks [{framework}]: {msg}", file=sys.stderr, flush=True)


def _shape_label(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


class Section:
    """One opbridge-vs-native comparison, before it is run."""

    def __init__(self, op: str, mode: str, shape: tuple[int, ...], opbridge: Callable[[], Any],
                 native: Callable[[], Any], descriptions: dict[str, str],
                 to_numpy: Callable[[Any], Any], sync: Callable[[], Any] | None = None,
                 sync_note: str | None = None) -> None:
        self.op, self.mode, self.shape = op, mode, shape
        self.fns = {"opbridge": opbridge, "native": native}
        self.descriptions = descriptions
        self.to_numpy = to_numpy
        self.sync = sync
        self.sync_note = sync_note

    @property
    def key(self) -> str:
        return f"{self.op}/{self.mode}/{_shape_label(self.shape)}"


# -- checking and timing ------------------------------------------------------


def _verify(section: Section) -> str:
    """Check opbridge's result against the native one; return how (raises AssertionError)."""
    import numpy as np

    from opbridge import ops

    got = np.asarray(section.to_numpy(section.fns["opbridge"]()))
    want = np.asarray(section.to_numpy(section.fns["native"]()))
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"opbridge gave {got.dtype}{list(got.shape)}, "
                             f"native {want.dtype}{list(want.shape)}")
    if section.op == "add":
        if not np.array_equal(got, want):
            raise AssertionError(f"results differ: max |diff| {float(np.max(np.abs(got - want)))}")
        return "exact"
    rtol, atol = getattr(ops, section.op).opdef.tolerance("float32")
    if not np.allclose(got, want, rtol=rtol, atol=atol):
        raise AssertionError(f"results differ beyond rtol={rtol}, atol={atol}: "
                             f"max |diff| {float(np.max(np.abs(got - want)))}")
    return f"allclose(rtol={rtol}, atol={atol})"


def _batched(fn: Callable[[], Any], sync: Callable[[], Any], number: int) -> None:
    """*number* calls of *fn*, then one wait for the framework's pipeline."""
    for _ in range(number):
        fn()
    sync()


def _calibrate(section: Section, number: int, target_s: float) -> int:
    """Calls per sample: at most *number*, about *target_s* per sample for the slower candidate.

    An asynchronous section (one with a ``sync``) aims at ``_ASYNC_TARGET_FACTOR``
    times longer samples and estimates the per-call cost from a batch of
    ``_ASYNC_PROBE`` calls, so that the one pipeline wait per sample (a thread
    wake-up, milliseconds on a loaded machine) is amortised rather than timed.
    """
    probe = 3 if section.sync is None else _ASYNC_PROBE
    target = target_s if section.sync is None else target_s * _ASYNC_TARGET_FACTOR
    slowest = 0.0
    for fn in section.fns.values():
        for _ in range(2):
            fn()
        if section.sync is not None:
            section.sync()
        start = time.perf_counter()
        for _ in range(probe):
            fn()
        if section.sync is not None:
            section.sync()
        slowest = max(slowest, (time.perf_counter() - start) / probe)
    return max(1, min(number, int(target / max(slowest, 1e-9))))


def _time(section: Section, rounds: int, number: int, target_s: float) -> dict[str, Any]:
    n = _calibrate(section, number, target_s)
    if section.sync is None:
        samples = interleaved(section.fns, rounds=rounds, number=n)
    else:
        # Asynchronous framework: a sample is n calls plus one wait for their results.
        batches = {k: functools.partial(_batched, f, section.sync, n) for k, f in section.fns.items()}
        samples = {k: [s / n for s in v] for k, v in interleaved(batches, rounds=rounds, number=1).items()}
    stats = summary(samples)
    ratios = {q: round(stats["opbridge"][q] / stats["native"][q], 3) for q in ("p20", "p50", "p80")}
    return {"number": n, "stats_us": stats, "ratio": ratios["p50"], "ratios": ratios}


def run_sections(framework: str, sections: list[Section], rounds: int, number: int,
                 target_s: float) -> tuple[dict[str, Any], dict[str, str]]:
    """Verify and time *sections*; return ``({key: result}, {key: error})``."""
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for s in sections:
        row: dict[str, Any] = {"op": s.op, "mode": s.mode, "shape": list(s.shape), "dtype": "float32",
                               "candidates": s.descriptions}
        if s.sync_note:
            row["sync"] = s.sync_note
        try:
            row["verified"] = _verify(s)
        except Exception as e:
            errors[s.key] = f"verification failed: {type(e).__name__}: {e}"
            continue
        _progress(framework, f"{s.key}: timing opbridge vs native, {rounds} interleaved rounds")
        row.update(_time(s, rounds, number, target_s))
        results[s.key] = row
    return results, errors


# -- the module every framework loads ----------------------------------------


def _use_module(path: str | None) -> dict[str, Any]:
    """Make opbridge use the compiled library at *path* (see the module docstring)."""
    from opbridge import loader
    from opbridge.build import jit
    from opbridge.ops import LIBRARY

    spec = loader.build_spec(LIBRARY, "cpu")
    own: str | None
    try:
        own = str(jit._entry_dir(spec) / f"{spec.name}.so")
    except OSError:
        own = None
    info: dict[str, Any] = {"requested_path": path, "own_key_path": own, "pinned": False}
    if path is None or own == path:
        loader.load(LIBRARY, "cpu")  # now, before the sources can change under a concurrent edit
        return info
    from opbridge._tvm import tvm_ffi

    key = (LIBRARY.namespace, "cpu")
    with loader._LOCK:
        loader._MODULES[key] = tvm_ffi().load_module(path)
        loader._PATHS[key] = Path(path)
    info["pinned"] = True
    info["note"] = ("this process's own build key names another file (the key covers sources, headers and "
                    "flags, including tvm-ffi's include directory, which differs between virtualenvs), so "
                    "the requested module was loaded explicitly instead of building its own")
    return info


# -- the frameworks -------------------------------------------------------------


def _rand(shape: tuple[int, ...], seed: int) -> Any:
    import numpy as np

    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _numpy_sections() -> tuple[list[Section], dict[str, str], dict[str, Any]]:
    import numpy as np

    from opbridge import ops

    x, y = _rand(_SMALL, 0), _rand(_SMALL, 1)
    s = Section("add", "eager", _SMALL, functools.partial(ops.add, x, y), functools.partial(np.add, x, y),
                {"opbridge": "opbridge.ops.add(x, y)", "native": "np.add(x, y)"}, to_numpy=lambda a: a)
    return [s], {}, {}


def _torch_sections() -> tuple[list[Section], dict[str, str], dict[str, Any]]:
    import torch

    from opbridge import ops

    x, y = torch.from_numpy(_rand(_SMALL, 0)), torch.from_numpy(_rand(_SMALL, 1))
    s = Section("add", "eager", _SMALL, functools.partial(ops.add, x, y), functools.partial(torch.add, x, y),
                {"opbridge": "opbridge.ops.add(x, y)", "native": "torch.add(x, y)"},
                to_numpy=lambda t: t.numpy())
    return [s], {}, {"torch_threads": torch.get_num_threads()}


def _block(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args).block_until_ready()


def _jax_sections() -> tuple[list[Section], dict[str, str], dict[str, Any]]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from opbridge import ops

    def arr(shape: tuple[int, ...], seed: int) -> Any:
        return jnp.asarray(_rand(shape, seed))

    def to_np(a: Any) -> Any:
        return np.asarray(a)

    x, y = arr(_SMALL, 0), arr(_SMALL, 1)
    native_add = jax.jit(jnp.add)
    sections = [Section(
        "add", "eager", _SMALL, functools.partial(_block, ops.add, x, y),
        functools.partial(_block, native_add, x, y),
        {"opbridge": "opbridge.ops.add(x, y).block_until_ready()",
         "native": "jax.jit(jnp.add)(x, y).block_until_ready(), called eagerly"}, to_numpy=to_np)]
    jit_pairs: list[tuple[str, Callable[..., Any], Callable[..., Any], str, str, int]] = [
        ("add", lambda a, b: ops.add(a, b), lambda a, b: a + b,
         "jax.jit(lambda x, y: ops.add(x, y))", "jax.jit(lambda x, y: x + y)", 2),
        ("gelu", lambda a: ops.gelu(a), lambda a: 0.5 * a * (1.0 + jnp.tanh(_C * (a + 0.044715 * a * a * a))),
         "jax.jit(lambda x: ops.gelu(x))",
         "jax.jit(lambda x: 0.5*x*(1 + jnp.tanh(sqrt(2/pi)*(x + 0.044715*x**3))))",
         1),
        ("rms_norm", lambda a, w: ops.rms_norm(a, w, _EPS),
         lambda a, w: a * jax.lax.rsqrt(jnp.mean(a * a, axis=-1, keepdims=True) + _EPS) * w,
         f"jax.jit(lambda x, w: ops.rms_norm(x, w, {_EPS}))",
         f"jax.jit(lambda x, w: x * lax.rsqrt(jnp.mean(x*x, -1, keepdims=True) + {_EPS}) * w)", 2),
    ]
    for op, ours, theirs, d_ours, d_theirs, nargs in jit_pairs:
        for shape in (_SMALL, _LARGE):
            if op == "rms_norm":
                args = (arr(shape, 2), arr(shape[-1:], 3))
            else:
                args = tuple(arr(shape, 4 + i) for i in range(nargs))
            sections.append(Section(
                op, "jit", shape, functools.partial(_block, jax.jit(ours), *args),
                functools.partial(_block, jax.jit(theirs), *args),
                {"opbridge": f"{d_ours}(...).block_until_ready()",
                 "native": f"{d_theirs}(...).block_until_ready()"},
                to_numpy=to_np))
    info = {"jax_backend": jax.default_backend(), "jax_devices": [str(d) for d in jax.devices()]}
    return sections, {}, info


def _paddle_sections() -> tuple[list[Section], dict[str, str], dict[str, Any]]:
    import paddle

    from opbridge import ops

    paddle.device.set_device("cpu")
    x, y = paddle.to_tensor(_rand(_SMALL, 0)), paddle.to_tensor(_rand(_SMALL, 1))
    s = Section("add", "eager", _SMALL, functools.partial(ops.add, x, y), functools.partial(paddle.add, x, y),
                {"opbridge": "opbridge.ops.add(x, y)", "native": "paddle.add(x, y)"},
                to_numpy=lambda t: t.numpy())
    return [s], {}, {"paddle_device": paddle.device.get_device()}


# MindSpore compiles these from source inside ms.jit, so they are module-level
# functions; the globals they name are set by _mindspore_sections().
_OPB: Any = None
_MSOPS: Any = None


def _ms_graph_opbridge(x: Any, y: Any) -> Any:
    return _OPB.add(x, y)


def _ms_graph_native(x: Any, y: Any) -> Any:
    return _MSOPS.add(x, y)


def _mindspore_sections() -> tuple[list[Section], dict[str, str], dict[str, Any]]:
    global _OPB, _MSOPS
    import mindspore as ms
    from mindspore import ops as msops

    from opbridge import ops

    _OPB, _MSOPS = ops, msops
    ms.set_device("CPU")
    x, y = ms.Tensor(_rand(_SMALL, 0)), ms.Tensor(_rand(_SMALL, 1))
    sync: Callable[[], Any]
    try:
        from mindspore.graph.api import _pynative_executor

        sync, note = _pynative_executor.sync, "sample = N calls + one _pynative_executor.sync()"
    except ImportError:  # pragma: no cover - other MindSpore layouts
        sync, note = (lambda: msops.add(x, y).asnumpy()), "sample = N calls + one ops.add(...).asnumpy()"
    note = ("MindSpore PyNative runs ops asynchronously (ops.add returns before its kernel ran); " + note
            + ", divided by N")

    def to_np(t: Any) -> Any:
        return t.asnumpy()

    sections = [Section(
        "add", "pynative", _SMALL, functools.partial(ops.add, x, y), functools.partial(msops.add, x, y),
        {"opbridge": "opbridge.ops.add(x, y)", "native": "mindspore.ops.add(x, y)"},
        to_numpy=to_np, sync=sync, sync_note=note)]
    skipped: dict[str, str] = {}
    extra: dict[str, Any] = {}
    key = f"add/ms.jit/{_shape_label(_SMALL)}"
    try:
        from opbridge.adapters import mindspore as adapter

        if not hasattr(adapter, "register"):
            raise NotImplementedError("opbridge.adapters.mindspore has no graph-mode support (no register())")
        ours, theirs = ms.jit(_ms_graph_opbridge), ms.jit(_ms_graph_native)
        ours(x, y).asnumpy()  # compiles; raises if graph mode is not supported
        theirs(x, y).asnumpy()
        sections.append(Section(
            "add", "ms.jit", _SMALL, functools.partial(ours, x, y), functools.partial(theirs, x, y),
            {"opbridge": "ms.jit(def f(x, y): return opbridge.ops.add(x, y))",
             "native": "ms.jit(def f(x, y): return mindspore.ops.add(x, y))"},
            to_numpy=to_np, sync=sync, sync_note=note))
        try:
            from opbridge.adapters.mindspore import aot as mindspore_aot

            extra["graph_wrapper_path"] = str(mindspore_aot.aot_module(ops.LIBRARY).path)
            extra["graph_wrapper_note"] = ("ms.jit runs the ops.Custom(func_type='aot') wrapper, which calls "
                                           "the kernels of the loaded module (module.loaded_path)")
        except Exception as e:  # informational only
            extra["graph_wrapper_path"] = f"unknown ({type(e).__name__}: {e})"
    except Exception as e:
        skipped[key] = f"MindSpore graph mode not available: {type(e).__name__}: {str(e).strip()[:500]}"
    return sections, skipped, extra


_SECTIONS: dict[str, Callable[[], tuple[list[Section], dict[str, str], dict[str, Any]]]] = {
    "numpy": _numpy_sections,
    "torch": _torch_sections,
    "jax": _jax_sections,
    "paddle": _paddle_sections,
    "mindspore": _mindspore_sections,
}


def measure(framework: str, rounds: int, number: int, target_ms: float = 5.0,
            module: str | None = None) -> dict[str, Any]:
    """Run *framework*'s sections in this process; return the worker's document."""
    import importlib.util

    doc: dict[str, Any] = {
        "protocol": PROTOCOL,
        "framework": framework,
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "versions": {d: dist_version(d) for d in (*_DISTS[framework], "apache-tvm-ffi", "opbridge")},
    }
    if importlib.util.find_spec(_IMPORT[framework]) is None:
        doc["unavailable"] = f"{_IMPORT[framework]} is not installed for {sys.executable}"
        return doc
    try:
        importlib.import_module(_IMPORT[framework])
    except Exception as e:
        doc["unavailable"] = f"import {_IMPORT[framework]} failed: {type(e).__name__}: {e}"
        return doc
    doc["module"] = _use_module(module)
    _progress(framework, "building the sections (compiles jitted functions)")
    sections, skipped, extra = _SECTIONS[framework]()
    doc.update(extra)
    results, errors = run_sections(framework, sections, rounds, number, target_ms / 1e3)

    from opbridge import loader
    from opbridge.ops import LIBRARY

    doc["module"]["loaded_path"] = str(loader.loaded_path(LIBRARY, "cpu"))
    doc.update({"rounds": rounds, "max_number": number, "target_sample_ms": target_ms,
                "sections": results, "skipped_sections": skipped, "errors": errors})
    return doc


def main(argv: list[str] | None = None) -> int:
    """Entry point: print one JSON document (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m opbridge.bench.fw_worker",
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("framework", choices=FRAMEWORKS)
    p.add_argument("--rounds", type=int, default=100, help="interleaved rounds per section")
    p.add_argument("--number", type=int, default=400, help="most calls per candidate per round")
    p.add_argument("--target-ms", type=float, default=5.0,
                   help="aim for samples of about this long (fewer calls for slow candidates)")
    p.add_argument("--module", default=None, help="path of the compiled op library to load")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.number < 1 or args.target_ms <= 0:
        p.error("--rounds, --number and --target-ms must be positive")
    try:
        doc = measure(args.framework, args.rounds, args.number, args.target_ms, args.module)
    except Exception as e:
        traceback.print_exc()
        doc = {"protocol": PROTOCOL, "framework": args.framework, "failed": f"{type(e).__name__}: {e}"}
        print(json.dumps(doc), flush=True)
        return 1
    print(json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
