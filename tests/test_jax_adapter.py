"""The JAX adapter: FFI custom calls under jit and eager, grad, vmap, mutating ops, bad input."""

from __future__ import annotations

import functools
import itertools
import mmap
import resource
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jax_tvm_ffi = pytest.importorskip("jax_tvm_ffi")

import jax.numpy as jnp  # noqa: E402

import opbridge  # noqa: E402
from opbridge import loader, ops  # noqa: E402
from opbridge.adapters import jax as jax_adapter  # noqa: E402
from opbridge.call import core  # noqa: E402
from opbridge.testing.harness_jax import HARNESS  # noqa: E402
from opbridge.testing.matrix import LAYOUT, NONCONTIGUOUS, make_cases  # noqa: E402

# Float ops with hand-built inputs; every op (int and mutating ones too) runs in tests/conformance.
BUILTIN = sorted(n for n, op in ops.LIBRARY.ops.items() if op.call.__module__ == "opbridge.ops"
                 and getattr(op.reference, "__module__", "") == "opbridge.ops.basic")
WITH_BACKWARD = [n for n in BUILTIN if ops.LIBRARY.ops[n].backward is not None]
DTYPES = ["float32", "bfloat16"]
_NS = itertools.count()

EXTRA_CC = """
#include <opbridge/opbridge.h>
#include <cmath>
using tvm::ffi::TensorView;
using tvm::ffi::Optional;

// Scalars before and between tensors: out = a * x + b * y.
void axpby_cpu(TensorView out, double a, TensorView x, double b, TensorView y) {
  OPB_CHECK_DTYPE("axpby", x, opbridge::kFloat32);
  OPB_CHECK_SAME_DTYPE("axpby", y, x);
  OPB_CHECK_SAME_SHAPE("axpby", y, x);
  const float* px = static_cast<const float*>(x.data_ptr());
  const float* py = static_cast<const float*>(y.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = float(a) * px[i] + float(b) * py[i];
}
OPBRIDGE_EXPORT(axpby_cpu);

// Mutating, like fused_add_rms_norm: residual += input; input = residual * weight * alpha.
void fused_add_scale__cpu(TensorView input, TensorView residual, TensorView weight, double alpha) {
  OPB_CHECK_DTYPE("fused_add_scale_", input, opbridge::kFloat32);
  OPB_CHECK_SAME_SHAPE("fused_add_scale_", residual, input);
  const int64_t H = input.size(input.ndim() - 1);
  OPB_CHECK_SIZE("fused_add_scale_", weight, 0, H, "input's last dim");
  float* in = static_cast<float*>(input.data_ptr());
  float* res = static_cast<float*>(residual.data_ptr());
  const float* w = static_cast<const float*>(weight.data_ptr());
  for (int64_t i = 0; i < input.numel(); ++i) {
    res[i] += in[i];
    in[i] = res[i] * w[i % H] * float(alpha);
  }
}
OPBRIDGE_EXPORT(fused_add_scale__cpu);

// Optional tensor, int and bool scalars: out = times * (x + bias), negated if neg.
void bias_add_cpu(TensorView out, TensorView x, Optional<TensorView> bias, int64_t times, bool neg) {
  OPB_CHECK_DTYPE("bias_add", x, opbridge::kFloat32);
  const float* px = static_cast<const float*>(x.data_ptr());
  const float* pb = nullptr;
  if (bias.has_value()) {
    OPB_CHECK_SAME_SHAPE("bias_add", bias.value(), x);
    pb = static_cast<const float*>(bias.value().data_ptr());
  }
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) {
    float v = float(times) * (px[i] + (pb ? pb[i] : 0.f));
    o[i] = neg ? -v : v;
  }
}
OPBRIDGE_EXPORT(bias_add_cpu);

// An integer tensor argument: out = x * k (k int32).
void scale_by_int_cpu(TensorView out, TensorView x, TensorView k) {
  OPB_CHECK_DTYPE("scale_by_int", x, opbridge::kFloat32);
  OPB_CHECK_DTYPE("scale_by_int", k, opbridge::kInt32);
  OPB_CHECK_SAME_SHAPE("scale_by_int", k, x);
  const float* px = static_cast<const float*>(x.data_ptr());
  const int32_t* pk = static_cast<const int32_t*>(k.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = px[i] * float(pk[i]);
}
OPBRIDGE_EXPORT(scale_by_int_cpu);

// float32 and float64 (declared): out = -x.
void negate_cpu(TensorView out, TensorView x) {
  OPB_CHECK_SAME_SHAPE("negate", out, x);
  if (x.dtype().bits == 64) {
    const double* a = static_cast<const double*>(x.data_ptr());
    double* o = static_cast<double*>(out.data_ptr());
    for (int64_t i = 0; i < x.numel(); ++i) o[i] = -a[i];
    return;
  }
  OPB_CHECK_DTYPE("negate", x, opbridge::kFloat32);
  const float* a = static_cast<const float*>(x.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = -a[i];
}
OPBRIDGE_EXPORT(negate_cpu);

// No backward declared; no dtype check (the declared dtypes guard it).
void twice_cpu(TensorView out, TensorView x) {
  const float* a = static_cast<const float*>(x.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = 2 * a[i];
}
OPBRIDGE_EXPORT(twice_cpu);
"""


@pytest.fixture(scope="module")
def extra(tmp_path_factory: pytest.TempPathFactory) -> opbridge.Library:
    root = tmp_path_factory.mktemp("jaxextra")
    (root / "k.cc").write_text(EXTRA_CC)
    lib = opbridge.Library(f"opb_jax_test_{next(_NS)}_{root.name[-6:].replace('-', '_')}",
                           sources=["k.cc"], root=root)

    @lib.op("axpby(float a, Tensor x, float b, Tensor y) -> Tensor", shape=opbridge.like("x"),
            backward=lambda g, a, x, b, y: (axpby(a, g, 0.0, g), axpby(b, g, 0.0, g)))
    def axpby(a: float, x: Any, b: float, y: Any) -> Any:
        return a * x + b * y

    @lib.op("fused_add_scale_(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float alpha) -> ()")
    def fused_add_scale_(input: Any, residual: Any, weight: Any, alpha: float) -> None:
        residual += input
        input[...] = residual * weight * alpha

    @lib.op("bias_add(Tensor x, Tensor? bias, int times=1, bool neg=False) -> Tensor",
            shape=opbridge.like("x"))
    def bias_add(x: Any, bias: Any, times: int = 1, neg: bool = False) -> Any:
        v = times * (x + (0 if bias is None else bias))
        return -v if neg else v

    @lib.op("scale_by_int(Tensor x, Tensor k) -> Tensor", shape=opbridge.like("x"),
            backward=lambda g, x, k: (scale_by_int(g, k), None))
    def scale_by_int(x: Any, k: Any) -> Any:
        return x * k

    @lib.op("twice(Tensor x) -> Tensor", shape=opbridge.like("x"), dtypes=("float32",))
    def twice(x: Any) -> Any:
        return 2 * x

    @lib.op("negate(Tensor x) -> Tensor", shape=opbridge.like("x"), dtypes=("float32", "float64"),
            backward=lambda g, x: (negate(g),))
    def negate(x: Any) -> Any:
        return -x

    @lib.op("negate64(Tensor x) -> Tensor", shape=opbridge.like("x"), dtypes=("float64",),
            kernels={"cpu": "negate_cpu"})
    def negate64(x: Any) -> Any:  # an op that takes a 64-bit dtype only
        return -x

    return lib


def _rand(*shape: int, dtype: Any = jnp.float32, seed: int = 0) -> Any:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype=dtype)


def _cases(name: str, dtype: str) -> list[dict[str, Any]]:
    """The shared matrix's cases for *name*, minus the layouts JAX cannot express."""
    return [c for c in make_cases(ops.LIBRARY.ops[name], dtype)
            if c.get(LAYOUT, "contiguous") == "contiguous" and c.get(NONCONTIGUOUS) is None]


def _args(name: str, case: dict[str, Any], dtype: str) -> tuple[list[Any], list[Any]]:
    """(jax arguments, NumPy float64 reference arguments of the dtype-rounded values; integers kept)."""
    jx, ref = [], []
    for a in ops.LIBRARY.ops[name].schema.arguments:
        v = case[a.name]
        if a.type.is_tensor and v is not None:
            integer = np.asarray(v).dtype.kind in "iu"  # indices (positions, block tables) keep their dtype
            x = HARNESS.from_numpy(np.asarray(v), None if integer else dtype)
            jx.append(x)
            ref.append(np.asarray(x) if integer else HARNESS.to_numpy(x).astype(np.float64))
        else:
            jx.append(v)
            ref.append(v)
    return jx, ref


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


def _with_tensors(fn: Callable[..., Any], full: list[Any], scalars: set[int], *ts: Any) -> Any:
    """``fn(*full)`` with the tensor slots of *full* (those not in *scalars*) replaced by *ts*."""
    it = iter(ts)
    return fn(*(v if i in scalars else next(it) for i, v in enumerate(full)))


# ---------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", BUILTIN)
def test_forward_matches_reference(name: str, dtype: str, mode: str) -> None:
    op = ops.LIBRARY.ops[name]
    scalars = {i for i, a in enumerate(op.schema.arguments) if not a.type.is_tensor}
    rtol, atol = op.tolerance(dtype)
    for case in _cases(name, dtype):
        jx, ref = _args(name, case, dtype)
        if mode == "jit":  # static scalars are closed over
            tensors = [v for i, v in enumerate(jx) if i not in scalars]
            out = _as_tuple(jax.jit(functools.partial(_with_tensors, op.call, jx, scalars))(*tensors))
        else:
            out = _as_tuple(op.call(*jx))
        expected = _as_tuple(op.reference(*ref))
        assert len(out) == len(expected)
        for o, e in zip(out, expected, strict=True):
            assert isinstance(o, jax.Array)
            assert o.dtype == jnp.dtype(dtype) and o.shape == np.shape(e)
            e = np.asarray(HARNESS.from_numpy(np.asarray(e), dtype).astype(jnp.float32), dtype=np.float64)
            np.testing.assert_allclose(HARNESS.to_numpy(o), e, rtol=rtol, atol=atol,
                                       err_msg=f"{name} {dtype} {mode} {o.shape}")


def test_eager_call_returns_concrete_arrays_and_dispatches_by_type() -> None:
    x = _rand(3, 8)
    out = ops.add(x, x)
    assert type(out).__module__.startswith("jaxlib")
    np.testing.assert_allclose(np.asarray(out), 2 * np.asarray(x))
    # both the concrete array type and the tracer types reach this adapter
    table = ops.add.__globals__["_table"]
    assert type(x) in table
    jax.jit(lambda a: ops.add(a, a))(x)
    assert any(issubclass(t, jax.core.Tracer) for t in table)


def test_lowered_module_has_custom_call_and_no_host_callback() -> None:
    x, w = _rand(4, 16), _rand(16, seed=1)

    def f(x: Any, w: Any) -> Any:
        return ops.gelu(ops.rms_norm(x, w, 1e-5))

    text = jax.jit(f).lower(x, w).as_text()
    assert "stablehlo.custom_call @opbridge.opbridge.rms_norm" in text
    assert "stablehlo.custom_call @opbridge.opbridge.gelu" in text
    assert "eps = 1.000000e-05 : f64" in text
    for host in ("callback", "xla_python_cpu_callback", "xla_ffi_python"):
        assert host not in text
    grad_text = jax.jit(jax.grad(lambda x, w: f(x, w).sum(), argnums=(0, 1))).lower(x, w).as_text()
    assert "@opbridge.opbridge.rms_norm_backward" in grad_text
    assert "@opbridge.opbridge.gelu_backward" in grad_text
    assert "callback" not in grad_text


def test_static_scalar_changes_retrace_not_reregister() -> None:
    x, w = _rand(2, 8), _rand(8, seed=1)
    a = ops.rms_norm(x, w, 1e-6)
    b = ops.rms_norm(x, w, 0.5)
    ref = ops.rms_norm.reference
    np.testing.assert_allclose(np.asarray(a), ref(np.asarray(x), np.asarray(w), 1e-6), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(b), ref(np.asarray(x), np.asarray(w), 0.5), rtol=1e-5, atol=1e-6)
    targets = [t for t in jax_adapter._REGISTERED if t.startswith("opbridge.opbridge.rms_norm")]
    assert targets.count("opbridge.opbridge.rms_norm") == 1


# ---------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------


def _fd_vjp(op: Any, ref: list[Any], idx: int, ct: list[np.ndarray], step: float = 1e-6) -> np.ndarray:
    """d/d ref[idx] of sum(reference(*ref) * ct), by central differences in float64."""
    base = ref[idx]
    grad = np.zeros_like(base)
    for k in np.ndindex(base.shape):
        vals = []
        for sign in (1, -1):
            args = list(ref)
            args[idx] = base.copy()
            args[idx][k] += sign * step
            out = _as_tuple(op.reference(*args))
            vals.append(sum(float(np.sum(np.asarray(o) * c)) for o, c in zip(out, ct, strict=True)))
        grad[k] = (vals[0] - vals[1]) / (2 * step)
    return grad


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", WITH_BACKWARD)
def test_grad_matches_finite_differences(name: str, jit: bool) -> None:
    op = ops.LIBRARY.ops[name]
    case = next(c for c in _cases(name, "float32")
                if all(not a.type.is_tensor or 0 < np.size(c[a.name]) <= 64 for a in op.schema.arguments))
    jx, ref = _args(name, case, "float32")
    tidx = [i for i, a in enumerate(op.schema.arguments) if a.type.is_tensor]

    def f(*ts: Any) -> Any:
        full = list(jx)
        for i, t in zip(tidx, ts, strict=True):
            full[i] = t
        return op.call(*full)

    out, pullback = jax.vjp(jax.jit(f) if jit else f, *(jx[i] for i in tidx))
    rng = np.random.default_rng(1)
    cts = [rng.standard_normal(o.shape) for o in _as_tuple(out)]
    grads = pullback(cts[0] if len(cts) == 1 else tuple(cts))
    for i, g in zip(tidx, grads, strict=True):
        expected = _fd_vjp(op, ref, i, cts)
        np.testing.assert_allclose(np.asarray(g, np.float64), expected, rtol=2e-3, atol=2e-4,
                                   err_msg=f"{name}: d/d{op.schema.arguments[i].name}")


def test_grad_under_jit_bfloat16_and_against_jnp() -> None:
    x, w = _rand(5, 33), _rand(33, seed=1)

    def loss(x: Any, w: Any) -> Any:
        return (ops.gelu(ops.rms_norm(x, w)) ** 2).sum()

    def loss_jnp(x: Any, w: Any) -> Any:
        y = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w
        return (jax.nn.gelu(y, approximate=True) ** 2).sum()

    g = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    g2 = jax.grad(loss_jnp, argnums=(0, 1))(x, w)
    for a, b in zip(g, g2, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    gb = jax.jit(jax.grad(loss))(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    assert gb.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(gb, np.float32), np.asarray(g[0]), rtol=0.1, atol=0.1)


def test_grad_of_grad_and_forward_mode() -> None:
    x = jnp.arange(3.0)
    hess_diag = jax.grad(lambda a: jax.grad(lambda b: (ops.add(b, b) ** 2).sum())(a).sum())(x)
    np.testing.assert_array_equal(np.asarray(hess_diag), np.full(3, 8.0))
    with pytest.raises(NotImplementedError, match="gelu_backward: no backward is declared, so it cannot be"):
        jax.grad(lambda a: jax.grad(lambda b: ops.gelu(b).sum())(a).sum())(x)
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(ops.gelu, (x,), (x,))


def test_scalars_before_tensors_and_their_grad(extra: opbridge.Library) -> None:
    axpby = extra.ops["axpby"].call
    x, y = _rand(3, 7), _rand(3, 7, seed=1)
    out = axpby(2.0, x, -0.5, y)
    np.testing.assert_allclose(np.asarray(out), 2 * np.asarray(x) - 0.5 * np.asarray(y), rtol=1e-6)
    f = jax.jit(lambda x, y: axpby(2.0, x, -0.5, y))
    np.testing.assert_allclose(np.asarray(f(x, y)), np.asarray(out), rtol=0, atol=0)
    text = f.lower(x, y).as_text()
    assert f"@opbridge.{extra.namespace}.axpby.p(" in text
    gx, gy = jax.grad(lambda x, y: axpby(2.0, x, -0.5, y).sum(), argnums=(0, 1))(x, y)
    np.testing.assert_allclose(np.asarray(gx), np.full((3, 7), 2.0))
    np.testing.assert_allclose(np.asarray(gy), np.full((3, 7), -0.5))


def test_optional_tensor_and_int_bool_scalars(extra: opbridge.Library) -> None:
    bias_add = extra.ops["bias_add"].call
    x, b = _rand(4, 5), _rand(4, 5, seed=1)
    np.testing.assert_allclose(np.asarray(bias_add(x, b, 3, True)), -3 * (np.asarray(x) + np.asarray(b)),
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(bias_add(x, None)), np.asarray(x))
    np.testing.assert_allclose(np.asarray(jax.jit(lambda x: bias_add(x, None, 2, False))(x)),
                               2 * np.asarray(x), rtol=1e-6)
    with pytest.raises(TypeError, match="bias_add: argument 'times' must be int, got float"):
        bias_add(x, b, 1.5)


def test_an_absent_optional_tensor_takes_the_fast_route(extra: opbridge.Library, monkeypatch: Any) -> None:
    """None for an optional tensor is part of the fast route's key, as present ones are: no checked path."""
    from opbridge.adapters import jax as adapter

    op = extra.ops["bias_add"]
    x, b = _rand(4, 5), _rand(4, 5, seed=1)
    op.call(x, None, 2, False)  # the checked path fills the fast route for this None pattern
    op.call(x, b, 2, False)
    jop = adapter._jop(op)
    monkeypatch.setattr(jop, "general", lambda *a: pytest.fail("the checked path ran"))
    monkeypatch.setattr(jop, "check", lambda *a: pytest.fail("the checked path ran"))
    call = jop.make_call(type(x))  # the generated call binds `general` when made
    np.testing.assert_allclose(np.asarray(call(x, None, 2, False)), 2 * np.asarray(x), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(call(x, b, 2, False)), 2 * (np.asarray(x) + np.asarray(b)), rtol=1e-6)


def test_integer_tensor_argument_gets_float0_cotangent(extra: opbridge.Library) -> None:
    scale_by_int = extra.ops["scale_by_int"].call
    x, k = _rand(6), jnp.arange(6, dtype=jnp.int32)
    gx = jax.grad(lambda x, k: scale_by_int(x, k).sum())(x, k)
    np.testing.assert_allclose(np.asarray(gx), np.arange(6, dtype=np.float32))
    gk = jax.grad(lambda x, k: scale_by_int(x, k).sum(), argnums=1, allow_int=True)(x, k)
    assert gk.dtype == jax.dtypes.float0


def test_op_without_backward_raises_when_differentiated(extra: opbridge.Library) -> None:
    twice = extra.ops["twice"].call
    x = _rand(3)
    np.testing.assert_allclose(np.asarray(twice(x)), 2 * np.asarray(x))
    with pytest.raises(NotImplementedError, match="twice: no backward is declared, so it cannot be differentiated"):
        jax.grad(lambda x: twice(x).sum())(x)
    with pytest.raises(NotImplementedError, match="twice"):
        jax.jit(jax.grad(lambda x: twice(x).sum()))(x)


# ---------------------------------------------------------------------------
# vmap
# ---------------------------------------------------------------------------


def test_vmap_matches_python_loop() -> None:
    xs, ws = _rand(3, 4, 16), _rand(3, 16, seed=1)
    got = jax.vmap(ops.rms_norm)(xs, ws)
    loop = jnp.stack([ops.rms_norm(xs[i], ws[i]) for i in range(3)])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(loop))
    got = jax.jit(jax.vmap(ops.rms_norm, in_axes=(1, None)))(xs, ws[0])
    loop = jnp.stack([ops.rms_norm(xs[:, i], ws[0]) for i in range(4)])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(loop))
    gx, gdw = jax.vmap(ops.rms_norm_backward)(xs, xs, ws)
    for i in range(3):
        ex, ew = ops.rms_norm_backward(xs[i], xs[i], ws[i])
        np.testing.assert_array_equal(np.asarray(gx[i]), np.asarray(ex))
        np.testing.assert_array_equal(np.asarray(gdw[i]), np.asarray(ew))


def test_vmap_of_grad() -> None:
    xs = _rand(4, 9)
    got = jax.vmap(jax.grad(lambda x: ops.gelu(x).sum()))(xs)
    want = jnp.stack([jax.grad(lambda x: ops.gelu(x).sum())(xs[i]) for i in range(4)])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ---------------------------------------------------------------------------
# mutating ops
# ---------------------------------------------------------------------------


def _fused_ref(x: np.ndarray, r: np.ndarray, w: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    r2 = r + x
    return r2 * w * alpha, r2


def test_mutating_op_returns_new_values(extra: opbridge.Library) -> None:
    op = extra.ops["fused_add_scale_"].call
    x, r, w = _rand(3, 8), _rand(3, 8, seed=1), _rand(8, seed=2)
    x0, r0 = np.asarray(x).copy(), np.asarray(r).copy()
    out = op(x, r, w, 0.5)
    assert isinstance(out, tuple) and len(out) == 2
    ex, er = _fused_ref(x0, r0, np.asarray(w), 0.5)
    np.testing.assert_allclose(np.asarray(out[0]), ex, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out[1]), er, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(x), x0)  # the arrays passed in are unchanged
    np.testing.assert_array_equal(np.asarray(r), r0)


def test_mutating_ops_return_what_their_generated_wrappers_say() -> None:
    """The generated stubs type a mutating op's result on JAX arrays (opbridge.codegen.types): one tuple of its
    mutated arguments' new values (None for an optional one passed as None), then its returns."""
    from opbridge.codegen.types import call_returns_annotation

    x, w = _rand(2, 8), _rand(8, seed=1)
    assert call_returns_annotation(ops.fused_add_rms_norm.opdef.schema) == "tuple[Tensor, Tensor] | None"
    got = ops.fused_add_rms_norm(x, x, w)
    assert isinstance(got, tuple) and len(got) == 2 and all(isinstance(g, jax.Array) for g in got)
    assert call_returns_annotation(ops.rotary_embedding.opdef.schema) == "tuple[Tensor, Tensor | None] | None"
    got = ops.rotary_embedding(jnp.zeros(2, jnp.int32), _rand(2, 8), None, 8, _rand(4, 8), True)
    assert isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], jax.Array) and got[1] is None


def test_mutating_op_under_jit_aliases_and_keeps_inputs_intact(extra: opbridge.Library) -> None:
    op = extra.ops["fused_add_scale_"].call
    x, r, w = _rand(3, 8), _rand(3, 8, seed=1), _rand(8, seed=2)

    def f(x: Any, r: Any, w: Any) -> Any:
        nx, nr = op(x, r, w, 2.0)
        return nx, nr, x * 1.0, r * 1.0  # the old values are still live after the call

    lowered = jax.jit(f).lower(x, r, w).as_text()
    assert f"@opbridge.{extra.namespace}.fused_add_scale_" in lowered
    assert "output_operand_aliases" in lowered
    nx, nr, ox, orr = jax.jit(f)(x, r, w)
    ex, er = _fused_ref(np.asarray(x), np.asarray(r), np.asarray(w), 2.0)
    np.testing.assert_allclose(np.asarray(nx), ex, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(nr), er, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(ox), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(orr), np.asarray(r))


def test_mutating_op_updates_donated_buffer_in_place(extra: opbridge.Library) -> None:
    op = extra.ops["fused_add_scale_"].call
    x, r, w = _rand(64, 128), _rand(64, 128, seed=1), _rand(128, seed=2)
    ex, er = _fused_ref(np.asarray(x), np.asarray(r), np.asarray(w), 1.5)
    px, pr = x.unsafe_buffer_pointer(), r.unsafe_buffer_pointer()
    f = jax.jit(lambda x, r, w: op(x, r, w, 1.5), donate_argnums=(0, 1))
    nx, nr = f(x, r, w)
    assert (nx.unsafe_buffer_pointer(), nr.unsafe_buffer_pointer()) == (px, pr)
    assert x.is_deleted() and r.is_deleted()
    np.testing.assert_allclose(np.asarray(nx), ex, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(nr), er, rtol=1e-6)


def test_mutating_op_vmap_and_grad(extra: opbridge.Library) -> None:
    op = extra.ops["fused_add_scale_"].call
    xs, rs, w = _rand(3, 2, 8), _rand(3, 2, 8, seed=1), _rand(8, seed=2)
    nx, nr = jax.vmap(lambda x, r: op(x, r, w, 0.25))(xs, rs)
    for i in range(3):
        ex, er = _fused_ref(np.asarray(xs[i]), np.asarray(rs[i]), np.asarray(w), 0.25)
        np.testing.assert_allclose(np.asarray(nx[i]), ex, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(nr[i]), er, rtol=1e-6)
    with pytest.raises(NotImplementedError, match="fused_add_scale_: cannot be differentiated: it mutates"):
        jax.grad(lambda w: op(xs[0], rs[0], w, 1.0)[0].sum())(w)


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------

BadCall = Callable[[], Any]
BAD_INPUTS: list[tuple[str, BadCall, type[Exception], str]] = [
    ("int dtype", lambda: ops.rms_norm(jnp.ones((2, 4), jnp.int32), jnp.ones(4)), TypeError,
     r"rms_norm: x must have dtype"),
    ("mixed dtypes", lambda: ops.add(jnp.ones(3), jnp.ones(3, jnp.bfloat16)), TypeError,
     r"add: y must have the same dtype as x"),
    ("rank", lambda: ops.rms_norm(jnp.ones((2, 4)), jnp.ones((1, 4))), ValueError, r"rms_norm: weight"),
    ("size", lambda: ops.rms_norm(jnp.ones((2, 64)), jnp.ones(63)), ValueError,
     r"rms_norm: weight must have size 64"),
    ("shape", lambda: ops.add(jnp.ones(3), jnp.ones(4)), ValueError, r"add: y must have the same shape"),
    ("eps < 0", lambda: ops.rms_norm(jnp.ones((2, 4)), jnp.ones(4), -1.0), ValueError,
     r"rms_norm: eps must be >= 0"),
    ("jit shape", lambda: jax.jit(lambda a, b: ops.add(a, b))(jnp.ones(3), jnp.ones(4)), ValueError,
     r"add: y must have the same shape"),
    ("jit dtype", lambda: jax.jit(ops.gelu)(jnp.ones(3, jnp.int32)), TypeError, r"gelu: x must have dtype"),
    ("missing", lambda: ops.rms_norm(jnp.ones((2, 4))), TypeError, r"rms_norm\(\) missing .*'weight'"),
    ("scalar type", lambda: ops.rms_norm(jnp.ones((2, 4)), jnp.ones(4), "big"), TypeError,
     r"rms_norm: argument 'eps' must be float, got str"),
    ("traced scalar", lambda: jax.jit(lambda x, e: ops.rms_norm(x, x[0], e))(jnp.ones((2, 2)), 0.1),
     TypeError, r"rms_norm: argument 'eps' must be float, got a traced value; it is static"),
    ("numpy in tensor slot", lambda: ops.add(jnp.ones(2), np.ones(2, np.float32)), TypeError,
     r"add: argument 'y' must be a jax.Array, got ndarray"),
    ("list in tensor slot", lambda: ops.add(jnp.ones(2), [1.0, 2.0]), TypeError,
     r"add: argument 'y' must be a jax.Array, got list"),
    ("float in tensor slot", lambda: jax.jit(lambda x: ops.add(x, 1.0))(jnp.ones(2)), TypeError,
     r"add: argument 'y' must be a jax.Array, got float"),
    # beyond int64 (a kernel's int64_t): was NumPy's bare OverflowError for an int argument, and for a float one
    # a float64 attribute here while every other framework refused it
    ("int beyond int64", lambda: ops.rotary_embedding(jnp.zeros(2, jnp.int32), jnp.ones((2, 8)), None, 2**70,
                                                      jnp.ones((4, 8)), True), ValueError,
     r"rotary_embedding: argument 'head_size' must be in int64's range \[-2\*\*63, 2\*\*63 - 1\] \(a kernel's "
     r"int64_t\), got the int 1180591620717411303424"),
    ("int beyond int64, for a float", lambda: ops.rms_norm(jnp.ones((2, 4)), jnp.ones(4), 2**64), ValueError,
     r"rms_norm: argument 'eps' is the int 18446744073709551616, outside int64's range"),
]


@pytest.mark.parametrize(("case", "call", "exc", "pattern"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_named_error(case: str, call: BadCall, exc: Any, pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        call()


def test_kernel_error_past_the_dry_run_is_a_python_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the trace-time check, the kernel's error still arrives as an exception, not a crash."""
    monkeypatch.setattr(core, "DRY_RUN_MAX_BYTES", -1)
    with pytest.raises(jax.errors.JaxRuntimeError, match="add: y must have the same dtype as x"):
        jax.jit(lambda a, b: ops.add(a, b.astype(jnp.float16)))(jnp.ones(5), jnp.ones(5)).block_until_ready()


# ---------------------------------------------------------------------------
# harness
# ---------------------------------------------------------------------------


def test_harness_round_trip_vjp_compile() -> None:
    assert HARNESS.skip_reason() is None
    assert HARNESS.mutates_in_place is False and "bfloat16" in HARNESS.dtypes
    a = np.random.default_rng(0).standard_normal((3, 5))
    x = HARNESS.from_numpy(a, "bfloat16")
    assert x.dtype == jnp.bfloat16
    assert HARNESS.to_numpy(x).dtype == np.float32
    k = HARNESS.from_numpy(np.arange(3, dtype=np.int32), None)
    assert k.dtype == jnp.int32
    x = HARNESS.from_numpy(a, "float32")
    w = HARNESS.from_numpy(a[0], "float32")
    ct = np.ones((3, 5))
    gx, gw = HARNESS.vjp(ops.rms_norm, [x, w], [0, 1], ct)
    ex, ew = ops.rms_norm_backward(jnp.ones((3, 5)), x, w)
    np.testing.assert_allclose(gx, np.asarray(ex), rtol=1e-6)
    np.testing.assert_allclose(gw, np.asarray(ew), rtol=1e-6)
    compiled = HARNESS.compile(ops.gelu)
    assert compiled is not None
    np.testing.assert_array_equal(HARNESS.to_numpy(compiled(x)), HARNESS.to_numpy(ops.gelu(x)))
    compiled = HARNESS.compile(ops.rms_norm)  # the float scalar stays static
    assert compiled is not None
    np.testing.assert_array_equal(HARNESS.to_numpy(compiled(x, w, 1e-3)),
                                  HARNESS.to_numpy(ops.rms_norm(x, w, 1e-3)))
    assert HARNESS.data_ptr(x) == x.unsafe_buffer_pointer() != 0


# ---------------------------------------------------------------------------
# declared dtypes (issue 19)
# ---------------------------------------------------------------------------


def test_undeclared_dtype_is_rejected_with_the_shared_message(extra: opbridge.Library) -> None:
    op = extra.ops["twice"]  # its kernel checks no dtype: only the declaration guards it
    x = _rand(4, dtype=jnp.bfloat16)
    want = str(core.dtype_error(op, "x", "bfloat16"))
    assert want == ('twice: x must have dtype float32, got bfloat16 (the dtypes twice declares); convert it first, '
                    'e.g. x.astype("float32")')
    with pytest.raises(TypeError) as eager:
        op.call(x)
    assert str(eager.value) == want
    with pytest.raises(TypeError) as jitted:
        jax.jit(op.call)(x)
    assert str(jitted.value) == want
    with pytest.raises(TypeError, match="rms_norm: x must have dtype float32, float16, bfloat16 or float64, got int32"):
        jax.jit(ops.rms_norm)(jnp.ones((2, 4), jnp.int32), jnp.ones(4, jnp.int32))
    np.testing.assert_array_equal(np.asarray(op.call(_rand(4))), 2 * np.asarray(_rand(4)))


def test_float64_flows_through_under_x64(extra: opbridge.Library) -> None:
    negate = extra.ops["negate"].call
    with jax.enable_x64(True):
        x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5)) * 1e-200)  # below float32's range
        assert x.dtype == jnp.float64
        for out in (negate(x), jax.jit(negate)(x)):
            assert out.dtype == jnp.float64
            np.testing.assert_array_equal(np.asarray(out), -np.asarray(x))
        g = jax.grad(lambda x: negate(x).sum())(x)
        assert g.dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(g), -np.ones((3, 5)))
        for name in BUILTIN:  # built-in ops that declare float64 take it too
            op = ops.LIBRARY.ops[name]
            if "float64" not in op.dtypes:
                continue
            jx, ref = _args(name, _cases(name, "float64")[0], "float64")
            for o, e in zip(_as_tuple(op.call(*jx)), _as_tuple(op.reference(*ref)), strict=True):
                assert o.dtype == jnp.float64
                np.testing.assert_allclose(np.asarray(o), e, rtol=1e-12, atol=1e-12, err_msg=name)
    if not jax.config.read("jax_enable_x64"):  # without x64 JAX narrows the input before opbridge sees it
        assert negate(jnp.asarray(np.ones(3))).dtype == jnp.float32


# ---------------------------------------------------------------------------
# strided inputs (issue 11): JAX arrays are dense, views are materialised by XLA
# ---------------------------------------------------------------------------

STRIDED_OPS = ["add", "rms_norm", "silu_and_mul", "fused_add_rms_norm", "rotary_embedding"]


def _strided_views(x: Any) -> dict[str, tuple[Any, Callable[[Any], Any]]]:
    """Ways to reach *x* through a non-contiguous view: (base array, view of base equal to x)."""
    if x.ndim == 0:
        return {}
    views: dict[str, tuple[Any, Callable[[Any], Any]]] = {
        "every other": (jnp.repeat(x, 2, axis=-1), lambda b: b[..., ::2]),
        "reversed": (x[..., ::-1], lambda b: b[..., ::-1]),
    }
    if x.ndim == 2:
        views["transposed"] = (x.T, lambda b: b.T)
    return views


@pytest.mark.parametrize("name", STRIDED_OPS)
def test_strided_inputs_match_contiguous(name: str) -> None:
    op = ops.LIBRARY.ops[name]
    with jax.enable_x64(True):  # rotary_embedding's positions are int64
        case = next(c for c in _cases(name, "float32")
                    if all(not a.type.is_tensor or c[a.name] is None or np.size(c[a.name]) > 1
                           for a in op.schema.arguments))
        jx, _ = _args(name, case, "float32")
        tidx = [i for i, a in enumerate(op.schema.arguments) if a.type.is_tensor and jx[i] is not None]
        scalars = {i for i in range(len(jx)) if i not in tidx}
        want = _as_tuple(op.call(*jx))
        for i in tidx:
            for how, (base, view) in _strided_views(jx[i]).items():
                def f(b: Any, *, _i: int = i, _view: Callable[[Any], Any] = view) -> Any:
                    full = list(jx)
                    full[_i] = _view(b)
                    return op.call(*full)

                for mode, fn in (("eager", f), ("jit", jax.jit(f))):
                    got = _as_tuple(fn(base))
                    for g, w in zip(got, want, strict=True):
                        np.testing.assert_array_equal(np.asarray(g), np.asarray(w),
                                                      err_msg=f"{name} {op.schema.arguments[i].name} {how} {mode}")
                if op.backward is None or op.schema.is_mutating or not jnp.issubdtype(jx[i].dtype, jnp.inexact):
                    continue

                def loss(*ts: Any) -> Any:
                    return sum(o.sum() for o in _as_tuple(_with_tensors(op.call, jx, scalars, *ts)))

                g_ref = jax.grad(loss, argnums=tidx.index(i))(*(jx[k] for k in tidx))

                def strided_loss(b: Any, _i: int = i, _view: Callable[[Any], Any] = view) -> Any:
                    ts = [_view(b) if k == _i else jx[k] for k in tidx]
                    return loss(*ts)

                g = jax.jit(jax.grad(strided_loss))(base)
                np.testing.assert_allclose(np.asarray(view(g)), np.asarray(g_ref), rtol=1e-6, atol=1e-6,
                                           err_msg=f"grad {name} {op.schema.arguments[i].name} {how}")


# ---------------------------------------------------------------------------
# large outputs on huge pages (issue 21)
# ---------------------------------------------------------------------------

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_skip_reason() -> str | None:
    if not sys.platform.startswith("linux") or not _THP.exists():
        return "not Linux: no transparent huge pages"
    if "[madvise]" not in _THP.read_text():
        return f"transparent huge pages are '{_THP.read_text().strip()}', not [madvise]: advice changes nothing"
    if not jax_adapter.targets.advice_min_bytes():
        return "huge-page advice is off in this process (OPBRIDGE_HUGEPAGES=0)"
    return None


def _faults_per_call(fn: Callable[..., Any], *args: Any, calls: int = 3) -> float:
    fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(calls):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        fn(*args).block_until_ready()  # the output is freed at once: the next call maps it anew
        best = min(best, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return best


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["add", "rms_norm"])
def test_fresh_xla_output_faults_in_huge_pages(name: str, dtype: str) -> None:
    """A (4096, 4096) output that XLA allocates for an op faults in 2 MiB pages (issue 21).

    The control, XLA's own ``x + x`` of the same size, shows that this process
    gets a fresh mapping per output (16,384 4-KiB faults at float32, 8,192 at
    bfloat16); without that, the advice could not be seen and the test skips.
    """
    reason = _thp_skip_reason()
    if reason:
        pytest.skip(reason)
    x = jax.device_put(np.random.default_rng(0).standard_normal((4096, 4096), np.float32), jax.devices("cpu")[0])
    x = x.astype(dtype)
    pages = x.nbytes // 4096
    control = _faults_per_call(jax.jit(lambda a: a + a), x)
    if control < pages // 2:
        pytest.skip(f"XLA reuses its output memory here ({control:.0f} faults for {pages} pages): "
                    f"the advice cannot be observed")
    fn = jax.jit(ops.add if name == "add" else lambda x, w: ops.rms_norm(x, w))
    args = (x, x) if name == "add" else (x, x[0])
    # in 4 KiB pages: `pages` faults; on 2 MiB pages 32 (16), plus the unaligned ends (<= 2 x 512)
    faults = _faults_per_call(fn, *args)
    assert faults < pages // 4, f"{name} {dtype}: {faults:.0f} faults per call, XLA's own op {control:.0f}"
    if dtype == "bfloat16":
        return
    np.testing.assert_allclose(np.asarray(fn(*args))[-1], np.asarray(ops.LIBRARY.ops[name].reference(
        *(np.asarray(a)[-1:] if a.ndim == 2 else np.asarray(a) for a in args)))[0], rtol=1e-5, atol=1e-5)


def test_handler_shim_advises_the_fresh_output_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ shim itself, on a fresh anonymous mapping that nobody else advised."""
    targets = jax_adapter.targets
    add = ops.LIBRARY.ops["add"]
    kernel = loader.kernel(add, "cpu")
    monkeypatch.setattr(targets, "advice_min_bytes", lambda: 0)  # OPBRIDGE_HUGEPAGES=0 and friends
    assert targets._handler(add, kernel, [0, 1, 2], True, 1) is kernel  # no shim in front of the kernel
    monkeypatch.setattr(targets, "advice_min_bytes", lambda: 4 << 20)
    shim = targets._handler(add, kernel, [0, 1, 2], True, 1)
    assert shim is not kernel
    x = np.ones((4096, 4096), np.float32)
    reason = _thp_skip_reason()
    faults = {}
    for name, fn in (("kernel", kernel), ("shim", shim)):
        buf = mmap.mmap(-1, x.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # 64 MiB, untouched
        out = np.frombuffer(buf, np.float32).reshape(x.shape)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        fn(out, x, x)
        faults[name] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        np.testing.assert_array_equal(out[::1024, ::1024], 2 * x[::1024, ::1024])
        del out
        buf.close()
    if reason:
        pytest.skip(reason)
    assert faults["kernel"] > 8000 and faults["shim"] < 4000, faults


# ---------------------------------------------------------------------------
# GPU handlers (issue 12): requested wherever jaxlib has a CUDA backend
# ---------------------------------------------------------------------------


def _jax_args(op: Any) -> list[Any]:
    """Arguments for *op*'s first case: jax arrays in tensor slots (values do not matter here)."""
    case = make_cases(op, op.dtypes[0])[0]
    return [jnp.asarray(np.asarray(case[a.name])) if a.type.is_tensor and case[a.name] is not None
            else case[a.name] for a in op.schema.arguments]


class _Recorder:
    """Stands in for ``jax_tvm_ffi.register_ffi_target``: records (name, platform, cuda graphs)."""

    def __init__(self, real: Callable[..., Any] | None = None) -> None:
        self.calls: list[tuple[str, str, bool]] = []
        self.real = real

    def __call__(self, name: str, fn: Any, arg_spec: Any = None, platform: str = "cpu", **kw: Any) -> Any:
        self.calls.append((name, platform, bool(kw.get("allow_cuda_graph", False))))
        if platform == "cpu" and self.real is not None:
            return self.real(name, fn, arg_spec, platform=platform, **kw)
        return object()


@pytest.mark.parametrize("plugin", [True, False], ids=["cuda-plugin", "cpu-only"])
def test_gpu_handler_requested_for_every_op_with_a_cuda_kernel(plugin: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    targets = jax_adapter.targets
    rec = _Recorder()
    monkeypatch.setattr(jax_tvm_ffi, "register_ffi_target", rec)
    monkeypatch.setattr(targets, "REGISTERED", {})
    monkeypatch.setattr(targets, "cuda_available", lambda: plugin)
    asked: list[str] = []
    monkeypatch.setattr(targets, "_gpu_kernel", lambda op: asked.append(op.name) or loader.kernel(op, "cpu"))
    with jax.enable_x64(True):
        names = {}
        for name, op in ops.LIBRARY.ops.items():
            names[name] = jax_adapter._JaxOp(op).variant(_jax_args(op)).target
    with_cuda = sorted(n for n, op in ops.LIBRARY.ops.items() if "cuda" in op.kernels)
    assert with_cuda == sorted(ops.LIBRARY.ops)  # every built-in op has a CUDA kernel
    for name, target in names.items():
        platforms = [(p, graphs) for t, p, graphs in rec.calls if t == target]
        # XLA may capture a handler into a CUDA graph only where the op says its host code need not run
        graphs = ops.LIBRARY.ops[name].graph_safe
        want = [("cpu", False), ("gpu", graphs)] if plugin and name in with_cuda else [("cpu", False)]
        assert platforms == want, name
    assert sorted(asked) == (with_cuda if plugin else [])
    # the ops whose CUDA host code raises what an earlier call's kernel found (cuda_error_flag.h)
    assert sorted(n for n, op in ops.LIBRARY.ops.items() if not op.graph_safe) == ["advance_step_flashattn",
                                                                                 "rotary_embedding"]


def test_gpu_registration_leaves_the_cpu_path_unchanged(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "k.cc").write_text(EXTRA_CC)
    lib = opbridge.Library(f"opb_jax_gpu_{next(_NS)}", sources=["k.cc"], root=tmp_path)

    @lib.op("twice(Tensor x) -> Tensor", shape=opbridge.like("x"),
            kernels={"cpu": "twice_cpu", "cuda": "twice_cuda"})
    def twice(x: Any) -> Any:
        return 2 * x

    targets = jax_adapter.targets
    rec = _Recorder(real=jax_tvm_ffi.register_ffi_target)
    monkeypatch.setattr(jax_tvm_ffi, "register_ffi_target", rec)
    monkeypatch.setattr(targets, "cuda_available", lambda: True)
    monkeypatch.setattr(targets, "_gpu_kernel", lambda op: loader.kernel(op, "cpu"))
    x = jax.device_put(_rand(4, 6), jax.devices("cpu")[0])  # CPU arrays also where a GPU is the default
    np.testing.assert_array_equal(np.asarray(jax.jit(twice)(x)), 2 * np.asarray(x))
    np.testing.assert_array_equal(np.asarray(twice(x)), 2 * np.asarray(x))
    target = jax_adapter.target_name(lib.ops["twice"])
    assert rec.calls == [(target, "cpu", False), (target, "gpu", True)]
    assert jax.devices()[0].platform == "cpu" or targets.cuda_available()


def test_gpu_kernel_that_cannot_load_warns_and_keeps_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "k.cc").write_text(EXTRA_CC)
    lib = opbridge.Library(f"opb_jax_nocuda_{next(_NS)}", sources=["k.cc"], root=tmp_path)

    @lib.op("twice(Tensor x) -> Tensor", shape=opbridge.like("x"),
            kernels={"cpu": "twice_cpu", "cuda": "twice_cuda"})
    def twice(x: Any) -> Any:
        return 2 * x

    targets = jax_adapter.targets
    rec = _Recorder(real=jax_tvm_ffi.register_ffi_target)
    monkeypatch.setattr(jax_tvm_ffi, "register_ffi_target", rec)
    monkeypatch.setattr(targets, "cuda_available", lambda: True)
    x = jax.device_put(_rand(3), jax.devices("cpu")[0])
    with pytest.warns(RuntimeWarning, match="no GPU handler for JAX"):  # no .cu sources: nothing to load
        out = jax.jit(twice)(x)
    np.testing.assert_array_equal(np.asarray(out), 2 * np.asarray(x))
    assert [p for _, p, _ in rec.calls] == ["cpu"]


_NO_GPU = "no CUDA device for JAX here (jaxlib without a CUDA plugin, or no GPU); runs on a GPU machine"


def _gpu() -> Any:
    if not jax_adapter.targets.cuda_available():
        pytest.skip(_NO_GPU)
    return jax.devices("gpu")[0]


@pytest.mark.parametrize("name", sorted(ops.LIBRARY.ops))
def test_cuda_arrays_under_jit_match_cpu(name: str) -> None:
    gpu, cpu = _gpu(), jax.devices("cpu")[0]
    op = ops.LIBRARY.ops[name]
    with jax.enable_x64(True):
        dtype = op.dtypes[0]
        jx, _ = _args(name, _cases(name, dtype)[-1], dtype)
        scalars = {i for i, a in enumerate(op.schema.arguments) if not a.type.is_tensor or jx[i] is None}
        ts = [v for i, v in enumerate(jx) if i not in scalars]
        f = jax.jit(functools.partial(_with_tensors, op.call, jx, scalars))
        on_cpu = _as_tuple(f(*jax.device_put(ts, cpu)))
        on_gpu = _as_tuple(f(*jax.device_put(ts, gpu)))
        rtol, atol = op.tolerance(dtype)
        for c, g in zip(on_cpu, on_gpu, strict=True):
            if c is None:
                continue
            assert g.devices() == {gpu}
            np.testing.assert_allclose(HARNESS.to_numpy(g), HARNESS.to_numpy(c), rtol=rtol, atol=atol, err_msg=name)


def test_cuda_grad_vmap_and_donated_mutation() -> None:
    gpu = _gpu()
    x, w = jax.device_put((_rand(6, 64), _rand(64, seed=1)), gpu)

    def loss(x: Any, w: Any) -> Any:
        return (ops.gelu(ops.rms_norm(x, w)) ** 2).sum()

    g = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    g_cpu = jax.jit(jax.grad(loss, argnums=(0, 1)))(*jax.device_put((x, w), jax.devices("cpu")[0]))
    for a, b in zip(g, g_cpu, strict=True):
        assert a.devices() == {gpu}
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    xs = jax.device_put(_rand(3, 4, 64), gpu)
    got = jax.jit(jax.vmap(ops.rms_norm, in_axes=(0, None)))(xs, w)
    np.testing.assert_allclose(np.asarray(got), np.stack([np.asarray(ops.rms_norm(xs[i], w)) for i in range(3)]),
                               rtol=1e-6, atol=1e-6)
    r = jax.device_put(_rand(6, 64, seed=2), gpu)
    ex, er = (np.asarray(v) for v in ops.fused_add_rms_norm(*jax.device_put((x, r, w), jax.devices("cpu")[0])))
    px = x.unsafe_buffer_pointer()
    nx, nr = jax.jit(lambda x, r, w: ops.fused_add_rms_norm(x, r, w), donate_argnums=(0, 1))(x, r, w)
    assert nx.unsafe_buffer_pointer() == px and x.is_deleted()
    np.testing.assert_allclose(np.asarray(nx), ex, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(nr), er, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sync", ["0", "1"], ids=["async", "sync-checks"])
def test_cuda_content_error_surfaces_as_on_cpu(sync: str, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = _gpu()
    monkeypatch.setenv("OPBRIDGE_CUDA_SYNC_CHECKS", sync)
    with jax.enable_x64(True):
        q, cache = _rand(2, 8), _rand(4, 8, seed=1)
        bad = jnp.asarray([0, 9], jnp.int64)  # position 9 is beyond the 4-row cache

        def rope(p: Any, q: Any, c: Any) -> Any:
            return ops.rotary_embedding(p, q, None, 8, c, True)[0]

        f = jax.jit(rope)
        for width in (jnp.int64, jnp.int32):  # torch's and vLLM's positions; JAX's without x64
            good = jnp.asarray([0, 3], width)
            on_cpu = jax.device_put((good, q, cache), jax.devices("cpu")[0])
            np.testing.assert_allclose(np.asarray(f(*jax.device_put((good, q, cache), gpu))),
                                       np.asarray(f(*on_cpu)), rtol=1e-5, atol=1e-6)
        # JAX raises the kernel's error as JaxRuntimeError, or as ValueError from its C++ dispatch fast path
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match="rotary_embedding: positions"):
            f(*jax.device_put((bad, q, cache), jax.devices("cpu")[0])).block_until_ready()
        args = jax.device_put((bad, q, cache), gpu)
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match="rotary_embedding: positions"):
            f(*args).block_until_ready()
            f(*args).block_until_ready()  # without sync checks: raised by the next call


# -- large eager outputs from opbridge's pool (issue 21) ------------------------------------------


@pytest.mark.parametrize("name", ["add", "rms_norm", "silu_and_mul"])
def test_large_eager_outputs_come_from_the_pool(name: str) -> None:
    """Eager calls with 4 MiB+ CPU outputs: the kernel writes a pool buffer that JAX takes without a copy.

    Aligned to 2 MiB, recycled once freed, and equal to the jitted call (which
    XLA allocates for, as under any user's jax.jit).
    """
    from opbridge.call import memory

    x = jnp.asarray(np.random.default_rng(0).standard_normal((1024, 2048)).astype(np.float32))
    w = jnp.ones(2048, jnp.float32)
    args = {"add": (x, x), "rms_norm": (x, w), "silu_and_mul": (jnp.concatenate([x, x], axis=1),)}[name]
    fn = getattr(ops, name)
    fn(*args)
    first = fn(*args)
    p = first.unsafe_buffer_pointer()
    assert p % (2 << 20) == 0
    expected = np.asarray(jax.jit(fn)(*args))
    np.testing.assert_array_equal(np.asarray(first), expected)
    reused = memory.host_stats()["reused"]  # type: ignore[index]
    del first
    second = fn(*args)
    assert second.unsafe_buffer_pointer() == p
    assert memory.host_stats()["reused"] == reused + 1  # type: ignore[index]
    np.testing.assert_array_equal(np.asarray(second), expected)


def test_only_small_avals_take_the_unchecked_route_and_their_memory_is_bounded(monkeypatch: Any) -> None:
    """The generated call skips the pool test for avals the checked path saw small, and only those."""
    from opbridge.adapters import jax as adapter

    jop = adapter._jop(ops.LIBRARY.ops["add"])
    jop.small_avals.clear()
    small, large = jnp.ones((8, 4), jnp.float32), jnp.ones((1024, 2048), jnp.float32)
    ops.add(small, small)
    ops.add(large, large)
    assert small.aval in jop.small_avals and large.aval not in jop.small_avals
    np.testing.assert_array_equal(np.asarray(ops.add(small, small)), 2 * np.ones((8, 4), np.float32))
    monkeypatch.setattr(adapter, "MAX_SMALL_AVALS", 16)
    for n in range(1, 40):  # shapes that change every call
        ops.add(jnp.ones((n,), jnp.float32), jnp.ones((n,), jnp.float32))
    assert 0 < len(jop.small_avals) <= 16


def test_large_eager_calls_keep_grad_and_dtype_errors() -> None:
    x = jnp.ones((1024, 2048), jnp.float32)
    g = jax.grad(lambda a: ops.gelu(a).sum())(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(jax.grad(lambda a: jax.nn.gelu(a).sum())(x)),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match=r"add: x must have dtype"):
        ops.add(jnp.ones((1024, 2048), jnp.int8), jnp.ones((1024, 2048), jnp.int8))


# -- out=: the result in the caller's (donated) buffer --------------------------------------------


def test_out_eager_donates_the_buffer_and_returns_the_result_in_it() -> None:
    x = jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4)
    o = jnp.zeros((3, 4), jnp.float32)
    p = o.unsafe_buffer_pointer()
    y = ops.add(x, x, out=o)
    np.testing.assert_array_equal(np.asarray(y), 2 * np.asarray(x))
    assert y.unsafe_buffer_pointer() == p and o.is_deleted()


def test_an_eager_out_that_is_also_an_input_is_kept() -> None:
    """XLA cannot donate a buffer the same call reads ("Attempt to donate a buffer which is also used"):
    such an out, or one given twice, is not donated, and the call returns a new array."""
    x = jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4)
    y = jnp.ones((3, 4), jnp.float32)
    np.testing.assert_array_equal(np.asarray(ops.add(x, x, out=x)), 2 * np.arange(12.0).reshape(3, 4))
    np.testing.assert_array_equal(np.asarray(ops.add(x, y, out=y)), np.arange(12.0).reshape(3, 4) + 1)
    assert not x.is_deleted() and not y.is_deleted()
    g, w = jnp.ones((4, 8), jnp.float32), jnp.ones(8, jnp.float32)
    d = jnp.zeros((4, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"rms_norm_backward: out\[1\] has shape \(4, 8\)"):
        ops.rms_norm_backward(g, g, w, out=(d, d))


@pytest.mark.parametrize("donate", [True, False])
def test_out_under_jit(donate: bool) -> None:
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32))
    w = jnp.ones(32, jnp.float32)
    f = jax.jit(lambda a, b, o: ops.rms_norm(a, b, out=o), donate_argnums=(2,) if donate else ())
    o = jnp.zeros_like(x)
    p = o.unsafe_buffer_pointer()
    y = f(x, w, o)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ops.rms_norm(x, w)), rtol=1e-6)
    if donate:  # XLA wrote the result where o was
        assert y.unsafe_buffer_pointer() == p and o.is_deleted()
    else:  # XLA copied o first: o is intact
        assert not o.is_deleted() and float(jnp.abs(o).max()) == 0.0


def test_out_with_a_shape_rule_and_errors() -> None:
    x = jnp.ones((4, 16), jnp.float32)
    y = ops.silu_and_mul(x, out=jnp.zeros((4, 8), jnp.float32))
    np.testing.assert_allclose(np.asarray(y), np.asarray(ops.silu_and_mul(x)), rtol=1e-6)
    with pytest.raises(ValueError, match=r"silu_and_mul: out has shape \(4, 16\) and dtype float32, but the "
                                         r"output has shape \(4, 8\)"):
        ops.silu_and_mul(x, out=jnp.zeros((4, 16), jnp.float32))
    with pytest.raises(TypeError, match=r"add: out\[0\] must be an array of the same framework"):
        ops.add(x, x, out=np.zeros((4, 16), np.float32))


def test_large_out_under_jit_needs_no_fresh_memory() -> None:
    """The point of out= under jax.jit: a donated output buffer is reused, so no page faults per call."""
    import resource

    x = jnp.ones((1024, 2048), jnp.float32)
    f = jax.jit(lambda a, o: ops.add(a, a, out=o), donate_argnums=1)
    z = f(x, jnp.zeros_like(x))
    z = f(x, z).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        z = f(x, z).block_until_ready()
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3 < 50
    assert float(z[0, 0]) == 2.0


def test_seen_eager_calls_skip_the_type_lookup() -> None:
    """A call on concrete arrays of a seen signature runs the jitted executable from the op's public callable
    (the adapter's prelude), without the dispatch table; anything else still takes the table."""
    x = jnp.arange(8, dtype=jnp.float32)
    ops.add(x, x)  # the first call resolves the adapter, installs the prelude and records the signature
    table = ops.add.__globals__["_table"]
    saved = table[type(x)]

    def refuse(*args: Any) -> Any:
        raise AssertionError("the dispatch table was consulted")

    table[type(x)] = refuse
    try:
        np.testing.assert_array_equal(np.asarray(ops.add(x, x)), 2 * np.arange(8, dtype=np.float32))
        with pytest.raises(AssertionError, match="dispatch table"):
            ops.add(jnp.arange(5, dtype=jnp.float32), jnp.arange(5, dtype=jnp.float32))  # a new shape: the table
    finally:
        table[type(x)] = saved
    assert "jax" in ops.add.opdef.preludes
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: ops.add(a, a))(x)), 2 * np.asarray(x))


# -- the variant cache is bounded ---------------------------------------------------------------------


def test_variants_are_bounded_and_a_forgotten_one_is_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A static argument that changes every call (an eps schedule) must not keep an executable per value."""
    import gc
    import threading
    import weakref

    monkeypatch.setattr(jax_adapter, "MAX_VARIANTS", 4)
    jop = jax_adapter._jop(ops.LIBRARY.ops["rms_norm"])
    x, w = _rand(4, 8), jnp.ones(8, jnp.float32)
    ops.rms_norm(x, w, 0.5)
    jax.grad(lambda a: ops.rms_norm(a, w, 0.5).sum())(x)  # the traced backward must not pin it either
    first = weakref.ref(next(v for k, v in jop.variants.items() if k[0][0][0] == 0.5))

    def run(eps: list[float]) -> None:
        for e in eps:
            got = np.asarray(ops.rms_norm(x, w, e))
            xf = np.asarray(x, np.float64)
            np.testing.assert_allclose(got, xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + e), rtol=1e-5)

    errors: list[BaseException] = []

    def worker(eps: list[float]) -> None:
        try:
            run(eps)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=([0.01 * (t * 10 + i + 1) for i in range(10)],))
               for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    run([0.7, 0.8])
    gc.collect()
    assert len(jop.variants) <= 4 and len(jop.fast) <= 4 * 4
    assert first() is None


def test_out_inside_grad_names_the_op_not_its_target() -> None:
    x, w = _rand(3, 8), jnp.ones(8, jnp.float32)
    for diff in (lambda f: jax.grad(lambda a: jnp.sum(f(a)))(x), lambda f: jax.jvp(f, (x,), (x,))):
        with pytest.raises(NotImplementedError, match=r"rms_norm: out= is not differentiable.*without out="):
            diff(lambda a: ops.rms_norm(a, w, out=jnp.zeros((3, 8), jnp.float32)))
    # out= of a value that is not differentiated still works inside grad
    g = jax.grad(lambda b: jnp.sum(ops.rms_norm(x, jnp.ones(8), out=jnp.zeros((3, 8))) * b))(2.0)
    np.testing.assert_allclose(float(g), float(jnp.sum(ops.rms_norm(x, jnp.ones(8)))), rtol=1e-5)


def test_advance_step_runs_without_x64() -> None:
    """JAX without x64 makes token ids, positions and slots int32; the kernels take them as they are
    and advance as vLLM's int64 step does."""
    if jax.config.jax_enable_x64:
        pytest.skip("x64 is on in this process")
    rng = np.random.default_rng(0)
    n, q, bs, width = 6, 4, 16, 4
    state = {"input_tokens": np.full(n, 555), "sampled_token_ids": rng.integers(0, 32000, (q, 1)),
             "input_positions": np.full(n, 777), "seq_lens": rng.integers(0, bs * width, n).astype(np.int32),
             "slot_mapping": np.full(n, 999), "block_tables": rng.integers(0, 5000, (n, width)).astype(np.int32)}
    want = {k: v.copy() for k, v in state.items()}
    ops.advance_step_flashattn.reference(n, q, bs, *want.values())  # int64, as vLLM's
    mutated = ["input_tokens", "input_positions", "seq_lens", "slot_mapping"]
    args = [jnp.asarray(v) for v in state.values()]
    assert args[0].dtype == jnp.int32
    for call in (ops.advance_step_flashattn, jax.jit(ops.advance_step_flashattn, static_argnums=(0, 1, 2))):
        got = call(n, q, bs, *args)
        for name, g in zip(mutated, got, strict=True):
            assert g.dtype == jnp.int32, name
            np.testing.assert_array_equal(np.asarray(g), want[name], err_msg=name)
    bad = [*args[:3], args[3].at[1].set(-1), *args[4:]]
    with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match=r"seq_lens must be >= 0, got seq_lens\[1\]"):
        jax.block_until_ready(ops.advance_step_flashattn(n, q, bs, *bad))


def test_rotary_embedding_takes_int32_positions_without_x64() -> None:
    """JAX without x64 (its default) makes positions int32; the kernels take them as they are."""
    if jax.config.jax_enable_x64:
        pytest.skip("x64 is on in this process")
    rng = np.random.default_rng(0)
    pos = rng.integers(0, 16, size=(2, 5))
    q, k, cache = rng.standard_normal((2, 5, 32)), rng.standard_normal((2, 5, 16)), rng.standard_normal((16, 6))
    want = [np.asarray(t, np.float32).copy() for t in (q, k)]
    ops.rotary_embedding.reference(pos, want[0], want[1], 8, cache.astype(np.float32), False)
    jx = [jnp.asarray(a, jnp.float32) for a in (q, k, cache)]
    assert jnp.asarray(pos).dtype == jnp.int32
    for call in (ops.rotary_embedding, jax.jit(ops.rotary_embedding, static_argnums=(3, 5))):
        got = call(jnp.asarray(pos), jx[0], jx[1], 8, jx[2], False)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5)
    with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match=r"positions\[1, 2\] = 16"):
        bad = pos.copy()
        bad[1, 2] = 16
        jax.jit(ops.rotary_embedding, static_argnums=(3, 5))(jnp.asarray(bad), *jx[:2], 8, jx[2], False)[0] \
            .block_until_ready()


def test_a_64_bit_dtype_error_without_x64_says_how_to_enable_it(extra: opbridge.Library) -> None:
    from opbridge.adapters.jax.variant import _with_x64_hint

    if jax.config.jax_enable_x64:
        pytest.skip("x64 is on in this process")
    negate64 = extra.ops["negate64"].call
    x = jnp.asarray(np.ones(2))  # what JAX makes of a float64 array without x64: float32
    for call in (negate64, jax.jit(negate64)):
        with pytest.raises(TypeError, match=r"x must have dtype float64, got float32.*\(JAX makes 64-bit "
                                            r'arrays 32-bit unless x64 is on: jax.config.update\("jax_enable_x64", '
                                            r"True\)"):
            call(x)
    with pytest.raises(TypeError) as narrowed:
        negate64(x)
    assert "convert it first" not in str(narrowed.value)  # astype("float64") would be narrowed again
    assert _with_x64_hint("negate: x must have dtype float32 or float64, got float32") is None  # not narrowed
    assert _with_x64_hint("add: x must have dtype float32 or bfloat16, got int32 (the dtypes add declares)") is None
    assert "jax_enable_x64" in (_with_x64_hint("negate: x must have dtype float64, got float32") or "")
