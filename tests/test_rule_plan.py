"""core.rule_plan: the shape rule asked once per argument signature, for every adapter that allocates from it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import opbridge
from opbridge.call import core
from opbridge.declare import Spec


@pytest.fixture(scope="module")
def counted() -> tuple[opbridge.OpDef, list[int]]:
    calls = [0]
    lib = opbridge.Library("rule_plan_test", sources=[])

    def rule(x: Any, w: Any, k: int) -> Spec:
        calls[0] += 1
        return Spec((*x.shape[:-1], x.shape[-1] * k), x.dtype)

    @lib.op("widen(Tensor x, Tensor? w, int k) -> Tensor", shape=rule)
    def widen(x: Any, w: Any, k: int) -> Any:
        return np.repeat(x, k, axis=-1)

    return widen.opdef, calls


def test_one_rule_call_per_signature(counted: tuple[opbridge.OpDef, list[int]]) -> None:
    op, calls = counted
    plans = core.rule_plan(op, "{t}.shape, {t}.dtype", lambda shape, dt: (shape, str(dt)), "test")
    x, w = np.ones((2, 3), np.float32), np.ones(3, np.float32)
    before = calls[0]
    assert plans((x, None, 2)) == [((2, 6), "float32")]
    assert plans((x, None, 2)) == [((2, 6), "float32")]
    assert calls[0] == before + 1
    assert plans((x, w, 2)) == [((2, 6), "float32")]  # an optional tensor given is another signature
    assert plans((x, None, 3)) == [((2, 9), "float32")]  # so is another scalar
    assert plans((x.astype(np.float64), None, 3)) == [((2, 9), "float64")]
    assert calls[0] == before + 4


def test_cache_is_bounded(counted: tuple[opbridge.OpDef, list[int]]) -> None:
    op, calls = counted
    plans = core.rule_plan(op, "{t}.shape, {t}.dtype", lambda shape, dt: shape, "test")
    for n in range(core.RULE_CACHE_SIZE + 10):
        assert plans((np.ones((1, n + 1), np.float32), None, 1)) == [(1, n + 1)]
    before = calls[0]
    plans((np.ones((1, core.RULE_CACHE_SIZE + 10), np.float32), None, 1))  # kept after the cache started over
    assert calls[0] == before


def test_unhashable_scalar_runs_the_rule_each_time() -> None:
    calls = [0]
    lib = opbridge.Library("rule_plan_list_test", sources=[])

    def rule(x: Any, ks: list[int]) -> Spec:
        calls[0] += 1
        return Spec((*x.shape[:-1], x.shape[-1] * sum(ks)), x.dtype)

    @lib.op("widen_by(Tensor x, int[] ks) -> Tensor", shape=rule)
    def widen_by(x: Any, ks: list[int]) -> Any:
        return np.repeat(x, sum(ks), axis=-1)

    plans = core.rule_plan(widen_by.opdef, "{t}.shape, {t}.dtype", lambda shape, dt: shape, "test")
    x = np.ones((2, 3), np.float32)
    assert plans((x, [1, 2])) == [(2, 9)]
    assert plans((x, [1, 1])) == [(2, 6)]
    assert calls[0] == 2


def test_like_names_a_tensor_that_is_always_there() -> None:
    """like() copies an argument's shape and dtype: a Tensor? may be None and a scalar has none, so the
    declaration refuses both (a C entry once read an unset slot for a None one)."""
    from opbridge.errors import DeclarationError

    lib = opbridge.Library("rule_plan_like_test", sources=[])
    with pytest.raises(DeclarationError, match=r"pick: like\('y'\) names a Tensor\? argument, which may be None"):
        lib.op("pick(Tensor x, Tensor? y) -> Tensor", shape=opbridge.like("y"))(lambda x, y: y)
    with pytest.raises(DeclarationError, match=r"scaled: like\('n'\) names a non-Tensor argument, which has no shape"):
        lib.op("scaled(Tensor x, int n) -> Tensor", shape=opbridge.like("n"))(lambda x, n: x)


def test_a_shape_rule_answer_is_checked() -> None:
    """Negative dimensions, and more elements than any buffer holds, raise the op's ValueError."""
    lib = opbridge.Library("rule_plan_dims_test", sources=[])
    op = lib.op("rep(Tensor x, int n) -> Tensor", shape=lambda x, n: Spec((2, n), x.dtype))(lambda x, n: x)
    x = np.zeros(3, np.float32)
    assert op.opdef.output_specs([x, np.int64(4)]) == (Spec((2, 4), x.dtype),)
    with pytest.raises(ValueError, match=r"rep: its shape rule gave output 0 the shape \(2, -1\); dimensions must be"):
        op.opdef.output_specs([x, -1])
    with pytest.raises(ValueError, match=r"rep: .* the shape \(2, 576460752303423488\), 1152921504606846976 elements"):
        op.opdef.output_specs([x, 2**59])
