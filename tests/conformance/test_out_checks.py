"""``out=`` of another shape or dtype than the op's output raises ValueError, in every framework and on every
path (C entry, generated fast path, checked path), before the kernel runs.

The kernels here check nothing (as a user's kernel may not): handed a wrong buffer they would write past its
end or store float32 bits in another type, which is what the first tries of opbridge as a new user found
(a float16 out= of the README's `scale` crashed the process). The op's shape rule says what the output
is, so the op-call core checks it (`call.core.check_outs`), and the fast paths hand a mismatch to it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import opbridge
from conformance._framework import FRAMEWORK, H, framework_mark

pytestmark = framework_mark

UNCHECKED_CC = """
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;
// twice(Tensor x) -> Tensor, shaped like x; checks nothing.
void twice_cpu(TensorView out, TensorView x) {
  const float* a = static_cast<const float*>(x.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = 2 * a[i];
}
OPBRIDGE_EXPORT(twice_cpu);
// front(Tensor x) -> Tensor: the first half of each row (a shape rule); checks nothing.
void front_cpu(TensorView out, TensorView x) {
  const float* a = static_cast<const float*>(x.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  const int64_t h = x.size(x.ndim() - 1), rows = x.numel() / h;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < h / 2; ++j) o[r * (h / 2) + j] = a[r * h + j];
}
OPBRIDGE_EXPORT(front_cpu);
"""

SENTINEL = -7.0


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> opbridge.Library:
    if FRAMEWORK == "torch":  # torch's C entry and native kernels come from its shim: built now, not later
        from opbridge.adapters.torch import native

        if native.enabled():
            native.shim(build_now=True)
    root: Path = tmp_path_factory.mktemp("unchecked")
    (root / "unchecked.cc").write_text(UNCHECKED_CC)
    lib = opbridge.Library(f"out_checks_{FRAMEWORK}", sources=["unchecked.cc"], root=root)

    @lib.op("twice(Tensor x) -> Tensor", shape=opbridge.like("x"), dtypes=["float32"])
    def twice(x: Any) -> Any:
        return 2 * x

    def halved(x: Any) -> opbridge.Spec:
        return opbridge.Spec((*x.shape[:-1], x.shape[-1] // 2), x.dtype)

    @lib.op("front(Tensor x) -> Tensor", shape=halved, dtypes=["float32"])
    def front(x: Any) -> Any:
        return x[..., : x.shape[-1] // 2]

    return lib


def _buffer(shape: tuple[int, ...], dtype: str) -> Any:
    return H.from_numpy(np.full(shape, SENTINEL, np.dtype(dtype)), dtype)


CASES = [  # (op, out shape, out dtype, the output's shape)
    ("twice", (4, 6), "float16", (4, 6)),
    ("twice", (4, 6), "float64", (4, 6)),
    ("twice", (4, 3), "float32", (4, 6)),
    ("twice", (24,), "float32", (4, 6)),
    ("twice", (4, 8), "float32", (4, 6)),
    ("front", (4, 6), "float32", (4, 3)),
    ("front", (4, 3), "float16", (4, 3)),
]


@pytest.mark.parametrize(("name", "shape", "dtype", "want"), CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[2]}" for c in CASES])
def test_out_of_another_shape_or_dtype_raises_and_writes_nothing(lib: opbridge.Library, name: str,
                                                                  shape: tuple[int, ...], dtype: str,
                                                                  want: tuple[int, ...]) -> None:
    if dtype not in H.dtypes:
        pytest.skip(f"{FRAMEWORK} has no {dtype}")
    op = lib.ops[name].call
    x = H.from_numpy(np.arange(24, dtype=np.float32).reshape(4, 6), "float32")
    message = re.escape(f"{name}: out has shape {shape} and dtype {dtype}, but the output has shape {want} "
                        f"and dtype float32")
    for _ in range(3):  # the first call installs the fast paths and C entries; later calls go through them
        got = op(x, out=_buffer(want, "float32"))  # a new one each time: JAX donates it
        np.testing.assert_array_equal(H.to_numpy(got), lib.ops[name].reference(H.to_numpy(x)) * 1.0)
        bad = _buffer(shape, dtype)
        with pytest.raises(ValueError, match=message):
            op(x, out=bad)
        np.testing.assert_array_equal(H.to_numpy(bad).astype(np.float64), SENTINEL)
