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
void int32_for_int_cpu(TensorView out, TensorView x, int32_t k) {}
OPBRIDGE_EXPORT(int32_for_int_cpu);
void float_for_float_cpu(TensorView out, TensorView x, float k) {}
OPBRIDGE_EXPORT(float_for_float_cpu);
void scalar_for_list_cpu(TensorView out, TensorView x, int64_t dims) {}
OPBRIDGE_EXPORT(scalar_for_list_cpu);
void double_for_str_cpu(TensorView out, TensorView x, double tag) {}
OPBRIDGE_EXPORT(double_for_str_cpu);
void narrow_list_cpu(TensorView out, TensorView x, tvm::ffi::Array<int32_t> dims) {}
OPBRIDGE_EXPORT(narrow_list_cpu);
void unsigned_for_int_cpu(TensorView out, TensorView x, uint64_t k) {}
OPBRIDGE_EXPORT(unsigned_for_int_cpu);
void scalar_for_optional_cpu(TensorView out, TensorView x, double a) {}
OPBRIDGE_EXPORT(scalar_for_optional_cpu);
"""

#: Kernels whose parameters are each spelt another way that takes what the schema passes.
ALTERNATIVES = """
#include <opbridge/opbridge.h>
#include <tvm/ffi/extra/stl.h>
using opbridge::Optional;
using opbridge::TensorView;
void spelt_cpu(TensorView out, TensorView x, Optional<double> a, std::optional<int64_t> n, std::vector<int64_t> dims,
               tvm::ffi::Shape shape, Optional<tvm::ffi::Array<double>> ws, std::string tag, long long m, bool flag) {
  const float* src = static_cast<const float*>(x.data_ptr());
  float* dst = static_cast<float*>(out.data_ptr());
  int64_t total = (a.has_value() ? 1 : 0) + n.value_or(0) + int64_t(dims.size()) + int64_t(shape.size()) +
                  (ws.has_value() ? int64_t(ws.value().size()) : 0) + int64_t(tag.size()) + m + (flag ? 1 : 0);
  for (int64_t i = 0; i < x.numel(); ++i) dst[i] = src[i] + float(total);
}
OPBRIDGE_EXPORT(spelt_cpu);
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

    @lib.op("int32_for_int(Tensor x, int k) -> Tensor", shape=like)
    def int32_for_int(x: np.ndarray, k: int) -> np.ndarray:
        return x + k

    @lib.op("float_for_float(Tensor x, float k) -> Tensor", shape=like)
    def float_for_float(x: np.ndarray, k: float) -> np.ndarray:
        return x + k

    @lib.op("scalar_for_list(Tensor x, int[] dims) -> Tensor", shape=like)
    def scalar_for_list(x: np.ndarray, dims: object) -> np.ndarray:
        return x

    @lib.op("double_for_str(Tensor x, str tag) -> Tensor", shape=like)
    def double_for_str(x: np.ndarray, tag: str) -> np.ndarray:
        return x

    @lib.op("narrow_list(Tensor x, int[] dims) -> Tensor", shape=like)
    def narrow_list(x: np.ndarray, dims: object) -> np.ndarray:
        return x

    @lib.op("scalar_for_optional(Tensor x, float? a=None) -> Tensor", shape=like)
    def scalar_for_optional(x: np.ndarray, a: object = None) -> np.ndarray:
        return x

    @lib.op("unsigned_for_int(Tensor x, int k) -> Tensor", shape=like)
    def unsigned_for_int(x: np.ndarray, k: int) -> np.ndarray:
        return x + k

    lib.calls = {f.__name__: f for f in (  # type: ignore[attr-defined]
        fine, short, int_for_float, returns, scalar_for_tensor, int32_for_int, float_for_float, scalar_for_list,
        double_for_str, narrow_list, scalar_for_optional, unsigned_for_int)}
    return lib


def test_the_module_records_every_kernels_signature(lib: opbridge.Library) -> None:
    sigs = signatures(loader.build(lib))
    assert sigs == {"fine_cpu": "v:TTOdlb[ls", "short_cpu": "v:TT", "int_for_float_cpu": "v:TTl",
                    "returns_cpu": "r:TT", "scalar_for_tensor_cpu": "v:Td", "int32_for_int_cpu": "v:TTi",
                    "float_for_float_cpu": "v:TTf", "scalar_for_list_cpu": "v:TTl", "double_for_str_cpu": "v:TTd",
                    "narrow_list_cpu": "v:TT[i", "scalar_for_optional_cpu": "v:TTd",
                    "unsigned_for_int_cpu": "v:TTn"}


def test_a_matching_kernel_runs(lib: opbridge.Library) -> None:
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(lib.calls["fine"](x, None, 1.0, 2, True, [0], "t"), x)


@pytest.mark.parametrize(("op", "message"), [
    ("short", r"kernel short_cpu\(TensorView, TensorView\) does not take what the schema "
              r"'short\(Tensor x, float alpha\) -> Tensor' passes it: \(Tensor out, Tensor x, float alpha\), the "
              r"new outputs first, then the schema's arguments in order; it takes 2 argument\(s\), the schema "
              r"passes 3"),
    ("int_for_float", r"argument #2 \(float alpha\) arrives as double, the kernel takes int64_t: take double"),
    # A narrower scalar would be accepted by tvm-ffi and round or truncate the value silently.
    ("int32_for_int", r"argument #2 \(int k\) arrives as int64_t, the kernel takes int32_t, which would "
                      r"truncate values beyond its range silently: take int64_t"),
    ("float_for_float", r"argument #2 \(float k\) arrives as double, the kernel takes float, which would round "
                        r"every value to float precision silently: take double"),
    # Lists and strings: otherwise tvm-ffi's own message, naming the kernel but neither op nor schema.
    ("scalar_for_list", r"argument #2 \(int\[\] dims\) arrives as tvm::ffi::Array<int64_t>, the kernel takes "
                        r"int64_t: take tvm::ffi::Array<int64_t>"),
    ("double_for_str", r"argument #2 \(str tag\) arrives as tvm::ffi::String, the kernel takes double: take "
                       r"tvm::ffi::String"),
    ("narrow_list", r"argument #2 \(int\[\] dims\) arrives as tvm::ffi::Array<int64_t>, the kernel takes "
                    r"tvm::ffi::Array<int32_t>, which would truncate values beyond its range silently: take "
                    r"tvm::ffi::Array<int64_t>"),
    ("unsigned_for_int", r"argument #2 \(int k\) arrives as int64_t, the kernel takes an unsigned or narrower "
                         r"integer, which would truncate values beyond its range silently: take int64_t"),
    ("scalar_for_optional", r"argument #2 \(float\? a\) arrives as Optional<double>, the kernel takes double: "
                            r"take Optional<double>"),
    ("returns", r"it returns a value, but kernels write their outputs into the tensors passed first"),
    ("scalar_for_tensor", r"argument #1 \(Tensor y\) arrives as TensorView, the kernel takes double"),
])
def test_a_kernel_that_does_not_take_what_its_schema_passes_is_named_before_it_runs(
        lib: opbridge.Library, op: str, message: str) -> None:
    x = np.ones(3, dtype=np.float32)
    args = {"short": (x, 2.0), "int_for_float": (x, 2.0), "returns": (x,), "scalar_for_tensor": (x, x),
            "int32_for_int": (x, 2**40 + 5), "float_for_float": (x, 0.1), "scalar_for_list": (x, [1]),
            "double_for_str": (x, "s"), "narrow_list": (x, [1]), "scalar_for_optional": (x, None),
            "unsigned_for_int": (x, -1)}[op]
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


def test_every_spelling_that_takes_what_the_schema_passes_is_accepted(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Optional scalars and lists, std::optional, std::vector, Shape, std::string and long long all take
    what opbridge passes; the check names the type, not one spelling of it."""
    root = tmp_path_factory.mktemp("sigs_spelt")
    (root / "spelt.cc").write_text(ALTERNATIVES)
    lib = opbridge.Library("sig_spelt", sources=["spelt.cc"], root=root, dtypes=["float32"])

    @lib.op("spelt(Tensor x, float? a, int? n, int[] dims, int[] shape, float[]? ws, str tag, int m, bool flag)"
            " -> Tensor", shape=opbridge.like("x"))
    def spelt(x: np.ndarray, a: object, n: object, dims: list[int], shape: list[int], ws: object, tag: str, m: int,
              flag: bool) -> np.ndarray:
        ws_len = 0 if ws is None else len(ws)  # type: ignore[arg-type]
        return x + (a is not None) + (n or 0) + len(dims) + len(shape) + ws_len + len(tag) + m + flag

    assert signatures(loader.build(lib)) == {"spelt_cpu": "v:TT?d?l[l[l?[dslb"}
    x = np.zeros(3, dtype=np.float32)
    np.testing.assert_array_equal(spelt(x, None, 2, [1, 2], [3], [0.5], "ab", 2**33, True),
                                  x + 2 + 2 + 1 + 1 + 2 + 2**33 + 1)
    np.testing.assert_array_equal(spelt(x, 1.0, None, [], [], None, "", 0, False), x + 1)


def test_a_module_recorded_before_lists_and_strings_had_letters_still_loads(lib: opbridge.Library) -> None:
    """Such a module records each list, string and optional scalar as ``o`` ("another type"): those stay
    unchecked, as they were, while a scalar recorded as ``o`` is refused as before."""
    loader.check_signature(lib.ops["fine"], "fine_cpu", "v:TTOdlboo")
    loader.check_signature(lib.ops["scalar_for_optional"], "scalar_for_optional_cpu", "v:TTo")
    with pytest.raises(DeclarationError, match=r"argument #2 \(float alpha\) arrives as double, the kernel takes "
                                               r"another type: take double"):
        loader.check_signature(lib.ops["int_for_float"], "int_for_float_cpu", "v:TTo")
