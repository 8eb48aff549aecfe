"""Arguments an op declares ``row_strided`` reach its kernel as they are, in every framework with views.

A probe op writes, into the first element of each row of its argument, the
row stride its kernel saw (``opbridge::row_stride``). Declared
``row_strided``, a column slice of a wider tensor must arrive with the wide
stride (no dense copy); undeclared, or in a layout that is not rows at a
stride, it arrives dense and is copied back. Either way, nothing outside the
view is written. JAX arrays have no strides: there, the kernel sees dense rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import opbridge
from opbridge.testing.layouts import Memory

from ._framework import FRAMEWORK, H, framework_mark

pytestmark = framework_mark

PROBE_CC = """
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;
namespace {
void probe(const char* op, TensorView x, int64_t stride) {
  OPB_CHECK_DTYPE(op, x, opbridge::kFloat32);
  OPB_CHECK_NDIM(op, x, 2);
  float* p = static_cast<float*>(x.data_ptr());
  for (int64_t r = 0; r < x.size(0); ++r) p[r * stride] = float(stride);
}
}  // namespace
void row_probe__cpu(TensorView x) { probe("row_probe_", x, opbridge::row_stride("row_probe_", "x", x)); }
void dense_probe__cpu(TensorView x) {
  OPB_CHECK_CONTIGUOUS("dense_probe_", x);
  probe("dense_probe_", x, x.size(1));
}
OPBRIDGE_EXPORT(row_probe__cpu);
OPBRIDGE_EXPORT(dense_probe__cpu);
"""


def _reference(x: Any) -> None:
    x[:, 0] = x.shape[1]


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    root: Path = tmp_path_factory.mktemp("probe")
    (root / "probe.cc").write_text(PROBE_CC)
    lib = opbridge.Library(f"row_strided_{FRAMEWORK}", sources=["probe.cc"], root=root, dtypes=["float32"])
    row = lib.op("row_probe_(Tensor(a!) x) -> ()", row_strided=["x"])(_reference)
    dense = lib.op("dense_probe_(Tensor(a!) x) -> ()")(_reference)
    return row, dense


def _place(layout: str) -> tuple[Memory, Any]:
    mem = Memory(H)
    if layout not in mem.layouts:
        pytest.skip(f"{FRAMEWORK} has no {layout} views")
    return mem, mem.place("x", np.zeros((3, 4)), "float32", layout)


def _seen(placed: Any, out: Any) -> np.ndarray:
    got = H.to_numpy(placed.view if H.mutates_in_place else (out[0] if isinstance(out, tuple) else out))
    return np.asarray(got)[:, 0]


@pytest.mark.parametrize("layout", ["contiguous", "padded_rows"])
def test_declared_argument_arrives_as_it_is(probes: tuple[Any, Any], layout: str) -> None:
    row, _ = probes
    mem, placed = _place(layout)
    out = row(placed.view)
    wide = 4 if layout == "contiguous" or not H.mutates_in_place else 7  # padded_rows: 3 more columns
    np.testing.assert_array_equal(_seen(placed, out), [wide] * 3)
    mem.check_around(placed, "row_probe_")


@pytest.mark.parametrize("layout", ["padded_rows", "every_other"])
def test_other_strided_arguments_arrive_dense(probes: tuple[Any, Any], layout: str) -> None:
    row, dense = probes
    if not H.mutates_in_place:
        pytest.skip(f"{FRAMEWORK} arrays have no strides")
    op = dense if layout == "padded_rows" else row  # undeclared, or declared in a layout that is not rows
    mem, placed = _place(layout)
    op(placed.view)
    np.testing.assert_array_equal(_seen(placed, None), [4] * 3)  # a dense copy, written back
    mem.check_around(placed, op.__name__ if hasattr(op, "__name__") else "probe")
