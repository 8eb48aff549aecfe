"""The NumPy adapter: eager calls, out=, and named errors."""

from __future__ import annotations

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
    with pytest.raises(TypeError, match="out\\[0\\] must be an array of the same framework"):
        ops.gelu(x, out=[0.0] * 4)
    with pytest.raises(opbridge.UnsupportedFrameworkError, match="gelu: argument 'x' must be an array"):
        ops.gelu("not an array")
