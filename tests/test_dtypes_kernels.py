"""float64 (and, for ``add``, int32 / int64) in the built-in CPU kernels, called through NumPy.

Every built-in op with floating tensors runs on float64 NumPy arrays of odd
shapes (one element, a vector tail, rows of 769 and 5125, and one case past
the parallel grain and the 16 MiB streaming-store threshold) and is compared
with its float64 reference. The tolerance is far tighter than float32 could
meet: a kernel that refused float64 raises, and one that computed float64
through float32 would be off by ~1e-8 relative, so either fails here.

``advance_step_flashattn`` has no floating tensors (int32 / int64 only), so it
has nothing to check here; ``tests/test_serving_ops.py`` covers it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import opbridge.ops

OPS = opbridge.ops.LIBRARY.ops
SHAPES = [(1,), (7,), (3, 769), (2, 5125), (520, 4100)]
EVEN_SHAPES = [(2,), (8,), (3, 770), (2, 5126), (520, 4100)]  # the gated ops halve the last dim
#: float64 kernels compute in double; the references use other (equivalent)
#: formulas, e.g. gelu through tanh where the kernel uses x sigmoid(2u), so
#: they agree to a few ulp times the formula's condition, well inside this.
RTOL, ATOL = 1e-12, 1e-13


def _rng(*key: object) -> np.random.Generator:
    return np.random.default_rng(abs(hash(key)) % 2**32)


def _randn(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 2.0) -> np.ndarray:
    return rng.standard_normal(shape) * scale


def _reference(name: str) -> Callable[..., Any]:
    ref = OPS[name].reference
    assert ref is not None
    return ref


def _call(name: str, *args: Any) -> Any:
    return getattr(opbridge.ops, name)(*args)


def _close(got: Any, want: Any, rtol: float = RTOL, atol: float = ATOL) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.float64, got.dtype
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------
# elementwise and gated ops, forward and backward
# ---------------------------------------------------------------------------

UNARY = ["gelu", "silu_and_mul", "gelu_and_mul"]
WITH_GRAD = ["gelu_backward", "silu_and_mul_backward", "gelu_and_mul_backward"]


def _shapes(name: str) -> list[tuple[int, ...]]:
    return EVEN_SHAPES if "and_mul" in name else SHAPES


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_add_float64(shape: tuple[int, ...]) -> None:
    rng = _rng("add", shape)
    x, y = _randn(rng, shape), _randn(rng, shape)
    _close(_call("add", x, y), _reference("add")(x, y), rtol=0, atol=0)  # one rounding, as NumPy's


@pytest.mark.parametrize("name", UNARY)
@pytest.mark.parametrize("index", range(len(SHAPES)))
def test_unary_float64(name: str, index: int) -> None:
    shape = _shapes(name)[index]
    x = _randn(_rng(name, shape), shape)
    _close(_call(name, x), _reference(name)(x))


@pytest.mark.parametrize("name", WITH_GRAD)
@pytest.mark.parametrize("index", range(len(SHAPES)))
def test_backward_float64(name: str, index: int) -> None:
    shape = _shapes(name)[index]
    rng = _rng(name, shape)
    x = _randn(rng, shape)
    gshape = (*shape[:-1], shape[-1] // 2) if "and_mul" in name else shape
    grad = _randn(rng, gshape, 1.0)
    _close(_call(name, grad, x), _reference(name)(grad, x))


WHOLE_RANGE = np.concatenate([np.linspace(-745.0, 705.0, 20001), np.linspace(-30.0, 30.0, 20001)])


@pytest.mark.parametrize("name", ["silu_and_mul", "gelu_and_mul"])
def test_activations_over_the_whole_float64_range(name: str) -> None:
    """The float64 exp behind silu / gelu: 1 ulp over [-745, 705], underflow and overflow included."""
    a = WHOLE_RANGE
    x = np.concatenate([a, np.ones_like(a)])  # [a | b = 1]: act(a) itself
    with np.errstate(all="ignore"):
        want = _reference(name)(x)
    got = _call(name, x)
    tiny = np.abs(want) < 1e-290  # subnormal results: compare absolutely
    # silu's exponent is x itself; gelu's is z(x), whose rounding (a few ulp)
    # e^z amplifies by |z| (up to ~700 here) in the kernel and the reference alike.
    rtol = 1e-13 if name == "silu_and_mul" else 1e-12
    _close(got[~tiny], want[~tiny], rtol=rtol, atol=0)
    np.testing.assert_allclose(got[tiny], want[tiny], rtol=0, atol=1e-300)


def test_gelu_is_gelu_and_mul_with_b_one_over_the_whole_range() -> None:
    """gelu's float64 kernel computes what gelu_and_mul's does (checked above against the
    accurate x sigmoid(2u) reference): gelu's own reference, 0.5 x (1 + tanh(u)), cancels on
    the negative tail, so it cannot judge the kernel there."""
    a = WHOLE_RANGE[np.abs(WHOLE_RANGE) < 60]
    np.testing.assert_array_equal(_call("gelu", a), _call("gelu_and_mul", np.concatenate([a, np.ones_like(a)])))


# ---------------------------------------------------------------------------
# norms
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_float64(shape: tuple[int, ...]) -> None:
    rng = _rng("rms_norm", shape)
    x, w = _randn(rng, shape), _randn(rng, shape[-1:], 1.0)
    _close(_call("rms_norm", x, w, 1e-6), _reference("rms_norm")(x, w, 1e-6))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_backward_float64(shape: tuple[int, ...]) -> None:
    rng = _rng("rms_norm_backward", shape)
    grad, x, w = _randn(rng, shape, 1.0), _randn(rng, shape), _randn(rng, shape[-1:], 1.0)
    gx, gw = _call("rms_norm_backward", grad, x, w, 1e-6)
    want_gx, want_gw = _reference("rms_norm_backward")(grad, x, w, 1e-6)
    _close(gx, want_gx)
    # grad_weight sums over every row (520 of them for the largest case): the
    # kernel sums per thread, then the partials; NumPy pairwise.
    _close(gw, want_gw, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_add_rms_norm_float64(shape: tuple[int, ...]) -> None:
    rng = _rng("fused_add_rms_norm", shape)
    inp, res, w = _randn(rng, shape), _randn(rng, shape), _randn(rng, shape[-1:], 1.0)
    want_in, want_res = inp.copy(), res.copy()
    _reference("fused_add_rms_norm")(want_in, want_res, w, 1e-6)
    assert _call("fused_add_rms_norm", inp, res, w, 1e-6) is None
    _close(res, want_res, rtol=0, atol=0)  # one addition, rounded once
    _close(inp, want_in)


# ---------------------------------------------------------------------------
# rotary_embedding
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize(("pos_shape", "head_size", "rot_dim", "heads", "kv_heads"),
                         [((1,), 8, 8, 1, 1), ((7,), 64, 32, 4, 2), ((2, 5), 130, 128, 3, None)])
def test_rotary_embedding_float64(is_neox: bool, pos_shape: tuple[int, ...], head_size: int, rot_dim: int,
                                  heads: int, kv_heads: int | None) -> None:
    rng = _rng("rotary", pos_shape, head_size, is_neox)
    max_position = 97
    positions = rng.integers(0, max_position, pos_shape).astype(np.int64)
    query = _randn(rng, (*pos_shape, heads * head_size))
    key = None if kv_heads is None else _randn(rng, (*pos_shape, kv_heads, head_size))
    cache = _randn(rng, (max_position, rot_dim), 1.0)
    want_q = query.copy()
    want_k = None if key is None else key.copy()
    _reference("rotary_embedding")(positions, want_q, want_k, head_size, cache, is_neox)
    _call("rotary_embedding", positions, query, key, head_size, cache, is_neox)
    _close(query, want_q)
    if key is not None:
        _close(key, want_k)


# ---------------------------------------------------------------------------
# add on integers; dtypes no kernel takes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_add_integers(dtype: Any, shape: tuple[int, ...]) -> None:
    info = np.iinfo(dtype)
    rng = _rng("add", dtype, shape)
    x = rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    y = rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    got = _call("add", x, y)
    assert got.dtype == dtype
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got, x + y)  # wraps around on overflow, as NumPy does


def test_add_wraps_around_at_the_integer_limits() -> None:
    for dtype in (np.int32, np.int64):
        info = np.iinfo(dtype)
        x = np.array([info.max, info.min, -1, 5], dtype=dtype)
        y = np.array([1, -1, 1, -7], dtype=dtype)
        np.testing.assert_array_equal(_call("add", x, y), np.array([info.min, info.max, 0, -2], dtype=dtype))


@pytest.mark.parametrize(("name", "args", "message"), [
    ("gelu", lambda: (np.ones(3, np.int64),),
     "gelu: x must have dtype float32, float16, bfloat16 or float64, got int64"),
    ("rms_norm", lambda: (np.ones((2, 4), np.int32), np.ones(4, np.int32), 1e-6),
     "rms_norm: x must have dtype float32, float16, bfloat16 or float64, got int32"),
    ("add", lambda: (np.ones(3, np.bool_), np.ones(3, np.bool_)),
     "add: x must have dtype float32, float16, bfloat16, float64, int32 or int64, got bool"),
])
def test_other_dtypes_are_refused_naming_the_accepted_ones(name: str, args: Callable[[], tuple[Any, ...]],
                                                          message: str) -> None:
    with pytest.raises(TypeError, match=message):
        _call(name, *args())
