"""The MindSpore adapter: PyNative through DLPack, gradients, graph mode (ops.Custom aot), bad input.

MindSpore 2.10 needs numpy<2 and cannot share a process with paddle, so this
file runs in its own environment::

    OPBRIDGE_CACHE_DIR=/tmp/opbcache-ms /tmp/msenv/bin/python -m pytest tests/test_mindspore_adapter.py
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from opbridge.testing.harness_mindspore import HARNESS

if HARNESS.skip_reason() is not None:
    pytest.skip(HARNESS.skip_reason(), allow_module_level=True)

ms = pytest.importorskip("mindspore")

import tvm_ffi  # noqa: E402
from mindspore import Tensor, nn  # noqa: E402
from mindspore.graph.api import _pynative_executor  # noqa: E402

import opbridge  # noqa: E402
from _hugepages import faults_per_call  # noqa: E402
from _split_sum import SPLIT_SUM_CC, declare_split_sum  # noqa: E402
from opbridge import ops  # noqa: E402
from opbridge.adapters import mindspore as adapter  # noqa: E402
from opbridge.adapters.mindspore import aot, shim  # noqa: E402
from opbridge.build import jit as opb_jit  # noqa: E402
from opbridge.call import core  # noqa: E402
from opbridge.ops import gelu as gelu_alias  # noqa: E402
from opbridge.testing import assert_close, make_cases  # noqa: E402
from opbridge.testing.matrix import NONCONTIGUOUS  # noqa: E402

OPS = list(ops.LIBRARY.ops.values())
GRAD_OPS = [op for op in OPS if op.backward is not None]
_NS = itertools.count()

TOY_CC = """
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;

// scale_(Tensor(a!) x, Tensor other, float alpha): x = x * alpha + other
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

// twice(Tensor x) -> Tensor, no backward declared
void twice_cpu(TensorView out, TensorView x) {
  OPB_CHECK_DTYPE("twice", x, opbridge::kFloat32);
  const float* a = static_cast<const float*>(x.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = 2 * a[i];
}
OPBRIDGE_EXPORT(twice_cpu);

// affine(Tensor x, float alpha, *, int k=1, bool negate=False) -> Tensor: (+-) alpha * k * x
template <typename T>
void affine_loop(TensorView out, TensorView x, double c) {
  const T* a = static_cast<const T*>(x.data_ptr());
  T* o = static_cast<T*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = T(c * double(a[i]));
}
void affine_cpu(TensorView out, TensorView x, double alpha, int64_t k, bool negate) {
  OPB_CHECK_DTYPE("affine", x, opbridge::kFloat32, opbridge::kFloat64);
  OPB_CHECK_SAME_DTYPE("affine", out, x);
  OPB_CHECK(k > 0, ValueError) << "affine: k must be > 0, got " << k;
  const double c = (negate ? -alpha : alpha) * double(k);
  if (x.dtype() == opbridge::kFloat64) {
    affine_loop<double>(out, x, c);
  } else {
    affine_loop<float>(out, x, c);
  }
}
OPBRIDGE_EXPORT(affine_cpu);

""" + SPLIT_SUM_CC


@pytest.fixture(autouse=True, scope="module")
def _compile_failure_dumps(mindspore_om_path: None) -> None:
    """MindSpore's compile-failure dumps go to a temporary directory (conftest's ``mindspore_om_path``)."""


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> opbridge.Library:
    """A throwaway library: a mutating op, an op without backward, scalar-argument and 2-output ops."""
    root: Path = tmp_path_factory.mktemp("mstoy")
    (root / "toy.cc").write_text(TOY_CC)
    lib = opbridge.Library(f"opb_ms_test_{next(_NS)}", sources=["toy.cc"], root=root)

    @lib.op("scale_(Tensor(a!) x, Tensor other, float alpha) -> ()")
    def scale_(x: Any, other: Any, alpha: float) -> None:
        x *= alpha
        x += other

    @lib.op("twice(Tensor x) -> Tensor", shape=opbridge.like("x"))
    def twice(x: Any) -> Any:
        return 2 * x

    @lib.op("affine(Tensor x, float alpha, *, int k=1, bool negate=False) -> Tensor",
            shape=opbridge.like("x"), dtypes=("float32", "float64"),
            backward=lambda grad, x, alpha, k, negate: (affine(grad, alpha, k=k, negate=negate),))
    def affine(x: Any, alpha: float, *, k: int = 1, negate: bool = False) -> Any:
        return (-alpha if negate else alpha) * k * x

    declare_split_sum(lib)

    adapter.register(lib)  # declared after the adapter was imported: make it known to graphs
    return lib


def _t(a: Any, dtype: Any = np.float32) -> Tensor:
    return Tensor(np.asarray(a, dtype))


def _args(op: opbridge.OpDef, case: dict[str, Any], dtype: str) -> list[Any]:
    return [HARNESS.from_numpy(case[a.name], dtype if case[a.name].dtype.kind == "f" else None)
            if isinstance(case[a.name], np.ndarray) else case[a.name] for a in op.schema.arguments]


def _cases(op: opbridge.OpDef, dtype: str) -> list[dict[str, Any]]:
    return [c for c in make_cases(op, dtype, seed=11) if not c.get(NONCONTIGUOUS)]


def _np(x: Any) -> np.ndarray:
    return HARNESS.to_numpy(x)


def _is_array(x: Any) -> bool:
    return isinstance(x, Tensor)


def _reference(op: opbridge.OpDef, args: list[Any]) -> list[Any]:
    """The reference's mutated arguments (on float64 copies), then its outputs."""
    ref = [(_np(a).astype(np.float64) if _np(a).dtype.kind == "f" else _np(a).copy()) if _is_array(a) else a
           for a in args]
    out = op.reference(*ref)
    outs = [] if out is None else list(out) if isinstance(out, tuple) else [out]
    return [ref[i] for i, a in enumerate(op.schema.arguments) if a.is_mutated] + outs


def _observed(op: opbridge.OpDef, args: list[Any], out: Any) -> list[Any]:
    """The op's mutated arguments (read after the call), then its outputs."""
    outs = [] if out is None else list(out) if isinstance(out, tuple) else [out]
    return [args[i] for i, a in enumerate(op.schema.arguments) if a.is_mutated] + outs


def _outs(out: Any) -> list[Any]:
    return list(out) if isinstance(out, tuple) else [out]


@pytest.fixture
def graph_mode() -> Iterator[None]:
    """Run the test in ``GRAPH_MODE``, restoring the previous mode afterwards."""
    old = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        yield
    finally:
        ms.set_context(mode=old)


# ---------------------------------------------------------------------------
# PyNative forward
# ---------------------------------------------------------------------------


DECLARED = [(op, d) for op in OPS for d in op.dtypes if d in HARNESS.dtypes]


@pytest.mark.parametrize(("op", "dtype"), DECLARED, ids=[f"{op.name}-{d}" for op, d in DECLARED])
def test_forward_matches_reference(op: opbridge.OpDef, dtype: str) -> None:
    """Outputs, and arguments the op mutates in place, against the NumPy reference."""
    rtol, atol = op.tolerance(dtype)
    for case in _cases(op, dtype):
        args = _args(op, case, dtype)
        want = _reference(op, args)
        out = op.call(*args)
        assert len(_outs(out) if op.n_outputs else []) == op.n_outputs
        got = _observed(op, args, out)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            if g is None and w is None:  # an optional argument left out
                continue
            assert type(g) is Tensor, f"{op.name} must give mindspore.Tensor, got {type(g)}"
            assert_close(_np(g), w, rtol=rtol, atol=atol, name=f"mindspore {op.name} {dtype}")


def test_outputs_are_mindspore_tensors_in_the_kernels_memory() -> None:
    x, y = _t(np.arange(6).reshape(2, 3)), _t(np.ones((2, 3)))
    out = ops.add(x, y)
    assert type(out) is Tensor and out.shape == (2, 3) and out.dtype == ms.float32
    # The kernel wrote into the tensor's own buffer: the DLPack view of it is the same memory.
    assert tvm_ffi.from_dlpack(out.to_dlpack()).data_ptr() == out.data_ptr()
    # ... and MindSpore's own ops consume the result.
    np.testing.assert_array_equal(ms.ops.mul(out, 2).asnumpy(), (np.arange(6).reshape(2, 3) + 1) * 2)
    bf = ops.gelu(x.astype(ms.bfloat16))
    assert bf.dtype == ms.bfloat16
    assert tvm_ffi.from_dlpack(bf.to_dlpack()).data_ptr() == bf.data_ptr()


@pytest.mark.parametrize("name", ["add", "rms_norm"])
def test_eager_call_waits_once_and_hands_the_kernel_the_inputs_memory(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 21: no copy, no DLPack export, no ``asnumpy`` and one pipeline wait on the PyNative path.

    The kernel sees the inputs' own addresses and writes the returned tensor's
    memory; MindSpore's ``to_dlpack`` / ``asnumpy`` (copies or per-tensor
    waits) are never called.
    """
    from opbridge import loader
    from opbridge.adapters.mindspore import eager

    op = getattr(ops, name).opdef
    seen: list[list[int]] = []
    real = loader.kernel(op, "cpu")

    def recording(*args: Any) -> Any:
        seen.append([a.ctypes.data for a in args if isinstance(a, np.ndarray)])
        return real(*args)

    waits: list[None] = []
    monkeypatch.setattr(loader, "kernel", lambda o, device: recording if o is op else real)
    monkeypatch.setattr(eager, "sync", lambda: waits.append(None))
    for method in ("to_dlpack", "asnumpy"):
        def refuse(self: Any, *a: Any, _m: str = method, **k: Any) -> Any:
            raise AssertionError(f"the eager path called Tensor.{_m}")
        monkeypatch.setattr(Tensor, method, refuse)
    fn = eager.make_eager(op)
    x = _t(np.random.default_rng(0).standard_normal((64, 256)))
    args = (x, _t(np.ones((64, 256)))) if name == "add" else (x, _t(np.ones(256)), 1e-6)
    out = fn(*args)
    assert len(waits) == 1 and len(seen) == 1
    assert seen[0] == [out.data_ptr(), *(a.data_ptr() for a in args if isinstance(a, Tensor))]


def test_bfloat16_outputs_are_shared_numpy_buffers_not_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 21: a bfloat16 output is an ``ml_dtypes`` buffer MindSpore shares as it is.

    ``Tensor.view(bfloat16)`` of a uint16 buffer (the path without ml_dtypes)
    runs as a MindSpore op costing 0.6-0.9 ms at (1024, 4096), which made
    bfloat16 calls 2-6x the NumPy path; with ml_dtypes it is never called.
    """
    pytest.importorskip("ml_dtypes")
    from opbridge.adapters.mindspore import views

    def refuse(self: Any, *a: Any, **k: Any) -> Any:
        raise AssertionError("the bfloat16 output went through Tensor.view")

    monkeypatch.setattr(Tensor, "view", refuse)
    out, arg = views.alloc((4, 8), ms.bfloat16)
    assert out.dtype == ms.bfloat16 and out.data_ptr() == arg.data_ptr()
    x = _t(np.arange(32).reshape(4, 8) / 8).astype(ms.bfloat16)
    got = ops.add(x, x)
    assert got.dtype == ms.bfloat16
    np.testing.assert_array_equal(_np(got), np.arange(32).reshape(4, 8) / 4)


def test_bfloat16_outputs_without_ml_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ml_dtypes a bfloat16 output is a relabelled uint16 buffer: slower, the same values."""
    from opbridge.adapters.mindspore import views

    monkeypatch.setattr(views, "_numpy_bfloat16", lambda: None)
    out, arg = views.alloc((4, 8), ms.bfloat16)
    assert out.dtype == ms.bfloat16 and out.data_ptr() == arg.data_ptr()
    x = _t(np.arange(32).reshape(4, 8) / 8).astype(ms.bfloat16)
    np.testing.assert_array_equal(_np(ops.add(x, x)), np.arange(32).reshape(4, 8) / 4)


def test_inputs_produced_by_queued_mindspore_ops() -> None:
    """PyNative runs MindSpore ops asynchronously; the kernel must see their results."""
    a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    x = Tensor(a)
    for _ in range(3):
        x = ms.ops.matmul(x, Tensor(np.eye(256, dtype=np.float32) * 1.5))
    got = ops.gelu(x)
    assert_close(_np(got), ops.gelu.reference(a.astype(np.float64) * 1.5**3), rtol=1e-4, atol=1e-4)


def test_parameters_dispatch_too() -> None:
    w = ms.Parameter(_t(np.ones(4)), name="w")
    out = ops.rms_norm(_t(np.ones((2, 4))), w)
    assert_close(_np(out), np.ones((2, 4)) / np.sqrt(1 + 1e-6), rtol=1e-6, atol=1e-6)
    # as the dispatching argument too: MindSpore makes each Parameter's class at run time, in module abc
    assert type(w).__module__ == "abc"
    np.testing.assert_array_equal(_np(ops.add(w, w)), np.full(4, 2.0))


# ---------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------


def _directional_check(op: opbridge.OpDef, fn: Callable[..., Any], label: str) -> None:
    """``<vjp(g), u>`` against central differences of ``<reference, g>`` along random ``u``."""
    rng = np.random.default_rng(5)
    case = next(c for c in _cases(op, "float32")
                if all(v.size > 0 for v in c.values() if isinstance(v, np.ndarray)))
    args = _args(op, case, "float32")
    diff = list(op.differentiable)
    out = _np(fn(*args))
    g = rng.standard_normal(out.shape).astype(np.float32)
    grads = HARNESS.vjp(fn, args, diff, g)
    base = [_np(a).astype(np.float64) if isinstance(a, Tensor) else a for a in args]
    for i, grad in zip(diff, grads, strict=True):
        assert grad.shape == base[i].shape
        u = rng.standard_normal(base[i].shape)

        def f_at(t: float, i: int = i, u: np.ndarray = u) -> float:
            a = list(base)
            a[i] = base[i] + t * u
            return float(np.sum(op.reference(*a) * g))

        h = 1e-6
        fd = (f_at(h) - f_at(-h)) / (2 * h)
        got = float(np.sum(grad.astype(np.float64) * u))
        assert abs(got - fd) <= 1e-3 * max(1.0, abs(fd)), (
            f"{label} d{op.name}/d{op.schema.arguments[i].name}: <grad, u> = {got}, finite differences {fd}")


@pytest.mark.parametrize("op", GRAD_OPS, ids=lambda op: op.name)
def test_pynative_gradients_match_finite_differences(op: opbridge.OpDef) -> None:
    _directional_check(op, op.call, "pynative")


@pytest.mark.parametrize("op", GRAD_OPS, ids=lambda op: op.name)
def test_graph_gradients_match_finite_differences(op: opbridge.OpDef) -> None:
    compiled = HARNESS.compile(op.call)
    assert compiled is not None
    _directional_check(op, compiled, "ms.jit")


def test_grad_through_a_training_cell() -> None:
    """``value_and_grad`` over a Cell with a Parameter, in PyNative and GRAPH_MODE."""

    class Net(nn.Cell):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.w = ms.Parameter(Tensor(np.linspace(0.5, 1.5, 8).astype(np.float32)), name="w")

        def construct(self, x: Any) -> Any:
            return ops.gelu(ops.rms_norm(x, self.w, 1e-5)).sum()

    x = _t(np.random.default_rng(1).standard_normal((3, 8)))
    results = []
    for mode in (ms.PYNATIVE_MODE, ms.GRAPH_MODE):
        old = ms.get_context("mode")
        ms.set_context(mode=mode)
        try:
            net = Net()
            loss, grads = ms.value_and_grad(net, grad_position=0, weights=net.trainable_params())(x)
            results.append((float(loss.asnumpy()), _np(grads[0]), _np(grads[1][0])))
        finally:
            ms.set_context(mode=old)
    (l0, gx0, gw0), (l1, gx1, gw1) = results
    assert l0 == pytest.approx(l1, rel=1e-6)
    assert_close(gx1, gx0, rtol=1e-5, atol=1e-6, name="graph vs pynative dx")
    assert_close(gw1, gw0, rtol=1e-5, atol=1e-6, name="graph vs pynative dw")
    assert np.abs(gw0).sum() > 0


def test_op_without_backward_raises_instead_of_zero_gradients(toy: opbridge.Library) -> None:
    twice = toy.ops["twice"].call
    x = _t(np.ones(3))
    np.testing.assert_array_equal(_np(twice(x)), 2 * np.ones(3))
    with pytest.raises(NotImplementedError, match="twice: no backward is declared"):
        ms.grad(lambda a: twice(a).sum())(x)

    @ms.jit
    def f(a: Any) -> Any:
        return twice(a).sum()

    with pytest.raises(NotImplementedError, match="twice: no backward is declared"):
        ms.grad(f)(x)


def test_scalar_arguments_and_lambda_backward(toy: opbridge.Library) -> None:
    """float / int / bool (keyword-only) scalars reach the kernel eagerly, in graphs and in bprops."""
    affine = toy.ops["affine"].call
    x = _t(np.arange(4))
    np.testing.assert_allclose(_np(affine(x, 0.5, k=3, negate=True)), -1.5 * np.arange(4))

    @ms.jit
    def f(a: Any) -> Any:
        return affine(a, 0.5, k=3, negate=True)

    np.testing.assert_allclose(_np(f(x)), -1.5 * np.arange(4))
    g = _t(np.ones(4))
    for fn in (lambda a: affine(a, 0.5, k=3, negate=True), f):
        _, pullback = ms.vjp(fn, x)
        (dx,) = pullback(g)
        np.testing.assert_allclose(_np(dx), -1.5 * np.ones(4))
    # alpha reaches the kernel as a double in graphs too (as float32 it would round to 1.0). MindSpore
    # keeps float literals of graph source in float32, so it comes in as an argument of the graph.
    y = _t(np.ones(2), np.float64)
    compiled = HARNESS.compile(lambda a, alpha: affine(a, alpha, k=2) - 2)
    assert compiled is not None
    assert _np(compiled(y, 1 + 2**-40)).tolist() == [2**-39, 2**-39]
    with pytest.raises(ValueError, match="affine: k must be > 0, got 0"):
        compiled = HARNESS.compile(lambda a: affine(a, 1.0, k=0))
        assert compiled is not None
        compiled(y)


def test_two_outputs_in_graph_mode(toy: opbridge.Library) -> None:
    split_sum = toy.ops["split_sum"].call
    x = _t(np.arange(6).reshape(3, 2))

    @ms.jit
    def f(a: Any) -> Any:
        s, n = split_sum(a)
        return s * 2, n

    for _, n in (split_sum(x), f(x)):
        assert n.dtype == ms.int64
        np.testing.assert_array_equal(_np(n), [3])
    np.testing.assert_array_equal(_np(f(x)[0]), [2, 10, 18])


# ---------------------------------------------------------------------------
# graph mode
# ---------------------------------------------------------------------------


GRAPH_OPS = [op for op in OPS if aot.unsupported_reason(op) is None]
NON_GRAPH_OPS = [op for op in OPS if aot.unsupported_reason(op) is not None]


@pytest.mark.parametrize("op", NON_GRAPH_OPS, ids=lambda op: op.name)
def test_ops_graphs_cannot_express_raise_while_compiling(op: opbridge.OpDef) -> None:
    """E.g. ops mutating their arguments: a clear NotImplementedError, and no graph from the harness."""
    assert HARNESS.compile(op.call) is None
    args = _args(op, _cases(op, "float32")[0], "float32")
    with pytest.raises(NotImplementedError, match=rf"{op.name}: cannot be used inside a MindSpore graph"):
        ms.jit(adapter.graph_function(op))(*args)


@pytest.mark.parametrize("op", GRAPH_OPS, ids=lambda op: op.name)
def test_jit_forward_matches_pynative(op: opbridge.OpDef) -> None:
    compiled = HARNESS.compile(op.call)
    assert compiled is not None
    for case in _cases(op, "float32")[:3]:
        args = _args(op, case, "float32")
        want = _outs(op.call(*args))
        got = _outs(compiled(*args))
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_close(_np(g), _np(w), rtol=0, atol=0, name=f"ms.jit {op.name}")


def test_public_callables_inside_user_jit_functions() -> None:
    """``opbridge.ops.<op>`` attribute access and ``from ... import`` aliases both compile to ops.Custom."""
    x = _t(np.random.default_rng(2).standard_normal((4, 16)))
    w = _t(np.random.default_rng(3).standard_normal(16))

    @ms.jit
    def f(a: Any, b: Any) -> Any:
        h = ops.rms_norm(a, b, 1e-5)
        return ops.add(gelu_alias(h), a) * 2

    want = _np(ops.add(ops.gelu(ops.rms_norm(x, w, 1e-5)), x)) * 2
    assert_close(_np(f(x, w)), want, rtol=1e-6, atol=1e-6, name="jit pipeline")


def test_graph_mode_cell(graph_mode: None) -> None:
    class Net(nn.Cell):  # type: ignore[misc]
        def construct(self, a: Any, b: Any) -> Any:
            return ops.rms_norm(ops.gelu(a), b)

    x, w = _t(np.linspace(-2, 2, 24).reshape(3, 8)), _t(np.ones(8))
    got = Net()(x, w)
    want = ops.rms_norm.reference(ops.gelu.reference(_np(x).astype(np.float64)), np.ones(8))
    assert_close(_np(got), want, rtol=1e-5, atol=1e-5, name="GRAPH_MODE cell")


def test_custom_op_primitive(toy: opbridge.Library) -> None:
    prim = adapter.custom_op(ops.rms_norm)
    assert isinstance(prim, ms.ops.Custom)
    assert prim is adapter.custom_op(ops.rms_norm.opdef)
    x, w = _t(np.ones((2, 4))), _t(np.full(4, 2.0))
    eps = Tensor(0.0, ms.float64)
    np.testing.assert_allclose(_np(prim(x, w, eps)), np.full((2, 4), 2.0), rtol=1e-6)
    @ms.jit
    def f(a: Any, b: Any) -> Any:
        return prim(a, b, Tensor(0.0, ms.float64))

    np.testing.assert_allclose(_np(f(x, w)), np.full((2, 4), 2.0), rtol=1e-6)
    with pytest.raises(NotImplementedError, match="scale_: has no MindSpore graph primitive: it mutates"):
        adapter.custom_op(toy.ops["scale_"])


def test_aot_wrapper_is_generated_from_the_schemas_and_cached() -> None:
    src = aot.wrapper_source(ops.LIBRARY)
    for op in GRAPH_OPS:
        assert f"int opb_ms_{op.name}(int nparam, void** params" in src
        assert f'"{op.kernels["cpu"]}"' in src
    for op in NON_GRAPH_OPS:
        assert f"int opb_ms_{op.name}(" not in src
    entry = src[src.index("int opb_ms_rms_norm("):]
    entry = entry[:entry.index("\n}\n")]
    # eps (third parameter) is read from its scalar tensor; the output comes after the inputs.
    assert "kKinds[] = {kTensorArg, kTensorArg, kFloatArg, kTensorArg};" in entry
    assert 'kNames[] = {"x", "weight", "eps", "output 0"};' in entry
    assert "#include" not in shim._entry_source(ops.rms_norm.opdef, 0), "one entry: data only"
    mod = aot.aot_module(ops.LIBRARY)
    mod.ready()
    built = opb_jit.cached_artifact(mod.spec)
    assert built is not None, "built through opbridge's JIT cache"
    assert mod.path.read_bytes() == built.read_bytes()
    assert aot.AotModule(ops.LIBRARY).path == mod.path, "the wrapper's path depends on the schemas only"
    prim = adapter.custom_op(ops.gelu)
    assert str(mod.path) in prim.func


GROW_CC = """
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;
void neg_cpu(TensorView out, TensorView x) {
  const float* a = static_cast<const float*>(x.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = -a[i];
}
OPBRIDGE_EXPORT(neg_cpu);
void half_cpu(TensorView out, TensorView x) {
  const float* a = static_cast<const float*>(x.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = 0.5f * a[i];
}
OPBRIDGE_EXPORT(half_cpu);
"""


def test_library_declaring_more_ops_after_registration(tmp_path: Path) -> None:
    """Each declaration re-registers (the declare stage's hook); primitives made earlier stay valid."""
    (tmp_path / "grow.cc").write_text(GROW_CC)
    lib = opbridge.Library(f"opb_ms_grow_{next(_NS)}", sources=["grow.cc"], root=tmp_path)

    @lib.op("neg(Tensor x) -> Tensor", shape=opbridge.like("x"), backward=lambda g, x: (neg(g),))
    def neg(x: Any) -> Any:
        return -x

    adapter.register(lib)
    early = adapter.custom_op(neg)
    x = _t(np.arange(3))
    np.testing.assert_array_equal(_np(ms.jit(adapter.parseable(lambda a: neg(a)))(x)), -np.arange(3))
    # neg's backward names neg itself, assigned only when its decorator returned: still differentiable
    # while neg is the library's last op (nothing re-registers it).
    np.testing.assert_array_equal(_np(ms.grad(lambda a: neg(a).sum())(x)), -np.ones(3))

    @lib.op("half(Tensor x) -> Tensor", shape=opbridge.like("x"))
    def half(x: Any) -> Any:
        return 0.5 * x

    adapter.register(lib)

    @ms.jit
    def f(a: Any) -> Any:
        return half(neg(a))

    np.testing.assert_array_equal(_np(f(x)), -0.5 * np.arange(3))
    np.testing.assert_array_equal(_np(early(x)), -np.arange(3))
    np.testing.assert_array_equal(_np(ms.grad(lambda a: neg(a).sum())(x)), -np.ones(3))


# ---------------------------------------------------------------------------
# zero copy, mutation
# ---------------------------------------------------------------------------


def test_mutation_is_zero_copy(toy: opbridge.Library) -> None:
    scale_ = toy.ops["scale_"].call
    x, other = _t(np.arange(6)), _t(np.full(6, 0.5))
    ptr = HARNESS.data_ptr(x)
    assert scale_(x, other, 3.0) is None
    assert HARNESS.data_ptr(x) == ptr, "the mutated argument must keep its memory"
    np.testing.assert_array_equal(_np(x), np.arange(6) * 3.0 + 0.5)
    np.testing.assert_array_equal(_np(ms.ops.add(x, 1)), np.arange(6) * 3.0 + 1.5)


def test_mutation_waits_for_queued_readers(toy: opbridge.Library) -> None:
    """A queued MindSpore op reading the argument must see it as it was when queued."""
    scale_ = toy.ops["scale_"].call
    a = np.random.default_rng(4).standard_normal((300, 300)).astype(np.float32)
    x = Tensor(a)
    reader = ms.ops.matmul(x, x)
    scale_(x, Tensor(np.zeros_like(a)), 0.0)
    np.testing.assert_allclose(reader.asnumpy(), a @ a, rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(_np(x), np.zeros_like(a))


def test_out_writes_into_the_callers_tensors() -> None:
    x = _t(np.random.default_rng(6).standard_normal((3, 16)))
    w = _t(np.ones(16))
    buf = Tensor(np.zeros((3, 16), np.float32))
    ptr = buf.data_ptr()
    assert ops.rms_norm(x, w, out=buf) is buf
    assert buf.data_ptr() == ptr
    np.testing.assert_array_equal(_np(buf), _np(ops.rms_norm(x, w)))
    dx, dw = Tensor(np.zeros((3, 16), np.float32)), Tensor(np.zeros(16, np.float32))
    res = ops.rms_norm_backward(x, x, w, out=(dx, dw))
    assert res[0] is dx and res[1] is dw
    want = ops.rms_norm_backward(x, x, w)
    np.testing.assert_array_equal(_np(dw), _np(want[1]))
    with pytest.raises(ValueError, match=r"rms_norm: out has shape \(.*\) and dtype float32, but the output"):
        ops.rms_norm(x, w, out=Tensor(np.zeros(16, np.float32)))
    with pytest.raises(TypeError, match=r"gelu: out\[0\] must be an array of the same framework"):
        ops.gelu(x, out=np.zeros((3, 16), np.float32))
    with pytest.raises(RuntimeError, match="gelu: out= writes into existing tensors"):
        ms.grad(lambda a: ops.gelu(a, out=buf).sum())(x)

    @ms.jit
    def f(a: Any) -> Any:
        return ops.gelu(a, out=a)

    with pytest.raises(NotImplementedError, match="gelu: out= cannot be used inside a MindSpore graph"):
        f(x)


def test_mutated_argument_aliasing_another_input_is_rejected(toy: opbridge.Library) -> None:
    scale_ = toy.ops["scale_"].call
    x = _t(np.ones(8))
    with pytest.raises(ValueError, match="scale_: mutated argument 'x' overlaps argument 'other'"):
        scale_(x, x, 2.0)


def test_mutating_op_refuses_gradient_recording_and_graphs(toy: opbridge.Library) -> None:
    scale_ = toy.ops["scale_"].call
    x, other = _t(np.ones(3)), _t(np.ones(3))

    def f(a: Any) -> Any:
        scale_(a, other, 2.0)
        return a.sum()

    with pytest.raises(RuntimeError, match="scale_: mutates 'x' in place and declares no backward"):
        ms.grad(f)(x)
    with pytest.raises(NotImplementedError, match="scale_: cannot be used inside a MindSpore graph"):
        ms.jit(f)(x)


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------

BadCall = Callable[[], Any]
BAD_INPUTS: list[tuple[str, BadCall, type[Exception], str]] = [
    ("dtype", lambda: ops.rms_norm(_t(np.ones((2, 4)), np.int32), _t(np.ones(4))), TypeError,
     r"rms_norm: x must have dtype"),
    ("undeclared dtype", lambda: ops.gelu(_t(np.ones(3), np.int64)), TypeError, r"gelu: x must have dtype"),
    ("mixed dtypes", lambda: ops.add(_t(np.ones(3)), _t(np.ones(3), np.float16)), TypeError,
     r"add: y must have the same dtype as x"),
    ("rank", lambda: ops.rms_norm(_t(np.ones((2, 4))), _t(np.ones((1, 4)))), ValueError, r"rms_norm: weight"),
    ("size", lambda: ops.rms_norm(_t(np.ones((2, 64))), _t(np.ones(63))), ValueError,
     r"rms_norm: weight must have size 64"),
    ("mismatch", lambda: ops.add(_t(np.ones(3)), _t(np.ones(4))), ValueError,
     r"add: y must have the same shape"),
    ("eps < 0", lambda: ops.rms_norm(_t(np.ones((2, 4))), _t(np.ones(4)), -1.0), ValueError,
     r"rms_norm: eps must be >= 0"),
    ("missing", lambda: ops.rms_norm(_t(np.ones((2, 4)))), TypeError, r"rms_norm\(\) missing .*'weight'"),
    ("wrong scalar type", lambda: ops.rms_norm(_t(np.ones((2, 4))), _t(np.ones(4)), "big"), TypeError,
     r"rms_norm: argument 'eps' must be float, got str"),
    ("not a tensor", lambda: ops.add(_t(np.ones(2)), [1.0, 2.0]), TypeError,
     r"add: argument 'y' must be a mindspore.Tensor, got list"),
    # a dtype opbridge does not view as NumPy, as in every framework (it said "Complex64 ... cannot pass")
    ("complex weight", lambda: ops.rms_norm(_t(np.ones((2, 4))), _t(np.ones(4), np.complex64)), TypeError,
     r"rms_norm: argument 'weight' has dtype complex64, which no kernel takes \(opbridge hands a kernel MindSpore "
     r"tensors of float32, .* only\); convert it first, e\.g\. weight\.astype\(\"float32\"\)"),
    ("uint32 y", lambda: ops.add(_t(np.ones(3), np.float64), _t(np.ones(3), np.uint32)), TypeError,
     r"add: argument 'y' has dtype uint32, which no kernel takes .*; convert it first, e\.g\. "
     r"y\.astype\(\"float64\"\)"),
    # tvm-ffi passes ints beyond int64 as ffi.BigInt, which no kernel takes ("Expected `int` but got `ffi.BigInt`")
    ("int beyond int64", lambda: ops.rotary_embedding(_t(np.zeros(2), np.int64), _t(np.ones((2, 8))), None, 2**70,
                                                      _t(np.ones((4, 8))), True), ValueError,
     r"rotary_embedding: argument 'head_size' must be in int64's range \[-2\*\*63, 2\*\*63 - 1\]"),
    ("int beyond int64, for a float", lambda: ops.rms_norm(_t(np.ones((2, 4))), _t(np.ones(4)), 2**64), ValueError,
     r"rms_norm: argument 'eps' is the int 18446744073709551616, outside int64's range"),
]


@pytest.mark.parametrize(("case", "call", "exc", "pattern"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_named_error(case: str, call: BadCall, exc: type[Exception], pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        call()


GRAPH_BAD_INPUTS: list[tuple[str, Callable[..., Any], tuple[Any, ...], type[Exception], str]] = [
    ("dtype", lambda x, w: ops.rms_norm(x, w), (np.int32, (2, 4), (4,)), TypeError,
     r"rms_norm: x must have dtype"),
    ("size", lambda x, w: ops.rms_norm(x, w), (np.float32, (2, 64), (63,)), ValueError,
     r"rms_norm: weight must have size 64"),
    ("eps < 0", lambda x, w: ops.rms_norm(x, w, -1.0), (np.float32, (2, 4), (4,)), ValueError,
     r"rms_norm: eps must be >= 0"),
    ("mismatch", lambda x, w: ops.add(x, w), (np.float32, (3,), (4,)), ValueError,
     r"add: y must have the same shape"),
]


@pytest.mark.parametrize(("case", "fn", "spec", "exc", "pattern"), GRAPH_BAD_INPUTS,
                         ids=[c[0] for c in GRAPH_BAD_INPUTS])
def test_bad_input_in_graphs_raises_named_error(case: str, fn: Callable[..., Any], spec: tuple[Any, ...],
                                                exc: type[Exception], pattern: str) -> None:
    """Raised while compiling, from the kernel's own checks (the dry run in shape inference)."""
    dtype, xs, ws = spec
    x = Tensor(np.ones(xs, dtype))
    w = Tensor(np.ones(ws, np.float32 if case != "mismatch" else dtype))
    with pytest.raises(exc, match=pattern):
        ms.jit(adapter.parseable(fn))(x, w)
    with pytest.raises(exc, match=pattern):  # PyNative while recording gradients: the same primitive
        ms.grad(lambda a, b: fn(a, b).sum())(x, w)


def test_a_dtype_the_graph_entry_points_cannot_take_is_named() -> None:
    """In a graph (and on the tape) a tensor the aot entry points cannot take is named as in PyNative: op,
    argument, dtype, how to convert (MindSpore makes no float8 tensor on the CPU: its metadata stands in)."""
    from types import SimpleNamespace

    from opbridge.adapters.mindspore.primitive import _Meta, check_call

    with pytest.raises(TypeError, match=r"rms_norm: argument 'weight' has dtype float8e4m3fn, which no kernel "
                                        r"takes \(opbridge's graph entry points take float16, .* only\); convert "
                                        r"it first, e\.g\. weight\.astype\(\"float32\"\)"):
        check_call(ops.rms_norm.opdef, [_Meta((2, 4), ms.float32), _Meta((4,), ms.float8_e4m3fn), 1e-6],
                   module=SimpleNamespace())


def test_kernel_errors_at_graph_run_time_raise_cleanly(monkeypatch: pytest.MonkeyPatch,
                                                       capfd: pytest.CaptureFixture[str]) -> None:
    """Past the dry run (large inputs), a kernel error is a nonzero status: RuntimeError, no abort."""
    monkeypatch.setattr(core, "DRY_RUN_MAX_BYTES", 0)
    x, w = Tensor(np.ones((2, 4), np.float32)), Tensor(np.ones(4, np.float32))

    @ms.jit
    def f(a: Any, b: Any) -> Any:
        return ops.rms_norm(a, b, -2.0)

    with pytest.raises(RuntimeError, match="opb_ms_rms_norm"):
        f(x, w)
    assert "opbridge: ValueError: rms_norm: eps must be >= 0" in capfd.readouterr().err
    # the process is fine: the next call works
    @ms.jit
    def g(a: Any, b: Any) -> Any:
        return ops.rms_norm(a, b, 0.0)

    np.testing.assert_allclose(_np(g(x, w)), np.ones((2, 4)))


def test_unsupported_array_type() -> None:
    with pytest.raises(TypeError, match=r"add: argument 'x' must be an array"):
        ops.add([1.0], [2.0])


# ---------------------------------------------------------------------------
# harness
# ---------------------------------------------------------------------------


def test_harness_roundtrip_and_vjp() -> None:
    assert HARNESS.skip_reason() is None
    a = np.linspace(-1, 1, 6).reshape(2, 3)
    for dtype in HARNESS.dtypes:
        t = HARNESS.from_numpy(a, dtype)
        assert str(t.dtype).lower() == dtype
        assert HARNESS.to_numpy(t).dtype == (np.float32 if dtype in ("float16", "bfloat16") else dtype)
        assert HARNESS.data_ptr(t) == t.data_ptr()
    grads = HARNESS.vjp(lambda x, y: ops.add(x, y), [_t(a), _t(a)], [1], np.full((2, 3), 3.0))
    np.testing.assert_array_equal(grads[0], np.full((2, 3), 3.0))
    compiled = HARNESS.compile(lambda x: ops.gelu(x) * 2)
    assert compiled is not None
    assert_close(_np(compiled(_t(a))), 2 * ops.gelu.reference(a), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# strided inputs, declared dtypes, tensors on a device, graph mode on first use
# ---------------------------------------------------------------------------

STRIDED_OPS = [ops.add.opdef, ops.rms_norm.opdef, ops.silu_and_mul.opdef, ops.fused_add_rms_norm.opdef,
               ops.rotary_embedding.opdef]
STRIDED = [(op, a.name) for op in STRIDED_OPS for a in op.schema.arguments if a.type.is_tensor]
SENTINEL = -7.0


def _strided(a: np.ndarray, dtype: str) -> tuple[Tensor, Tensor]:
    """A non-contiguous MindSpore view holding *a* (every other element of its last axis), and its base."""
    wide = np.full((*a.shape[:-1], 2 * a.shape[-1]), SENTINEL, a.dtype)
    wide[..., ::2] = a
    base = HARNESS.from_numpy(wide, dtype if a.dtype.kind == "f" else None)
    view = base[..., ::2]
    assert not view.is_contiguous()
    return view, base


def _strided_case(op: opbridge.OpDef, name: str) -> dict[str, Any]:
    return next(c for c in _cases(op, "float32")
                if c[name] is not None and c[name].ndim >= 1 and c[name].shape[-1] > 1
                and all(v.size > 0 for v in c.values() if isinstance(v, np.ndarray)))


@pytest.mark.parametrize(("op", "name"), STRIDED, ids=[f"{op.name}-{n}" for op, n in STRIDED])
def test_strided_input_matches_contiguous(op: opbridge.OpDef, name: str) -> None:
    """A non-contiguous view as argument *name*: same results; a mutated view is written in place."""
    case = _strided_case(op, name)
    dense_args = _args(op, case, "float32")
    want = _observed(op, dense_args, op.call(*dense_args))
    args = _args(op, case, "float32")
    i = [a.name for a in op.schema.arguments].index(name)
    args[i], base = _strided(case[name], "float32")
    got = _observed(op, args, op.call(*args))
    for g, w in zip(got, want, strict=True):
        if g is None and w is None:  # an optional argument left out
            continue
        assert g.is_contiguous() or g is args[i], "new outputs are contiguous"
        np.testing.assert_array_equal(_np(g), _np(w))
    # the elements between the view's are untouched (a mutated view is copied back exactly there)
    assert (_np(base)[..., 1::2] == SENTINEL).all()
    if op.schema.arguments[i].is_mutated:
        np.testing.assert_array_equal(_np(base)[..., ::2], _np(want[[a.name for a in op.schema.mutated_args]
                                                                     .index(name)]))


@pytest.mark.parametrize(("op", "name"), [(op, n) for op, n in STRIDED if op.backward is not None],
                         ids=[f"{op.name}-{n}" for op, n in STRIDED if op.backward is not None])
def test_strided_input_gradients_match_contiguous(op: opbridge.OpDef, name: str) -> None:
    case = _strided_case(op, name)
    args = _args(op, case, "float32")
    diff = list(op.differentiable)
    cot = np.random.default_rng(2).standard_normal(_np(op.call(*args)).shape)
    want = HARNESS.vjp(op.call, args, diff, cot)
    i = [a.name for a in op.schema.arguments].index(name)
    args[i], _ = _strided(case[name], "float32")
    got = HARNESS.vjp(op.call, args, diff, cot)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def _undeclared(op: opbridge.OpDef) -> str:
    return next(d for d in ("int32", "int64", "float64", "float16") if d not in op.dtypes)


def test_undeclared_dtype_raises_the_cores_message() -> None:
    """The same TypeError as every framework (opbridge.call.core.dtype_error), eagerly, taped and in graphs."""
    from opbridge.call.core import dtype_error

    op = ops.gelu.opdef
    dtype = _undeclared(op)
    x = HARNESS.from_numpy(np.ones((2, 3)), dtype)
    want = str(dtype_error(op, "x", dtype))
    with pytest.raises(TypeError) as eager:
        ops.gelu(x)
    assert str(eager.value) == want
    with pytest.raises(TypeError, match=want.split(" (")[0]):
        ms.grad(lambda a: ops.gelu(a).sum())(x)
    with pytest.raises(TypeError, match=want.split(" (")[0]):
        ms.jit(adapter.parseable(lambda a: ops.gelu(a)))(x)


def test_float64_flows_through_a_op_declaring_it(toy: opbridge.Library) -> None:
    affine = toy.ops["affine"].call
    x = _t(np.linspace(-1, 1, 5), np.float64)
    out = affine(x, 1 + 2**-40, k=2)
    assert out.dtype == ms.float64
    np.testing.assert_array_equal(_np(out), np.linspace(-1, 1, 5) * (2 + 2**-39))


def test_tensors_on_a_device_are_refused_by_name(toy: opbridge.Library, monkeypatch: pytest.MonkeyPatch) -> None:
    """MindSpore tensors claiming a GPU: a clear error naming op, framework, device; nothing is written."""
    scale_ = toy.ops["scale_"].call
    x, y, buf = _t(np.ones(4)), _t(np.ones(4)), _t(np.zeros(4))
    wide = _t(np.ones((2, 8)))
    with monkeypatch.context() as m:
        m.setattr(Tensor, "device", property(lambda self: "GPU:0"))
        pattern = r"add: argument 'x' is a MindSpore tensor on GPU:0, and opbridge has no GPU:0 kernel"
        with pytest.raises(opbridge.BackendUnavailableError, match=pattern):
            ops.add(x, y)
        with pytest.raises(opbridge.BackendUnavailableError, match=pattern):  # strided: no copy is made of it
            ops.add(wide[:, ::2], wide[:, 1::2])
        with pytest.raises(opbridge.BackendUnavailableError, match=pattern):
            ops.add(x, y, out=buf)
        with pytest.raises(opbridge.BackendUnavailableError, match=r"scale_: argument 'x' is a MindSpore tensor"):
            scale_(x, y, 3.0)
        try:
            with pytest.raises(opbridge.BackendUnavailableError, match=r"gelu: argument 'x' is a MindSpore tensor"):
                ms.grad(lambda a: ops.gelu(a).sum())(x)
        finally:  # MindSpore stays in grad mode after an error inside ms.grad (its own ops too): reset it
            _pynative_executor.clear_res()
    np.testing.assert_array_equal(_np(x), np.ones(4))  # the CPU kernel never ran on them
    np.testing.assert_array_equal(_np(buf), np.zeros(4))
    np.testing.assert_array_equal(_np(ops.add(x, y)), np.full(4, 2.0))  # and CPU tensors still work


FIRST_USE = {
    "jit-function": """
        import numpy as np
        import mindspore as ms
        import opbridge.ops

        @ms.jit
        def f(x, w):
            return opbridge.ops.rms_norm(x, w) * 2

        print(float(f(ms.Tensor(np.ones((2, 4), np.float32)), ms.Tensor(np.ones(4, np.float32))).asnumpy()[0, 0]))
    """,
    "adapter-imported-first": """
        # the adapter's own import brings MindSpore in (a circular import before the fix)
        import numpy as np
        import opbridge.ops
        from opbridge.adapters import mindspore as adapter
        import mindspore as ms

        adapter.load_kernels()

        @ms.jit
        def f(x, w):
            return opbridge.ops.rms_norm(x, w) * 2

        print(float(f(ms.Tensor(np.ones((2, 4), np.float32)), ms.Tensor(np.ones(4, np.float32))).asnumpy()[0, 0]))
    """,
    "graph-cell-opbridge-first": """
        import numpy as np
        import opbridge.ops
        import mindspore as ms
        from mindspore import nn

        class Net(nn.Cell):
            def construct(self, x, w):
                return opbridge.ops.rms_norm(x, w) * 2

        ms.set_context(mode=ms.GRAPH_MODE)
        print(float(Net()(ms.Tensor(np.ones((2, 4), np.float32)), ms.Tensor(np.ones(4, np.float32))).asnumpy()[0, 0]))
    """,
}


@pytest.mark.parametrize("script", list(FIRST_USE), ids=list(FIRST_USE))
def test_graph_mode_on_first_use(script: str, tmp_path: Path) -> None:
    """A fresh process whose first call of an op is inside a graph (issue 11 item 2)."""
    import subprocess
    import sys
    import textwrap

    path = tmp_path / f"{script}.py"
    path.write_text(textwrap.dedent(FIRST_USE[script]))
    env = dict(os.environ, MS_OM_PATH=str(tmp_path / "om"), GLOG_v="3")
    run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=600,
                         cwd=tmp_path, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert abs(float(run.stdout.split()[-1]) - 2 / np.sqrt(1 + 1e-6)) < 1e-5


# ---------------------------------------------------------------------------
# large outputs on huge pages, without a copy (issue 21)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_large_outputs_come_from_the_pool(dt: str) -> None:
    """4 MiB and more: 2 MiB-aligned, and a freed output's buffer is the next one's (tests/test_host_buffers.py)."""
    assert not adapter.eager.requires_grad(), "an earlier test left MindSpore recording gradients"
    x = _t(np.ones((1024, 2048), np.float32)).astype(getattr(ms, dt))
    ops.gelu(x)
    first = ops.gelu(x)
    p = int(first.data_ptr())
    assert p % (2 << 20) == 0
    del first
    second = ops.gelu(x)
    assert int(second.data_ptr()) == p
    assert second.dtype == getattr(ms, dt) and float(second.astype(ms.float32).asnumpy()[0, 0]) > 0.8


@pytest.mark.parametrize("name", ["add", "rms_norm"])
def test_large_outputs_reuse_memory_and_alias_the_kernels_buffer(name: str) -> None:
    """A new (4096, 4096) float32 output: almost no page faults per call, and the tensor is the kernel's buffer.

    MindSpore outputs are NumPy views of buffers from opbridge's pool, shared
    with the tensor: a freed output's memory is the next one's, so a call
    neither maps nor zeroes 64 MiB (a fresh mapping: 16,385 faults per call,
    about 545 on huge pages).
    """
    x = _t(np.ones((4096, 4096), np.float32))
    args = (x, x) if name == "add" else (x, _t(np.ones(4096, np.float32)), 1e-6)
    fn = getattr(ops, name)
    faults = faults_per_call(fn, *args)
    assert faults < 100, f"{name}: {faults:.0f} faults per call"
    out = fn(*args)
    assert out.asnumpy()[0, 0] == (2.0 if name == "add" else pytest.approx(1.0, rel=1e-5))
    view = adapter.views.host_view(out)
    assert view.ctypes.data == out.data_ptr()  # the tensor is the kernel's buffer: no copy on the way out


def test_out_calls_take_the_generated_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """out= one dense tensor apart from the arguments: the generated call writes it, no checked call; an out=
    that is an input, or strided, goes to the checked call, which gives the same results."""
    from opbridge.adapters.mindspore import eager

    checked: list[str] = []
    real = eager.run_with_out

    def spy(op: opbridge.OpDef, kernel: Any, args: Any, outs: Any) -> Any:
        checked.append(op.name)
        return real(op, kernel, args, outs)

    x = _t(np.random.default_rng(7).standard_normal((3, 16)))
    y = _t(np.random.default_rng(8).standard_normal((3, 16)))
    buf = Tensor(np.zeros((3, 16), np.float32))
    ops.add(x, y, out=buf)  # the first call installs the generated out= call
    monkeypatch.setattr(eager, "run_with_out", spy)
    assert ops.add(x, y, out=buf) is buf and checked == []
    np.testing.assert_array_equal(_np(buf), _np(x) + _np(y))
    h = Tensor(np.zeros((3, 8), np.float32))
    assert ops.silu_and_mul(x, out=h) is h
    assert_close(_np(h), ops.silu_and_mul.opdef.reference(_np(x)))
    xc = Tensor(_np(x).copy())
    assert ops.add(xc, y, out=xc) is xc  # out= is an input: the checked call's fresh buffer
    np.testing.assert_array_equal(_np(xc), _np(x) + _np(y))
    assert checked == ["add"]
    with pytest.raises(ValueError, match=r"rms_norm: out has shape \(.*\) and dtype float32, but the output"):
        ops.rms_norm(x, _t(np.ones(16)), out=Tensor(np.zeros(16, np.float32)))


@pytest.mark.parametrize("entry", ["1", "0"])
def test_strided_inputs_reach_a_kernel_that_checks_no_layout_as_dense_copies(
        toy: opbridge.Library, entry: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`twice`'s kernel reads x.data_ptr() as dense memory and checks nothing: a strided view must reach it as
    a dense copy from either path (the tensor C entry declines it; the generated call must too), with and
    without out=."""
    monkeypatch.setenv("OPBRIDGE_EXCHANGE_ENTRY", entry)
    twice = toy.ops["twice"].call
    base = _t(np.arange(48).reshape(4, 12))
    for view in (base[::2], base[..., ::2], base[:, 1:5], base.T):
        assert not view.is_contiguous()
        want = 2 * _np(view)
        np.testing.assert_array_equal(_np(twice(view)), want)
        out = Tensor(np.zeros(view.shape, np.float32))
        assert twice(view, out=out) is out
        np.testing.assert_array_equal(_np(out), want)


class _NormDense(nn.Cell):  # at module level: MindSpore's Rewrite reads a Cell's class from its source file
    def __init__(self) -> None:
        super().__init__()
        self.w = ms.Parameter(Tensor(np.linspace(0.5, 1.5, 16).astype(np.float32)), name="w")
        self.dense = nn.Dense(16, 16)

    def construct(self, x: Any) -> Any:
        return self.dense(ops.rms_norm(x, self.w, 1e-6))


@pytest.mark.parametrize("how", ["O1", "white_list"])
def test_mixed_precision_rewrite_keeps_an_op_call_whole(how: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """MindSpore's Rewrite (auto_mixed_precision O1, custom_mixed_precision's white list) re-emits the Python
    functions a Cell calls from their source files; an op's generated callable is kept as a call (before: 'For
    MindSpore Rewrite, in module parser, file .../<opbridge op opbridge::rms_norm #3> not exist')."""
    from mindspore.amp import auto_mixed_precision, custom_mixed_precision

    monkeypatch.chdir(tmp_path)  # Rewrite writes its rewritten_network/ there
    x = _t(np.random.default_rng(3).standard_normal((4, 16)))
    net = _NormDense()
    want = _np(net(x))
    cast = (auto_mixed_precision(net, "O1", dtype=ms.float16) if how == "O1"
            else custom_mixed_precision(net, white_list=[nn.Dense], dtype=ms.float16))
    np.testing.assert_allclose(_np(cast(x)), want, rtol=2e-2, atol=2e-2)


MINDIR_EXPORT = """
    import sys
    import numpy as np
    import mindspore as ms
    from mindspore import nn
    import opbridge.ops

    class Net(nn.Cell):
        def construct(self, x, w):
            return opbridge.ops.rms_norm(x, w) * 2

    x = ms.Tensor(np.linspace(-1, 1, 32).reshape(4, 8).astype(np.float32))
    w = ms.Tensor(np.linspace(0.5, 1.5, 8).astype(np.float32))
    ms.export(Net(), x, w, file_name=sys.argv[1], file_format="MINDIR")
    np.save(sys.argv[1] + ".npy", Net()(x, w).asnumpy())
"""

MINDIR_LOAD = """
    import sys
    import numpy as np
    import mindspore as ms
    from mindspore import nn
    import opbridge.ops
    from opbridge.adapters.mindspore import load_kernels

    load_kernels()
    x = ms.Tensor(np.linspace(-1, 1, 32).reshape(4, 8).astype(np.float32))
    w = ms.Tensor(np.linspace(0.5, 1.5, 8).astype(np.float32))
    got = nn.GraphCell(ms.load(sys.argv[1] + ".mindir"))(x, w).asnumpy()
    np.testing.assert_array_equal(got, np.load(sys.argv[1] + ".npy"))
    print("ok")
"""


def test_an_exported_mindir_runs_in_a_fresh_process_after_load_kernels(tmp_path: Path) -> None:
    """ms.export of a Cell calling an op, then ms.load in a process that never ran the op in a graph: its aot
    entry points are bound by load_kernels() (before: 'kernel rms_norm_cpu is not bound')."""
    import subprocess
    import sys
    import textwrap

    env = dict(os.environ, MS_OM_PATH=str(tmp_path / "om"), GLOG_v="3")
    stem = str(tmp_path / "net")
    for name, source in (("export", MINDIR_EXPORT), ("load", MINDIR_LOAD)):
        path = tmp_path / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        run = subprocess.run([sys.executable, str(path), stem], capture_output=True, text=True, env=env,
                             timeout=600, cwd=tmp_path)
        assert run.returncode == 0, f"{name}: {run.stdout[-2000:]}{run.stderr[-3000:]}"
    assert run.stdout.strip().endswith("ok")


@pytest.mark.parametrize(("name", "dtype", "layout"), [("add", "float32", "step"), ("add", "bfloat16", "step"),
                                                       ("fused_add_rms_norm", "float32", "step"),
                                                       ("rms_norm", "float32", "transposed")])
def test_strided_tensors_run_on_dense_copies_not_the_checked_call(name: str, dtype: str, layout: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor in a layout the kernels do not take runs the op again on dense copies (overlap.recall_dense:
    the method entry takes them), not through the checked call (add on a (64, 128) slice: 48-50 us there, 7
    contiguous) nor a kernel's error (rms_norm's x is row_strided, but a transpose is not rows). A written
    strided argument is updated through the caller's view: its base sees it."""
    op = getattr(ops, name).opdef
    rng = np.random.default_rng(0)
    if layout == "step":
        base = HARNESS.from_numpy(rng.standard_normal((6, 32)).astype(np.float32), dtype)
        x = base[:, ::2]
    else:
        base = HARNESS.from_numpy(rng.standard_normal((16, 6)).astype(np.float32), dtype)
        x = base.T
    others = [HARNESS.from_numpy(rng.standard_normal((6, 16)).astype(np.float32), dtype)][:name != "rms_norm"]
    if name != "add":
        others.append(HARNESS.from_numpy(rng.standard_normal(16).astype(np.float32), dtype))
    assert not x.is_contiguous()
    dense = [HARNESS.from_numpy(_np(t), dtype) for t in (x, *others)]  # exact: bfloat16 widened and narrowed
    want = op.call(*dense)
    fn = op.call.__globals__["_table"][Tensor]

    def checked(*a: Any) -> Any:
        raise AssertionError("the checked call ran")

    monkeypatch.setitem(fn.__globals__, "_checked", checked)
    got = op.call(x, *others)
    assert not x.is_contiguous(), "the caller's view keeps its layout"
    if name == "fused_add_rms_norm":  # input and residual are written: input through the view, into its base
        np.testing.assert_array_equal(_np(base)[:, ::2], _np(dense[0]))
        np.testing.assert_array_equal(_np(others[0]), _np(dense[1]))
    else:
        assert got.is_contiguous() and got.dtype == x.dtype
        np.testing.assert_array_equal(_np(got), _np(want))
