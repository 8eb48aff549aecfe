"""Worker of ``opbridge bench frameworks``: time one framework, in its own process.

Run as::

    python -m opbridge.bench.fw_worker FRAMEWORK [--rounds N] [--number N] [--target-ms MS]
                                      [--module PATH] [--parity SECONDS] [--ops OP ...]

It prints **one JSON document** on stdout (progress goes to stderr) and exits
0, also when the framework is not installed (the document then says
``"unavailable": "<reason>"``); a non-zero exit means the worker itself broke.
Each framework runs in a process of its own because Paddle and MindSpore
cannot be imported into one process (oneDNN symbol clash), and MindSpore
lives in another virtual environment (NumPy 1.x).

Every *section* (:mod:`opbridge.bench.fw_sections`; ``--ops`` picks the
per-call ops, ``add`` by default) compares ``opbridge.ops.<op>`` with the
framework's own equivalent on the same inputs: the results are checked
(``add`` exactly, the other ops within the op's declared float32 tolerance;
an op that writes its arguments runs each candidate once on fresh copies of
the inputs and compares every argument written) before anything is timed,
then both are timed interleaved (:func:`opbridge.bench.timing.interleaved`),
a mutating op's candidates on the same buffers. A section that cannot run (a
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from opbridge.bench import POSITIVE_FLOAT, POSITIVE_INT
from opbridge.bench.fw_sections import PER_CALL_OPS, SECTIONS, Section, called_op
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
#: Asynchronous sections (MindSpore) aim at samples this many times longer.
_ASYNC_TARGET_FACTOR = 10
#: Calls in the batch that estimates an asynchronous candidate's per-call cost.
_ASYNC_PROBE = 50


def _progress(framework: str, msg: str) -> None:
    print(f"bench frameworks [{framework}]: {msg}", file=sys.stderr, flush=True)


# -- checking and timing ------------------------------------------------------


def _outcome(section: Section, name: str) -> list[Any]:
    """What verification compares of candidate *name*: its results, or the arguments it wrote."""
    import numpy as np

    from opbridge.bench.verify import as_tuple

    got = section.result(name) if section.result is not None else section.fns[name]()
    return [np.asarray(section.to_numpy(t)) for t in as_tuple(got)]


def _verify(section: Section) -> str:
    """Check opbridge's result against the native one; return how (raises AssertionError).

    A mutating op's candidates each run once on fresh copies of the inputs,
    and the arguments they wrote are compared (JAX: the new values they
    return, in the same order).
    """
    import numpy as np

    from opbridge import ops

    opdef = getattr(ops, called_op(section.op)).opdef
    written = [a.name for a in opdef.schema.mutated_args]
    ours, theirs = _outcome(section, "opbridge"), _outcome(section, "native")
    if len(ours) != len(theirs) or not ours:
        raise AssertionError(f"opbridge gave {len(ours)} result(s), native {len(theirs)}")
    names = written if len(written) == len(ours) else [f"result {i}" for i in range(len(ours))]
    exact = called_op(section.op) == "add"
    rtol, atol = (0.0, 0.0) if exact else opdef.tolerance("float32")
    for name, got, want in zip(names, ours, theirs):
        if got.shape != want.shape or got.dtype != want.dtype:
            raise AssertionError(f"{name}: opbridge gave {got.dtype}{list(got.shape)}, "
                                 f"native {want.dtype}{list(want.shape)}")
        if not (np.array_equal(got, want) if exact else np.allclose(got, want, rtol=rtol, atol=atol)):
            how = "" if exact else f" beyond rtol={rtol}, atol={atol}"
            raise AssertionError(f"{name}: results differ{how}: max |diff| {float(np.max(np.abs(got - want)))}")
    how = "exact" if exact else f"allclose(rtol={rtol}, atol={atol})"
    if written and section.result is not None:
        return f"{', '.join(names)} as written, each candidate on fresh copies of the inputs: {how}"
    return f"{', '.join(names)} (the new values returned): {how}" if written else how


def _batched(fn: Callable[[], Any], sync: Callable[[], Any], number: int) -> None:
    """*number* calls of *fn*, then one wait for the framework's pipeline."""
    for _ in range(number):
        fn()
    sync()


def _calibrate(section: Section, number: int, target_s: float) -> dict[str, int]:
    """Calls per sample of each candidate: at most *number*, samples of about *target_s*.

    Synchronous candidates share one count, the slower one's, so that a round
    times both alike. An asynchronous section (one with a ``sync``) sizes
    each candidate's samples itself (MindSpore's own formulas can take
    milliseconds where opbridge's call takes microseconds; one shared count
    would time opbridge one call plus one wait at a time), aims at
    ``_ASYNC_TARGET_FACTOR`` times longer samples and estimates the per-call
    cost from a batch of ``_ASYNC_PROBE`` calls, so that the one pipeline
    wait per sample (a thread wake-up, milliseconds on a loaded machine) is
    amortised rather than timed.
    """
    probe = 3 if section.sync is None else _ASYNC_PROBE
    target = target_s if section.sync is None else target_s * _ASYNC_TARGET_FACTOR
    calls = {}
    for name, fn in section.fns.items():
        for _ in range(2):
            fn()
        if section.sync is not None:
            section.sync()
        start = time.perf_counter()
        for _ in range(probe):
            fn()
        if section.sync is not None:
            section.sync()
        cost = (time.perf_counter() - start) / probe
        calls[name] = max(1, min(number, int(target / max(cost, 1e-9))))
    if section.sync is None:
        calls = dict.fromkeys(calls, min(calls.values()))
    return calls


def _time(section: Section, rounds: int, number: int, target_s: float) -> dict[str, Any]:
    calls = _calibrate(section, number, target_s)
    if section.sync is None:
        samples = interleaved(section.fns, rounds=rounds, number=calls["opbridge"])
    else:
        # Asynchronous framework: a sample is n calls plus one wait for their results.
        batches = {k: functools.partial(_batched, f, section.sync, calls[k]) for k, f in section.fns.items()}
        samples = {k: [s / calls[k] for s in v]
                   for k, v in interleaved(batches, rounds=rounds, number=1).items()}
    stats = summary(samples)
    # 4 significant digits: MindSpore's own formulas can take 10^4 times opbridge's call
    ratios = {q: float(f"{stats['opbridge'][q] / stats['native'][q]:.4g}") for q in ("p20", "p50", "p80")}
    return {"number": min(calls.values()), "calls": calls, "stats_us": stats, "ratio": ratios["p50"],
            "ratios": ratios}


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


def measure(framework: str, rounds: int, number: int, target_ms: float = 5.0,
            module: str | None = None, parity_budget_s: float | None = None,
            ops: Sequence[str] = ("add",)) -> dict[str, Any]:
    """Run *framework*'s sections of the per-call ops *ops* in this process; return the worker's document.

    With *parity_budget_s* (seconds per row), the parity table
    (:mod:`opbridge.bench.parity`) instead of the sections, under ``"parity"``.
    """
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
    # the native entries the timings go through, built now: a background build takes idle CPU only,
    # which the timing leaves none of
    from opbridge.aot import natives

    doc["natives"] = natives.summary((framework,))
    if parity_budget_s is not None:
        from opbridge.bench import parity

        doc["parity"] = parity.measure(framework, rounds=rounds, number=number, target_s=target_ms / 1e3,
                                       budget_s=parity_budget_s)
        results: dict[str, Any] = {}
        errors: dict[str, Any] = {}
        skipped = {"*": "--parity: the parity table only"}
    else:
        _progress(framework, "building the sections (compiles jitted functions)")
        sections, skipped, extra = SECTIONS[framework](ops)
        doc["ops"] = list(ops)
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
    p.add_argument("--rounds", type=POSITIVE_INT, default=100, help="interleaved rounds per section")
    p.add_argument("--number", type=POSITIVE_INT, default=400, help="most calls per candidate per round")
    p.add_argument("--target-ms", type=POSITIVE_FLOAT, default=5.0,
                   help="aim for samples of about this long (fewer calls for slow candidates)")
    p.add_argument("--module", default=None, help="path of the compiled op library to load")
    p.add_argument("--parity", type=POSITIVE_FLOAT, metavar="SECONDS", default=None,
                   help="time the parity table instead of the sections, about SECONDS per row")
    p.add_argument("--ops", nargs="+", choices=PER_CALL_OPS, default=["add"], metavar="OP",
                   help=f"per-call ops whose sections to time (default: add; any of {', '.join(PER_CALL_OPS)})")
    args = p.parse_args(argv)
    try:
        doc = measure(args.framework, args.rounds, args.number, args.target_ms, args.module, args.parity,
                      ops=tuple(dict.fromkeys(args.ops)))
    except Exception as e:
        traceback.print_exc()
        doc = {"protocol": PROTOCOL, "framework": args.framework, "failed": f"{type(e).__name__}: {e}"}
        print(json.dumps(doc), flush=True)
        return 1
    print(json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
