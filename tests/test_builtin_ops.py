"""The built-in ops through the testing kit, and the kit catching deliberately broken ops.

Every op of ``opbridge.ops.LIBRARY`` (taken from the registry, not listed here)
runs through :func:`opbridge.testing.check_op` for each dtype it declares, in
torch and in NumPy. The second half declares a throwaway library whose kernels are
broken on purpose and checks that ``check_op`` fails on each, with a message
that says what is wrong.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import opbridge
import opbridge.ops
from opbridge.declare import DEFAULT_TOLERANCES
from opbridge.testing import CASE_HINTS, TOLERANCES, assert_close, check_op, make_cases
from opbridge.testing.matrix import LAYOUT, NONCONTIGUOUS

torch = pytest.importorskip("torch")

BUILTIN = opbridge.ops.LIBRARY.ops
REQUIRED_LEAD_SHAPES = [(1,), (7,), (3, 769), (2, 5125), (0, 16), (4, 1, 33)]


# ---------------------------------------------------------------------------
# the built-in ops
# ---------------------------------------------------------------------------


#: (op name, dtype) for every dtype each built-in op declares
DECLARED = [pytest.param(n, d, id=f"{n}-{d}") for n in sorted(BUILTIN) for d in BUILTIN[n].dtypes]


@pytest.mark.parametrize(("name", "dtype"), DECLARED)
def test_builtin_op_torch(name: str, dtype: str) -> None:
    op = BUILTIN[name]
    report = check_op(op, dtypes=(dtype,))
    n_tensors = len(op.schema.tensor_args)
    assert report.dtypes == (dtype,)
    assert report.checks["forward"] >= 7
    assert report.checks["sentinel"] == report.checks["forward"]
    assert report.checks["inputs_unchanged"] == report.checks["forward"]
    assert report.checks["noncontiguous"] == n_tensors
    assert report.checks["opcheck"] == 1
    assert report.checks["compile"] == 1
    differentiable = op.backward is not None and not op.schema.is_mutating
    if dtype == "float32" and differentiable:
        assert report.checks["grad"] >= 6  # every non-empty case
        assert report.checks["compile_grad"] == 1
    else:
        assert report.checks["grad"] == 0
    assert report.checks["gradcheck"] == (dtype == "float64" and differentiable)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_op_numpy(name: str) -> None:
    op = BUILTIN[name]
    report = check_op(op, framework="numpy")  # every declared dtype NumPy has
    assert report.dtypes == tuple(d for d in op.dtypes if d != "bfloat16")
    assert ("bfloat16" in op.dtypes) == any("dtype bfloat16: not supported by numpy" in s for s in report.skipped)
    assert report.checks["forward"] >= 7 * len(report.dtypes)
    assert report.checks["sentinel"] == report.checks["forward"]
    assert report.checks["noncontiguous"] == len(op.schema.tensor_args) * len(report.dtypes)
    assert report.checks["grad"] == report.checks["opcheck"] == report.checks["compile"] == 0
    assert report.checks["gradcheck"] == 0


GENERIC_HINTED = sorted(n for n, op in BUILTIN.items()
                        if (op.hints.__doc__ if op.hints else "").startswith(("Elementwise", "Normalisation")))


@pytest.mark.parametrize("name", GENERIC_HINTED)
def test_make_cases_cover_required_layouts(name: str) -> None:
    op = BUILTIN[name]
    cases = make_cases(op, "float32", seed=0)
    again = make_cases(op.call, "float32", seed=0)
    lead = op.schema.arguments[op.dispatch_arg].name
    shapes = [np.shape(c[lead]) for c in cases]
    for s in REQUIRED_LEAD_SHAPES:
        assert s in shapes, (name, s)
    assert any(c.get(LAYOUT) == "sliced" for c in cases)
    assert sorted(c[NONCONTIGUOUS] for c in cases if c.get(NONCONTIGUOUS)) == sorted(
        a.name for a in op.schema.tensor_args)
    assert all(np.array_equal(a[lead], b[lead]) for a, b in zip(cases, again, strict=True))  # deterministic
    for c in cases:  # every argument has a value, scalars their schema default
        assert {a.name for a in op.schema.arguments} <= set(c)
        for a in op.schema.arguments:
            if not a.type.is_tensor:
                assert c[a.name] == a.default
    if name.startswith("rms_norm"):
        assert all(np.shape(c["weight"]) == (np.shape(c["x"])[-1],) for c in cases)


def test_import_is_framework_free() -> None:
    code = "import sys, opbridge.testing; sys.exit('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(Path(opbridge.__file__).parents[1])}
    assert subprocess.run([sys.executable, "-c", code], env=env, check=False).returncode == 0


# ---------------------------------------------------------------------------
# assert_close and TOLERANCES
# ---------------------------------------------------------------------------


def test_tolerance_table_matches_declared_defaults() -> None:
    assert TOLERANCES is opbridge.declare.TOLERANCES  # one table, not a copy
    assert set(TOLERANCES) == {"float64", "float32", "float16", "bfloat16"}
    for dtype, (rtol, atol, reason) in TOLERANCES.items():
        assert (rtol, atol) == DEFAULT_TOLERANCES[dtype]
        assert dtype in reason and "mantissa bits" in reason


def test_assert_close_passes_within_tolerance_and_on_matching_nans() -> None:
    e = np.array([1.0, np.nan, np.inf, -np.inf, 0.0], dtype=np.float32)
    assert_close(e.copy(), e)
    assert_close(torch.from_numpy(e).to(torch.bfloat16), e.astype(np.float64))
    assert_close(np.float32(1.0) + np.zeros(3, np.float32) + 5e-6, np.ones(3))  # float32: rtol 1e-5
    x = torch.ones(3, dtype=torch.bfloat16)
    assert_close(x, np.full(3, 1.0 + 2**-7))  # one bfloat16 ulp at 1: within its default tolerance
    with pytest.raises(AssertionError):
        assert_close(np.ones(3, np.float32), np.full(3, 1.0 + 2**-7))  # not for float32


def test_assert_close_failure_message() -> None:
    expected = np.arange(12, dtype=np.float64).reshape(3, 4)
    actual = expected.astype(np.float32)
    actual[1, 2] = np.nan
    actual[2, 3] += 0.5
    expected[0, 0] = np.nan
    with pytest.raises(AssertionError) as info:
        assert_close(actual, expected, name="y")
    msg = str(info.value)
    assert "y: 3 of 12 elements mismatch" in msg
    assert "float32" in msg and "shape (3, 4)" in msg
    first = msg.index("[0, 0]: actual=0.0 expected=nan")
    second = msg.index("[1, 2]: actual=nan expected=6.0")
    assert first < second < msg.index("[2, 3]: actual=11.5 expected=11.0")
    assert "abs diff=0.5" in msg
    assert "max abs error: 0.5 at [2, 3]" in msg
    assert "NaN: actual 1, expected 1; Inf: actual 0, expected 0" in msg


def test_assert_close_shows_at_most_five_bad_indices() -> None:
    with pytest.raises(AssertionError) as info:
        assert_close(torch.zeros(10), torch.ones(10))
    msg = str(info.value)
    assert "10 of 10 elements mismatch" in msg
    assert "[4]: actual=" in msg and "[5]: actual=" not in msg


def test_assert_close_shape_mismatch() -> None:
    msg = r"out: shape mismatch: actual has shape \(3, 4\), expected \(4, 3\)"
    with pytest.raises(AssertionError, match=msg):
        assert_close(np.zeros((3, 4)), np.zeros((4, 3)), name="out")


# ---------------------------------------------------------------------------
# the kit catches broken ops
# ---------------------------------------------------------------------------

SELFTEST_SOURCE = r"""
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;

namespace {
void check(const char* op, TensorView out, TensorView x) {
  OPB_CHECK_DTYPE(op, x, opbridge::kFloat32);
  OPB_CHECK_SAME_SHAPE(op, out, x);
  OPB_CHECK_CONTIGUOUS(op, x);
  OPB_CHECK_CONTIGUOUS(op, out);
}
}  // namespace

// Writes one element past the end of its output.
void bad_copy_cpu(TensorView out, TensorView x) {
  check("bad_copy", out, x);
  float* o = static_cast<float*>(out.data_ptr());
  const float* a = static_cast<const float*>(x.data_ptr());
  for (int64_t i = 0; i <= x.numel(); ++i) o[i] = i < x.numel() ? a[i] : 0.f;
}
OPBRIDGE_EXPORT(bad_copy_cpu);

// Gets the middle element wrong.
void wrong_copy_cpu(TensorView out, TensorView x) {
  check("wrong_copy", out, x);
  float* o = static_cast<float*>(out.data_ptr());
  const float* a = static_cast<const float*>(x.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = a[i] + (i == x.numel() / 2 ? 0.5f : 0.f);
}
OPBRIDGE_EXPORT(wrong_copy_cpu);

// Never writes the last element.
void short_copy_cpu(TensorView out, TensorView x) {
  check("short_copy", out, x);
  float* o = static_cast<float*>(out.data_ptr());
  const float* a = static_cast<const float*>(x.data_ptr());
  for (int64_t i = 0; i + 1 < x.numel(); ++i) o[i] = a[i];
}
OPBRIDGE_EXPORT(short_copy_cpu);

// Correct output, but negates its input afterwards.
void scribble_copy_cpu(TensorView out, TensorView x) {
  check("scribble_copy", out, x);
  float* o = static_cast<float*>(out.data_ptr());
  float* a = static_cast<float*>(x.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) { o[i] = a[i]; a[i] = -a[i]; }
}
OPBRIDGE_EXPORT(scribble_copy_cpu);

// Correct on contiguous input, but never checks that it is.
void lax_copy_cpu(TensorView out, TensorView x) {
  OPB_CHECK_DTYPE("lax_copy", x, opbridge::kFloat32);
  float* o = static_cast<float*>(out.data_ptr());
  const float* a = static_cast<const float*>(x.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = a[i];
}
OPBRIDGE_EXPORT(lax_copy_cpu);

// x += 1 in place, correct.
void add_one__cpu(TensorView x) {
  OPB_CHECK_DTYPE("add_one_", x, opbridge::kFloat32);
  OPB_CHECK_CONTIGUOUS("add_one_", x);
  float* a = static_cast<float*>(x.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) a[i] += 1.f;
}
OPBRIDGE_EXPORT(add_one__cpu);

// 2 x, correct (declared with a correct and with a wrong backward).
void twice_cpu(TensorView out, TensorView x) {
  check("twice", out, x);
  float* o = static_cast<float*>(out.data_ptr());
  const float* a = static_cast<const float*>(x.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = 2.f * a[i];
}
OPBRIDGE_EXPORT(twice_cpu);

// 2 x in float32 and float64 (declared with a correct and with a wrong backward).
void twice64_cpu(TensorView out, TensorView x) {
  OPB_CHECK_DTYPE("twice64", x, opbridge::kFloat32, opbridge::kFloat64);
  OPB_CHECK_SAME_DTYPE("twice64", out, x);
  OPB_CHECK_SAME_SHAPE("twice64", out, x);
  OPB_CHECK_CONTIGUOUS("twice64", x);
  if (x.dtype() == opbridge::kFloat64) {
    double* o = static_cast<double*>(out.data_ptr());
    const double* a = static_cast<const double*>(x.data_ptr());
    for (int64_t i = 0; i < x.numel(); ++i) o[i] = 2.0 * a[i];
    return;
  }
  float* o = static_cast<float*>(out.data_ptr());
  const float* a = static_cast<const float*>(x.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = 2.f * a[i];
}
OPBRIDGE_EXPORT(twice64_cpu);
"""


@pytest.fixture(scope="module")
def selftest(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A throwaway library of deliberately broken float32 copy kernels (one build for all tests)."""
    root = tmp_path_factory.mktemp("kit_selftest")
    (root / "selftest.cc").write_text(textwrap.dedent(SELFTEST_SOURCE))
    lib = opbridge.Library("kit_selftest_builtin", sources=["selftest.cc"], root=root)
    ops: dict[str, Any] = {}

    def copy(x: Any) -> Any:
        return x.copy()

    for name in ("bad_copy", "wrong_copy", "short_copy", "scribble_copy", "lax_copy"):
        ops[name] = lib.op(f"{name}(Tensor x) -> Tensor", shape=opbridge.like("x"))(copy)

    def twice(x: Any) -> Any:
        return 2 * x

    ops["twice"] = lib.op("twice(Tensor x) -> Tensor", shape=opbridge.like("x"),
                          backward=lambda grad, x: (ops["twice"](grad),))(twice)
    ops["twice_bad_grad"] = lib.op("twice_bad_grad(Tensor x) -> Tensor", shape=opbridge.like("x"),
                                   kernels={"cpu": "twice_cpu"},
                                   backward=lambda grad, x: (grad,))(twice)  # wrong: d(2x)/dx is 2

    f64: dict[str, Any] = {"kernels": {"cpu": "twice64_cpu"}, "dtypes": ("float32", "float64")}
    ops["twice64"] = lib.op("twice64(Tensor x) -> Tensor", shape=opbridge.like("x"), **f64,
                            backward=lambda grad, x: (ops["twice64"](grad),))(twice)
    ops["twice64_bad_grad"] = lib.op("twice64_bad_grad(Tensor x) -> Tensor", shape=opbridge.like("x"), **f64,
                                     backward=lambda grad, x: (grad,))(twice)  # wrong: d(2x)/dx is 2

    def add_one_(x: Any) -> None:
        x += 1

    ops["add_one_"] = lib.op("add_one_(Tensor(a!) x) -> ()")(add_one_)
    lib.build()
    return ops


F32: dict[str, Any] = {"dtypes": ("float32",)}
QUICK: dict[str, Any] = {"dtypes": ("float32",), "check_opcheck": False, "check_compile": False}


def test_kit_passes_a_correct_user_op(selftest: dict[str, Any]) -> None:
    report = check_op(selftest["twice"], **F32)
    assert report.checks["grad"] > 0 and report.checks["compile_grad"] == 1
    assert report.checks["opcheck"] == 1 and report.checks["noncontiguous"] == 1


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_kit_passes_a_correct_mutating_op(selftest: dict[str, Any], framework: str) -> None:
    report = check_op(selftest["add_one_"], framework=framework, **F32)
    assert report.checks["forward"] >= 7 and report.checks["sentinel"] == report.checks["forward"]
    assert report.checks["grad"] == 0  # mutating: not differentiable
    if framework == "torch":
        assert report.checks["opcheck"] == 1 and report.checks["compile"] == 1


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_kit_catches_out_of_bounds_write(selftest: dict[str, Any], framework: str) -> None:
    with pytest.raises(AssertionError) as info:
        check_op(selftest["bad_copy"], framework=framework, **QUICK)
    msg = str(info.value)
    assert "check_op(kit_selftest_builtin::bad_copy): sentinel check failed" in msg
    assert f"framework: {framework}, dtype: float32" in msg
    assert "case: x: shape (1,)" in msg
    assert "out-of-bounds write: 1 element(s) of the sentinel guard after output" in msg
    assert "offset +0 past its end" in msg


def test_kit_catches_wrong_values(selftest: dict[str, Any]) -> None:
    with pytest.raises(AssertionError) as info:
        check_op(selftest["wrong_copy"], **QUICK)
    msg = str(info.value)
    assert "wrong_copy): forward check failed" in msg
    assert "output vs the float64 reference: 1 of 1 elements mismatch" in msg
    assert "first bad index:" in msg and "[0]: actual=" in msg and "abs diff=0.5" in msg
    assert "NaN: actual 0, expected 0" in msg


def test_kit_catches_unwritten_output(selftest: dict[str, Any]) -> None:
    msg = r"sentinel check failed(.|\n)*1 of 1 elements were left unwritten"
    with pytest.raises(AssertionError, match=msg):
        check_op(selftest["short_copy"], **QUICK)


def test_kit_catches_modified_input(selftest: dict[str, Any]) -> None:
    with pytest.raises(AssertionError, match=r"inputs_unchanged check failed(.|\n)*input 'x' was modified"):
        check_op(selftest["scribble_copy"], **QUICK)


def test_a_kernel_without_contiguity_check_is_safe_behind_the_adapters(selftest: dict[str, Any]) -> None:
    """lax_copy indexes raw memory and checks no strides: the adapters hand it dense copies (issue 11),
    so the kit's non-contiguous cases, which compare with the reference, pass."""
    report = check_op(selftest["lax_copy"], **QUICK)
    assert report.checks["noncontiguous"] > 0


def test_kit_catches_wrong_gradient(selftest: dict[str, Any]) -> None:
    with pytest.raises(AssertionError) as info:
        check_op(selftest["twice_bad_grad"], **QUICK)
    msg = str(info.value)
    assert "twice_bad_grad): grad check failed" in msg
    assert "gradient of 'x' disagrees with finite differences" in msg


def test_kit_runs_gradcheck_in_float64(selftest: dict[str, Any]) -> None:
    report = check_op(selftest["twice64"])  # its declared dtypes: float32 and float64
    assert report.dtypes == ("float32", "float64")
    assert report.checks["gradcheck"] == 1 and report.checks["grad"] > 0
    assert report.checks["opcheck"] == report.checks["compile"] == 2
    assert not any("gradcheck" in s for s in report.skipped)


def test_kit_skips_gradcheck_without_float64(selftest: dict[str, Any]) -> None:
    report = check_op(selftest["twice"], **QUICK)
    assert report.checks["gradcheck"] == 0
    assert any("gradcheck: needs float64 kernels, and the op declares no float64" in s for s in report.skipped)


def test_kit_gradcheck_catches_wrong_gradient(selftest: dict[str, Any]) -> None:
    with pytest.raises(AssertionError) as info:
        check_op(selftest["twice64_bad_grad"], cases=[{"x": np.linspace(-1, 1, 9)}], dtypes=("float64",),
                 check_compile=False, check_opcheck=False)
    msg = str(info.value)
    assert "twice64_bad_grad): gradcheck check failed" in msg
    assert "framework: torch, dtype: float64" in msg and "torch.autograd.gradcheck" in msg
    assert "Jacobian mismatch" in msg


def test_kit_reports_bad_case_hint(selftest: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="unknown argument"):
        check_op(selftest["twice"], cases=[{"y": np.ones(3)}], **QUICK)
    with pytest.raises(ValueError, match="none of the dtypes"):
        check_op(selftest["twice"], framework="numpy", dtypes=("bfloat16",))


def test_kit_names_the_frameworks_and_what_to_install(selftest: dict[str, Any],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="framework must be one of 'torch', 'numpy', 'jax', 'paddle', 'mindspore', "
                                         "got 'tensorflow'"):
        check_op(selftest["twice"], framework="tensorflow")
    monkeypatch.setitem(sys.modules, "paddle", None)  # as if not installed: importlib finds no spec
    with pytest.raises(ModuleNotFoundError, match=r"framework='paddle' needs paddle, which is not installed here; "
                                                  r"pass framework='numpy' \(or pip install 'opbridge\[paddle\]'\)"):
        check_op(selftest["twice"], framework="paddle")


def test_explicit_cases(selftest: dict[str, Any]) -> None:
    report = check_op(selftest["twice"], cases=[{"x": np.linspace(-1, 1, 9)}], **QUICK)
    assert report.cases == 1 and report.checks["forward"] == 1 and report.checks["grad"] == 1


def test_deprecated_case_hints_still_drive_user_ops(selftest: dict[str, Any]) -> None:
    """CASE_HINTS (deprecated for ``hints=``) warns when written and is still used for ops without hints."""
    op = selftest["twice"].opdef
    assert op.hints is None
    with pytest.warns(DeprecationWarning, match="hints="):
        CASE_HINTS[op.qualname] = lambda dtype, rng: [{"x": np.arange(5.0)}, {"x": np.ones((2, 3))}]
    try:
        assert [np.shape(c["x"]) for c in make_cases(op)] == [(5,), (2, 3)]
        assert check_op(op, **QUICK).cases == 2
    finally:
        dict.pop(CASE_HINTS, op.qualname)
    assert CASE_HINTS["opbridge::add"] is opbridge.ops.add.opdef.hints  # reads give the declared hints


# ---------------------------------------------------------------------------
# 16-bit loads and stores (math.h's block conversions)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_load_store_is_bit_exact(dtype: str) -> None:
    """``add(x, 0)`` and ``add(x, y)`` over every 16-bit pattern equal torch's float32 sum rounded to *dtype*.

    65536 values span many staging blocks and end off a 16-lane boundary once sliced,
    so the vector loops and their scalar tails are both compared.
    """
    t = getattr(torch, dtype)
    allbits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(t)
    gen = torch.Generator().manual_seed(0)
    rand = torch.randint(-32768, 32768, (3, 65536), generator=gen, dtype=torch.int32).to(torch.int16).view(t)
    for a, b in [(allbits, torch.zeros_like(allbits)), (allbits, rand[0]), (rand[1], rand[2]),
                 (allbits[5:-6], rand[0][11:])]:
        out = opbridge.ops.add(a, b)
        want = (a.float() + b.float()).to(t)
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(out), nan)
        assert torch.equal(out.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def test_bfloat16_nan_keeps_its_sign_and_payload_and_is_quiet() -> None:
    """A bfloat16 NaN plus 0 comes back as the same NaN, quiet bit set (0x0040), sign kept."""
    allbits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = allbits.view(torch.bfloat16)
    nan = torch.isnan(x)
    assert int(nan.sum()) == 2 * 127  # both signs, every non-zero mantissa
    out = opbridge.ops.add(x, torch.zeros_like(x)).view(torch.int16)
    assert torch.equal(out[nan], allbits[nan] | 0x0040)


# ---------------------------------------------------------------------------
# large float32 outputs (add and rms_norm stream them: 16 MiB and more, math.h)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["add", "gelu", "gelu_backward", "rms_norm", "silu_and_mul"])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_large_float32_outputs_match_the_reference(name: str, offset: int) -> None:
    """Outputs past the streaming threshold, also into buffers that start off a 16-byte boundary."""
    op = getattr(opbridge.ops, name)
    rows, cols = 1031, 4099 * (2 if name == "silu_and_mul" else 1)  # 16.1 MiB of output
    gen = torch.Generator().manual_seed(offset)
    x = torch.randn(rows, cols, generator=gen)
    args = {"add": (x, torch.randn(rows, cols, generator=gen)), "gelu": (x,),
            "gelu_backward": (torch.randn(rows, cols, generator=gen), x),
            "rms_norm": (x, torch.randn(cols, generator=gen), 1e-6), "silu_and_mul": (x,)}[name]
    shape = (rows, cols // 2) if name == "silu_and_mul" else (rows, cols)
    assert math.prod(shape) * 4 >= 16 << 20
    buf = torch.full((math.prod(shape) + offset + 7,), float("nan"))
    out = buf[offset: offset + math.prod(shape)].view(shape)
    op(*args, out=out)
    want = op.reference(*(a.numpy() if isinstance(a, torch.Tensor) else a for a in args))
    assert_close(out, torch.from_numpy(np.asarray(want)), rtol=1e-5, atol=1e-5)
    assert torch.isnan(buf[:offset]).all() and torch.isnan(buf[offset + math.prod(shape):]).all()
    np.testing.assert_array_equal(op(*args).numpy(), out.numpy())  # a new output: the same bits


@pytest.mark.parametrize("name", ["add", "gelu", "silu_and_mul", "gelu_and_mul"])
def test_bfloat16_maps_are_the_float32_map_rounded(name: str) -> None:
    """An elementwise bfloat16 map computes in float32 and rounds once, bit for bit, at every tail length.

    On AVX2 machines these run the in-register bfloat16 loops (16 values a step,
    math.h map1/map2_bf16_avx2) while float32 runs the 8-lane float loops; both
    must give the float32 result rounded to nearest-even.
    """
    op = getattr(opbridge.ops, name)
    gen = torch.Generator().manual_seed(7)
    for n in [*range(1, 40), 255, 256, 257, 4099]:
        cols = 2 * n if name.endswith("_and_mul") else n
        x = (torch.randn(3, cols, generator=gen) * 4).bfloat16()
        x[0, 0] = float("nan") if n > 2 else x[0, 0]
        args = (x, torch.randn(3, cols, generator=gen).bfloat16()) if name == "add" else (x,)
        got = op(*args)
        want = op(*(a.float() for a in args)).bfloat16()  # torch's rounding (its NaN is 0xffff, ours keeps bits)
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan), n
        assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan]), n


def test_builtin_ops_with_a_backward_declare_float64_for_gradcheck() -> None:
    missing = sorted(n for n, op in BUILTIN.items() if op.backward is not None and "float64" not in op.dtypes)
    assert not missing, f"no float64 declared, so no torch.autograd.gradcheck, for {missing}"


UNDECLARED_CANDIDATES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
                         "bool")


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_kernels_refuse_every_undeclared_dtype(name: str) -> None:
    """The built-in library promises kernels_check_inputs: its fast paths skip the Python dtype test and
    rely on the kernel's TypeError, so every kernel must refuse every dtype its op does not declare."""
    import torch

    from opbridge.cases import LAYOUT, NONCONTIGUOUS
    from opbridge.testing.matrix import make_cases

    op = BUILTIN[name]
    assert op.library.kernels_check_inputs
    case = next(c for c in make_cases(op, op.dtypes[0]) if not c.get(NONCONTIGUOUS) and not c.get(LAYOUT))
    lead = op.schema.arguments[op.dtype_arg].name
    for dtype in (d for d in UNDECLARED_CANDIDATES if d not in op.dtypes):
        args = []
        for a in op.schema.arguments:
            v = case.get(a.name, a.default if a.has_default else None)
            if a.type.is_tensor and v is not None:
                v = torch.from_numpy(np.array(v, copy=True))
                if a.name == lead:
                    v = v.to(getattr(torch, dtype))
            args.append(v)
        for _ in range(2):  # the first call resolves the adapter, the second takes the fast path
            with pytest.raises(TypeError, match=rf"{name}: {lead} must have dtype .* \(the dtypes {name} declares\); "
                                                rf"convert it first, e\.g\. {lead}\.to\(torch\.{op.dtypes[0]}\)$"):
                op.call(*args)
        if "float16" not in op.dtypes:  # NumPy's hint: astype, with the name NumPy takes
            with pytest.raises(TypeError, match=rf"convert it first, e\.g\. {lead}\.astype\(\"{op.dtypes[0]}\"\)$"):
                op.call(*[np.array(case[a.name], dtype=np.float16 if i == op.dtype_arg else None, copy=True)
                          if a.type.is_tensor and case.get(a.name) is not None
                          else case.get(a.name, a.default if a.has_default else None)
                          for i, a in enumerate(op.schema.arguments)])


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_sentinel_fill_fits_every_integer_dtype(framework: str) -> None:
    """Guards and new outputs of an int8 op are filled with a value int8 holds (-7919 once overflowed)."""
    from opbridge.testing.kits import INTEGER_DTYPES, NumpyKit, TorchKit

    kit = NumpyKit() if framework == "numpy" else TorchKit()
    for d in INTEGER_DTYPES:
        values = kit.to_np64(kit.empty_filled(3, d))
        assert len(set(values.tolist())) == 1 and values[0] not in (0, 1, -1), (d, values)
