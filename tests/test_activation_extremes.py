"""The activation backward ops at extreme inputs: |x| up to the dtype's largest finite value and +-inf.

gelu_backward, silu_and_mul_backward and gelu_and_mul_backward once gave
wrong gradients far out on the tails while their forwards were fine: x dz/dx
(which grows like x^3) met the exp's floor (1 - s never reaches 0) or
overflowed, so gelu' was 3.6 at x = 1e13 (float32), -3.9e3 at -1e13 and
+-inf from |x| ~ 1e13 on, silu' 4.7 at 3e38, and in float64 gelu' was inf
from 1e103. The kernels now clamp x in the derivative (activation_math.h's
kGeluGrad* / kSiluGrad*). Each op and dtype is compared here with the op's
own NumPy reference, evaluated in float64 on the dtype-rounded inputs and
rounded to the dtype, within the op's declared tolerance, wherever that
reference is defined (not NaN: it is inf * 0 at x = +-inf, and for gelu where
x^2 or x^3 overflows in float64); there the derivative must be its limit, 1 for
x -> +inf and 0 for x -> -inf.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import opbridge.ops

OPS = opbridge.ops.LIBRARY.ops
NAMES = ["gelu_backward", "silu_and_mul_backward", "gelu_and_mul_backward"]
DTYPES = ["float32", "float64", "float16", "bfloat16"]

_BIG = [1e5, 1e10, 1e13, 1e30, 3e38]
_ORDINARY = [0.0, 0.5, -0.5, 1.0, -1.0, 3.0, -3.0, 9.0, -9.0, -9.7, -12.0, 25.0, 100.0, -100.0]
#: Per dtype, the extreme magnitudes that are finite in it (float16 tops out at 65504), then +-inf.
EXTREMES = {
    "float32": _BIG,
    "bfloat16": _BIG,
    "float16": [1e4, 3e4, 65504.0],
    "float64": [*_BIG, 1e100, 1e103, 1e150, 1e200, 1e300, 1.7e308],
}


def _values(dtype: str) -> np.ndarray:
    big = np.array(EXTREMES[dtype] + [np.inf])
    return np.concatenate([_ORDINARY, big, -big])


def _to(dtype: str, a: np.ndarray) -> Any:
    """a (float64) as an array of dtype: NumPy, or torch for bfloat16 (NumPy has none)."""
    if dtype == "bfloat16":
        torch = pytest.importorskip("torch")
        return torch.from_numpy(a).to(torch.bfloat16)
    return a.astype(dtype)


def _f64(v: Any) -> np.ndarray:
    """v (NumPy or torch, any float dtype) as float64 NumPy."""
    if hasattr(v, "detach"):
        return v.detach().double().numpy()  # type: ignore[no-any-return]
    return np.asarray(v).astype(np.float64)


def _args(name: str, dtype: str) -> tuple[Any, Any, int]:
    """(grad, x, n) for the op: x = the values (gelu_backward) or [a | b] with a = the values (gated)."""
    a = _values(dtype)
    n = a.size
    if name == "gelu_backward":
        return _to(dtype, np.full(n, -0.75)), _to(dtype, a), n
    x = np.concatenate([a, np.full(n, 1.5)])[None]  # b = 1.5: grad_a = grad 1.5 act'(a)
    return _to(dtype, np.full((1, n), -0.75)), _to(dtype, x), n


def _reference(name: str, dtype: str, grad: Any, x: Any) -> np.ndarray:
    """The op's NumPy reference in float64 on the (rounded) inputs, rounded to dtype, as float64."""
    ref = OPS[name].reference
    assert ref is not None
    with np.errstate(all="ignore"):
        want = np.asarray(ref(_f64(grad), _f64(x)), dtype=np.float64)
    return _f64(_to(dtype, want)) if dtype != "float64" else want


def _run(name: str, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    grad, x, n = _args(name, dtype)
    got = _f64(getattr(opbridge.ops, name)(grad, x)).reshape(-1)
    want = _reference(name, dtype, grad, x).reshape(-1)
    return got, want, _f64(x).reshape(-1)[:n], n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_extremes_match_reference(name: str, dtype: str) -> None:
    """Every element whose float64 reference is defined, within the op's tolerance."""
    got, want, a, n = _run(name, dtype)
    rtol, atol = OPS[name].tolerance(dtype)
    defined = ~np.isnan(want)
    assert defined[:n][np.abs(a) <= 1e100].all()  # undefined: x = +-inf, and where gelu's x^3 overflows
    xs = np.concatenate([a, a])[: got.size]  # the a value behind each element (grad_a, then grad_b)
    for i in np.flatnonzero(defined):
        g, w = got[i], want[i]
        ok = g == w if np.isinf(w) else abs(g - w) <= atol + rtol * abs(w)
        assert ok, f"{name} {dtype}: x = {xs[i]!r} gave {g!r}, reference {w!r} (element {i})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_derivative_limits_where_reference_is_undefined(name: str, dtype: str) -> None:
    """act'(x) -> 1 as x -> +inf and -> 0 as x -> -inf, where the formula itself gives inf * 0.

    grad_a (the first n elements) is grad * b * act'(a) = -0.75 * 1.5 * act'(a);
    gelu_backward's is grad * gelu'(x) = -0.75 * gelu'(x).
    """
    got, want, a, n = _run(name, dtype)
    scale = -0.75 if name == "gelu_backward" else -0.75 * 1.5
    undefined = np.isnan(want[:n])
    assert undefined[np.isinf(a)].all()  # the references' own inf * 0
    limit = np.where(a > 0, scale, 0.0)
    _, atol = OPS[name].tolerance(dtype)
    bad = undefined & ~(np.abs(got[:n] - limit) <= atol)
    assert not bad.any(), f"{name} {dtype}: x = {a[bad]} gave {got[:n][bad]}, limit {limit[bad]}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_nan_propagates(name: str, dtype: str) -> None:
    a = np.array([np.nan, 1.0])
    if name == "gelu_backward":
        out = _f64(opbridge.ops.gelu_backward(_to(dtype, np.ones(2)), _to(dtype, a)))
    else:
        x = np.concatenate([a, np.ones(2)])[None]
        out = _f64(getattr(opbridge.ops, name)(_to(dtype, np.ones((1, 2))), _to(dtype, x)))[0]
    assert np.isnan(out[0]) and np.isfinite(out[1])
