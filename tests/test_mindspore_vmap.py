"""``mindspore.ops.vmap`` of opbridge ops (:mod:`opbridge.adapters.mindspore.vmap`).

A batch over an op's declared rows alone runs its primitive once, with the batch as one more leading
dim; any other batch runs it once per element (MindSpore's general rule). The tests see which of the
two ran through the shapes the primitive infers while MindSpore compiles (the one call infers the
batched shapes; the general rule infers each element's once more per element), so a rule that always
loops fails them. MindSpore-only (its own environment, like ``test_mindspore_adapter.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from opbridge.testing.harness_mindspore import HARNESS

if HARNESS.skip_reason() is not None:
    pytest.skip(HARNESS.skip_reason(), allow_module_level=True)

ms = pytest.importorskip("mindspore")

from mindspore import Tensor  # noqa: E402
from mindspore import ops as mops  # noqa: E402

import opbridge  # noqa: E402
from opbridge import ops  # noqa: E402
from opbridge.adapters import mindspore as adapter  # noqa: E402
from opbridge.adapters.mindspore import primitive  # noqa: E402

_B, _R, _H = 4, 3, 16

SIGN_SPLIT_CC = """
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;

// sign_split(Tensor x) -> (Tensor, Tensor): max(x, 0) and min(x, 0), element by element
void sign_split_cpu(TensorView pos, TensorView neg, TensorView x) {
  OPB_CHECK_DTYPE("sign_split", x, opbridge::kFloat32);
  const float* a = static_cast<const float*>(x.data_ptr());
  float* p = static_cast<float*>(pos.data_ptr());
  float* n = static_cast<float*>(neg.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) {
    p[i] = a[i] > 0.f ? a[i] : 0.f;
    n[i] = a[i] > 0.f ? 0.f : a[i];
  }
}
OPBRIDGE_EXPORT(sign_split_cpu);

// sign_split_whole(Tensor x) -> (Tensor, Tensor): the same, declared without rows
void sign_split_whole_cpu(TensorView pos, TensorView neg, TensorView x) { sign_split_cpu(pos, neg, x); }
OPBRIDGE_EXPORT(sign_split_whole_cpu);
"""


@pytest.fixture(autouse=True, scope="module")
def _compile_failure_dumps(mindspore_om_path: None) -> None:
    """MindSpore's compile-failure dumps go to a temporary directory (conftest's ``mindspore_om_path``)."""


@pytest.fixture
def infers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[tuple[int, ...], ...]]]:
    """(op, input shapes) of every shape inference of an opbridge primitive, in order."""
    seen: list[tuple[str, tuple[tuple[int, ...], ...]]] = []
    infer = primitive.OpCustom.__infer__

    def spy(self: Any, *args: Any) -> Any:
        seen.append((self.opdef.name, tuple(tuple(a["shape"]) for a in args)))
        return infer(self, *args)

    monkeypatch.setattr(primitive.OpCustom, "__infer__", spy)
    return seen


def _rand(*shape: int, seed: int = 0) -> Tensor:
    return Tensor(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _stack(parts: list[Any], axis: int = 0) -> np.ndarray:
    return np.stack([p.asnumpy() for p in parts], axis)


def _one_call(seen: list[Any], op: str, shapes: tuple[tuple[int, ...], ...], element: tuple[int, ...]) -> None:
    """*op* inferred *shapes* (the whole batch at once), and the element's shape *element* (its first input's)
    only while MindSpore traced the function before vectorising it, not once more per batch element."""
    mine = [s for n, s in seen if n == op]
    assert shapes in mine, f"{op}: no call at the batched shapes {shapes}; inferred {mine}"
    assert sum(s[0] == element for s in mine) < _B, f"{op}: ran per element; inferred {mine}"


def test_vmap_over_rows_is_one_call(infers: list[Any]) -> None:
    x, w = _rand(_B, _R, _H), _rand(_H, seed=1)

    def f(a: Any) -> Any:
        return ops.rms_norm(a, w, 1e-6)

    np.testing.assert_array_equal(mops.vmap(f)(x).asnumpy(), _stack([ops.rms_norm(a, w, 1e-6) for a in x]))
    _one_call(infers, "rms_norm", ((_B, _R, _H), (_H,), ()), (_R, _H))

    # the batch on another axis, and the result's batch on another axis: the batch dim moves to the front
    infers.clear()

    def g(a: Any) -> Any:
        return ops.rms_norm(a, w, 1e-6)

    got = mops.vmap(g, in_axes=1, out_axes=1)(x)
    np.testing.assert_array_equal(got.asnumpy(), _stack([ops.rms_norm(x[:, i], w, 1e-6) for i in range(_R)], 1))
    _one_call(infers, "rms_norm", ((_R, _B, _H), (_H,), ()), (_B, _H))

    # a row argument the batch leaves out is broadcast along it
    infers.clear()
    y = _rand(_R, _H, seed=2)

    def h(a: Any) -> Any:
        return ops.add(a, y)

    np.testing.assert_array_equal(mops.vmap(h)(x).asnumpy(), x.asnumpy() + y.asnumpy())
    _one_call(infers, "add", ((_B, _R, _H), (_B, _R, _H)), (_R, _H))

    # nested: two batch dims, still one call
    infers.clear()

    def k(a: Any) -> Any:
        return ops.rms_norm(a, w, 1e-6)

    np.testing.assert_array_equal(mops.vmap(mops.vmap(k))(x).asnumpy(), ops.rms_norm(x, w, 1e-6).asnumpy())
    _one_call(infers, "rms_norm", ((_B, _R, _H), (_H,), ()), (_H,))


def test_vmap_over_a_shared_argument_runs_per_element(infers: list[Any]) -> None:
    x, ws = _rand(_R, _H), _rand(_B, _H, seed=1)

    def f(w: Any) -> Any:
        return ops.rms_norm(x, w, 1e-6)

    np.testing.assert_array_equal(mops.vmap(f)(ws).asnumpy(), _stack([ops.rms_norm(x, w, 1e-6) for w in ws]))
    shapes = {s for _, s in infers}
    assert shapes == {((_R, _H), (_H,), ())}, shapes  # never the whole batch at once
    assert len(infers) > _B  # once per element

    # an op call the batch does not reach runs once, unbatched
    infers.clear()

    def g(a: Any, w: Any) -> Any:
        return a + ops.rms_norm(x, w, 1e-6)

    xs, w = _rand(_B, _R, _H, seed=2), ws[0]
    np.testing.assert_array_equal(mops.vmap(g, in_axes=(0, None))(xs, w).asnumpy(),
                                  xs.asnumpy() + ops.rms_norm(x, w, 1e-6).asnumpy()[None])


def test_vmap_with_gradients(infers: list[Any]) -> None:
    x, w = _rand(_B, _R, _H), _rand(_H, seed=1)

    def loss(a: Any, weight: Any) -> Any:
        return (ops.rms_norm(a, weight, 1e-6) ** 2).sum()

    # vmap of grad: per-example gradients, the weight's too (rms_norm_backward declares no rows: per element)
    dx, dw = mops.vmap(ms.grad(loss, grad_position=(0, 1)), in_axes=(0, None))(x, w)
    _one_call(infers, "rms_norm", ((_B, _R, _H), (_H,), ()), (_R, _H))
    per = [ms.grad(loss, grad_position=(0, 1))(a, w) for a in x]
    np.testing.assert_allclose(dx.asnumpy(), _stack([p[0] for p in per]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dw.asnumpy(), _stack([p[1] for p in per]), rtol=1e-6, atol=1e-6)

    # grad of vmap: the one call's bprop runs at the batched shapes; the shared weight's gradient sums the batch
    def batched_loss(a: Any, weight: Any) -> Any:
        return (mops.vmap(ops.rms_norm, in_axes=(0, None, None))(a, weight, 1e-6) ** 2).sum()

    got = ms.grad(batched_loss, grad_position=(0, 1))(x, w)
    want = ms.grad(loss, grad_position=(0, 1))(x, w)  # rms_norm is row by row: the same loss on (B, R, H)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g.asnumpy(), e.asnumpy(), rtol=1e-5, atol=1e-5)

    # a row argument broadcast along the batch gets the batch's summed gradient
    y = _rand(_R, _H, seed=2)

    def add_loss(a: Any, b: Any) -> Any:
        return (mops.vmap(ops.add, in_axes=(0, None))(a, b) * x).sum()

    np.testing.assert_allclose(ms.grad(add_loss, grad_position=1)(x, y).asnumpy(), x.asnumpy().sum(0), rtol=1e-6)


def test_vmap_of_ops_with_two_outputs(tmp_path: Path, infers: list[Any]) -> None:
    (tmp_path / "sign_split.cc").write_text(SIGN_SPLIT_CC)
    lib = opbridge.Library("opb_ms_vmap_test", sources=["sign_split.cc"], root=tmp_path)

    def specs(x: Any) -> Any:
        return opbridge.Spec(x.shape, x.dtype), opbridge.Spec(x.shape, x.dtype)

    @lib.op("sign_split(Tensor x) -> (Tensor, Tensor)", shape=specs, rows=("x",))
    def sign_split(x: Any) -> Any:
        return np.maximum(x, 0), np.minimum(x, 0)

    @lib.op("sign_split_whole(Tensor x) -> (Tensor, Tensor)", shape=specs)
    def sign_split_whole(x: Any) -> Any:
        return np.maximum(x, 0), np.minimum(x, 0)

    adapter.register(lib)
    x = _rand(_B, _R, _H)

    def f(a: Any) -> Any:
        return sign_split(a)

    pos, neg = mops.vmap(f, in_axes=1, out_axes=(0, 1))(x)
    np.testing.assert_array_equal(pos.asnumpy(), np.moveaxis(np.maximum(x.asnumpy(), 0), 1, 0))
    np.testing.assert_array_equal(neg.asnumpy(), np.minimum(x.asnumpy(), 0))
    _one_call(infers, "sign_split", ((_R, _B, _H),), (_B, _H))

    # in one graph, each op by its own declaration: the same batch of the same shapes, one call and a loop
    infers.clear()

    def g(a: Any) -> Any:
        p, _ = sign_split(a)
        _, n = sign_split_whole(a)
        return p + n

    np.testing.assert_array_equal(mops.vmap(g)(x).asnumpy(), x.asnumpy())
    _one_call(infers, "sign_split", ((_B, _R, _H),), (_R, _H))
    assert {s for n, s in infers if n == "sign_split_whole"} == {((_R, _H),)}
    assert sum(n == "sign_split_whole" for n, _ in infers) > _B


def test_other_custom_ops_keep_mindspores_general_rule() -> None:
    """The rule is the opbridge primitive's own (``get_vmap_rule``), not one for every op named "Custom"."""
    from mindspore.ops._vmap.vmap_base import vmap_rules_getters

    seen: list[tuple[int, ...]] = []

    def double(a: Any) -> Any:
        seen.append(a.shape)
        return a * 2

    custom = mops.Custom(double, out_shape=lambda s: s, out_dtype=lambda t: t, func_type="pyfunc")
    assert custom.name == adapter.custom_op(ops.rms_norm).name == "Custom"  # one name for every Custom op
    assert not hasattr(custom, "get_vmap_rule") and "Custom" not in vmap_rules_getters
    x = Tensor(np.arange(_B * _R * 2, dtype=np.float32).reshape(_B, _R, 2))

    def f(a: Any) -> Any:
        return custom(a)

    np.testing.assert_array_equal(mops.vmap(f)(x).asnumpy(), 2 * x.asnumpy())
    assert seen == [(_R, 2)] * _B  # once per element, as MindSpore's general rule runs it


def test_vmap_of_a_mutating_op_raises_as_in_any_graph() -> None:
    inp, res, w = _rand(_B, _R, _H), _rand(_B, _R, _H, seed=1), _rand(_H, seed=2)

    def f(a: Any, r: Any) -> Any:
        ops.fused_add_rms_norm(a, r, w, 1e-6)
        return a

    with pytest.raises(NotImplementedError, match="fused_add_rms_norm: cannot be used inside a MindSpore graph"):
        mops.vmap(f)(inp, res)
