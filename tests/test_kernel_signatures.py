"""A kernel's exported signature is checked against its op's schema before its first call.

``OPBRIDGE_EXPORT`` records each kernel's parameter kinds in the module
(``__opbridge_signatures``); the loader compares them with what the adapters
pass (the new outputs, then the schema's arguments) and names the mismatch,
instead of the kernel's call failing with an argument count or type.
"""

from __future__ import annotations

import numpy as np
import pytest

import opbridge
from opbridge import loader
from opbridge.build.library import signatures
from opbridge.errors import DeclarationError

KERNELS = """
#include <opbridge/opbridge.h>
using opbridge::Optional;
using opbridge::TensorView;
void fine_cpu(TensorView out, TensorView x, Optional<TensorView> w, double a, int64_t n, bool flag,
              tvm::ffi::Array<int64_t> dims, tvm::ffi::String tag) {
  const float* src = static_cast<const float*>(x.data_ptr());
  float* dst = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) dst[i] = src[i];
}
OPBRIDGE_EXPORT(fine_cpu);
void short_cpu(TensorView out, TensorView x) {}
OPBRIDGE_EXPORT(short_cpu);
void int_for_float_cpu(TensorView out, TensorView x, int64_t alpha) {}
OPBRIDGE_EXPORT(int_for_float_cpu);
int64_t returns_cpu(TensorView out, TensorView x) { return 0; }
OPBRIDGE_EXPORT(returns_cpu);
void scalar_for_tensor_cpu(TensorView x, double y) {}
OPBRIDGE_EXPORT(scalar_for_tensor_cpu);
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> opbridge.Library:
    """The library; its ops' public callables are in ``lib.calls``."""
    root = tmp_path_factory.mktemp("sigs")
    (root / "kernels.cc").write_text(KERNELS)
    lib = opbridge.Library("sig_checks", sources=["kernels.cc"], root=root, dtypes=["float32"])
    like = opbridge.like("x")

    @lib.op("fine(Tensor x, Tensor? w, float a, int n, bool flag, int[] dims, str tag) -> Tensor", shape=like)
    def fine(x: np.ndarray, w: object, a: float, n: int, flag: bool, dims: object, tag: str) -> np.ndarray:
        return x

    @lib.op("short(Tensor x, float alpha) -> Tensor", shape=like)
    def short(x: np.ndarray, alpha: float) -> np.ndarray:
        return x

    @lib.op("int_for_float(Tensor x, float alpha) -> Tensor", shape=like)
    def int_for_float(x: np.ndarray, alpha: float) -> np.ndarray:
        return x

    @lib.op("returns(Tensor x) -> Tensor", shape=like)
    def returns(x: np.ndarray) -> np.ndarray:
        return x

    @lib.op("scalar_for_tensor(Tensor(a!) x, Tensor y) -> ()")
    def scalar_for_tensor(x: np.ndarray, y: np.ndarray) -> None:
        pass

    lib.calls = {f.__name__: f for f in (fine, short, int_for_float, returns, scalar_for_tensor)}  # type: ignore[attr-defined]
    return lib


def test_the_module_records_every_kernels_signature(lib: opbridge.Library) -> None:
    sigs = signatures(loader.build(lib))
    assert sigs == {"fine_cpu": "v:TTOdlboo", "short_cpu": "v:TT", "int_for_float_cpu": "v:TTl",
                    "returns_cpu": "r:TT", "scalar_for_tensor_cpu": "v:Td"}


def test_a_matching_kernel_runs(lib: opbridge.Library) -> None:
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(lib.calls["fine"](x, None, 1.0, 2, True, [0], "t"), x)


@pytest.mark.parametrize(("op", "message"), [
    ("short", r"kernel short_cpu\(TensorView, TensorView\) does not take what the schema "
              r"'short\(Tensor x, float alpha\) -> Tensor' passes it: \(Tensor out, Tensor x, float alpha\), the "
              r"new outputs first, then the schema's arguments in order; it takes 2 argument\(s\), the schema "
              r"passes 3"),
    ("int_for_float", r"argument #2 \(float alpha\) arrives as double or float, the kernel takes int64_t"),
    ("returns", r"it returns a value, but kernels write their outputs into the tensors passed first"),
    ("scalar_for_tensor", r"argument #1 \(Tensor y\) arrives as TensorView, the kernel takes double"),
])
def test_a_kernel_that_does_not_take_what_its_schema_passes_is_named_before_it_runs(
        lib: opbridge.Library, op: str, message: str) -> None:
    x = np.ones(3, dtype=np.float32)
    args = {"short": (x, 2.0), "int_for_float": (x, 2.0), "returns": (x,), "scalar_for_tensor": (x, x)}[op]
    with pytest.raises(DeclarationError, match=message):
        lib.calls[op](*args)
    with pytest.raises(DeclarationError, match=message):  # every time, not only the first
        lib.calls[op](*args)


def test_modules_without_signatures_are_not_checked() -> None:
    # A library built before opbridge recorded signatures (here, one no opbridge build made) has no list.
    assert signatures("libc.so.6") == {}


OWNING_CC = """
#include <opbridge/opbridge.h>
void owning_cpu(tvm::ffi::Tensor out, tvm::ffi::Tensor x, tvm::ffi::Optional<tvm::ffi::Tensor> w) {
  const float* src = static_cast<const float*>(x.data_ptr());
  float* dst = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) dst[i] = src[i] + (w.has_value() ? 1.0f : 0.0f);
}
OPBRIDGE_EXPORT(owning_cpu);
"""


def test_a_kernel_over_tvm_ffis_owning_tensor_is_named(tmp_path_factory: pytest.TempPathFactory) -> None:
    """tvm-ffi's examples often take ``tvm::ffi::Tensor``; opbridge's C entries pass views (DLTensor*),
    so such a kernel ran on one path and failed on the next: it is refused before its first call."""
    root = tmp_path_factory.mktemp("sigs_owning")
    (root / "owning.cc").write_text(OWNING_CC)
    lib = opbridge.Library("sig_owning", sources=["owning.cc"], root=root, dtypes=["float32"])

    @lib.op("owning(Tensor x, Tensor? w) -> Tensor", shape=opbridge.like("x"))
    def owning(x: np.ndarray, w: object) -> np.ndarray:
        return x if w is None else x + 1

    assert signatures(loader.build(lib)) == {"owning_cpu": "v:XXY"}
    with pytest.raises(DeclarationError, match=r"argument #0 is tvm::ffi::Tensor, an owning tensor, but opbridge "
                                               r"passes tensors as views .*take TensorView"):
        owning(np.arange(4, dtype=np.float32), None)
