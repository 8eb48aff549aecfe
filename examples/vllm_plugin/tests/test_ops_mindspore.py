"""The plugin's ops on MindSpore tensors (run with a MindSpore environment's Python, in its own process).

Skips when MindSpore or opbridge's MindSpore adapter is not installed.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="MindSpore is not installed in this environment")
if importlib.util.find_spec("opbridge.adapters.mindspore") is None:
    pytest.skip("opbridge's MindSpore adapter (opbridge/adapters/mindspore.py) is not installed yet",
                allow_module_level=True)

from vllm_plugin import _custom_ops as ops  # noqa: E402
from vllm_plugin.ops import LIBRARY  # noqa: E402


def _silu_and_mul(x: np.ndarray) -> np.ndarray:
    return np.asarray(LIBRARY.ops["silu_and_mul"].reference(x.astype(np.float64)))


def test_silu_and_mul_forward() -> None:
    x = np.random.default_rng(0).standard_normal((4, 10)).astype(np.float32)
    out = ops.silu_and_mul(ms.Tensor(x))
    assert isinstance(out, ms.Tensor) and tuple(out.shape) == (4, 5)
    np.testing.assert_allclose(out.asnumpy(), _silu_and_mul(x), rtol=1e-5, atol=1e-6)


def test_silu_and_mul_backward_from_the_yaml_derivatives() -> None:
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    grad = ms.grad(lambda t: ops.silu_and_mul(t).sum())(ms.Tensor(x))
    want = LIBRARY.ops["silu_and_mul_backward"].reference(np.ones((3, 4)), x.astype(np.float64))
    np.testing.assert_allclose(grad.asnumpy(), want, rtol=1e-4, atol=1e-5)


def test_scale_in_place() -> None:
    x = ms.Tensor(np.arange(6, dtype=np.float32))
    assert ops.scale_(x, 2.0) is None
    np.testing.assert_allclose(x.asnumpy(), np.arange(6) * 2.0)


def test_advance_step_in_place() -> None:
    seq_lens = ms.Tensor(np.array([3, 4], np.int32))
    tokens, positions, slots = (ms.Tensor(np.zeros(2, np.int64)) for _ in range(3))
    tables = ms.Tensor(np.array([[7, 8], [9, 10]], np.int32))
    ops.advance_step_flashattn(2, 2, 4, tokens, ms.Tensor(np.array([[11], [12]], np.int64)), positions,
                               seq_lens, slots, tables)
    assert tokens.asnumpy().tolist() == [11, 12] and seq_lens.asnumpy().tolist() == [4, 5]
    assert slots.asnumpy().tolist() == [7 * 4 + 3, 10 * 4]


def test_fused_add_rms_norm_in_place() -> None:
    rng = np.random.default_rng(2)
    x, res, w = (rng.standard_normal(s).astype(np.float32) for s in ((3, 16), (3, 16), (16,)))
    xt, rt = ms.Tensor(x), ms.Tensor(res)
    ops.fused_add_rms_norm(xt, rt, ms.Tensor(w), 1e-6)
    total = x.astype(np.float64) + res
    want = total / np.sqrt(np.mean(total * total, axis=-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(rt.asnumpy(), total, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(xt.asnumpy(), want, rtol=1e-5, atol=1e-5)
