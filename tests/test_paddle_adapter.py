"""The paddle adapter: eager calls, zero copy, autograd, mutation, bad input, to_static."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import opbridge

# The built-ins are declared before paddle is imported: Paddle imports torch half-way through its
# own import, and opbridge's after-torch-import hook would otherwise declare them (and import this
# adapter) while paddle is only partly initialised (reported to the lead; see the adapter's report).
from opbridge import ops

paddle = pytest.importorskip("paddle")

import opbridge.adapters.paddle as paddle_adapter  # noqa: E402
from _hugepages import faults_per_call, thp_skip_reason  # noqa: E402
from opbridge.adapters.paddle import ADAPTER, PaddleStaticError  # noqa: E402
from opbridge.adapters.paddle import _base as paddle_base  # noqa: E402
from opbridge.call import core  # noqa: E402
from opbridge.errors import BackendUnavailableError  # noqa: E402
from opbridge.testing.generate import make_cases  # noqa: E402
from opbridge.testing.harness_paddle import HARNESS  # noqa: E402

KERNELS_CC = """
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;
void scale__cpu(TensorView x, TensorView other, double alpha) {
  OPB_CHECK_DTYPE("scale_", x, opbridge::kFloat32);
  OPB_CHECK_SAME_DTYPE("scale_", other, x);
  OPB_CHECK_SAME_SHAPE("scale_", other, x);
  OPB_CHECK_CONTIGUOUS("scale_", x);
  OPB_CHECK_CONTIGUOUS("scale_", other);
  float* a = static_cast<float*>(x.data_ptr());
  const float* b = static_cast<const float*>(other.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) a[i] = a[i] * float(alpha) + b[i];
}
OPBRIDGE_EXPORT(scale__cpu);
void twice_cpu(TensorView out, TensorView x) {
  const float* a = static_cast<const float*>(x.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = 2 * a[i];
}
OPBRIDGE_EXPORT(twice_cpu);
void twice64_cpu(TensorView out, TensorView x) {
  const double* a = static_cast<const double*>(x.data_ptr());
  double* o = static_cast<double*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = 2 * a[i];
}
OPBRIDGE_EXPORT(twice64_cpu);
// Writes the addresses it was handed: out = [&out[0], &x[0]].
void addresses_cpu(TensorView out, TensorView x) {
  int64_t* o = static_cast<int64_t*>(out.data_ptr());
  o[0] = reinterpret_cast<int64_t>(out.data_ptr());
  o[1] = reinterpret_cast<int64_t>(x.data_ptr());
}
OPBRIDGE_EXPORT(addresses_cpu);
// maybe_mul(Tensor x, Tensor? w) -> Tensor: x * w, or x where w is None.
void maybe_mul_cpu(TensorView out, TensorView x, tvm::ffi::Optional<TensorView> w) {
  const float* a = static_cast<const float*>(x.data_ptr());
  const float* b = w.has_value() ? static_cast<const float*>(w.value().data_ptr()) : nullptr;
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = b ? a[i] * b[i] : a[i];
}
OPBRIDGE_EXPORT(maybe_mul_cpu);
"""

_NS = itertools.count()

# Paddle's own backward construction under to_static reads Value.place and warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:Tensor do not have 'place' interface:UserWarning")


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> opbridge.Library:
    root = tmp_path_factory.mktemp("paddle_lib")
    (root / "k.cc").write_text(KERNELS_CC)
    lib = opbridge.Library(f"opb_test_paddle_{next(_NS)}_{root.name[-6:].replace('-', '_')}",
                           sources=["k.cc"], root=root)

    @lib.op("scale_(Tensor(a!) x, Tensor other, float alpha) -> ()")
    def scale_(x: Any, other: Any, alpha: float) -> None:
        x *= alpha
        x += other

    # dtypes: the kernel reads float32 without checking, so the adapter's declared-dtype check is all there is
    @lib.op("twice(Tensor x) -> Tensor", shape=opbridge.like("x"), dtypes=("float32",))
    def twice(x: Any) -> Any:
        return 2 * x

    @lib.op("twice64(Tensor x) -> Tensor", shape=opbridge.like("x"), dtypes=("float64",))
    def twice64(x: Any) -> Any:
        return 2 * x

    @lib.op("maybe_mul(Tensor x, Tensor? w) -> Tensor", shape=opbridge.like("x"), dtypes=("float32",))
    def maybe_mul(x: Any, w: Any) -> Any:
        return x if w is None else x * w

    @lib.op("addresses(Tensor x) -> Tensor", shape=lambda x: opbridge.Spec((2,), "int64"))
    def addresses(x: Any) -> Any:
        raise NotImplementedError("addresses are not reproducible")

    return lib


# -- inputs ----------------------------------------------------------------------

ROWS, H = 5, 33


def _example(op: opbridge.OpDef, rng: np.random.Generator, rows: int = ROWS, h: int = H) -> list[Any]:
    """NumPy float64 arguments for *op*: (rows, h) tensors, (h,) for ``weight``, defaults for scalars."""
    out: list[Any] = []
    for a in op.schema.arguments:
        if a.type.is_tensor:
            shape = (h,) if a.name == "weight" else (rows, h)
            out.append(rng.standard_normal(shape))
        else:
            out.append(a.default)
    return out


def _to_paddle(args: list[Any], dtype: str) -> list[Any]:
    return [HARNESS.from_numpy(a, dtype) if isinstance(a, np.ndarray) else a for a in args]


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


# Float ops with hand-built inputs; every op (int and mutating ones too) runs in tests/conformance.
BUILTINS = sorted(n for n, op in ops.LIBRARY.ops.items()
                  if getattr(op.reference, "__module__", "") == "opbridge.ops.basic")
DIFFERENTIABLE = sorted(n for n, op in ops.LIBRARY.ops.items() if op.backward is not None)


# -- forward -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", BUILTINS)
def test_forward_matches_reference(name: str, dtype: str) -> None:
    op = ops.LIBRARY.ops[name]
    args = _to_paddle(_example(op, np.random.default_rng(0)), dtype)
    got = _as_tuple(op.call(*args))
    # the reference sees exactly the (rounded) values the kernel saw
    ref_args = [HARNESS.to_numpy(a) if isinstance(a, paddle.Tensor) else a for a in args]
    want = _as_tuple(op.reference(*ref_args))
    rtol, atol = op.tolerance(dtype)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert isinstance(g, paddle.Tensor)
        assert g.dtype == args[op.dispatch_arg].dtype
        assert g.stop_gradient, "no input needs grad, so neither does the output"
        np.testing.assert_allclose(HARNESS.to_numpy(g), w, rtol=rtol, atol=atol)


def test_float16_and_parameters() -> None:
    x = paddle.randn([4, 16]).astype("float16")
    layer = paddle.nn.Linear(16, 16)  # weight/bias are EagerParamBase, a Tensor subclass
    x32 = x.astype("float32")
    out = ops.rms_norm(x32, layer.bias)
    np.testing.assert_allclose(out.numpy(), ops.rms_norm.reference(x32.numpy(), layer.bias.numpy()),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ops.gelu(x).astype("float32").numpy(),
                               ops.gelu.reference(x.astype("float32").numpy()), rtol=1e-3, atol=1e-3)


def test_public_callable_keywords_and_defaults() -> None:
    x, w = paddle.randn([3, 8]), paddle.randn([8])
    a = ops.rms_norm(x, w)
    b = ops.rms_norm(x=x, weight=w, eps=1e-6)
    np.testing.assert_array_equal(a.numpy(), b.numpy())


# -- zero copy ---------------------------------------------------------------------------


def test_kernel_sees_our_buffers_without_copies(lib: opbridge.Library) -> None:
    addresses = lib.ops["addresses"].call
    x = paddle.randn([7])
    out = addresses(x)
    assert out.dtype == paddle.int64 and tuple(out.shape) == (2,)
    out_addr, x_addr = (int(v) for v in out.numpy())
    assert out_addr == out.data_ptr(), "the returned tensor is the buffer the kernel wrote"
    assert x_addr == x.data_ptr(), "the kernel read the input in place"


def test_mutated_argument_keeps_its_buffer(lib: opbridge.Library) -> None:
    scale_ = lib.ops["scale_"].call
    x, other = paddle.ones([6]), paddle.full([6], 0.5)
    ptr, version = x.data_ptr(), x.inplace_version
    assert scale_(x, other, 3.0) is None
    np.testing.assert_array_equal(x.numpy(), np.full(6, 3.5, np.float32))
    assert x.data_ptr() == ptr
    assert x.inplace_version == version + 1, "an in-place write bumps the inplace version"


# -- autograd -----------------------------------------------------------------------------


def _numeric_vjp(op: opbridge.OpDef, args: list[Any], i: int, cot: np.ndarray,
                 eps: float = 1e-6) -> np.ndarray:
    """d/d args[i] of sum(reference(*args) * cot), by central differences in float64."""
    x = args[i]
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        vals = []
        for step in (eps, -eps):
            shifted = list(args)
            shifted[i] = x.copy()
            shifted[i][idx] += step
            vals.append(float(np.sum(_as_tuple(op.reference(*shifted))[0] * cot)))
        grad[idx] = (vals[0] - vals[1]) / (2 * eps)
    return grad


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_gradients_match_finite_differences(name: str) -> None:
    op = ops.LIBRARY.ops[name]
    rng = np.random.default_rng(1)
    args = _example(op, rng, rows=3, h=6)
    argnums = [i for i in op.differentiable]
    cot = rng.standard_normal(np.shape(op.reference(*args)))
    got = HARNESS.vjp(op.call, _to_paddle(args, "float32"), argnums, cot.astype(np.float32))
    for i, g in zip(argnums, got, strict=True):
        np.testing.assert_allclose(g, _numeric_vjp(op, args, i, cot), rtol=1e-3, atol=1e-4,
                                   err_msg=f"{name}: gradient of '{op.schema.arguments[i].name}'")


def test_autograd_only_for_inputs_that_need_it() -> None:
    x, w = paddle.randn([3, 8]), paddle.randn([8])
    x.stop_gradient = False
    out = ops.rms_norm(x, w)
    assert not out.stop_gradient
    out.sum().backward()
    assert x.grad is not None and w.grad is None
    with paddle.no_grad():
        assert ops.rms_norm(x, w).stop_gradient


def test_autograd_keeps_only_what_the_backward_reads() -> None:
    """add's backward is (grad, grad): a temporary input is not kept alive for it (rms_norm's x is)."""
    import gc
    import weakref

    a = paddle.randn([64, 64])
    a.stop_gradient = False
    for op, kept in ((ops.add, False), (ops.rms_norm, True)):
        t = a * 2
        ref = weakref.ref(t)
        y = op(t, paddle.ones([64, 64])) if op is ops.add else op(t, paddle.ones([64]))
        del t
        gc.collect()
        assert (ref() is not None) == kept
        y.sum().backward()


def test_double_backward_through_differentiable_backward() -> None:
    x, y = paddle.randn([4]), paddle.randn([4])
    x.stop_gradient = False
    (gx,) = paddle.grad([ops.add(x, y) * x], [x], create_graph=True)  # d/dx (x+y)x = 2x + y
    np.testing.assert_allclose(gx.numpy(), 2 * x.numpy() + y.numpy(), rtol=1e-6)


def test_op_without_backward_raises_when_differentiated(lib: opbridge.Library) -> None:
    x = paddle.ones([3])
    x.stop_gradient = False
    y = lib.ops["twice"].call(x)
    assert not y.stop_gradient
    with pytest.raises(Exception, match="twice: no backward is declared"):
        y.sum().backward()
    z = ops.gelu_backward(paddle.ones([3]), x)
    with pytest.raises(Exception, match="gelu_backward: no backward is declared"):
        paddle.grad([z.sum()], [x])


def test_errors_keep_their_type_under_autograd() -> None:
    x = paddle.ones([4, 6])
    x.stop_gradient = False
    with pytest.raises(ValueError, match="add: y must have the same shape"):
        ops.add(x, paddle.ones([4, 5]))


# -- mutation ------------------------------------------------------------------------------


def test_mutating_op_rejects_aliasing(lib: opbridge.Library) -> None:
    scale_ = lib.ops["scale_"].call
    x = paddle.ones([8])
    with pytest.raises(ValueError, match="scale_: mutated argument 'x' overlaps argument 'other'"):
        scale_(x, x, 2.0)
    with pytest.raises(ValueError, match="overlaps"):
        scale_(x[:4], x[2:6], 2.0)
    np.testing.assert_array_equal(x.numpy(), np.ones(8, np.float32))


def test_mutating_op_refuses_autograd(lib: opbridge.Library) -> None:
    scale_ = lib.ops["scale_"].call
    x, other = paddle.ones([3]), paddle.ones([3])
    other.stop_gradient = False
    with pytest.raises(RuntimeError, match="scale_: argument 'other' requires grad"):
        scale_(x, other, 1.0)
    with paddle.no_grad():
        scale_(x, other, 1.0)
    np.testing.assert_array_equal(x.numpy(), np.full(3, 2.0, np.float32))


def test_mutation_invalidates_saved_tensors(lib: opbridge.Library) -> None:
    scale_ = lib.ops["scale_"].call
    w, x = paddle.ones([4]), paddle.ones([4])
    w.stop_gradient = False
    y = (w * x).sum()  # saves x for backward
    scale_(x, paddle.zeros([4]), 2.0)
    with pytest.raises(Exception, match="inplace"):
        y.backward()


# -- bad input ---------------------------------------------------------------------------------

BadCall = Callable[[], Any]
BAD_INPUTS: list[tuple[str, BadCall, Any, str]] = [
    ("int dtype", lambda: ops.rms_norm(paddle.ones([2, 4], "int32"), paddle.ones([4])), TypeError,
     r"rms_norm: x must have dtype"),
    ("undeclared dtype", lambda: ops.gelu(paddle.ones([3], "int32")), TypeError, r"gelu: x must have dtype"),
    ("mixed dtypes", lambda: ops.add(paddle.ones([3]), paddle.ones([3], "float16")), TypeError,
     r"add: y must have the same dtype as x"),
    ("rank", lambda: ops.rms_norm(paddle.ones([2, 4]), paddle.ones([1, 4])), ValueError, r"rms_norm: weight"),
    ("size", lambda: ops.rms_norm(paddle.ones([2, 64]), paddle.ones([63])), ValueError,
     r"rms_norm: weight must have size 64"),
    ("shape mismatch", lambda: ops.add(paddle.ones([3]), paddle.ones([4])), ValueError,
     r"add: y must have the same shape"),
    ("strided, wrong shape", lambda: ops.add(paddle.ones([4, 6])[:, ::2], paddle.ones([4, 4])), ValueError,
     r"add: y must have the same shape"),
    ("missing", lambda: ops.rms_norm(paddle.ones([2, 4])), TypeError, r"rms_norm\(\) missing .*'weight'"),
    ("scalar type", lambda: ops.rms_norm(paddle.ones([2, 4]), paddle.ones([4]), "big"), TypeError,
     r"rms_norm: argument 'eps' must be float, got str"),
    ("list", lambda: ops.add(paddle.ones([2]), [1.0, 2.0]), TypeError,
     r"add: argument 'y' must be a paddle.Tensor, got list"),
    ("numpy", lambda: ops.add(paddle.ones([2]), np.ones(2, np.float32)), TypeError,
     r"add: argument 'y' must be a paddle.Tensor, got ndarray"),
    ("none", lambda: ops.gelu_backward(paddle.ones([2]), None), TypeError, r"gelu_backward: argument 'x'"),
    # DLPack carries dense tensors only: a sparse one is named wherever it is (was Paddle's "Invalid dimension")
    ("sparse weight", lambda: ops.rms_norm(paddle.ones([2, 4]), paddle.ones([4]).to_sparse_coo(1)), TypeError,
     r"rms_norm: argument 'weight' has a sparse COO layout, which no kernel takes \(DLPack carries dense tensors "
     r"only\); convert it first, e\.g\. weight\.to_dense\(\)"),
    ("sparse lead", lambda: ops.gelu(paddle.ones([2, 4]).to_sparse_csr()), TypeError,
     r"gelu: argument 'x' has a sparse CSR layout, which no kernel takes"),
    ("sparse written", lambda: ops.fused_add_rms_norm(paddle.ones([2, 4]), paddle.ones([2, 4]).to_sparse_coo(2),
                                                      paddle.ones([4])), TypeError,
     r"fused_add_rms_norm: argument 'residual' has a sparse COO layout"),
    ("sparse, out=", lambda: ops.add(paddle.ones([4]), paddle.ones([4]).to_sparse_coo(1), out=paddle.empty([4])),
     TypeError, r"add: argument 'y' has a sparse COO layout"),
    # tvm-ffi passes ints beyond int64 as ffi.BigInt, which no kernel takes ("Expected `int` but got `ffi.BigInt`")
    ("int beyond int64", lambda: ops.rotary_embedding(paddle.zeros([2], "int64"), paddle.ones([2, 8]), None, 2**70,
                                                      paddle.ones([4, 8]), True), ValueError,
     r"rotary_embedding: argument 'head_size' must be in int64's range \[-2\*\*63, 2\*\*63 - 1\]"),
    ("int beyond int64, for a float", lambda: ops.rms_norm(paddle.ones([2, 4]), paddle.ones([4]), -(2**64)), ValueError,
     r"rms_norm: argument 'eps' is the int -18446744073709551616, outside int64's range"),
]


@pytest.mark.parametrize(("case", "call", "exc", "pattern"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_named_error(case: str, call: BadCall, exc: Any, pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        call()


def test_bad_input_with_grad_raises_named_error() -> None:
    x = paddle.ones([2, 4])
    x.stop_gradient = False
    with pytest.raises(TypeError, match="rms_norm: argument 'eps' must be float"):
        ops.rms_norm(x, paddle.ones([4]), "big")
    with pytest.raises(TypeError, match=r"add: argument 'y' must be a paddle\.Tensor"):
        ops.add(x, [1.0])
    with pytest.raises(TypeError, match=r"rms_norm: argument 'weight' has a sparse COO layout"):
        ops.rms_norm(x, paddle.ones([4]).to_sparse_coo(1))


# -- to_static -------------------------------------------------------------------------------


def _graph_fns() -> dict[str, Callable[..., Any]]:
    def f_add(x: Any, y: Any) -> Any:
        return ops.add(x, y) * 2

    def f_gelu(x: Any) -> Any:
        return ops.gelu(x) * 2

    def f_rms(x: Any, w: Any) -> Any:
        return ops.rms_norm(ops.gelu(x), w, 1e-5) * 2

    return {"add": f_add, "gelu": f_gelu, "rms_norm": f_rms}


GRAPH_ARGS = {"add": [(4, 16), (4, 16)], "gelu": [(4, 16)], "rms_norm": [(4, 16), (16,)]}


@pytest.mark.parametrize("full_graph", [True, False], ids=["full_graph", "sot"])
@pytest.mark.parametrize("name", sorted(GRAPH_ARGS))
def test_to_static_forward_and_backward(name: str, full_graph: bool) -> None:
    f = _graph_fns()[name]
    args = [paddle.randn(list(s)) for s in GRAPH_ARGS[name]]
    for a in args:
        a.stop_gradient = False
    compiled = paddle.jit.to_static(f, full_graph=full_graph)
    out = compiled(*args)
    np.testing.assert_allclose(out.numpy(), f(*args).numpy(), rtol=1e-6, atol=1e-6)
    out.sum().backward()
    grads = [a.grad.numpy() for a in args]
    for a in args:
        a.clear_gradient()
    f(*args).sum().backward()
    for g, a in zip(grads, args, strict=True):
        np.testing.assert_allclose(g, a.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_to_static_records_python_ops_and_pylayers() -> None:
    f = _graph_fns()["rms_norm"]
    x, w = paddle.randn([4, 16]), paddle.randn([16])
    compiled = paddle.jit.to_static(f, full_graph=True)
    compiled(x, w)
    text = str(compiled.concrete_program.main_program)
    assert "py_op.opbridge__opbridge__gelu" in text and "py_op.opbridge__opbridge__rms_norm" in text
    assert "pd_op.pylayer" not in text, "no input needs grad: plain Python ops"
    x.stop_gradient = False
    compiled(x, w)
    assert "pd_op.pylayer" in str(compiled.concrete_program.main_program)


def test_to_static_multiple_outputs_and_dynamic_shapes() -> None:
    def f(g: Any, x: Any, w: Any) -> Any:
        dx, dw = ops.rms_norm_backward(g, x, w)
        return dx, dw

    spec = [paddle.static.InputSpec([None, 16], "float32"), paddle.static.InputSpec([None, 16], "float32"),
            paddle.static.InputSpec([16], "float32")]
    compiled = paddle.jit.to_static(f, input_spec=spec, full_graph=True)
    for rows in (3, 5):
        args = [paddle.randn([rows, 16]), paddle.randn([rows, 16]), paddle.randn([16])]
        for got, want in zip(compiled(*args), f(*args), strict=True):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)


def test_harness_compile() -> None:
    compiled = HARNESS.compile(lambda x, w: ops.rms_norm(x, w) + 1)
    assert compiled is not None
    x, w = paddle.randn([3, 8]), paddle.randn([8])
    np.testing.assert_allclose(compiled(x, w).numpy(), (ops.rms_norm(x, w) + 1).numpy(), rtol=1e-6)


@pytest.mark.parametrize("none_first", [True, False], ids=["none-first", "tensor-first"])
def test_to_static_optional_tensor_given_and_left_out(lib: opbridge.Library, none_first: bool) -> None:
    """Programs that pass an optional Tensor and programs that leave it out each get their own Python op:
    before, the second form reused the first's (a tensor ignored, or None given where a Value was
    expected, which aborted the process)."""
    maybe_mul = lib.ops["maybe_mul"].call

    def without(a: Any) -> Any:
        return maybe_mul(a, None)

    def given(a: Any, b: Any) -> Any:
        return maybe_mul(a, b)

    x, w = paddle.to_tensor([1.0, 2.0, 3.0]), paddle.to_tensor([10.0, 20.0, 30.0])
    calls = [(paddle.jit.to_static(without, full_graph=True), (x,), [1.0, 2.0, 3.0]),
             (paddle.jit.to_static(given, full_graph=True), (x, w), [10.0, 40.0, 90.0])]
    for fn, args, want in calls if none_first else calls[::-1]:
        np.testing.assert_array_equal(fn(*args).numpy(), np.float32(want))


def test_to_static_mutating_op_raises_clear_error(lib: opbridge.Library) -> None:
    scale_ = lib.ops["scale_"].call

    def f(x: Any, other: Any) -> Any:
        scale_(x, other, 2.0)
        return x

    with pytest.raises(PaddleStaticError, match=r"scale_: mutates its arguments in place.*to_static"):
        paddle.jit.to_static(f, full_graph=True)(paddle.ones([3]), paddle.ones([3]))


def test_to_static_without_backward_raises_when_differentiated(lib: opbridge.Library) -> None:
    twice = lib.ops["twice"].call

    def f(x: Any) -> Any:
        return twice(x)

    x = paddle.ones([3])
    compiled = paddle.jit.to_static(f, full_graph=True)
    np.testing.assert_array_equal(compiled(x).numpy(), np.full(3, 2.0, np.float32))
    x.stop_gradient = False
    with pytest.raises(Exception, match="twice: no backward is declared"):
        compiled(x).sum().backward()


def test_to_static_bad_input() -> None:
    def f(x: Any, y: Any) -> Any:
        return ops.add(x, y)

    # Shape-rule and argument-type errors surface while tracing, with their own type.
    with pytest.raises(TypeError, match=r"add: argument 'y' must be a paddle\.pir\.Value"):
        paddle.jit.to_static(lambda_free(lambda x: ops.add(x, 1.0)), full_graph=True)(paddle.ones([2]))
    # So do the kernel's own checks (a dry run on zeros of the traced shapes), and the declared dtypes:
    # at run time Paddle would report them as a SystemError with the op's message only in its log.
    with pytest.raises(ValueError, match=r"add: y must have the same shape as x \(3,\), got \(4,\)"):
        paddle.jit.to_static(f, full_graph=True)(paddle.ones([3]), paddle.ones([4]))

    def g(x: Any) -> Any:
        return ops.gelu(x)

    with pytest.raises(TypeError, match=r"gelu: x must have dtype float32, float16, bfloat16 or float64, got int8"):
        paddle.jit.to_static(g, full_graph=True)(paddle.ones([3]).astype("int8"))


def test_to_static_dry_run_is_bounded_by_the_cores_one_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past opbridge.call.core.DRY_RUN_MAX_BYTES (one bound for JAX, Paddle and MindSpore) the trace runs no
    kernel, so the kernel's error is not raised while tracing (it was, under Paddle's own bound)."""
    def f(x: Any, y: Any) -> Any:
        return ops.add(x, y)

    monkeypatch.setattr(core, "DRY_RUN_MAX_BYTES", -1)
    with pytest.raises(Exception) as err:  # whatever the running program raises
        paddle.jit.to_static(f, full_graph=True)(paddle.ones([5]), paddle.ones([6]))
    assert not isinstance(err.value, ValueError), err.value


def test_to_static_open_dimensions() -> None:
    """A dimension InputSpec leaves open (-1) passes a like rule; any other rule names what it needs."""
    def gated(x: Any) -> Any:
        return ops.silu_and_mul(x)

    def norm(x: Any, w: Any) -> Any:
        return ops.rms_norm(x, w)

    x, w = paddle.randn([6, 10]), paddle.randn([10])
    spec = [paddle.static.InputSpec([None, 10], "float32"), paddle.static.InputSpec([10], "float32")]
    np.testing.assert_allclose(paddle.jit.to_static(norm, input_spec=spec, full_graph=True)(x, w).numpy(),
                               ops.rms_norm(x, w).numpy(), rtol=1e-6)
    with pytest.raises(PaddleStaticError, match=r"silu_and_mul: its shape rule needs every dimension of 'x' under "
                                                r"paddle.jit.to_static, and Paddle left one open"):
        paddle.jit.to_static(gated, input_spec=spec[:1], full_graph=True)(x)
    np.testing.assert_array_equal(paddle.jit.to_static(gated, full_graph=True)(x).numpy(), ops.silu_and_mul(x).numpy())


def test_sot_runs_mutating_ops_eagerly(lib: opbridge.Library) -> None:
    scale_ = lib.ops["scale_"].call

    def f(x: Any, other: Any) -> Any:
        scale_(x, other, 2.0)
        return x * 1

    x = paddle.ones([3])
    out = paddle.jit.to_static(f, full_graph=False)(x, paddle.ones([3]))
    np.testing.assert_array_equal(out.numpy(), np.full(3, 3.0, np.float32))
    np.testing.assert_array_equal(x.numpy(), np.full(3, 3.0, np.float32))


def test_sot_first_call_of_a_new_op(tmp_path: Any) -> None:
    """An op declared after the adapter loaded, first called (and built) while SOT traces."""
    (tmp_path / "k.cc").write_text(KERNELS_CC)
    new = opbridge.Library(f"opb_test_paddle_sot_{next(_NS)}_{tmp_path.name[-6:].replace('-', '_')}",
                           sources=["k.cc"], root=tmp_path)

    @new.op("twice(Tensor x) -> Tensor", shape=opbridge.like("x"), backward=lambda g, x: (ops.add(g, g),))
    def twice(x: Any) -> Any:
        return 2 * x

    @new.op("scale_(Tensor(a!) x, Tensor other, float alpha) -> ()")
    def scale_(x: Any, other: Any, alpha: float) -> None:
        x *= alpha
        x += other

    def f(x: Any, y: Any, z: Any) -> Any:
        scale_(y, z, 1.0)  # y = 1 * 1 + 1
        return twice(x) * 3 + y

    compiled = paddle.jit.to_static(f, full_graph=False)
    for _ in range(2):
        x, y, z = paddle.ones([3]), paddle.ones([3]), paddle.ones([3])
        x.stop_gradient = False
        out = compiled(x, y, z)
        np.testing.assert_array_equal(out.numpy(), np.full(3, 8.0, np.float32))
        (gx,) = paddle.grad([out.sum()], [x])
        np.testing.assert_array_equal(gx.numpy(), np.full(3, 6.0, np.float32))


# -- out= -------------------------------------------------------------------------------------


def test_out_writes_into_given_tensors() -> None:
    x, w = paddle.randn([3, 8]), paddle.randn([8])
    out = paddle.empty([3, 8])
    ptr = out.data_ptr()
    assert ops.rms_norm(x, w, out=out) is out
    assert out.data_ptr() == ptr
    np.testing.assert_array_equal(out.numpy(), ops.rms_norm(x, w).numpy())
    dx, dw = paddle.empty([3, 8]), paddle.empty([8])
    got = ops.rms_norm_backward(x, x, w, out=(dx, dw))
    assert got[0] is dx and got[1] is dw
    with pytest.raises(ValueError, match=r"rms_norm: out has shape \(.*\) and dtype float32, but the output"):
        ops.rms_norm(x, w, out=paddle.empty([3, 7]))
    x.stop_gradient = False
    with pytest.raises(RuntimeError, match="rms_norm: out= does not support autograd"):
        ops.rms_norm(x, w, out=out)


def lambda_free(fn: Callable[..., Any]) -> Callable[..., Any]:
    """to_static cannot transcribe a lambda at top level; give it a def."""
    def wrapped(x: Any) -> Any:
        return fn(x)

    return wrapped


# -- declared dtypes (issue 19) -----------------------------------------------------------------


def test_undeclared_dtype_raises_the_core_message_before_the_kernel(lib: opbridge.Library) -> None:
    twice = lib.ops["twice"]
    x = paddle.ones([4], "float64")  # its kernel would read these bytes as float32
    with pytest.raises(TypeError) as err:
        twice.call(x)
    assert str(err.value) == str(core.dtype_error(twice, "x", "float64"))
    out = paddle.full([4], 7.0, "float64")
    with pytest.raises(TypeError, match="twice: x must have dtype float32, got float64"):
        twice.call(x, out=out)
    np.testing.assert_array_equal(out.numpy(), np.full(4, 7.0)), "nothing was written"
    rms = ops.LIBRARY.ops["rms_norm"]
    with pytest.raises(TypeError) as err:
        ops.rms_norm(paddle.ones([2, 4], "int32"), paddle.ones([4], "int32"))
    assert str(err.value) == str(core.dtype_error(rms, "x", "int32"))


def test_float64_op(lib: opbridge.Library) -> None:
    twice64 = lib.ops["twice64"].call
    x = paddle.to_tensor(np.array([1 + 2.0**-40, -3.5, 1e300]))
    assert x.dtype == paddle.float64
    got = twice64(x)
    assert got.dtype == paddle.float64
    np.testing.assert_array_equal(got.numpy(), 2 * x.numpy())
    np.testing.assert_array_equal(twice64(paddle.to_tensor(np.arange(8.0)).reshape([2, 4]).t()).numpy(),
                                  2 * np.arange(8.0).reshape(2, 4).T)
    with pytest.raises(TypeError, match="twice64: x must have dtype float64, got float32"):
        twice64(paddle.ones([3]))


@pytest.mark.parametrize("name", ["add", "gelu", "rms_norm"])
def test_float64_flows_where_declared(name: str) -> None:
    op = ops.LIBRARY.ops[name]
    if "float64" not in op.dtypes:
        pytest.skip(f"{name} does not declare float64 (yet)")
    args = _to_paddle(_example(op, np.random.default_rng(3)), "float64")
    got = op.call(*args)
    assert got.dtype == paddle.float64
    want = op.reference(*[a.numpy() if isinstance(a, paddle.Tensor) else a for a in args])
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)


# -- strided inputs (issue 11 item 1) ------------------------------------------------------------

STRIDED_OPS = ["add", "rms_norm", "silu_and_mul", "fused_add_rms_norm", "rotary_embedding"]
SENTINEL = 7.0


def _first_case(op: opbridge.OpDef) -> dict[str, Any]:
    """The op's first generated float32 case whose tensors are all non-empty and at least 1-D."""
    for case in make_cases(op, "float32", seed=5):
        if not any(k.startswith("_") for k in case) and all(
                np.ndim(v) >= 1 and np.size(v) > 0 for k, v in case.items()
                if isinstance(v, np.ndarray)):
            return case
    raise AssertionError(f"{op.name}: no plain case")


def _tensor(a: np.ndarray, strided: bool, leaf: bool = False) -> tuple[Any, Any]:
    """``(base, view)``: *a* as a paddle tensor, or as every other column of a sentinel-filled wider one."""
    dtype = "float32" if a.dtype.kind == "f" else None
    if not strided:
        base = HARNESS.from_numpy(a, dtype)
        base.stop_gradient = not leaf
        return base, base
    wide = np.full((*a.shape[:-1], 2 * a.shape[-1]), SENTINEL, a.dtype)
    wide[..., ::2] = a
    base = HARNESS.from_numpy(wide, dtype)
    base.stop_gradient = not leaf
    view = base[..., ::2]
    assert not view.is_contiguous()
    return base, view


def _call(op: opbridge.OpDef, case: dict[str, Any], strided: str | None) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Run *op* on *case* (argument *strided* as a strided view): its outputs and every tensor's base."""
    args, bases = [], {}
    for a in op.schema.arguments:
        v = case[a.name]
        if isinstance(v, np.ndarray):
            bases[a.name], v = _tensor(v, a.name == strided)
        args.append(v)
    got = op.call(*args)
    outs = [HARNESS.to_numpy(g) for g in _as_tuple(got)] if got is not None else []
    return outs, bases


@pytest.mark.parametrize("name", STRIDED_OPS)
def test_strided_inputs_match_contiguous(name: str) -> None:
    op = ops.LIBRARY.ops[name]
    case = _first_case(op)
    want, want_bases = _call(op, case, None)
    tensors = [a for a in op.schema.arguments if isinstance(case[a.name], np.ndarray)]
    assert tensors
    for a in tensors:
        got, bases = _call(op, case, a.name)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w, err_msg=f"{name}: output with '{a.name}' strided")
        for arg in tensors:  # mutated arguments: the same new values, written through the view
            base = HARNESS.to_numpy(bases[arg.name])
            view = base[..., ::2] if arg.name == a.name else base
            np.testing.assert_array_equal(view, HARNESS.to_numpy(want_bases[arg.name]),
                                          err_msg=f"{name}: '{arg.name}' with '{a.name}' strided")
        sentinel = HARNESS.to_numpy(bases[a.name])[..., 1::2]
        assert (sentinel == SENTINEL).all(), f"{name}: wrote beside the strided view of '{a.name}'"


@pytest.mark.parametrize("name", ["add", "rms_norm", "silu_and_mul"])
def test_strided_inputs_backward(name: str) -> None:
    op = ops.LIBRARY.ops[name]
    case = _first_case(op)
    tensors = [a.name for a in op.schema.arguments if isinstance(case[a.name], np.ndarray)]
    rng = np.random.default_rng(2)
    cot = None

    def grads(strided: str | None) -> list[np.ndarray]:
        nonlocal cot
        args, leaves = [], []
        for a in op.schema.arguments:
            v = case[a.name]
            if isinstance(v, np.ndarray):
                base, v = _tensor(v, a.name == strided, leaf=True)
                leaves.append(base)
            args.append(v)
        out = op.call(*args)
        if cot is None:
            cot = rng.standard_normal(out.shape).astype(np.float32)
        got = paddle.grad([out], leaves, grad_outputs=[paddle.to_tensor(cot)])
        return [g.numpy() for g in got]

    want = grads(None)
    for i, n in enumerate(tensors):
        got = grads(n)
        np.testing.assert_allclose(got[i][..., ::2], want[i], rtol=1e-6, atol=1e-6,
                                   err_msg=f"{name}: gradient of strided '{n}'")
        assert (got[i][..., 1::2] == 0).all()
        for j, (g, w) in enumerate(zip(got, want, strict=True)):
            if j != i:
                np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_strided_input_reaches_a_kernel_without_stride_checks_dense(lib: opbridge.Library) -> None:
    twice, scale_ = lib.ops["twice"].call, lib.ops["scale_"].call
    base = paddle.arange(12, dtype="float32").reshape([3, 4])
    np.testing.assert_array_equal(twice(base.t()).numpy(), 2 * base.numpy().T)
    out = paddle.empty([4, 3])
    assert twice(base.t(), out=out) is out
    np.testing.assert_array_equal(out.numpy(), 2 * base.numpy().T)
    x = paddle.ones([4, 6])
    version = x.inplace_version
    scale_(x[:, ::2], paddle.ones([4, 3]), 3.0)  # mutated through a strided view
    want = np.ones((4, 6), np.float32)
    want[:, ::2] = 4.0
    np.testing.assert_array_equal(x.numpy(), want)
    assert x.inplace_version > version


# -- devices (issue 12 item 4, host side) ------------------------------------------------------------


class _FakeGpuPlace:
    """A place that claims to be GPU 0 (this Paddle is CPU-only)."""

    def is_cpu_place(self) -> bool:
        return False

    def is_gpu_place(self) -> bool:
        return True

    def gpu_device_id(self) -> int:
        return 0


class _ClaimsGpu(paddle.Tensor):  # type: ignore[misc]
    """A CPU tensor whose ``place`` says ``gpu:0``: the adapter must never hand it to a CPU kernel."""

    __module__ = "paddle.testing_fake"  # opbridge picks the adapter by the array type's top-level module

    @property
    def place(self) -> Any:
        return _FakeGpuPlace()


def _claims_gpu(a: np.ndarray) -> Any:
    return _ClaimsGpu(np.ascontiguousarray(a, np.float32))


@pytest.fixture
def device_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the adapter treat this Paddle as one that can hold device tensors (calls made from now on).

    A CPU-only Paddle has no device tensors, so its fast path tests no place; a
    tensor claiming a GPU exists only where Paddle can hold one.
    """
    monkeypatch.setattr(paddle_adapter, "host_only", lambda: False)


@pytest.mark.usefixtures("device_build")
def test_gpu_tensor_without_cuda_build_raises_and_writes_nothing(lib: opbridge.Library) -> None:
    if paddle.is_compiled_with_cuda():
        pytest.skip("this Paddle has CUDA: the fake GPU tensor would reach the CUDA kernel")
    x = _claims_gpu(np.ones(6))
    with pytest.raises(BackendUnavailableError, match=r"add: cannot run on paddle tensors on gpu:0: "
                                                      r"this Paddle build \(.*\) has no CUDA"):
        ops.add(x, _claims_gpu(np.ones(6)))
    scale_ = lib.ops["scale_"].call
    with pytest.raises(BackendUnavailableError, match="scale_: cannot run on paddle tensors on gpu:0"):
        scale_(x, _claims_gpu(np.ones(6)), 3.0)
    np.testing.assert_array_equal(x.numpy(), np.ones(6, np.float32)), "the CPU kernel never ran"
    out = _claims_gpu(np.full(6, SENTINEL))
    with pytest.raises(BackendUnavailableError, match="gelu: cannot run on paddle tensors on gpu:0"):
        ops.gelu(x, out=out)
    np.testing.assert_array_equal(out.numpy(), np.full(6, SENTINEL, np.float32))


@pytest.mark.usefixtures("device_build")
def test_gpu_tensors_reach_the_cuda_kernel_on_paddles_current_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Routing only (this Paddle has no CUDA): the CUDA kernel, under Paddle's current stream of that GPU."""
    import tvm_ffi

    calls: list[tuple[str, str, int]] = []

    def kernel(op: opbridge.OpDef, device: str) -> Callable[..., None]:
        def run(*args: Any) -> None:
            calls.append((op.name, device, tvm_ffi.get_raw_stream(tvm_ffi.device("cuda", 0))))
        return run

    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(paddle_base.loader, "kernel", kernel)
    monkeypatch.setattr(paddle_base.CORE, "_get_current_stream",
                        lambda index: SimpleNamespace(cuda_stream=0xABC + index), raising=False)
    x, residual, w = _claims_gpu(np.ones((2, 8))), _claims_gpu(np.ones((2, 8))), _claims_gpu(np.ones(8))
    assert ops.fused_add_rms_norm(x, residual, w) is None
    assert calls == [("fused_add_rms_norm", "cuda", 0xABC)]


@pytest.mark.usefixtures("device_build")
def test_op_without_cuda_kernel_names_it(lib: opbridge.Library, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    with pytest.raises(BackendUnavailableError, match=r"twice: cannot run on paddle tensors on gpu:0: twice has "
                                                      r"no CUDA kernel \(kernels: cpu\)"):
        lib.ops["twice"].call(_claims_gpu(np.ones(3)))


@pytest.mark.usefixtures("device_build")
def test_tensors_on_two_devices_raise_and_write_nothing(lib: opbridge.Library) -> None:
    """Where Paddle can hold device tensors, the fast path tests every tensor's place."""
    scale = ADAPTER.make_call(lib.ops["scale_"], paddle.Tensor)
    x = paddle.ones([6])
    with pytest.raises(ValueError, match=r"scale_: argument 'other' is a paddle tensor on gpu:0, but 'x' is on "
                                         r"cpu; put every tensor of the call on one device"):
        scale(x, _claims_gpu(np.ones(6)), 3.0)
    np.testing.assert_array_equal(x.numpy(), np.ones(6, np.float32))
    add = ADAPTER.make_call(ops.LIBRARY.ops["add"], paddle.Tensor)
    np.testing.assert_array_equal(add(x, x).numpy(), np.full(6, 2.0, np.float32)), "CPU tensors still run"
    out = _claims_gpu(np.full(6, SENTINEL))
    with pytest.raises(ValueError, match=r"add: argument 'out\[0\]' is a paddle tensor on gpu:0"):
        ops.add(x, x, out=out)
    np.testing.assert_array_equal(out.numpy(), np.full(6, SENTINEL, np.float32))


# -- large outputs on huge pages (issue 21) ------------------------------------------------------------

@pytest.mark.parametrize("name", ["add", "rms_norm_backward"])
def test_large_outputs_fault_in_huge_pages(name: str) -> None:
    """A (4096, 4096) float32 output is 16,384 4-KiB pages; advised, it faults ~545 times per call.

    The control, Paddle's own ``paddle.add`` of the same size, shows that
    Paddle maps each such output anew here (16,385 faults); without that,
    the advice could not be seen and the test skips.
    """
    off = os.environ.get("OPBRIDGE_HUGEPAGES") == "0"
    reason = "OPBRIDGE_HUGEPAGES=0 turns the advice off" if off else thp_skip_reason()
    if reason:
        pytest.skip(reason)
    x = paddle.ones([4096, 4096])
    control = faults_per_call(paddle.add, x, x)
    if control < 8000:
        pytest.skip(f"Paddle reuses its output memory here ({control:.0f} faults for 16,384 pages): the "
                    f"advice cannot be observed")
    args = {"add": (x, x), "rms_norm_backward": (x, x, paddle.ones([4096]))}[name]
    per_call = faults_per_call(ops.LIBRARY.ops[name].call, *args)
    assert per_call < 4000, (f"{name}: {per_call:.0f} page faults per call ({control:.0f} for paddle.add, "
                             f"without huge-page advice)")



@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_large_outputs_come_from_the_pool(dt: str) -> None:
    """4 MiB and more: 2 MiB-aligned, and a freed output's buffer is the next one's (tests/test_host_buffers.py)."""
    x = paddle.ones([1024, 2048], dtype=dt)
    ops.gelu(x)
    first = ops.gelu(x)
    p = first.data_ptr()
    assert p % (2 << 20) == 0
    del first
    assert ops.gelu(x).data_ptr() == p


def test_heap_sized_outputs_reuse_memory_like_numpy() -> None:
    """A new (1024, 4096) float32 output (16 MiB) is memory the pool reuses: no faults per call.

    Paddle's own allocator maps such a buffer anew per call (the control,
    ``paddle.add``: ~4,097 faults); opbridge's output is a buffer of its pool
    shared through DLPack, as cheap as the NumPy path's. The result is an ordinary
    Paddle tensor: in-place updates, autograd through the checked path.
    """
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((1024, 4096)).astype(np.float32))
    control = faults_per_call(paddle.add, x, x)
    faults = faults_per_call(ops.add, x, x)
    if control < 2000:
        pytest.skip(f"Paddle reuses its own output memory here ({control:.0f} faults): nothing to compare")
    assert faults < 100, f"{faults:.0f} faults per call ({control:.0f} for paddle.add)"
    out = ops.add(x, x)
    np.testing.assert_array_equal(out.numpy(), 2 * x.numpy())
    out.add_(x)
    np.testing.assert_array_equal(out.numpy(), 3 * x.numpy())
    xg = x.clone()
    xg.stop_gradient = False
    w = paddle.ones([4096])
    w.stop_gradient = False
    y = ops.rms_norm(xg, w, 1e-6)
    y.sum().backward()
    assert xg.grad is not None and xg.grad.shape == [1024, 4096] and w.grad.shape == [4096]
    # bfloat16 (no NumPy dtype) and (4096, 4096) outputs stay Paddle's own, advised
    xb = x.astype("bfloat16")
    np.testing.assert_array_equal(ops.add(xb, xb).astype("float32").numpy(),
                                  2 * xb.astype("float32").numpy())  # exact: doubling a bfloat16


@pytest.mark.parametrize("name", ["add", "fused_add_rms_norm"])
def test_strided_tensors_run_on_dense_copies_not_the_checked_call(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A strided tensor runs the op again on dense copies (overlap.recall_dense: the exchange entry takes
    them), not through the checked call (add on a (64, 128) slice: 28-31 us there, 2.4 contiguous). A
    written strided argument is updated through the caller's view (its base sees it) and its inplace
    version bumped; the caller's tensor is not made contiguous (Paddle's contiguous() would)."""
    op = getattr(ops, name).opdef
    rng = np.random.default_rng(0)
    base = paddle.to_tensor(rng.standard_normal((6, 32)).astype(np.float32))
    x = base[:, ::2]
    others = [paddle.to_tensor(rng.standard_normal((6, 16)).astype(np.float32))]
    if name == "fused_add_rms_norm":
        others.append(paddle.to_tensor(rng.standard_normal(16).astype(np.float32)))
    op.call(x.clone(), *[o.clone() for o in others])  # the eager call built
    fn = op.call.__globals__["_table"][paddle.Tensor]

    def checked(*a: Any) -> Any:
        raise AssertionError("the checked call ran")

    monkeypatch.setitem(fn.__globals__, "_slow", checked)
    dense = [x.clone(), *[o.clone() for o in others]]
    want = op.call(*dense)
    version = x._inplace_version()
    got = op.call(x, *others)
    assert not x.is_contiguous(), "the caller's view keeps its layout"
    if name == "add":
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    else:  # input and residual are written: input through the view, into its base
        np.testing.assert_allclose(base.numpy()[:, ::2], dense[0].numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(others[0].numpy(), dense[1].numpy(), rtol=1e-6, atol=1e-6)
        assert x._inplace_version() > version
