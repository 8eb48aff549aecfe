"""``opbridge bench jax-gpu`` without a GPU: the whole path on JAX's CPU device (``--platform cpu``).

The same code times JAX's GPU device on a GPU machine (``scripts/gpu-check.sh``);
here it runs at a small size on the CPU, its mismatch report and exit status
are checked with a wrong formula, and the default platform skips for want of
a JAX GPU device. Also: ``scripts/gpu_check_summary.py`` folds its results in.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("jax_tvm_ffi")
pytest.importorskip("torch")

from opbridge import bench  # noqa: E402
from opbridge.bench import jax_gpu, jax_gpu_calls, jax_gpu_report, natives  # noqa: E402
from opbridge.cli import main  # noqa: E402

CPU = ["bench", "jax-gpu", "--platform", "cpu", "--rounds", "2", "--quick"]


def _has_jax_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def test_cpu_platform_through_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "opbridge", *CPU, "--size", "64", "128", "--json", "--out",
                           str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["benchmark"] == "jax-gpu" and result["ok"] is True and result["problems"] == []
    assert result["device"]["platform"] == "cpu" and result["settings"]["rounds"] == 2
    per_call, large = result["per_call"], result["large"]
    assert [(r["op"], r["mode"]) for r in per_call] == [(o, m) for o in jax_gpu.PER_CALL_OPS for m in ("eager", "jit")]
    assert all(r["shape"][-1] == 8 and r["dtype"] == "float32" and r["peer"] == "jnp" for r in per_call)
    assert [(r["op"], r["dtype"]) for r in large] == [(o, d) for o in jax_gpu.OPS for d in jax_gpu.DTYPES]
    for r in [*per_call, *large]:
        assert r["mismatches"] == [] and r["ratio"] > 0 and isinstance(r["meets_target"], bool), r
        for c in r["candidates"].values():
            assert c["us"]["p20"] <= c["us"]["p50"] <= c["us"]["p80"] and c["us"]["rounds"] == 2
    gated = next(r for r in large if r["op"] == "silu_and_mul" and r["dtype"] == "float32")
    assert gated["shape"] == [64, 128] and gated["bytes"] == 64 * 128 * 4 + 64 * 64 * 4  # x read, half written
    assert gated["candidates"]["xla"]["gbps"] > 0 and gated["target"] == 1.0 and per_call[0]["target"] == 1.1
    fused = next(r for r in large if r["op"] == "fused_add_rms_norm")
    assert "donated" in fused["candidates"]["opbridge"]["what"]
    # each jitted call applies the op to 8 copies, every copy verified; opbridge's program is 8 custom calls
    assert result["settings"]["copies"] == jax_gpu.COPIES == 8 and "8 copies" in fused["candidates"]["xla"]["what"]
    assert all(r["copies"] == 8 and r["kernels"]["opbridge"] == 8 and r["kernels"]["xla"] >= 8 for r in large)
    assert result["ratios"]["per_call"]["add eager"] == per_call[0]["ratio"]
    assert result["ratios"]["large"]["add float32 64x128"] == large[0]["ratio"]
    assert json.loads((out / "results.json").read_text())["ratios"] == result["ratios"]
    assert len((out / "results.csv").read_text().splitlines()) == 1 + 2 * (len(per_call) + len(large))
    text = jax_gpu.format_text(result)
    assert "per call (1x8, float32)" in text and "fused_add_rms_norm" in text and "FAILED" not in text
    assert "8 copies of the arguments per jitted call; times per op" in text


def test_one_op_per_jitted_call_and_copies_that_xla_fused(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    args = [*CPU, "--ops", "add", "fused_add_rms_norm", "--size", "8", "16", "--dtypes", "float32", "--no-per-call"]
    assert main([*args, "--copies", "1", "--json"]) == 0
    large = json.loads(capsys.readouterr().out)["large"]
    assert [(r["copies"], r["kernels"]["opbridge"]) for r in large] == [(1, 1), (1, 1)]
    assert "copies" not in large[0]["candidates"]["opbridge"]["what"]
    # a program with fewer kernels than copies (XLA's horizontal fusion on a GPU) is named in the case's notes
    # a program with fewer kernels than its copies' (XLA's horizontal fusion on a GPU) is named in the notes:
    # here one copy's program has 2 and three copies' have 5
    monkeypatch.setattr(jax_gpu_calls, "kernels_in", lambda jitted, tensors: 2 if len(tensors) <= 3 else 5)
    assert main([*args, "--copies", "3", "--json"]) == 0
    large = json.loads(capsys.readouterr().out)["large"]
    assert all(r["notes"] == ["opbridge: 5 kernels for 3 copies of 2 (copies fused)",
                              "xla: 5 kernels for 3 copies of 2 (copies fused)"] for r in large), large


def test_kernels_are_counted_outside_fusion_bodies() -> None:
    hlo = """HloModule m
%fused_inner (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%p)
}
%fused_outer (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %f = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused_inner
}
%command_buffer (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %c = f32[8]{0} custom-call(%a), custom_call_target="opbridge.x"
  ROOT %g = f32[8]{0} fusion(%c), kind=kCustom, calls=%fused_outer
}
ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %h = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_inner
  ROOT %cb = f32[8]{0} call(%x), to_apply=%command_buffer
}
"""
    # the custom call and the fusion in the command buffer, the fusion in ENTRY; not the one nested in %fused_outer
    assert jax_gpu_calls.count_kernels(hlo) == 3


def test_a_wrong_formula_is_a_mismatch_and_fails_the_command(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    right = natives.jax_formulas

    def wrong() -> dict[str, Any]:
        f = right()
        add = f["add"]
        return {**f, "add": lambda x, y: add(x, y) + 1}

    monkeypatch.setattr(natives, "jax_formulas", wrong)
    rc = main([*CPU, "--ops", "add", "gelu", "--size", "8", "16", "--dtypes", "float32", "--json"])
    assert rc == 1
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is False and bench.exit_status(result) == 1
    bad = [r for r in [*result["per_call"], *result["large"]] if r["mismatches"]]
    assert [(r["section"], r["op"], r["mode"]) for r in bad] == [
        ("per_call", "add", "eager"), ("per_call", "add", "jit"), ("large", "add", "jit")]
    for r in bad:
        assert [m["candidate"] for m in r["mismatches"]] == [r["peer"]] and "result 0" in r["mismatches"][0]["message"]
        assert r["candidates"]["opbridge"]["us"] is not None and r["ratio"] is None  # the run went on
    assert len(result["problems"]) == 3 and all(r["ratio"] for r in result["large"] if r["op"] == "gelu")
    text = jax_gpu.format_text(result)
    assert "MISMATCH jnp (not timed)" in text and "FAILED: 3 candidate(s)" in text


@pytest.mark.skipif(_has_jax_gpu(), reason="JAX has a GPU here: the default platform would measure")
def test_without_a_jax_gpu_it_skips_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "jax-gpu", "--json", "--out", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert list(result) == ["skipped"] and result["skipped"].startswith("no JAX GPU device")
    assert json.loads((tmp_path / "results.json").read_text()) == result
    assert jax_gpu.format_text(result).startswith("opbridge bench jax-gpu: skipped: no JAX GPU device")


def test_without_jax_tvm_ffi_or_jax_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jax_tvm_ffi", None)
    assert "jax-tvm-ffi is not installed" in (jax_gpu.unavailable("cpu") or "")
    monkeypatch.setitem(sys.modules, "jax", None)
    assert "JAX is not installed" in (jax_gpu.unavailable("cpu") or "")


def test_record_ratio_targets_and_misses() -> None:
    stats = {"opbridge": {"p20": 9.0, "p50": 12.0, "p80": 13.0, "rounds": 3},
             "xla": {"p20": 9.0, "p50": 10.0, "p80": 11.0, "rounds": 3}}
    rec = jax_gpu_report.record("large", "add", "bfloat16", (4096, 4096), "jit", "xla", stats,
                                {"opbridge": "ours", "xla": "theirs"}, 100, moved=3 * 4096 * 4096 * 2)
    assert rec["ratio"] == 1.2 and rec["meets_target"] is False
    assert rec["candidates"]["xla"]["gbps"] == pytest.approx(3 * 4096 * 4096 * 2 / 10e-6 / 1e9, rel=1e-3)
    assert jax_gpu_report.misses([rec]) == ["add bfloat16 4096x4096: opbridge / xla = 1.200 > 1.0"]
    small = jax_gpu_report.record("per_call", "add", "float32", (1, 8), "eager", "jnp", {"opbridge": stats["xla"]},
                                  {"opbridge": "ours", "jnp": "theirs"}, 100)
    assert small["ratio"] is None and small["meets_target"] is None and small["target"] == 1.1


def test_gpu_check_summary_folds_the_jax_gpu_results(tmp_path: Path, script_module: Callable[[str], Any],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    summary_script = script_module("gpu_check_summary")
    (tmp_path / "gpu.txt").write_text("NVIDIA H100, 550, 81559 MiB\n")
    (tmp_path / "steps.txt").write_text("bench_gpu 0 60\nbench_jax_gpu 1 30\n")
    (tmp_path / "bench-jax-gpu").mkdir()
    folded = {"benchmark": "jax-gpu", "ok": False, "ratios": {"per_call": {"add eager": 1.05}, "large": {}}}
    (tmp_path / "bench-jax-gpu" / "results.json").write_text(json.dumps(folded))
    assert summary_script.main(tmp_path) == 1  # a step failed
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["bench_jax_gpu"] == folded and summary["bench_gpu"] is None
    assert summary["steps"]["bench_jax_gpu"] == {"exit_status": 1, "seconds": 30}
    # any other bench gpu run (gpu-check's bench-gpu, -serving, -large, or a device script's own) is folded,
    # and its cases behind a peer are printed
    (tmp_path / "bench-gpu-staged").mkdir()
    behind = {"op": "rms_norm", "size": "large", "dtype": "bfloat16", "peer": "liger", "mode": "new",
              "ratio": 0.8, "peer_us": 8.0, "opbridge_us": 10.0}
    staged = {"benchmark": "gpu", "results": [], "standing": {"cases": 2, "behind": [behind]}}
    (tmp_path / "bench-gpu-staged" / "results.json").write_text(json.dumps(staged))
    summary_script.main(tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["bench_gpu_staged"] == staged
    printed = capsys.readouterr().out
    assert "bench_gpu_staged:" in printed and "behind in 1" in printed and "0.800  liger" in printed
