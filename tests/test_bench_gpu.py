"""``opbridge bench gpu`` host-side logic on the CPU: case lists, tolerances, GB/s, mismatch reports.

The GPU-only parts (CUDA events, CUDA graphs, Liger-Kernel) run only where a
CUDA device is present (the last test); everything else runs here.
"""

from __future__ import annotations

import argparse
import math
import weakref
from typing import Any

import pytest

from opbridge import bench
from opbridge.bench import gpu, verify
from opbridge.bench.gpu import cases

torch = pytest.importorskip("torch")

from opbridge.ops import LIBRARY  # noqa: E402


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    gpu.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_serving_and_large_sizes() -> None:
    full = gpu.plan_sizes(_args(), "rms_norm")
    assert [s.rows_cols for s in full] == [(1, 4096), (8, 4096), (256, 4096), (4096, 4096), (8192, 8192)]
    gated = gpu.plan_sizes(_args(), "silu_and_mul")
    assert [s.rows_cols for s in gated][:4] == [(r, 2 * 14336) for r in (1, 8, 256, 4096)]
    assert gated[-1].label == "large"
    quick = gpu.plan_sizes(_args("--quick"), "add")
    assert [s.rows_cols for s in quick] == [(8, 4096), (4096, 4096)]  # no large size with --quick
    assert [s.rows_cols for s in gpu.plan_sizes(_args("--rows", "--size", "64", "128"), "add")] == [(64, 128)]
    assert cases.is_gated("gelu_and_mul_backward") and not cases.is_gated("gelu")


def test_rows_are_words_commas_or_repeated_and_each_a_positive_int() -> None:
    """`--rows 8,4096` was refused ("must be a positive integer, got '8,4096'"): --rows now reads as every list
    option does. Parsing and its checks need no GPU."""
    for argv in (["--rows", "8,4096"], ["--rows", "8", "4096"], ["--rows", "8", "--rows", "4096"],
                 ["--rows", "8,", "4096,8"]):
        assert _args(*argv).rows == [8, 4096], argv
    assert _args("--rows").rows == [] and _args().rows is None
    for bad in ("0", "8,-1", "8,x", ","):
        with pytest.raises(SystemExit):
            _args("--rows", bad)
    assert _args("--dtypes", "float32", "--dtypes", "bfloat16,float16").dtypes == ["float32", "bfloat16", "float16"]
    assert _args("--ops", "add,gelu", "--ops", "rms_norm").ops == ["add", "gelu", "rms_norm"]
    gpu.check_options(_args("--ops", "add,rms_norm", "--rows", "8,4096", "--no-large"))  # nothing amiss
    for argv, match in ((["--ops", "add,nope"], "--ops: no op 'nope' in the opbridge library; declared: add, "),
                        (["--no-large", "--size", "8", "8"], "--no-large leaves out"),
                        (["--rows", "--no-large"], "nothing would run"),
                        (["--rows", "--quick"], r"--quick \(without --size\) the large one: nothing would run")):
        with pytest.raises(bench.UsageError, match=match):
            gpu.check_options(_args(*argv))


def test_tolerance_grows_with_reduction_length() -> None:
    assert verify.reduction_length(4096, 4096) == 1
    assert verify.reduction_length(4096, 4096 * 4096) == 4096
    assert verify.reduction_tolerance(1e-5, 1e-6, 1) == (1e-5, 1e-6)
    rtol, atol = verify.reduction_tolerance(1e-5, 1e-6, 4096)
    assert rtol == pytest.approx(64e-5) and atol == pytest.approx(64e-6)
    op = LIBRARY.ops["rms_norm_backward"]
    rows, hidden = 512, 64
    args = [torch.randn(rows, hidden), torch.randn(rows, hidden), torch.randn(hidden), 1e-6]
    expected = verify.reference64(op, args)
    assert all(e.dtype == "float64" for e in expected)
    (dx_tol, dw_tol) = verify.reference_tolerances(op, "float32", expected, args)
    base = op.tolerance("float32")
    assert dx_tol == base  # dx: one row's reduction, the op's own tolerance
    assert dw_tol == pytest.approx((base[0] * math.sqrt(rows), base[1] * math.sqrt(rows)))


def test_reference64_never_compares_float32_with_float32() -> None:
    op = LIBRARY.ops["add"]
    x, y = torch.randn(3, 5, dtype=torch.bfloat16), torch.randn(3, 5, dtype=torch.bfloat16)
    (ref,) = verify.reference64(op, [x, y])
    assert ref.dtype == "float64"
    assert (ref == x.double().numpy() + y.double().numpy()).all()


def test_a_mismatch_is_reported_and_the_run_goes_on() -> None:
    """On CPU tensors: a wrong candidate becomes a mismatch record, the right ones are kept."""
    from opbridge.bench.candidates import Candidate, make_args, opbridge_candidates
    from opbridge.bench.gpu.device import verify as verify_case
    from opbridge.bench.workloads import workloads

    op = LIBRARY.ops["add"]
    args = make_args(op, workloads()["add"], (4, 64), "float32")

    def wrong(a: list[Any]) -> Any:
        return (lambda: torch.sub(a[0], a[1])), (lambda r: (r,))

    cands = [*opbridge_candidates(op), Candidate("wrong", "new", "x - y", wrong)]
    notes: list[str] = []
    kept, bad = verify_case(op, cands, args, "float32", notes)
    assert [c.name for c in kept] == ["opbridge_out", "opbridge_new"]
    assert [m["candidate"] for m in bad] == ["wrong"] and "result 0" in bad[0]["message"]


def _fake_result(mismatch: bool) -> dict[str, Any]:
    stats = {"opbridge_new": {"eager": {"p20": 9.0, "p50": 10.0, "p80": 11.0, "rounds": 3}, "number": 100,
                              "graph": {"p20": 3.0, "p50": 4.0, "p80": 5.0, "rounds": 3}, "graph_number": 50},
             "eager_new": {"eager": {"p20": 19.0, "p50": 20.0, "p80": 21.0, "rounds": 3}, "number": 100,
                           "graph": None, "graph_skipped": "CUDA graph capture failed: x"}}
    whats = {"opbridge_new": ("new", "ops.add(...)"), "eager_new": ("new", "torch.add")}
    rec = cases.record("add", "float32", cases.Size("rows=8", (8, 4096)), 3 * 8 * 4096 * 4, stats, whats,
                       gpu.SAME_MODE)
    rec["mismatches"] = [{"candidate": "liger", "message": "result 0 differs"}] if mismatch else []
    rec["notes"] = []
    for c in rec["candidates"].values():
        c["copy_fraction"] = 0.5
    results = [rec]
    return {"benchmark": "gpu", "ok": not mismatch, "problems": cases.problems(results), "liger": "installed",
            "gpu": {"name": "G", "capability": "9.0", "memory_gib": 80, "torch_cuda": "12"},
            "copy": {"before": {"gbps": 3000.0}, "after": {"gbps": 3100.0}, "reference_gbps": 3100.0},
            "results": results, "skipped_ops": {}}


def test_record_gbps_and_speedups() -> None:
    rec = _fake_result(False)["results"][0]
    ours, eager = rec["candidates"]["opbridge_new"], rec["candidates"]["eager_new"]
    assert ours["gbps"] == pytest.approx(3 * 8 * 4096 * 4 / 4e-6 / 1e9, rel=1e-3)  # graph p50: 4 µs
    assert ours["gbps_eager"] == pytest.approx(3 * 8 * 4096 * 4 / 10e-6 / 1e9, rel=1e-3)
    assert eager["gbps"] == eager["gbps_eager"] and eager["graph_skipped"].startswith("CUDA graph")
    assert eager["speedup_vs_opbridge"] == pytest.approx(5.0)  # 20 µs eager vs 4 µs in a graph
    assert eager["speedup_vs_opbridge_eager"] == pytest.approx(2.0)


def _timed(graph: float) -> dict[str, Any]:
    return {"eager": {"p20": 9.0, "p50": 10.0, "p80": 11.0, "rounds": 3}, "number": 100,
            "graph": {"p20": graph, "p50": graph, "p80": graph, "rounds": 3}, "graph_number": 50}


def test_standing_lists_the_cases_a_peer_wins_slowest_first() -> None:
    """Issue 12's "at least as fast as every peer", read off a run: the fastest faster peer per case, same mode."""
    whats = {"opbridge_new": ("new", "ops"), "opbridge_out": ("out", "ops out="), "liger": ("new", "liger"),
             "compile_new": ("new", "inductor"), "eager_out": ("out", "torch out=")}

    def rec(size: str, **graph: float) -> dict[str, Any]:
        return cases.record("silu_and_mul", "float32", cases.Size(size, (8, 28672)), 1000,
                            {n: _timed(g) for n, g in graph.items()}, whats, gpu.SAME_MODE)

    results = [rec("rows=1", opbridge_new=2.0, opbridge_out=2.0, liger=2.5, compile_new=2.2, eager_out=4.0),
               rec("rows=8", opbridge_new=4.0, opbridge_out=1.0, liger=3.0, compile_new=3.6, eager_out=5.0),
               rec("rows=256", opbridge_new=5.0, opbridge_out=9.0, liger=6.0, compile_new=7.0, eager_out=4.5)]
    st = cases.standing(results)
    assert st["cases"] == 3
    assert [(b["size"], b["peer"], b["mode"]) for b in st["behind"]] == [("rows=256", "eager_out", "out"),
                                                                         ("rows=8", "liger", "new")]
    assert st["behind"][0]["ratio"] == pytest.approx(0.5) and st["behind"][0]["opbridge_us"] == 9.0
    assert st["behind"][1]["ratio"] == pytest.approx(0.75) and st["behind"][1]["peer_us"] == 3.0
    from opbridge.bench.gpu.text import standing_lines

    lines = standing_lines(st)
    assert "ahead of or level with every peer in 1 of 3 cases; behind in 2" in lines[1]
    assert lines[2].split()[:4] == ["silu_and_mul", "rows=256", "float32", "0.500"]
    assert standing_lines(cases.standing(results[:1]))[1] == "ahead of or level with every peer in all 1 cases"
    result = _fake_result(False)
    result["standing"] = st
    assert "behind in 2" in gpu.format_text(result)
    # an in-place op has one form (fused_add_rms_norm): peers writing new outputs are compared with it
    whats["opbridge_out"] = ("inplace", "ops in place")
    whats["eager_out"] = ("inplace", "torch in place")
    inplace = cases.record("fused_add_rms_norm", "bfloat16", cases.Size("rows=8", (8, 4096)), 1000,
                           {n: _timed(g) for n, g in {"opbridge_out": 1.95, "liger": 1.82, "compile_new": 2.18,
                                                      "eager_out": 17.8}.items()}, whats, gpu.SAME_MODE)
    assert inplace["candidates"]["liger"]["vs"] == "opbridge_out"
    (b,) = cases.standing([inplace])["behind"]
    assert (b["peer"], b["mode"], b["opbridge_us"]) == ("liger", "new vs inplace", 1.95)
    assert b["ratio"] == pytest.approx(1.82 / 1.95, rel=1e-3)


def test_text_and_exit_status_report_a_mismatch() -> None:
    good, bad = _fake_result(False), _fake_result(True)
    assert bench.exit_status(good) == 0 and bench.exit_status(bad) == 1
    assert "MISMATCH" not in gpu.format_text(good)
    text = gpu.format_text(bad)
    assert "MISMATCH liger" in text and "FAILED: 1 candidate(s)" in text
    assert bad["problems"] == ["add rows=8 float32: liger disagrees with the float64 reference"]
    from opbridge.bench.gpu.text import csv_rows

    assert {r["candidate"] for r in csv_rows(bad)} == {"opbridge_new", "eager_new"}


def test_liger_is_optional() -> None:
    from opbridge.bench.gpu import peers

    if peers.liger_missing() is None:
        assert set(peers.liger_impls()) == set(peers.LIGER_OPS)
    else:
        assert peers.liger_impls() == {} and "pip install liger-kernel" in peers.liger_missing()


def _stand_in_liger(monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, str, tuple[Any, ...]]],
                    swapped: bool = False) -> None:
    """A stand-in liger_kernel: each Function records its calls; the gated Functions are real autograd
    Functions whose backward overwrites its saved halves with (grad_a, grad_b) and returns them, as
    Liger's does (*swapped*: (grad_b, grad_a), a wrong backward)."""
    import importlib.machinery
    import sys
    import types

    import torch.nn.functional as F  # noqa: N812

    from opbridge.bench.gpu import peers

    def gated(path: str, act: Any) -> type:
        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, a: Any, b: Any) -> Any:
                calls.append((path, "forward", (a, b)))
                ctx.save_for_backward(a, b)
                out = act(a) * b
                ctx.out = weakref.ref(out)  # apply returns this very tensor
                return out

            @staticmethod
            def backward(ctx: Any, dc: Any) -> Any:
                if ctx.out() is None:  # as torch 2.11 (the GPU machine's), which frees the saved tensors then
                    raise RuntimeError("Trying to backward through the graph a second time: the output is gone")
                a, b = ctx.saved_tensors
                calls.append((path, "backward", (a, b, dc)))
                with torch.enable_grad():
                    a_ = a.detach().requires_grad_()
                    da = torch.autograd.grad(act(a_), a_, dc * b)[0]
                db = dc * act(a)
                a.copy_(da)
                b.copy_(db)
                return (b, a, None, None) if swapped else (a, b, None, None)

        return Fn

    def plain(path: str) -> type:
        def apply(*a: Any) -> tuple[Any, ...]:
            calls.append((path, "apply", a))
            return (a[0],)

        return type(path.rpartition(".")[2], (), {"apply": staticmethod(apply)})

    acts = {"swiglu": F.silu, "geglu": lambda a: F.gelu(a, approximate="tanh")}
    for path in set(peers.LIGER_OPS.values()):
        parts = path.split(".")
        for i in range(1, len(parts)):
            name = ".".join(parts[:i])
            if name not in sys.modules or not hasattr(sys.modules[name], "_opb_fake"):
                mod = types.ModuleType(name)
                mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
                mod._opb_fake = True  # type: ignore[attr-defined]
                monkeypatch.setitem(sys.modules, name, mod)
        fn = gated(path, acts[parts[-2]]) if parts[-2] in acts else plain(path)
        setattr(sys.modules[".".join(parts[:-1])], parts[-1], fn)


def test_liger_candidates_call_its_functions(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a stand-in liger_kernel: each op's candidate calls its Function with Liger's arguments, the
    gated ops with the two halves as separate contiguous tensors made before the timed call."""
    from opbridge.bench.gpu import peers

    calls: list[tuple[str, str, tuple[Any, ...]]] = []
    _stand_in_liger(monkeypatch, calls)
    impls = peers.liger_impls()
    assert set(impls) == set(peers.LIGER_OPS)
    x = torch.arange(12.0).reshape(2, 6)
    w, r = torch.ones(6), torch.zeros(2, 6)
    args = {"rms_norm": [x, w, 1e-6], "fused_add_rms_norm": [x, r, w, 1e-6], "silu_and_mul": [x],
            "gelu_and_mul": [x]}
    for op, impl in impls.items():
        if op.endswith("_backward"):
            continue  # test_liger_backward_calls_the_functions_backward
        call, collect = peers.liger_candidate(LIBRARY.ops[op], impl).bind(args[op])
        before = len(calls)
        path = peers.LIGER_OPS[op]
        collect(call())
        assert len(calls) == before + 1  # nothing ran while binding, one call when called
        got_path, kind, got = calls[-1]
        assert got_path == path and kind in ("apply", "forward")
        if op in ("silu_and_mul", "gelu_and_mul"):
            a, b = got
            assert a.is_contiguous() and b.is_contiguous()
            assert torch.equal(a, x[:, :3]) and torch.equal(b, x[:, 3:])
        else:
            assert got[:len(args[op])] == tuple(args[op]) and got[len(args[op]):] == (0.0, "llama", False)


@pytest.mark.parametrize("op_name", ["silu_and_mul_backward", "gelu_and_mul_backward"])
def test_liger_backward_calls_the_functions_backward(monkeypatch: pytest.MonkeyPatch, op_name: str) -> None:
    """Binding runs one forward on contiguous copies of x's halves (never views of x); the call is the
    Function's backward alone on that forward's ctx; its (grad_a, grad_b) are joined into grad_x and
    checked against the float64 reference (a backward that returns them swapped is a mismatch)."""
    from opbridge.bench.candidates import make_args
    from opbridge.bench.gpu import peers
    from opbridge.bench.gpu.device import verify as verify_case
    from opbridge.bench.workloads import workloads

    calls: list[tuple[str, str, tuple[Any, ...]]] = []
    _stand_in_liger(monkeypatch, calls)
    op = LIBRARY.ops[op_name]
    path = peers.LIGER_OPS[op_name]
    assert path.rpartition(".")[0] == peers.LIGER_OPS[op_name.removesuffix("_backward")].rpartition(".")[0]
    args = make_args(op, workloads()[op_name], (3, 16), "float32")
    grad, x = args
    pristine = x.clone()
    cand = peers.liger_candidate(op, peers.liger_impls()[op_name])
    assert path.rpartition(".")[2] + ".backward(ctx, grad)" in cand.what and "untimed" in cand.what
    call, collect = cand.bind(args)
    assert [(p, k) for p, k, _ in calls] == [(path, "forward")]
    a, b = calls[0][2]
    assert a.is_contiguous() and b.is_contiguous() and a.data_ptr() != x.data_ptr()
    assert torch.equal(a, x[:, :8]) and torch.equal(b, x[:, 8:])
    (got,) = collect(call())
    assert [(p, k) for p, k, _ in calls] == [(path, "forward"), (path, "backward")]
    assert calls[1][2][2] is grad and torch.equal(x, pristine)  # x untouched: Liger wrote over its copies
    assert got.shape == x.shape

    notes: list[str] = []
    kept, bad = verify_case(op, [cand], [grad, pristine], "float32", notes)
    assert [c.name for c in kept] == ["liger"] and not bad and not notes
    calls.clear()
    _stand_in_liger(monkeypatch, calls, swapped=True)
    wrong = peers.liger_candidate(op, peers.liger_impls()[op_name])
    kept, bad = verify_case(op, [wrong], [grad, pristine], "float32", notes)
    assert not kept and [m["candidate"] for m in bad] == ["liger"]


@pytest.mark.parametrize("op_name", ["silu_and_mul_backward", "gelu_and_mul_backward"])
def test_gated_backward_is_a_first_class_workload(monkeypatch: pytest.MonkeyPatch, op_name: str) -> None:
    """The gated backward ops run by default after their forward, at the forward's sizes, against torch
    eager (new and into a buffer) and Inductor's compilation of the same formula, all verified against
    the float64 reference; bytes: x (2d) and grad (d) read, grad_x (2d) written."""
    from opbridge.bench.candidates import choose_torch, make_args
    from opbridge.bench.gpu.device import candidates
    from opbridge.bench.gpu.device import verify as verify_case
    from opbridge.bench.workloads import left_out, workloads

    forward = op_name.removesuffix("_backward")
    assert gpu.OPS.index(forward) < gpu.OPS.index(op_name)
    assert not left_out(list(gpu.OPS), LIBRARY.ops, workloads(), device="cuda")
    parser = argparse.ArgumentParser()
    gpu.add_arguments(parser)
    assert op_name in " ".join(parser.format_help().split())
    assert _args().ops is None  # the default: gpu.OPS
    assert gpu.plan_sizes(_args(), op_name) == gpu.plan_sizes(_args(), forward)

    op, wl = LIBRARY.ops[op_name], workloads()[op_name]
    rows, d = 4, 2 * 14336 // 2
    args = make_args(op, wl, (rows, 2 * d), "bfloat16")
    assert [tuple(t.shape) for t in args] == [(rows, d), (rows, 2 * d)]
    assert wl.moved(op, args) == {"read": 3 * rows * d * 2, "written": 2 * rows * d * 2, "total": 5 * rows * d * 2}

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # Inductor's input, run eagerly on the CPU
    impl = choose_torch(op, wl)
    cands = candidates(op, impl, None, use_compile=True)
    assert [c.name for c in cands] == ["opbridge_out", "opbridge_new", "eager_new", "eager_out", "compile_new"]
    act = "F.silu(a)" if forward == "silu_and_mul" else "F.gelu(a, approximate='tanh')"
    assert f"torch.autograd computes for {act} * b" in cands[2].what and impl.what in cands[4].what
    for dtype in ("float32", "bfloat16"):
        notes: list[str] = []
        pristine = make_args(op, wl, (8, 2 * 96), dtype, seed=3)
        kept, bad = verify_case(op, cands, pristine, dtype, notes)
        assert [c.name for c in kept] == [c.name for c in cands] and not bad and not notes


def test_a_wrong_gated_backward_formula_is_a_mismatch() -> None:
    """The float64 check catches what the backward formulas could get wrong: the halves swapped, the
    erf GELU for the tanh one, a missing factor."""
    import torch.nn.functional as F  # noqa: N812

    from opbridge.bench.candidates import Candidate, make_args
    from opbridge.bench.gpu.device import verify as verify_case
    from opbridge.bench.workloads import workloads

    def cand(name: str, f: Any) -> Candidate:
        def bind(args: list[Any]) -> Any:
            return (lambda: f(*args)), (lambda r: (r,))

        return Candidate(name, "new", name, bind)

    def halves(x: Any) -> tuple[Any, Any]:
        return x[..., :x.shape[-1] // 2], x[..., x.shape[-1] // 2:]

    def gelu_backward(approximate: str, g: Any, x: Any) -> Any:
        a, b = halves(x)
        return torch.cat([torch.ops.aten.gelu_backward(g * b, a, approximate=approximate),
                          g * F.gelu(a, approximate=approximate)], -1)

    wrong = {
        "silu_and_mul_backward": [
            cand("swapped", lambda g, x: torch.cat([g * F.silu(halves(x)[0]),
                                                    torch.ops.aten.silu_backward(g * halves(x)[1],
                                                                                 halves(x)[0])], -1)),
            cand("no_b", lambda g, x: torch.cat([torch.ops.aten.silu_backward(g, halves(x)[0]),
                                                 g * F.silu(halves(x)[0])], -1))],
        "gelu_and_mul_backward": [cand("erf", lambda g, x: gelu_backward("none", g, x)),
                                  cand("tanh", lambda g, x: gelu_backward("tanh", g, x))],
    }
    for op_name, cands in wrong.items():
        op = LIBRARY.ops[op_name]
        pristine = make_args(op, workloads()[op_name], (16, 2 * 128), "float32")
        kept, bad = verify_case(op, cands, pristine, "float32", [])
        assert [c.name for c in kept] == (["tanh"] if op_name.startswith("gelu") else [])
        assert {m["candidate"] for m in bad} == {c.name for c in cands} - {"tanh"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quick_gpu_run() -> None:
    result = gpu.run(_args("--quick", "--ops", "add", "rms_norm", "--rows", "8", "--rounds", "2"))
    assert result["ok"], result["problems"]
    for rec in result["results"]:
        for c in rec["candidates"].values():
            assert c["gbps"] > 1.0 and c["eager_us"]["p50"] > 0


def test_left_out_says_why_each_op_is_not_benchmarked() -> None:
    from types import SimpleNamespace

    from opbridge.bench.workloads import left_out

    ops = {n: SimpleNamespace(kernels=k) for n, k in
           {"cpu_only": {"cpu": "k"}, "both": {"cpu": "k", "cuda": "k"}, "no_wl": {"cuda": "k"},
            "no_formula": {"cuda": "k"}}.items()}
    wls = {"cpu_only": 1, "both": 1, "no_formula": 1}
    assert left_out(["missing", "cpu_only", "both", "no_wl"], ops, wls, device="cuda") == {
        "missing": "not declared", "cpu_only": "no CUDA kernel declared",
        "no_wl": "no workload in opbridge.bench.workloads"}
    assert left_out(["both", "no_formula", "cpu_only"], ops, wls, peers={"both": 1, "cpu_only": 1},
                    no_peer="no formula") == {"no_formula": "no formula"}
