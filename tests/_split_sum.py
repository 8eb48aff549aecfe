"""Toy ops whose outputs a shape rule gives, their kernel sources (after ``#include <opbridge/opbridge.h>`` and
``using tvm::ffi::TensorView;``) and declarations, shared by the entries' tests: ``split_sum`` (two outputs
of two dtypes) and ``repeat_first`` (an output sized by an int argument, which may make it negative)."""

from __future__ import annotations

from typing import Any

import numpy as np

import opbridge

SPLIT_SUM_CC = """
// split_sum(Tensor x) -> (Tensor, Tensor): the row sums (int64 count of rows as second output)
void split_sum_cpu(TensorView sums, TensorView count, TensorView x) {
  OPB_CHECK_DTYPE("split_sum", x, opbridge::kFloat32);
  OPB_CHECK_NDIM("split_sum", x, 2);
  const float* a = static_cast<const float*>(x.data_ptr());
  float* s = static_cast<float*>(sums.data_ptr());
  for (int64_t r = 0; r < x.size(0); ++r) {
    float acc = 0.f;
    for (int64_t c = 0; c < x.size(1); ++c) acc += a[r * x.size(1) + c];
    s[r] = acc;
  }
  static_cast<int64_t*>(count.data_ptr())[0] = x.size(0);
}
OPBRIDGE_EXPORT(split_sum_cpu);
"""


def declare_split_sum(lib: opbridge.Library) -> Any:
    """Declare ``split_sum`` in *lib* (whose sources hold :data:`SPLIT_SUM_CC`); its public callable."""

    @lib.op("split_sum(Tensor x) -> (Tensor, Tensor)",
            shape=lambda x: (opbridge.Spec((x.shape[0],), x.dtype), opbridge.Spec((1,), "int64")))
    def split_sum(x: Any) -> Any:
        return x.sum(axis=1), np.array([x.shape[0]], np.int64)

    return split_sum


REPEAT_FIRST_CC = """
// repeat_first(Tensor x, int n) -> Tensor: n copies of x's first element (float32)
void repeat_first_cpu(TensorView out, TensorView x, int64_t n) {
  OPB_CHECK_DTYPE("repeat_first", x, opbridge::kFloat32);
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < out.numel(); ++i) o[i] = static_cast<const float*>(x.data_ptr())[0];
}
OPBRIDGE_EXPORT(repeat_first_cpu);
"""


def declare_repeat_first(lib: opbridge.Library) -> Any:
    """Declare ``repeat_first`` in *lib* (whose sources hold :data:`REPEAT_FIRST_CC`); its public callable."""

    @lib.op("repeat_first(Tensor x, int n) -> Tensor", shape=lambda x, n: opbridge.Spec((n,), x.dtype))
    def repeat_first(x: Any, n: int) -> Any:
        return np.full(n, x.reshape(-1)[0], x.dtype)

    return repeat_first


def shape_rule_dimensions_below_zero_are_refused(repeat_first: Any, to: Any, calls: Any) -> None:
    """A shape rule's negative dimension, or an output of more elements than any buffer holds, is the op's
    ValueError on every path; an entry leaves both to Python: no output of a wrapped size is made. *to*
    makes a framework tensor from an array; *calls()* counts the calls the entry took."""
    import pytest

    x = to(np.full(2, 3.0, np.float32))
    np.testing.assert_array_equal(np.asarray(repeat_first(x, 3)), [3, 3, 3])  # registers the op's path
    before = calls()
    np.testing.assert_array_equal(np.asarray(repeat_first(x, 2)), [3, 3])
    assert calls() == before + 1, "the entry did not take a valid call"
    with pytest.raises(ValueError, match=r"repeat_first: its shape rule gave output 0 the shape \(-4,\); "
                                         r"dimensions must be >= 0"):
        repeat_first(x, -4)
    with pytest.raises(ValueError, match=r"repeat_first: its shape rule gave output 0 the shape "
                                         r"\(4611686018427387904,\), 4611686018427387904 elements: more than"):
        repeat_first(x, 2**62)  # 2^64 bytes: Paddle makes such a tensor, of a byte count wrapped to 0
    assert calls() == before + 1
