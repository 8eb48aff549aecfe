"""``split_sum``, a toy op with two outputs of two dtypes that a shape rule gives: its kernel source (after
``#include <opbridge/opbridge.h>`` and ``using tvm::ffi::TensorView;``) and its declaration, shared by the
NumPy entry's tests and MindSpore's."""

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
