"""opbridge.testing.fuzz: an op that cannot be built or called fails fuzz_op at once, and failures say why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import opbridge
from opbridge.build import jit
from opbridge.errors import BuildError, DeclarationError
from opbridge.testing import fuzz, fuzz_errors
from opbridge.testing.fuzz import fuzz_op
from opbridge.testing.fuzz_calls import Fuzzer

pytest.importorskip("hypothesis")

# A kernel that does not compile (the audit's compilecli.py).
BROKEN_CC = """
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;
void broken_sa_cpu(TensorView o, TensorView x, TensorView y, double a) {
  OPB_CHECK_DTYPE("broken_sa", x, opbridge::kFloat32);
  OPB_CHECK_SAME_SHAPE("broken_sa", o, x);
  int z = undefined_thing + 1;
}
OPBRIDGE_EXPORT(broken_sa_cpu);
"""

# Four kernels that compile, each wrong in its own way.
KERNELS_CC = """
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;
// 'alpha' is a float in the schema: the kernel cannot be called (a DeclarationError, a ValueError).
void sig_sa_cpu(TensorView o, TensorView x, TensorView y, int64_t a) {
  OPB_CHECK_DTYPE("sig_sa", x, opbridge::kFloat32);
  OPB_CHECK_SAME_SHAPE("sig_sa", o, x);
  float* po = static_cast<float*>(o.data_ptr());
  const float* px = static_cast<const float*>(x.data_ptr());
  const float* py = static_cast<const float*>(y.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) po[i] = px[i] + float(a) * py[i];
}
OPBRIDGE_EXPORT(sig_sa_cpu);

// Checks x only: a y of another dtype or shape is read as if it matched.
void unchecked_add_cpu(TensorView o, TensorView x, TensorView y) {
  OPB_CHECK_DTYPE("unchecked_add", x, opbridge::kFloat32);
  float* po = static_cast<float*>(o.data_ptr());
  const float* px = static_cast<const float*>(x.data_ptr());
  const float* py = static_cast<const float*>(y.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) po[i] = px[i] + py[i];
}
OPBRIDGE_EXPORT(unchecked_add_cpu);

// Checks everything, and adds one too many.
void off_add_cpu(TensorView o, TensorView x, TensorView y) {
  OPB_CHECK_DTYPE("off_add", x, opbridge::kFloat32);
  OPB_CHECK_SAME_DTYPE("off_add", y, x);
  OPB_CHECK_SAME_SHAPE("off_add", y, x);
  float* po = static_cast<float*>(o.data_ptr());
  const float* px = static_cast<const float*>(x.data_ptr());
  const float* py = static_cast<const float*>(y.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) po[i] = px[i] + py[i] + 1.0f;
}
OPBRIDGE_EXPORT(off_add_cpu);

// Refuses every call, valid or not, with a ValueError naming the op.
void refusing_add_cpu(TensorView o, TensorView x, TensorView y) {
  OPB_CHECK(false, ValueError) << "refusing_add: refuses every call";
}
OPBRIDGE_EXPORT(refusing_add_cpu);
"""


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root: Path = tmp_path_factory.mktemp("fuzz_failures")
    (root / "kernels.cc").write_text(KERNELS_CC)
    lib = opbridge.Library("fuzz_failures_test", sources=["kernels.cc"], root=root, dtypes=["float32"])

    @lib.op("sig_sa(Tensor x, Tensor y, float alpha) -> Tensor", shape=opbridge.like("x"))
    def sig_sa(x: Any, y: Any, alpha: float) -> Any:
        return x + alpha * y

    @lib.op("unchecked_add(Tensor x, Tensor y) -> Tensor", shape=opbridge.like("x"))
    def unchecked_add(x: Any, y: Any) -> Any:
        return x + y

    @lib.op("off_add(Tensor x, Tensor y) -> Tensor", shape=opbridge.like("x"))
    def off_add(x: Any, y: Any) -> Any:
        return x + y

    @lib.op("refusing_add(Tensor x, Tensor y) -> Tensor", shape=opbridge.like("x"))
    def refusing_add(x: Any, y: Any) -> Any:
        return x + y

    return {"sig_sa": sig_sa, "unchecked_add": unchecked_add, "off_add": off_add, "refusing_add": refusing_add}


class BuiltAgain(BaseException):
    """Raised by the counting build on a second build of the broken library (hypothesis does not catch it)."""


def test_a_kernel_that_does_not_compile_fails_with_its_build_error_after_one_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken.cc").write_text(BROKEN_CC)
    lib = opbridge.Library("fuzz_failures_broken", sources=["broken.cc"], root=tmp_path, dtypes=["float32"])

    @lib.op("broken_sa(Tensor x, Tensor y, float alpha) -> Tensor", shape=opbridge.like("x"))
    def broken_sa(x: Any, y: Any, alpha: float) -> Any:
        return x + alpha * y

    real = jit.build
    builds: list[Any] = []

    def counting_build(spec: Any, force: bool = False) -> Path:
        if any(Path(s).name == "broken.cc" for s in spec.sources):
            builds.append(spec)
            if len(builds) > 1:  # every example and every shrink step building again: stop here
                raise BuiltAgain(f"the broken library was built {len(builds)} times")
        return real(spec, force=force)

    monkeypatch.setattr(jit, "build", counting_build)
    with pytest.raises(BuildError, match="undefined_thing") as e:
        fuzz_op(broken_sa, "numpy", examples=5)
    assert "undefined_thing" in e.value.log  # the compiler's output
    assert len(builds) == 1


def test_a_kernel_that_cannot_be_called_fails_the_error_checks(kernels: dict[str, Any]) -> None:
    # Its DeclarationError is a ValueError naming the op, but it is no refusal of a bad argument.
    for checks in (["bad_shape", "bad_dtype"], ["bad_shape"], ["scalars"]):
        with pytest.raises(DeclarationError, match=r"sig_sa"):
            fuzz_op(kernels["sig_sa"], "numpy", examples=5, checks=checks)


def test_an_error_check_does_not_take_a_declaration_error_for_a_refusal(kernels: dict[str, Any]) -> None:
    f = Fuzzer(kernels["sig_sa"], "numpy")
    case = f.cases("float32")[0]
    with pytest.raises(DeclarationError, match=r"sig_sa"):
        fuzz_errors.check_bad_input(f, "float32", case, {}, "shape")


def test_an_opbridge_error_inside_hypothesis_ends_the_check_at_once(
        kernels: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the first, valid call, the error checks meet the DeclarationError: raised on the first
    # example, with no more examples and no shrinking.
    monkeypatch.setattr(Fuzzer, "first_call", lambda self: None, raising=False)
    real = fuzz.run_check
    runs: list[str] = []

    def counting(f: Fuzzer, check: str, data: Any) -> bool:
        runs.append(check)
        return real(f, check, data)

    monkeypatch.setattr(fuzz, "run_check", counting)
    with pytest.raises(DeclarationError, match=r"sig_sa"):
        fuzz_op(kernels["sig_sa"], "numpy", examples=10, checks=["bad_shape"])
    assert runs == ["bad_shape"]


def test_a_kernel_that_refuses_valid_calls_fails_before_the_error_checks(kernels: dict[str, Any]) -> None:
    with pytest.raises(AssertionError, match=r"refusing_add .*a valid call .* raised ValueError: .*refuses every"):
        fuzz_op(kernels["refusing_add"], "numpy", examples=5, checks=["bad_shape", "bad_dtype"])


@pytest.mark.parametrize(("check", "macro"), [("bad_shape", "OPB_CHECK_SAME_SHAPE"),
                                              ("bad_dtype", "OPB_CHECK_SAME_DTYPE")])
def test_a_missing_argument_check_says_what_was_expected(kernels: dict[str, Any], check: str, macro: str) -> None:
    with pytest.raises(AssertionError) as e:
        fuzz_op(kernels["unchecked_add"], "numpy", examples=5, checks=[check])
    msg = str(e.value)
    assert "'y' given" in msg
    assert "no error: expected a TypeError or ValueError naming 'unchecked_add', and the call returned" in msg
    assert f'{macro}("unchecked_add", y, x);' in msg


def test_a_mismatch_names_the_dtype_compared(kernels: dict[str, Any]) -> None:
    with pytest.raises(AssertionError, match=r"off_add .*elements mismatch \(float32, rtol=") as e:
        fuzz_op(kernels["off_add"], "numpy", examples=5, checks=["calls"])
    assert "float64, rtol" not in str(e.value)


def test_the_first_call_leaves_a_working_op_alone(kernels: dict[str, Any]) -> None:
    x = np.ones(3, np.float32)
    report = fuzz_op(kernels["off_add"], "numpy", examples=3, checks=["bad_shape", "bad_dtype"])
    assert report.examples["bad_shape"] > 0 and report.examples["bad_dtype"] > 0, report  # a case may be empty
    np.testing.assert_array_equal(kernels["off_add"](x, x), np.full(3, 3, np.float32))
