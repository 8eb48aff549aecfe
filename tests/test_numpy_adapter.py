"""The NumPy adapter: eager calls, out=, and named errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import opbridge
from opbridge import ops


def test_numpy_call_and_out() -> None:
    x = np.random.default_rng(0).standard_normal((3, 40)).astype(np.float32)
    w = np.ones(40, np.float32)
    got = ops.rms_norm(x, w)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    np.testing.assert_allclose(got, ops.rms_norm.reference(x.astype(np.float64), w, 1e-6), rtol=1e-5, atol=1e-5)
    buf = np.empty_like(x)
    assert ops.rms_norm(x, w, out=buf) is buf
    np.testing.assert_array_equal(buf, got)


def test_numpy_bad_input() -> None:
    x = np.ones(4, np.float32)
    with pytest.raises(TypeError, match=r"add: argument 'y' must be a numpy\.ndarray, got list"):
        ops.add(x, [1.0, 2.0, 3.0, 4.0])
    with pytest.raises(TypeError, match=r"rms_norm: argument 'eps' must be float"):
        ops.rms_norm(x.reshape(1, 4), x, "tiny")
    with pytest.raises(TypeError, match="add: x must have dtype"):
        ops.add(np.ones(4, np.int16), np.ones(4, np.int16))
    with pytest.raises(TypeError, match="gelu: out= takes a tensor or a tuple of them, got a list of 4"):
        ops.gelu(x, out=[0.0] * 4)
    with pytest.raises(TypeError, match="out\\[0\\] must be an array of the same framework"):
        ops.gelu(x, out=(0.0,))
    with pytest.raises(opbridge.UnsupportedFrameworkError, match="gelu: argument 'x' must be an array"):
        ops.gelu("not an array")


def test_dtype_error_says_whether_the_op_named_its_dtypes(make_library: Any) -> None:
    """An op that names no dtypes gets opbridge's default, and its error says so instead of "declares"."""
    src = {"k.cc": """
        #include <opbridge/opbridge.h>
        using tvm::ffi::TensorView;
        void neg_cpu(TensorView out, TensorView x) {}
        void dbl_cpu(TensorView out, TensorView x) {}
        OPBRIDGE_EXPORT(neg_cpu);
        OPBRIDGE_EXPORT(dbl_cpu);
    """}
    lib = make_library(src)
    neg = lib.op("neg(Tensor x) -> Tensor", shape=opbridge.like("x"))(lambda x: -x)
    dbl = lib.op("dbl(Tensor x) -> Tensor", shape=opbridge.like("x"), dtypes=["float32"])(lambda x: 2 * x)
    with pytest.raises(TypeError, match=r"^neg: x must have dtype float32, float16 or bfloat16, got float64 "
                                        r"\(opbridge's default dtypes: neg declares none; name its kernels' dtypes "
                                        r"with Library\.op\(\.\.\., dtypes=\.\.\.\)\); convert it first, "
                                        r"e\.g\. x\.astype\(\"float32\"\)$"):
        neg(np.ones(3))
    with pytest.raises(TypeError, match=r"^dbl: x must have dtype float32, got float64 \(the dtypes dbl declares\); "
                                        r"convert it first, e\.g\. x\.astype\(\"float32\"\)$"):
        dbl(np.ones(3))
    named = make_library(src, prefix="n")
    assert named.dtypes_declared is False
    lib64 = opbridge.Library(f"{named.namespace}_x", sources=[], dtypes=["float64"])
    op = lib64.op("neg(Tensor x) -> Tensor", shape=opbridge.like("x"))(lambda x: -x)
    assert lib64.ops["neg"].dtypes == ("float64",) and not lib64.ops["neg"].dtypes_defaulted and op is not None


# ---------------------------------------------------------------------------
# bfloat16 arrays (ml_dtypes): the NumPy path of `bench frameworks --parity`
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["add", "gelu", "rms_norm"])
def test_ml_dtypes_bfloat16_arrays(name: str) -> None:
    """bfloat16 arrays reach the kernel as relabelled bits (no copy) and give bfloat16 results."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    x32 = rng.standard_normal((7, 769)).astype(np.float32)
    w32 = rng.standard_normal(769).astype(np.float32)
    x, w = x32.astype(ml_dtypes.bfloat16), w32.astype(ml_dtypes.bfloat16)
    args = {"add": (x, x), "gelu": (x,), "rms_norm": (x, w, 1e-6)}[name]
    got = getattr(ops, name)(*args)
    assert got.dtype == ml_dtypes.bfloat16 and got.shape == x.shape
    op = ops.LIBRARY.ops[name]
    want = op.reference(*(a.astype(np.float32) if isinstance(a, np.ndarray) else a for a in args))
    rtol, atol = op.tolerance("bfloat16")
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=rtol, atol=atol)
    # strided bfloat16 inputs take the dense copy, out= takes a bfloat16 buffer
    strided = getattr(ops, name)(*(a[:, ::2] if isinstance(a, np.ndarray) and a.ndim == 2 else
                                   a[::2] if isinstance(a, np.ndarray) else a for a in args))
    dense = getattr(ops, name)(*(np.ascontiguousarray(a[:, ::2]) if isinstance(a, np.ndarray) and a.ndim == 2
                                 else np.ascontiguousarray(a[::2]) if isinstance(a, np.ndarray) else a
                                 for a in args))
    np.testing.assert_array_equal(strided.view(np.uint16), dense.view(np.uint16))
    out = np.full(x.shape, 7, ml_dtypes.bfloat16)
    assert getattr(ops, name)(*args, out=out) is out
    np.testing.assert_array_equal(out.view(np.uint16), got.view(np.uint16))


def test_bfloat16_undeclared_and_readonly_errors_unchanged() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.ones((4, 8), ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match="int16"):
        ops.add(x.view(np.int16), x.view(np.int16))
    ro = np.ones((4, 8), np.float32)
    ro.flags.writeable = False
    assert np.array_equal(ops.add(ro, ro), 2 * ro)  # read-only inputs are read through an alias
    assert np.array_equal(ops.add(np.broadcast_to(ro[0], (4, 8)), ro), 2 * ro)
    with pytest.raises(ValueError, match="read-only"):
        ops.add(ro, ro, out=ro)


@pytest.mark.parametrize("name", ["add", "rms_norm", "gelu"])  # the ops with a Python fast path (like rule)
def test_strided_arrays_never_reach_a_kernel_that_rejects_them(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A strided array takes the checked path (dense copies) by the fast path's guard, not by the kernel's
    ValueError: the C++ exception and its backtrace cost about 100 us a call (ops.add on a (64, 128)
    slice took 108 us, 15 us now). Arrays the kernel takes as they are (rows at a stride where declared)
    still reach it; results equal the dense call's."""
    from opbridge.call import layout
    from opbridge.testing import make_cases

    op = getattr(ops, name).opdef
    case = next(c for c in make_cases(op, "float32", seed=3)
                if all(c[a.name] is not None and c[a.name].ndim == 2 for a in op.schema.arguments[:1]))
    dense = [case[a.name] for a in op.schema.arguments]
    op.call(*dense)
    ns = op.call.__globals__
    kernel = ns["_np_k"]
    rejected: list[tuple[int, ...]] = []

    def checked(*a: Any) -> Any:
        rejected.extend(v.strides for v in a if isinstance(v, np.ndarray) and not v.flags.c_contiguous
                        and not layout.ndarray_rows(v))
        return kernel(*a)

    monkeypatch.setitem(ns, "_np_k", checked)
    x = dense[0]
    wide = np.zeros((x.shape[0], 2 * x.shape[1]), x.dtype)
    wide[:, ::2] = x
    rows = np.zeros_like(wide)
    rows[:, : x.shape[1]] = x  # rows at a stride: rms_norm takes them as they are
    for strided in (wide[:, ::2], np.asfortranarray(x), rows[:, : x.shape[1]]):
        got = op.call(strided, *dense[1:])
        np.testing.assert_array_equal(got, op.call(*dense))
    assert rejected == [], "a kernel was handed strides it rejects"
