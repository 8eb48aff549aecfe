"""opbridge.testing.fuzz: fuzz_op on a user's op, and what it catches."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import opbridge
from opbridge import ops
from opbridge.testing.fuzz import CHECKS, fuzz_op

pytest.importorskip("hypothesis")

# An add whose kernel checks only x: a y of another dtype or shape is read as if it matched.
SLOPPY_CC = """
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;
void sloppy_add_cpu(TensorView out, TensorView x, TensorView y) {
  OPB_CHECK_DTYPE("sloppy_add", x, opbridge::kFloat32);
  float* o = static_cast<float*>(out.data_ptr());
  const float* px = static_cast<const float*>(x.data_ptr());
  const float* py = static_cast<const float*>(y.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = px[i] + py[i];
}
OPBRIDGE_EXPORT(sloppy_add_cpu);
"""


@pytest.fixture(scope="module")
def sloppy_add(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root: Path = tmp_path_factory.mktemp("sloppy")
    (root / "sloppy.cc").write_text(SLOPPY_CC)
    lib = opbridge.Library("fuzz_kit_test", sources=["sloppy.cc"], root=root, dtypes=["float32"])

    @lib.op("sloppy_add(Tensor x, Tensor y) -> Tensor", shape=opbridge.like("x"))
    def sloppy_add(x: Any, y: Any) -> Any:
        return x + y

    return sloppy_add


def test_a_correct_op_passes_every_check_and_says_what_ran() -> None:
    report = fuzz_op(ops.rms_norm, "numpy", examples=5)
    assert report.op == "opbridge::rms_norm" and report.framework == "numpy"
    assert report.examples["calls"] == 5
    ran = [c for c in CHECKS if c != "aliasing"]  # rms_norm writes no argument
    assert all(0 < report.examples[c] <= 5 for c in ran), report.examples  # a draw may give nothing to check
    assert report.skipped == {"aliasing": "rms_norm writes no argument"}
    report = fuzz_op(ops.fused_add_rms_norm, "numpy", examples=5, checks=["aliasing"])
    assert report.examples["aliasing"] > 0 and report.skipped == {}


def test_checks_that_cannot_run_say_why() -> None:
    report = fuzz_op(ops.fused_add_rms_norm, "numpy", examples=3, checks=["calls", "out"])
    assert report.examples["calls"] == 3
    assert report.skipped == {"out": "fused_add_rms_norm takes no out="}
    report = fuzz_op(ops.gelu, "numpy", examples=3, checks=["bad_dtype"])
    assert "no drawn case had an argument to make inconsistent" in report.skipped["bad_dtype"]


def test_the_kernels_own_results_pass(sloppy_add: Any) -> None:
    report = fuzz_op(sloppy_add, "numpy", examples=10, checks=["calls", "out", "out_sharing"])
    assert report.examples["calls"] == 10


@pytest.mark.parametrize("check", ["bad_dtype", "bad_shape"])
def test_a_kernel_that_does_not_check_its_arguments_is_caught(sloppy_add: Any, check: str) -> None:
    with pytest.raises(AssertionError, match=r"sloppy_add .*'y' given .*: no error"):
        fuzz_op(sloppy_add, "numpy", examples=10, checks=[check])


def test_a_case_generator_replaces_the_declared_one(sloppy_add: Any) -> None:
    seen: list[tuple[int, ...]] = []

    def cases(dtype: str, rng: np.random.Generator) -> list[dict[str, Any]]:
        x = rng.standard_normal((3, 5))
        seen.append(x.shape)
        return [{"x": x, "y": rng.standard_normal((3, 5))}]

    fuzz_op(sloppy_add, "numpy", examples=4, checks=["calls"], cases=cases)
    assert seen and set(seen) == {(3, 5)}


def test_unknown_checks_and_a_missing_hypothesis_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown check"):
        fuzz_op(ops.add, "numpy", checks=["calls", "speed"])
    with pytest.raises(ValueError, match="argument 'framework' must be one of numpy"):
        fuzz_op(ops.add, "tensorflow")
    with pytest.raises(ValueError, match="argument 'examples' must be a positive int, got 0"):
        fuzz_op(ops.add, "numpy", examples=0)
    with pytest.raises(ValueError, match="argument 'device' must be 'cpu', or 'cuda' with torch"):
        fuzz_op(ops.add, "numpy", device="cuda")
    monkeypatch.setitem(sys.modules, "hypothesis", None)
    with pytest.raises(ImportError, match="pip install hypothesis"):
        fuzz_op(ops.add, "numpy")


SLOPPY_MODULE = '''
from pathlib import Path
import opbridge

lib = opbridge.Library("fuzz_cli_test", sources=["sloppy.cc"], root=Path(__file__).parent, dtypes=["float32"])


@lib.op("sloppy_add(Tensor x, Tensor y) -> Tensor", shape=opbridge.like("x"))
def sloppy_add(x, y):
    return x + y
'''


def test_opbridge_fuzz_command(tmp_path: Path) -> None:
    import json
    import subprocess

    (tmp_path / "sloppy.cc").write_text(SLOPPY_CC)
    (tmp_path / "sloppy_ops.py").write_text(SLOPPY_MODULE)
    env = {**__import__("os").environ, "OPBRIDGE_NO_PROGRESS": "1"}
    cmd = [sys.executable, "-m", "opbridge", "fuzz", "--frameworks", "numpy", "--examples", "4"]
    ok = subprocess.run([*cmd, "--ops", "rms_norm", "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert ok.returncode == 0, ok.stderr
    records = json.loads(ok.stdout)
    assert {r["check"] for r in records} == set(CHECKS) and not any("failure" in r for r in records)
    assert next(r for r in records if r["check"] == "aliasing")["skipped"] == "rms_norm writes no argument"
    bad = subprocess.run([*cmd, "--import", str(tmp_path / "sloppy_ops.py"), "--ops", "fuzz_cli_test::sloppy_add",
                          "--checks", "calls", "bad_shape"], capture_output=True, text=True, env=env, timeout=600)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAIL numpy fuzz_cli_test::sloppy_add bad_shape" in bad.stdout and "no error" in bad.stdout
    usage = subprocess.run([*cmd, "--ops", "no_such_op"], capture_output=True, text=True, env=env, timeout=600)
    assert usage.returncode == 2 and "no declared op named no_such_op" in usage.stderr


def test_opbridge_fuzz_import_fuzzes_the_imported_libraries_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    import opbridge.testing.fuzz as fuzz_module
    from opbridge import registry
    from opbridge.cli import main

    seen: list[str] = []

    def record(op: Any, framework: str, **kw: Any) -> Any:
        seen.append(op.qualname)
        return SimpleNamespace(examples={c: 1 for c in kw["checks"]}, skipped={})

    monkeypatch.setattr(fuzz_module, "fuzz_op", record)
    (tmp_path / "sloppy.cc").write_text(SLOPPY_CC)
    module = tmp_path / "fuzz_scope_ops.py"
    module.write_text(SLOPPY_MODULE.replace("fuzz_cli_test", "fuzz_scope_test"))
    (tmp_path / "fuzz_scope_none.py").write_text("declared = None\n")
    cmd = ["fuzz", "--frameworks", "numpy", "--checks", "calls"]

    def fuzzed(*argv: str, status: int = 0) -> set[str]:
        seen.clear()
        assert main([*cmd, *argv]) == status
        return set(seen)

    assert fuzzed("--import", str(module)) == {"fuzz_scope_test::sloppy_add"}
    assert fuzzed("--import", "fuzz_scope_ops") == {"fuzz_scope_test::sloppy_add"}  # imported already
    assert fuzzed("--import", "fuzz_scope_ops", "--ops", "add") == {"opbridge::add"}  # --ops picks from all
    everything = fuzzed()  # without --import: every declared op, the built-in ones too
    assert everything == {op.qualname for op in registry.all_ops()} and "opbridge::add" in everything
    assert fuzzed("--import", str(tmp_path / "fuzz_scope_none.py"), status=2) == set()


def test_a_result_smaller_than_the_lead_is_compared_as_a_sum_over_it() -> None:
    """rms_norm_backward's dw sums 33 rows of (33, 2053): fuzz_op, check_op and the benchmarks compare it
    within the op's tolerance grown by sqrt(33) (testing.tolerances, one rule); dx, the lead's size, within
    the op's own. A fuzz run once failed dw at 1.7e-5 of -0.0334 (a cancelling sum) against the bare one."""
    import math

    from opbridge import ops
    from opbridge.bench import verify
    from opbridge.testing.tolerances import result_tolerance

    op = ops.rms_norm_backward.opdef
    x, dw = np.zeros((33, 2053), np.float32), np.zeros(2053, np.float32)
    rtol, atol = op.tolerance("float32")
    assert result_tolerance(op, "float32", x, x) == (rtol, atol)
    got = result_tolerance(op, "float32", dw, x)
    assert got == pytest.approx((rtol * math.sqrt(33), atol * math.sqrt(33)))
    assert verify.reference_tolerances(op, "float32", [x, dw], [x, x, dw]) == [(rtol, atol), got]
