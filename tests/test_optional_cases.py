"""A ``Tensor?`` argument is tested with a tensor as well as None, or the report says it was not.

A kernel that ignores its optional tensor passed ``check_op`` and ``fuzz_op`` while the
generated cases passed only None for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import opbridge
from opbridge.cases import ELEMENTWISE_SHAPES, elementwise_cases, elementwise_hint
from opbridge.testing import check_op

KERNELS_CC = """
#include <opbridge/opbridge.h>
using opbridge::Optional;
using opbridge::TensorView;
// BUG on purpose: ignores bias.
void ignores_bias_cpu(TensorView out, TensorView x, Optional<TensorView> bias) {
  OPB_CHECK_DTYPE("ignores_bias", x, opbridge::kFloat32);
  const float* p = static_cast<const float*>(x.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = p[i];
}
OPBRIDGE_EXPORT(ignores_bias_cpu);
void adds_bias_cpu(TensorView out, TensorView x, Optional<TensorView> bias) {
  OPB_CHECK_DTYPE("adds_bias", x, opbridge::kFloat32);
  const float* b = nullptr;
  if (bias.has_value()) {
    OPB_CHECK_DTYPE("adds_bias", bias.value(), opbridge::kFloat32);
    OPB_CHECK_SAME_SHAPE("adds_bias", bias.value(), x);
    b = static_cast<const float*>(bias.value().data_ptr());
  }
  const float* p = static_cast<const float*>(x.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = p[i] + (b ? b[i] : 0.0f);
}
OPBRIDGE_EXPORT(adds_bias_cpu);
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> opbridge.Library:
    root: Path = tmp_path_factory.mktemp("optional_cases")
    (root / "kernels.cc").write_text(KERNELS_CC)
    lib = opbridge.Library("optional_cases", sources=["kernels.cc"], root=root, dtypes=["float32"])
    like = opbridge.like("x")

    @lib.op("ignores_bias(Tensor x, Tensor? bias=None) -> Tensor", shape=like)
    def ignores_bias(x: Any, bias: Any = None) -> Any:
        return x if bias is None else x + bias

    @lib.op("adds_bias(Tensor x, Tensor? bias=None) -> Tensor", shape=like)
    def adds_bias(x: Any, bias: Any = None) -> Any:
        return x if bias is None else x + bias

    return lib


def test_the_default_cases_give_an_optional_tensor_a_tensor_and_none(lib: opbridge.Library) -> None:
    cases = elementwise_cases(lib.ops["adds_bias"], "float32", np.random.default_rng(0))
    plain = [c for c in cases if len(c) == 2]  # no layout key
    assert [c["x"].shape for c in plain if c["bias"] is not None] == list(ELEMENTWISE_SHAPES)
    assert [c["x"].shape for c in plain if c["bias"] is None] == list(ELEMENTWISE_SHAPES)
    assert all(c["bias"].shape == c["x"].shape for c in plain if c["bias"] is not None)
    assert all(c["bias"] is not None for c in cases if len(c) == 3)  # the sliced and non-contiguous variants
    assert {c.get("_noncontiguous") for c in cases} == {None, "x", "bias"}


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_check_op_catches_a_kernel_that_ignores_its_optional_tensor(lib: opbridge.Library, framework: str) -> None:
    if framework == "torch":
        pytest.importorskip("torch")
    with pytest.raises(AssertionError, match=r"forward check failed(.|\n)*bias: shape"):
        check_op(lib.ops["ignores_bias"], framework=framework, check_grad=False)
    report = check_op(lib.ops["adds_bias"], framework=framework, check_grad=False)
    assert not any("only tested as None" in s for s in report.skipped)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_fuzz_op_catches_a_kernel_that_ignores_its_optional_tensor(lib: opbridge.Library, framework: str) -> None:
    pytest.importorskip("hypothesis")
    if framework == "torch":
        pytest.importorskip("torch")
    from opbridge.testing.fuzz import fuzz_op

    with pytest.raises(AssertionError, match="mismatch"):
        fuzz_op(lib.ops["ignores_bias"], framework, examples=20, checks=("calls",))
    report = fuzz_op(lib.ops["adds_bias"], framework, examples=20, checks=("calls",))
    assert report.examples["calls"] == 20 and "Tensor?" not in report.skipped


def test_cases_that_leave_an_optional_tensor_none_say_so(lib: opbridge.Library) -> None:
    """Declared cases decide the shapes; where none gives the argument a tensor, the reports say it."""
    note = "bias (Tensor?): only tested as None, no case gives it a tensor"
    report = check_op(lib.ops["ignores_bias"], elementwise_hint("x"), framework="numpy")
    assert any(s.startswith(note) for s in report.skipped)
    pytest.importorskip("hypothesis")
    from opbridge.testing.fuzz import fuzz_op

    fuzzed = fuzz_op(lib.ops["ignores_bias"], "numpy", examples=5, checks=("calls",), cases=elementwise_hint("x"))
    assert fuzzed.skipped["Tensor?"].startswith(note)
