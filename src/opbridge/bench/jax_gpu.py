"""``opbridge bench jax-gpu``: opbridge's ops in JAX on one CUDA device, against jnp and XLA's own fusion.

Issue 12 item 3's figures. Its targets, on the GPU: per small call,
opbridge at most 1.1x ``jnp``; at (4096, 4096) under ``jax.jit``, opbridge
no slower than XLA's fusion of the same formula. Everything runs on
``jax.devices("gpu")[0]`` in one process:

Per call
    ``add``, ``gelu`` and ``rms_norm`` on 8 float32 elements (``x`` of
    ``(1, 8)``, rms_norm's weight ``(8,)``). ``eager``: ``opbridge.ops.<op>``
    called as it is, against the jnp formula called eagerly (jnp op by op;
    :func:`opbridge.bench.natives.jax_formulas`). ``jit``: ``jax.jit`` of a
    lambda calling ``ops.<op>`` against ``jax.jit`` of the formula. Ratio
    opbridge / jnp, target 1.1.
Large
    ``add``, ``gelu``, ``rms_norm``, ``silu_and_mul``, ``gelu_and_mul`` and
    ``fused_add_rms_norm`` at ``--size`` (default (4096, 4096); a gated op's
    ``x`` is that size, its result half as wide), in float32 and bfloat16,
    under ``jax.jit``: opbridge against the formula jitted, which XLA fuses.
    Ratio opbridge / XLA, target 1.0; GB/s of each, bytes counted as by
    ``bench gpu`` (each input read once, each output written once:
    :func:`opbridge.bench.workloads.bytes_moved`).
``fused_add_rms_norm``
    It mutates ``input`` and ``residual``; in JAX it returns their new values
    and its custom call aliases them to its results. Without donation XLA
    would copy both operands before the kernel, so both candidates are
    jitted with the two donated and each call's results are the next
    call's ``input`` and ``residual``: opbridge's kernel updates the buffers
    in place and XLA's fusion may write into them. (The values drift from
    call to call; the time does not depend on them.)

Verification
    Before it is timed, every candidate, opbridge's included, is checked
    against the op's NumPy reference in float64 on the same inputs (those of
    ``bench gpu``: :func:`opbridge.bench.candidates.make_args`), within the
    op's tolerance for the dtype (:mod:`opbridge.bench.verify`). A candidate
    that disagrees (or an opbridge call that raises) is reported in the text
    and the JSON (``mismatches``, ``problems``) and left out of the timing;
    the run goes on, and the result's ``"ok": false`` makes the command exit
    1. A peer that raises is dropped with a note.
Timing
    Wall clock, the candidates of a case interleaved over ``--rounds``
    rounds, each sample about :data:`TARGET_MS` of calls
    (:func:`opbridge.bench.timing.calibrated`); p20/p50/p80 µs per call;
    ratios of p50s. Per call: each call ends in ``.block_until_ready()``
    (dispatch, kernel and the host's wait: a call's latency). Large:
    :data:`PIPELINE` calls back to back, then one wait, divided by
    :data:`PIPELINE` (the time per call once asynchronous dispatch keeps the
    device's queue full, not a host round trip of about 60 µs per call on an
    H200). Each jitted call applies the op to ``--copies`` (default
    :data:`COPIES`) independent copies of its arguments, and the time is per
    op: a jitted call's dispatch, about 40 µs on an H200, bounded both
    candidates at (4096, 4096) for the ops whose kernels take less (H200,
    2026-11-27, one op per call: 38 µs for XLA's bfloat16 silu_and_mul,
    whose data moves in 12 µs at copy bandwidth). The copies share no
    argument and each result passes through an ``optimization_barrier`` of
    its own, so that XLA fuses neither a chain nor the copies into one
    kernel (it fuses a chain of the formula across barriers, and loop
    fusions feeding one consumer horizontally, which a custom call cannot
    match); not yet checked on a GPU, so each case records the kernels of
    its programs and notes one that joined copies.
    ``--copies 1``: one op per jitted call, as before. A missed target is listed (``misses``), not a
    failure.

Without JAX, jax-tvm-ffi, torch (the shared inputs and the float64 check use
it) or a JAX GPU device, ``run`` returns ``{"skipped": reason}`` and measures
nothing. ``--platform cpu`` (not in ``--help``) runs the same code on JAX's
CPU device, so that the whole path is tested without a GPU. ``--quick``:
five rounds of 10 ms samples.

Here: the command, its cases and the run. The candidates' calls (eager,
jitted, donated and fed back, pipelined) and the arrays in and out are
:mod:`opbridge.bench.jax_gpu_calls`; the records and the report
:mod:`opbridge.bench.jax_gpu_report`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opbridge.bench import POSITIVE_INT, BenchError, ListOption, UsageError, check_declared
from opbridge.bench.jax_gpu_calls import Call, Jitted, Pipelined, candidates, results, to_jax
from opbridge.bench.jax_gpu_report import CSV_FIELDS, OURS, csv_rows, format_text, misses, problems, ratios, record
from opbridge.bench.timing import dist_version

DESCRIPTION = (
    "opbridge's ops in JAX on one CUDA device, against opbridge's targets: per small call (8 elements) eager and under "
    "jax.jit against jnp (target opbridge/jnp <= 1.1), and at a large size (default 4096 x 4096) in float32 and "
    "bfloat16 under jax.jit against XLA's fusion of the same formula (target opbridge/XLA <= 1.0), with GB/s; "
    "every candidate verified against a float64 reference (a mismatch is reported and the exit status is 1). "
    "Without JAX, jax-tvm-ffi or a JAX GPU device it reports why and measures nothing."
)

PER_CALL_OPS = ("add", "gelu", "rms_norm")
OPS = ("add", "gelu", "rms_norm", "silu_and_mul", "gelu_and_mul", "fused_add_rms_norm")
DTYPES = ("float32", "bfloat16")
DEFAULT_SIZE = (4096, 4096)
PER_CALL_SHAPE = (1, 8)
#: Milliseconds of calls per sample (``--quick``: half).
TARGET_MS = 20.0
#: Large cases: calls per wait (see Timing above).
PIPELINE = 20
#: Large cases: copies of the arguments per jitted call (``--copies``; see Timing above).
COPIES = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``opbridge bench jax-gpu``."""
    parser.add_argument("--ops", action=ListOption, metavar="OP", default=None,
                        help=f"ops, as words or comma-separated (default: {', '.join(OPS)}; per call only "
                             f"{', '.join(PER_CALL_OPS)})")
    parser.add_argument("--dtypes", action=ListOption, choices=("float32", "float16", "bfloat16"), default=list(DTYPES),
                        help="dtypes of the large size, as words or comma-separated (default: float32 bfloat16; "
                             "per call is float32)")
    parser.add_argument("--size", type=POSITIVE_INT, nargs=2, metavar=("ROWS", "COLS"), default=None,
                        help=f"the large size (default {DEFAULT_SIZE[0]} {DEFAULT_SIZE[1]})")
    parser.add_argument("--no-large", action="store_true", help="leave out the large size")
    parser.add_argument("--no-per-call", action="store_true", help="leave out the per-call cases")
    parser.add_argument("--copies", type=POSITIVE_INT, metavar="K", default=COPIES,
                        help=f"large size: each jitted call applies the op to K independent copies of its "
                             f"arguments, so that dispatch does not bound the kernels (default {COPIES}; 1: one "
                             f"op per jitted call)")
    parser.add_argument("--rounds", type=POSITIVE_INT, metavar="N", default=None,
                        help="interleaved rounds per case (default 15; --quick 5)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="also write results.json and results.csv into DIR")
    parser.add_argument("--platform", choices=("gpu", "cpu"), default="gpu", help=argparse.SUPPRESS)


def unavailable(platform: str = "gpu") -> str | None:
    """Why this process cannot run the benchmark on JAX's *platform*, or None if it can."""
    try:
        import jax
    except ImportError:
        return "JAX is not installed (pip install 'opbridge[jax]')"
    try:
        import jax_tvm_ffi  # noqa: F401
    except ImportError:
        return "jax-tvm-ffi is not installed (pip install 'opbridge[jax]'): opbridge's ops cannot run in JAX"
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch is not installed: the benchmarks' shared inputs and float64 check use it (pip install torch)"
    try:
        jax.devices(platform)
    except RuntimeError as e:
        return f"no JAX {platform.upper()} device (jax {jax.__version__}): {str(e).strip()[:300]}"
    return None


# -- one case ---------------------------------------------------------------------------------------


def run_case(section: str, op: Any, wl: Any, formula: Callable[..., Any], size: tuple[int, int], dtype: str,
             device: Any, mode: str, rounds: int, target_ms: float, copies: int = 1) -> dict[str, Any]:
    """Verify and time opbridge and its peer on one case; return its record (:func:`record`). *copies*:
    the large cases' copies of the arguments per jitted call (every copy's results are verified)."""
    from opbridge.bench.candidates import make_args
    from opbridge.bench.timing import calibrated
    from opbridge.bench.verify import mismatch, reference64, reference_tolerances

    pristine = make_args(op, wl, size, dtype)
    expected = reference64(op, pristine)
    tols = reference_tolerances(op, dtype, expected, pristine)
    peer = "jnp" if section == "per_call" else "xla"
    pipelined = section == "large"

    def fresh() -> list[Any]:  # arrays of a call's own: a donated one is gone after the call
        return [to_jax(a, device) for a in pristine]

    copies = copies if pipelined else 1
    cands = candidates(op, formula, pristine, mode, peer, copies)
    fns: dict[str, Call] = {}
    bad: list[dict[str, str]] = []
    notes: list[str] = []
    kernels: dict[str, int] = {}
    for name, _what, bind in cands:
        try:
            ret = bind(fresh())()
            got = [results(op, r) for r in (ret if copies > 1 else (ret,))]
        except Exception as e:  # opbridge failing is a problem; a peer that cannot run this case is missing
            msg = f"raised {type(e).__name__}: {str(e).strip()[:300]}"
            (bad.append({"candidate": name, "message": msg}) if name == OURS
             else notes.append(f"{name} dropped: {msg}"))
            continue
        why = next((f"copy {c}: {w}" if copies > 1 else w for c, w in
                    enumerate(mismatch(g, expected, tols, dtype) for g in got) if w is not None), None)
        if why is None:
            call = bind(fresh(), block=False) if pipelined else bind(fresh())
            fns[name] = Pipelined(call, PIPELINE) if pipelined else call
            if pipelined:  # the kernels of XLA's program: one copy's each, unless it joined copies (Timing)
                kernels[name] = call.kernels()  # type: ignore[attr-defined]
                single = call.single() if copies > 1 else kernels[name]  # type: ignore[attr-defined]
                if kernels[name] < copies * single:  # not the time of one op's kernels
                    notes.append(f"{name}: {kernels[name]} kernels for {copies} copies of {single} "
                                 f"(copies fused)")
        else:
            bad.append({"candidate": name, "message": why})
    stats: dict[str, dict[str, float]] = {}
    number = 0
    if fns:
        stats, _, number = calibrated(fns, target_s=target_ms / 1e3, rounds=rounds, min_rounds=rounds,
                                      budget_s=1e9)
        if pipelined:  # a sample's calls were batches of PIPELINE jitted calls of *copies* ops each
            per = PIPELINE * copies
            stats = {n: {k: (round(v / per, 4) if k.startswith("p") else v) for k, v in st.items()}
                     for n, st in stats.items()}
            number *= per
    moved = wl.moved(op, pristine)["total"] if section == "large" else None
    rec = record(section, op.name, dtype, tuple(pristine[op.dispatch_arg].shape), mode, peer, stats,
                 {n: w for n, w, _ in cands}, number, moved)
    rec["mismatches"], rec["notes"] = bad, notes
    if pipelined:
        rec["copies"], rec["kernels"] = copies, kernels
    return rec


# -- the run ----------------------------------------------------------------------------------------


def check_options(args: argparse.Namespace) -> None:
    """Refuse what argparse cannot (:class:`~opbridge.errors.UsageError`): an op that is not declared, and
    options that leave nothing to run or set what they leave out. Needs no JAX: :func:`run` calls it first."""
    check_declared(args.ops)
    if args.no_large and args.size is not None:
        raise UsageError("--size sets the large size, which --no-large leaves out: give one or the other")
    if args.no_large and (args.no_per_call or not set(args.ops or OPS) & set(PER_CALL_OPS)):
        left = ("--no-per-call the per-call ones" if args.no_per_call
                else f"the per-call cases time only {', '.join(PER_CALL_OPS)}")
        raise UsageError(f"--no-large leaves out the large cases, and {left}: nothing would run")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; ``{"skipped": reason}`` where JAX, jax-tvm-ffi or a JAX GPU device is missing."""
    from opbridge.bench.report import checked_result, say, write_json, write_results

    check_options(args)
    platform = getattr(args, "platform", "gpu")
    reason = unavailable(platform)
    if reason is not None:
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            write_json({"skipped": reason}, Path(args.out) / "results.json")
        return {"skipped": reason}
    import jax

    from opbridge import ops
    from opbridge.bench import natives
    from opbridge.bench.workloads import left_out, workloads

    quick = bool(getattr(args, "quick", False))
    rounds = args.rounds or (5 if quick else 15)
    target_ms = TARGET_MS / 2 if quick else TARGET_MS
    device = jax.devices(platform)[0]
    build_s = None
    if platform == "gpu":
        from opbridge.build.toolchain import nvcc_path

        if nvcc_path() is None:
            raise BenchError("nvcc was not found: the CUDA kernels cannot be built (install the CUDA toolkit)")
        started = time.perf_counter()
        ops.LIBRARY.module("cuda")
        build_s = round(time.perf_counter() - started, 3)

    formulas, wls = natives.jax_formulas(), workloads()
    names = list(args.ops or OPS)
    skipped = left_out(names, ops.LIBRARY.ops, wls, device="cuda" if platform == "gpu" else None, peers=formulas,
                       no_peer="no jnp formula in opbridge.bench.natives.jax_formulas")
    names = [n for n in names if n not in skipped]
    say("jax-gpu", f"{device.device_kind} ({device.platform}); {rounds} rounds")
    per_call: list[dict[str, Any]] = []
    for n in [] if args.no_per_call else [n for n in names if n in PER_CALL_OPS]:
        for mode in ("eager", "jit"):
            say("jax-gpu", f"per call: {n} {mode}")
            per_call.append(run_case("per_call", ops.LIBRARY.ops[n], wls[n], formulas[n], PER_CALL_SHAPE,
                                     "float32", device, mode, rounds, target_ms))
    large: list[dict[str, Any]] = []
    size = (int(args.size[0]), int(args.size[1])) if args.size else DEFAULT_SIZE
    for n in [] if args.no_large else names:
        for dtype in args.dtypes:
            say("jax-gpu", f"large: {n} {size} {dtype}")
            large.append(run_case("large", ops.LIBRARY.ops[n], wls[n], formulas[n], size, dtype, device, "jit",
                                  rounds, target_ms, args.copies))
    records = [*per_call, *large]
    bad = problems(records)
    result: dict[str, Any] = {
        **checked_result("jax-gpu", quick, bad),
        "misses": misses(records),
        "ratios": ratios(per_call, large),
        "device": {"platform": device.platform, "description": device.device_kind, "id": device.id},
        "versions": {v: dist_version(v) for v in ("jax", "jaxlib", "jax-tvm-ffi", "apache-tvm-ffi", "opbridge",
                                                  "jax-cuda12-plugin", "jax-cuda13-plugin")},
        "settings": {"rounds": rounds, "target_ms": target_ms, "per_call_shape": list(PER_CALL_SHAPE),
                     "size": list(size), "copies": args.copies, "dtypes": list(args.dtypes),
                     "platform": platform},
        "cuda_module_load_s": build_s,
        "per_call": per_call,
        "large": large,
        "skipped_ops": skipped,
    }
    if args.out:
        result["files"] = write_results(result, Path(args.out), CSV_FIELDS, csv_rows(result), None,
                                        bench="jax-gpu")
        write_json(result, result["files"]["json"])
    if bad:
        print(f"bench jax-gpu: {len(bad)} candidate(s) disagree with the float64 reference (see the report)",
              file=sys.stderr)
    return result


__all__ = ["DESCRIPTION", "DTYPES", "OPS", "PER_CALL_OPS", "Jitted", "add_arguments", "candidates", "check_options",
           "format_text", "results", "run", "run_case", "to_jax", "unavailable"]
