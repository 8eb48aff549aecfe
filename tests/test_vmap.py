"""Batching from the declaration (``Library.op(rows=...)``, :mod:`opbridge.call.batching`).

A batch over an op's declared rows alone runs its kernel once, with the batch as one more leading
dim; any other batch runs it once per element. Both must give what a Python loop over the batch
gives, in JAX (``jax.vmap``) and torch (``torch.func.vmap``), and the tests check which of the two
ways ran (the jaxpr, the calls torch dispatches), so a rule that always loops fails them.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np
import pytest

import opbridge
from opbridge import ops
from opbridge.call import batching
from opbridge.errors import DeclarationError
from opbridge.testing import check_op

_B, _R, _H = 4, 3, 16


def _rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------
# the declaration and the plan
# ---------------------------------------------------------------------------


def test_builtin_rows_are_declared_where_rows_are_independent() -> None:
    rows = {n: tuple(op.schema.arguments[i].name for i in op.rows) for n, op in ops.LIBRARY.ops.items()}
    assert rows["rms_norm"] == ("x",)
    assert rows["add"] == ("x", "y")
    assert rows["fused_add_rms_norm"] == ("input", "residual")
    assert rows["silu_and_mul_backward"] == ("grad", "x")
    assert rows["rms_norm_backward"] == ()  # its weight gradient sums over every row


def test_one_call_plan() -> None:
    op = ops.LIBRARY.ops["rms_norm"]
    assert batching.one_call(op, [0], [0, 1]) == ()  # x batched: one call, nothing to broadcast
    assert batching.one_call(op, [1], [0, 1]) is None  # the weight batched: once per element
    assert batching.one_call(op, [0, 1], [0, 1]) is None
    add = ops.LIBRARY.ops["add"]
    assert batching.one_call(add, [0], [0, 1]) == (1,)  # y broadcast along the batch
    assert batching.one_call(ops.LIBRARY.ops["rms_norm_backward"], [0, 1], [0, 1, 2]) is None


def test_rows_declaration_errors() -> None:
    lib = opbridge.Library("vmap_decl_t", sources=())
    with pytest.raises(DeclarationError, match="rows names 'eps', which is not one of its Tensor"):
        lib.op("f(Tensor x, float eps) -> Tensor", shape=opbridge.like("x"), rows=("eps",))(lambda x, eps: x)
    with pytest.raises(DeclarationError, match="rows takes argument names"):
        lib.op("g(Tensor x) -> Tensor", shape=opbridge.like("x"), rows="x")(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(DeclarationError, match=r"an argument the op writes \('cache'\) must be one of them"):
        lib.op("h(Tensor(a!) x, Tensor(b!) cache) -> ()", rows=("x",))(lambda x, cache: None)
    lib.op("k(Tensor x, Tensor w) -> Tensor", shape=opbridge.like("x"), rows=("x",))(lambda x, w: x)
    assert lib.ops["k"].rows == (0,)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_check_op_checks_the_rows_declaration(framework: str) -> None:
    if framework == "torch":
        pytest.importorskip("torch")
    quick = {"framework": framework, "dtypes": ["float32"], "check_grad": False, "check_opcheck": False,
             "check_compile": False, "check_gradcheck": False}
    assert check_op(ops.fused_add_rms_norm, **quick).checks["rows"] == 1
    # rms_norm_backward's weight gradient sums over rows: declared rows, a batch of two sums both
    op = ops.LIBRARY.ops["rms_norm_backward"]
    false = dataclasses.replace(op, rows=(0, 1))
    false.call = op.call
    with pytest.raises(AssertionError, match=r"rows check failed(.|\n)*output 1\[0\] of the batch vs element 0 alone"):
        check_op(false, **quick)


# ---------------------------------------------------------------------------
# JAX
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jx() -> Any:
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax_tvm_ffi")
    return jax


def _ffi_shapes(jaxpr: Any) -> list[tuple[str, tuple[tuple[int, ...], ...], bool]]:
    """(target, operand shapes, inside a loop) of every custom call in *jaxpr*, nested jaxprs included."""
    import jax.extend.core as jcore

    found = []

    def walk(j: Any, looped: bool) -> None:
        for eqn in j.eqns:
            if eqn.primitive.name == "ffi_call":
                found.append((eqn.params["target_name"], tuple(tuple(v.aval.shape) for v in eqn.invars), looped))
            for p in eqn.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    inner = getattr(sub, "jaxpr", sub)
                    if isinstance(inner, jcore.Jaxpr):
                        walk(inner, looped or eqn.primitive.name in ("scan", "while"))

    walk(jaxpr.jaxpr, False)
    return found


def test_jax_vmap_over_rows_is_one_call(jx: Any) -> None:
    import jax.numpy as jnp

    x, w = jnp.asarray(_rand(_B, _R, _H)), jnp.asarray(_rand(_H, seed=1))
    f = jx.vmap(lambda a: ops.rms_norm(a, w, 1e-6))
    assert _ffi_shapes(jx.make_jaxpr(f)(x)) == [("opbridge.opbridge.rms_norm", ((_B, _R, _H), (_H,)), False)]
    np.testing.assert_array_equal(np.asarray(jx.jit(f)(x)), np.stack([np.asarray(ops.rms_norm(a, w, 1e-6)) for a in x]))
    # the batch on another axis, and a row argument the batch leaves out (broadcast along it)
    g = jx.vmap(lambda a: ops.rms_norm(a, w, 1e-6), in_axes=1)
    np.testing.assert_array_equal(np.asarray(g(x)), np.stack([np.asarray(ops.rms_norm(x[:, i], w, 1e-6))
                                                              for i in range(_R)]))
    y = jnp.asarray(_rand(_R, _H, seed=2))
    h = jx.vmap(lambda a: ops.add(a, y))
    assert _ffi_shapes(jx.make_jaxpr(h)(x)) == [("opbridge.opbridge.add", ((_B, _R, _H), (_B, _R, _H)), False)]
    np.testing.assert_array_equal(np.asarray(h(x)), np.asarray(x) + np.asarray(y))
    # nested: two batch dims, still one call
    nested = jx.vmap(jx.vmap(lambda a: ops.rms_norm(a, w, 1e-6)))
    assert [s for _, s, _ in _ffi_shapes(jx.make_jaxpr(nested)(x))] == [((_B, _R, _H), (_H,))]
    np.testing.assert_array_equal(np.asarray(nested(x)), np.asarray(f(x)))


def test_jax_vmap_over_a_shared_argument_runs_per_element(jx: Any) -> None:
    import jax.numpy as jnp

    x, ws = jnp.asarray(_rand(_B, _R, _H)), jnp.asarray(_rand(_B, _H, seed=1))
    f = jx.vmap(lambda a, w: ops.rms_norm(a, w, 1e-6))
    assert _ffi_shapes(jx.make_jaxpr(f)(x, ws)) == [("opbridge.opbridge.rms_norm", ((_R, _H), (_H,)), True)]
    np.testing.assert_array_equal(np.asarray(f(x, ws)), np.stack([np.asarray(ops.rms_norm(a, w, 1e-6))
                                                                  for a, w in zip(x, ws, strict=True)]))


def test_jax_vmap_with_grad_and_mutating_ops(jx: Any) -> None:
    import jax.numpy as jnp

    x, w = jnp.asarray(_rand(_B, _R, _H)), jnp.asarray(_rand(_H, seed=1))
    f = lambda a: ops.rms_norm(a, w, 1e-6)  # noqa: E731
    by_vmap = jx.grad(lambda a: (jx.vmap(f)(a) ** 2).sum())(x)
    by_loop = jx.grad(lambda a: sum((f(a[i]) ** 2).sum() for i in range(_B)))(x)
    np.testing.assert_allclose(np.asarray(by_vmap), np.asarray(by_loop), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(jx.vmap(jx.grad(lambda a: (f(a) ** 2).sum()))(x)), np.asarray(by_loop),
                               rtol=1e-6, atol=1e-6)
    r = jnp.asarray(_rand(_B, _R, _H, seed=3))
    g = jx.vmap(lambda a, b: ops.fused_add_rms_norm(a, b, w, 1e-6))
    assert [s for _, s, _ in _ffi_shapes(jx.make_jaxpr(g)(x, r))] == [((_B, _R, _H), (_B, _R, _H), (_H,))]
    got = g(x, r)
    for i in range(_B):
        want = ops.fused_add_rms_norm(x[i], r[i], w, 1e-6)
        for k in range(2):
            np.testing.assert_array_equal(np.asarray(got[k][i]), np.asarray(want[k]))


# ---------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def th() -> Any:
    return pytest.importorskip("torch")


def _dispatched(th: Any, fn: Any, *args: Any) -> list[tuple[str, list[tuple[int, ...]]]]:
    """The opbridge ops *fn* dispatches below torch's batching, with their tensor arguments' shapes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: list[tuple[str, list[tuple[int, ...]]]] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.namespace == "opbridge":
                calls.append((func.__name__, [tuple(a.shape) for a in args if isinstance(a, th.Tensor)]))
            return func(*args, **(kwargs or {}))

    with Count():
        fn(*args)
    return calls


def test_torch_vmap_over_rows_is_one_call(th: Any) -> None:
    th.manual_seed(0)
    x, w, y = th.randn(_B, _R, _H), th.rand(_H), th.randn(_R, _H)
    f = th.func.vmap(lambda a: ops.rms_norm(a, w, 1e-6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's fallback warns ("a performance drop")
        assert _dispatched(th, f, x) == [("rms_norm.default", [(_B, _R, _H), (_H,)])]
        th.testing.assert_close(f(x), th.stack([ops.rms_norm(a, w, 1e-6) for a in x]), rtol=0, atol=0)
        g = th.func.vmap(lambda a: th.ops.opbridge.rms_norm(a, w, 1e-6), in_dims=1)
        th.testing.assert_close(g(x), th.stack([ops.rms_norm(x[:, i], w, 1e-6) for i in range(_R)]), rtol=0, atol=0)
        h = th.func.vmap(lambda a: ops.add(a, y))
        assert _dispatched(th, h, x) == [("add.default", [(_B, _R, _H), (_B, _R, _H)])]
        th.testing.assert_close(h(x), x + y, rtol=0, atol=0)
        # a shared argument batched: once per element, still no fallback warning
        ws = th.rand(_B, _H)
        k = th.func.vmap(lambda a, b: ops.rms_norm(a, b, 1e-6))
        assert [s for _, s in _dispatched(th, k, x, ws)] == [[(_R, _H), (_H,)]] * _B
        th.testing.assert_close(k(x, ws), th.stack([ops.rms_norm(a, b, 1e-6) for a, b in zip(x, ws, strict=True)]),
                                rtol=0, atol=0)
        # two outputs, once per element, stacked
        gx, gw = th.func.vmap(lambda g, a: ops.rms_norm_backward(g, a, w, 1e-6))(x, x)
        for i in range(_B):
            ex, ew = ops.rms_norm_backward(x[i], x[i], w, 1e-6)
            th.testing.assert_close(gx[i], ex, rtol=0, atol=0)
            th.testing.assert_close(gw[i], ew, rtol=0, atol=0)


def test_torch_vmap_autograd_and_mutating_ops(th: Any) -> None:
    th.manual_seed(1)
    x, w = th.randn(_B, _R, _H, requires_grad=True), th.rand(_H)
    (th.func.vmap(lambda a: ops.rms_norm(a, w, 1e-6))(x) ** 2).sum().backward()
    by_vmap, x.grad = x.grad, None
    sum((ops.rms_norm(a, w, 1e-6) ** 2).sum() for a in x).backward()
    th.testing.assert_close(by_vmap, x.grad)

    inp, res = th.randn(_R, _B, _H), th.randn(_R, _B, _H)
    want_inp, want_res = inp.clone(), res.clone()
    th.func.vmap(lambda a, b: (ops.fused_add_rms_norm(a, b, w, 1e-6), a)[1], in_dims=1)(inp, res)
    for i in range(_B):
        ops.fused_add_rms_norm(want_inp[:, i], want_res[:, i], w, 1e-6)
    th.testing.assert_close(inp, want_inp, rtol=0, atol=0)
    th.testing.assert_close(res, want_res, rtol=0, atol=0)

    fixed = th.randn(_R, _H)
    before = fixed.clone()
    with pytest.raises(RuntimeError, match="fused_add_rms_norm: vmap: the op writes 'input' in place"):
        th.func.vmap(lambda b: (ops.fused_add_rms_norm(fixed, b, w, 1e-6), b)[1])(res)
    assert th.equal(fixed, before)
