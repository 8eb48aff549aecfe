"""The user-facing test kit, ``check_op``, in the framework of this run (``OPBRIDGE_FRAMEWORK``).

A plugin author checks an op in each framework it ships for: its forward, gradients, graph mode and
rows there, and a wrong backward or reference fails, naming the check and the framework.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import opbridge
from opbridge import ops
from opbridge.testing import check_op

from ._framework import FRAMEWORK, H, framework_mark

pytestmark = framework_mark

#: differentiates (the kit's grad and compile_grad checks run), has graph mode, has views
DIFFERENTIATES = FRAMEWORK != "numpy"
GRAPH = FRAMEWORK != "numpy"
VIEWS = FRAMEWORK != "jax"
#: float64 where this framework holds it (JAX only with JAX_ENABLE_X64)
F64 = "float64" in H.dtypes

GELU_CASES = [{"x": np.linspace(-3, 3, 15).reshape(3, 5)}, {"x": np.linspace(-1, 2, 7)}]

TWICE_CC = """
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;

// out = 2 x in float32; declared below with a right and a wrong backward, and with a wrong reference.
void twice_cpu(TensorView out, TensorView x) {
  OPB_CHECK_DTYPE("twice", x, opbridge::kFloat32);
  OPB_CHECK_SAME_DTYPE("twice", out, x);
  OPB_CHECK_SAME_SHAPE("twice", out, x);
  OPB_CHECK_CONTIGUOUS("twice", out);
  OPB_CHECK_CONTIGUOUS("twice", x);
  float* o = static_cast<float*>(out.data_ptr());
  const float* a = static_cast<const float*>(x.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = 2.f * a[i];
}
OPBRIDGE_EXPORT(twice_cpu);

// The same, and one element past the end of out.
void overrun_cpu(TensorView out, TensorView x) {
  twice_cpu(out, x);
  static_cast<float*>(out.data_ptr())[x.numel()] = 0.f;
}
OPBRIDGE_EXPORT(overrun_cpu);

// out = alpha x: an op with a keyword-only argument and a backward.
void scaled_cpu(TensorView out, TensorView x, double alpha) {
  OPB_CHECK_DTYPE("scaled", x, opbridge::kFloat32);
  OPB_CHECK_SAME_DTYPE("scaled", out, x);
  OPB_CHECK_SAME_SHAPE("scaled", out, x);
  OPB_CHECK_CONTIGUOUS("scaled", out);
  OPB_CHECK_CONTIGUOUS("scaled", x);
  float* o = static_cast<float*>(out.data_ptr());
  const float* a = static_cast<const float*>(x.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = static_cast<float>(alpha) * a[i];
}
OPBRIDGE_EXPORT(scaled_cpu);

// x *= 2 in place.
void double__cpu(TensorView x) {
  OPB_CHECK_DTYPE("double_", x, opbridge::kFloat32);
  OPB_CHECK_CONTIGUOUS("double_", x);
  float* a = static_cast<float*>(x.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) a[i] *= 2.f;
}
OPBRIDGE_EXPORT(double__cpu);
"""


@pytest.fixture(scope="module")
def twice(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A throwaway library of float32 ops, right and deliberately wrong (one name for every framework, so one
    build in a cache the framework runs share)."""
    root: Path = tmp_path_factory.mktemp("check_op_kit")
    (root / "twice.cc").write_text(textwrap.dedent(TWICE_CC))
    lib = opbridge.Library("check_op_conformance", sources=["twice.cc"], root=root, dtypes=["float32"])
    same = {"shape": opbridge.like("x"), "kernels": {"cpu": "twice_cpu"}}

    def two_x(x: np.ndarray) -> np.ndarray:
        return 2 * x

    def three_x(x: np.ndarray) -> np.ndarray:
        return 3 * x

    found: dict[str, Any] = {}
    # The backward names the op itself (MindSpore's graph mode compiles it with the op's graph substitute).
    good = lib.op("twice(Tensor x) -> Tensor", **same, backward=lambda grad, x: (good(grad),))(two_x)
    found["twice"] = good
    found["bad_grad"] = lib.op("twice_bad_grad(Tensor x) -> Tensor", **same,
                               backward=lambda grad, x: (grad,))(two_x)  # wrong: d(2x)/dx is 2
    found["bad_ref"] = lib.op("twice_bad_ref(Tensor x) -> Tensor", **same)(three_x)  # the kernel gives 2x
    found["overrun"] = lib.op("overrun(Tensor x) -> Tensor", shape=opbridge.like("x"))(two_x)

    def alpha_x(x: np.ndarray, alpha: float = 3.0) -> np.ndarray:
        return alpha * x

    scaled = lib.op("scaled(Tensor x, *, float alpha=3.0) -> Tensor", shape=opbridge.like("x"),
                    backward=lambda grad, x, alpha: (scaled(grad, alpha=alpha),))(alpha_x)
    found["scaled"] = scaled

    def double_(x: np.ndarray) -> None:
        x *= 2

    found["double_"] = lib.op("double_(Tensor(a!) x) -> ()")(double_)
    lib.build()
    return found


def test_check_op_runs_every_check_the_framework_has() -> None:
    # opcheck (torch's, the slowest here) is left out: tests/test_builtin_ops.py runs it on every op
    report = check_op(ops.gelu, GELU_CASES, framework=FRAMEWORK, dtypes=("float32", "float64"), check_opcheck=False)
    ran = 2 if F64 else 1  # dtypes
    assert report.framework == FRAMEWORK and len(report.dtypes) == ran, report
    assert report.checks["forward"] == report.checks["inputs_unchanged"] == 2 * ran, report
    assert report.checks["sentinel"] == (2 * ran if VIEWS else 0), report
    assert report.checks["rows"] == ran, report  # gelu declares rows=("x",); JAX: through jax.vmap
    assert report.checks["grad"] == (2 if DIFFERENTIATES else 0), report  # float32 cases
    assert report.checks["compile"] == (ran if GRAPH else 0), report
    assert report.checks["compile_grad"] == (1 if GRAPH else 0), report
    assert "opcheck" not in report.checks, report
    if FRAMEWORK == "torch":
        assert report.checks["gradcheck"] == 1, report
    else:
        assert "gradcheck" not in report.checks, report
        assert "opcheck/gradcheck: torch only (torch.library.opcheck, torch.autograd.gradcheck)" in report.skipped
    if not F64:
        assert any(s.startswith("dtype float64: not supported by jax without 64-bit types (set JAX_ENABLE_X64=1")
                   for s in report.skipped), report.skipped
    if not VIEWS:
        assert any(s.startswith("sentinel: jax arrays are immutable") for s in report.skipped), report.skipped
    if not DIFFERENTIATES:
        assert "grad: numpy has no autograd" in report.skipped and "compile: numpy has no graph mode" in report.skipped


def test_check_op_passes_a_user_op_with_a_backward(twice: dict[str, Any]) -> None:
    report = check_op(twice["twice"], [{"x": np.linspace(-1, 1, 6).reshape(2, 3)}], framework=FRAMEWORK)
    assert report.checks["forward"] == 1 and report.checks["grad"] == (1 if DIFFERENTIATES else 0), report
    assert report.checks["compile"] == report.checks["compile_grad"] == (1 if GRAPH else 0), report


def test_check_op_differentiates_an_op_with_a_keyword_only_argument(twice: dict[str, Any]) -> None:
    """torch hands a custom op's keyword-only arguments to its autograd apart from the others (its backward
    once failed there: setup_context() got an unexpected keyword argument 'keyword_only_inputs')."""
    cases = [{"x": np.linspace(-1, 1, 6).reshape(2, 3), "alpha": -1.5}, {"x": np.linspace(0, 1, 4)}]
    report = check_op(twice["scaled"], cases, framework=FRAMEWORK)
    assert report.checks["forward"] == 2 and report.checks["grad"] == (2 if DIFFERENTIATES else 0), report
    assert report.checks["compile"] == report.checks["compile_grad"] == (1 if GRAPH else 0), report


def test_check_op_checks_an_op_that_writes_its_argument(twice: dict[str, Any]) -> None:
    """Written in place, or (JAX) returned as the argument's new value: compared with the reference either way,
    in eager calls and in graph mode where the framework's graphs take such ops."""
    report = check_op(twice["double_"], [{"x": np.linspace(-1, 1, 6).reshape(2, 3)}], framework=FRAMEWORK)
    assert report.checks["forward"] == 1 and report.checks["grad"] == 0, report
    if FRAMEWORK in ("torch", "jax"):
        assert report.checks["compile"] == 1, report
    elif FRAMEWORK != "numpy":
        assert "compile" not in report.checks and any(s.startswith("compile: ") for s in report.skipped), report


def test_check_op_catches_a_wrong_backward(twice: dict[str, Any]) -> None:
    cases = [{"x": np.linspace(-1, 1, 7)}]
    if not DIFFERENTIATES:
        report = check_op(twice["bad_grad"], cases, framework=FRAMEWORK, check_compile=False)
        assert "grad: numpy has no autograd" in report.skipped
        return
    with pytest.raises(AssertionError) as info:
        check_op(twice["bad_grad"], cases, framework=FRAMEWORK, check_compile=False)
    msg = str(info.value)
    assert "check_op(check_op_conformance::twice_bad_grad): grad check failed" in msg, msg
    assert f"framework: {FRAMEWORK}, dtype: float32" in msg, msg
    assert "gradient of 'x' disagrees with finite differences" in msg and f"{FRAMEWORK} autograd" in msg, msg


def test_check_op_catches_a_reference_the_kernel_disagrees_with(twice: dict[str, Any]) -> None:
    with pytest.raises(AssertionError) as info:
        check_op(twice["bad_ref"], [{"x": np.linspace(-1, 1, 7)}], framework=FRAMEWORK, check_compile=False)
    msg = str(info.value)
    assert "check_op(check_op_conformance::twice_bad_ref): forward check failed" in msg, msg
    assert f"framework: {FRAMEWORK}, dtype: float32" in msg and "output vs the float64 reference" in msg, msg


def test_check_op_catches_an_out_of_bounds_write(twice: dict[str, Any]) -> None:
    """The sentinel check's guard buffers are views in this framework: the kernel's write past its output
    lands in the guard (JAX has no views: the check cannot run, and the forward call would write past
    XLA's buffer, so the op is not called there)."""
    if not VIEWS:
        pytest.skip(f"{FRAMEWORK} arrays have no views: no sentinel check (the first test checks it says so)")
    with pytest.raises(AssertionError) as info:
        check_op(twice["overrun"], [{"x": np.linspace(-1, 1, 7)}], framework=FRAMEWORK)
    msg = str(info.value)
    assert "check_op(check_op_conformance::overrun): sentinel check failed" in msg, msg
    assert "out-of-bounds write: 1 element(s) of the sentinel guard after output" in msg, msg
