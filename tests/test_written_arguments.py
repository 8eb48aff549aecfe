"""Tensors an op writes through a dense copy: a strided mutated argument, an ``out=`` buffer.

Each is checked before any kernel runs (``call.layout.written_check``): a read-only or broadcast
array, one whose elements share memory (stride 0, rows closer than their width), and two ``out=``
buffers that share an element raise ValueError naming the op and the tensor, and nothing the caller
passed is written. Layouts whose elements are apart (slices, transposes, interleaved column slices)
still run, with the contiguous call's results.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import opbridge
from opbridge import ops

RNG = np.random.default_rng(0)
F32 = np.float32


def _f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(F32)


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


# -- which layouts share memory --------------------------------------------------------------------


def _brute_force(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    offsets = sorted(sum(i * s for i, s in zip(idx, strides)) for idx in itertools.product(*map(range, shape)))
    return any(b - a < itemsize for a, b in itertools.pairwise(offsets))


@pytest.mark.parametrize(("shape", "strides", "want"), [
    ((4, 8), (32, 4), False),  # C-contiguous
    ((8, 4), (4, 32), False),  # transposed
    ((4, 8), (64, 8), False),  # every other column
    ((4, 8), (-32, 4), False),  # negative stride
    ((4, 8), (0, 4), True),  # broadcast rows
    ((4, 8), (16, 4), True),  # rows closer than their width
    ((3, 3), (12, 8), False),  # nested in no order, yet apart: 0 8 16 12 20 28 24 32 40
    ((3, 3), (8, 4), True),  # 0 4 8 8 ...
    ((1, 8), (0, 4), False),  # a dim of one element has any stride
    ((0, 8), (0, 4), False),  # empty
    ((), (), False),
    ((4, 8), (32, 2), True),  # float32 elements two bytes apart
])
def test_self_overlaps(shape: tuple[int, ...], strides: tuple[int, ...], want: bool) -> None:
    from opbridge.call.layout import self_overlaps

    assert self_overlaps(0, shape, strides, 4) is want
    if all(shape):
        assert _brute_force(shape, strides, 4) is want


def test_self_overlaps_random_layouts() -> None:
    from opbridge.call.layout import self_overlaps

    rng = np.random.default_rng(1)
    for _ in range(500):
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(n) for n in rng.integers(1, 5, ndim))
        strides = tuple(int(s) * 4 for s in rng.integers(-6, 7, ndim))
        assert self_overlaps(0, shape, strides, 4) is _brute_force(shape, strides, 4), (shape, strides)


# -- NumPy: written arguments -----------------------------------------------------------------------


def _fused_inputs() -> tuple[np.ndarray, np.ndarray]:
    return _f32(4, 8), np.ones(8, F32)


@pytest.mark.parametrize("layout", ["strided", "broadcast", "transposed"])
def test_numpy_read_only_written_argument(layout: str) -> None:
    """A read-only residual that reaches the kernel as a copy: the contiguous call's error, before the kernel
    writes x (it used to run, then fail copying back: 'assignment destination is read-only')."""
    x, w = _fused_inputs()
    residual = {"strided": lambda: _read_only(_f32(4, 16)[:, ::2]),
                "broadcast": lambda: np.broadcast_to(_f32(8), (4, 8)),
                "transposed": lambda: _read_only(_f32(8, 4).T)}[layout]()
    x0, r0 = x.copy(), residual.copy()
    with pytest.raises(ValueError, match=r"^fused_add_rms_norm: argument 'residual' is read-only, and "
                                         r"fused_add_rms_norm writes it$"):
        ops.fused_add_rms_norm(x, residual, w)
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(residual, r0)


def test_numpy_read_only_strided_key_leaves_query() -> None:
    positions = np.arange(5, dtype=np.int64)
    query = _f32(5, 16)
    key = _read_only(_f32(8, 5).T)  # (5, 8), columns apart: a dense copy
    cache = RNG.standard_normal((16, 8)).astype(F32)
    q0 = query.copy()
    with pytest.raises(ValueError, match=r"^rotary_embedding: argument 'key' is read-only"):
        ops.rotary_embedding(positions, query, key, 8, cache, True)
    np.testing.assert_array_equal(query, q0)


def _advance_args(tokens: np.ndarray | None = None) -> list[Any]:
    n = 4
    return [n, n, 4, np.full(n, 7, np.int64) if tokens is None else tokens, np.ones((n, 1), np.int64),
            np.zeros(n, np.int64), np.array([1, 2, 3, 4], np.int32), np.zeros(n, np.int64),
            np.zeros((n, 4), np.int32)]


def test_numpy_broadcast_written_argument_leaves_the_others() -> None:
    args = _advance_args(np.broadcast_to(np.int64(7), (4,)))
    before = [np.array(a, copy=True) if isinstance(a, np.ndarray) else a for a in args]
    with pytest.raises(ValueError, match=r"^advance_step_flashattn: argument 'input_tokens' is read-only"):
        ops.advance_step_flashattn(*args)
    for a, b in zip(args, before):
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("row_stride", [0, 4])  # broadcast rows; rows 4 elements apart, 8 wide
def test_numpy_written_argument_sharing_memory(row_stride: int) -> None:
    x, w = _fused_inputs()
    base = _f32(64)
    residual = as_strided(base, (4, 8), (row_stride * 4, 4), writeable=True)
    x0, b0 = x.copy(), base.copy()
    with pytest.raises(ValueError, match=r"^fused_add_rms_norm: argument 'residual' has elements that share "
                                         r"memory"):
        ops.fused_add_rms_norm(x, residual, w)
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(base, b0)


def test_numpy_strided_written_arguments_apart_still_run() -> None:
    x, w = _fused_inputs()
    wide = _f32(4, 16)
    residual = wide[:, ::2]
    x_ref, r_ref = x.copy(), residual.copy()
    ops.fused_add_rms_norm(x_ref, r_ref, w)
    ops.fused_add_rms_norm(x, residual, w)
    np.testing.assert_array_equal(x, x_ref)
    np.testing.assert_array_equal(residual, r_ref)


# -- NumPy: out= -------------------------------------------------------------------------------------


@pytest.mark.parametrize("row_stride", [0, 4])
def test_numpy_out_sharing_memory(row_stride: int) -> None:
    base = np.zeros(64, F32)
    out = as_strided(base, (4, 8), (row_stride * 4, 4), writeable=True)
    with pytest.raises(ValueError, match=r"^add: out has elements that share memory"):
        ops.add(_f32(4, 8), _f32(4, 8), out=out)
    assert not base.any()


@pytest.mark.parametrize("second", [lambda d: d[0], lambda d: d[1, ::1], lambda d: d.reshape(-1)[4:12]])
def test_numpy_outs_overlapping_each_other(second: Any) -> None:
    g, x, w = _f32(4, 8), _f32(4, 8), np.ones(8, F32)
    d = np.zeros((4, 8), F32)
    with pytest.raises(ValueError, match=r"^rms_norm_backward: out\[0\] and out\[1\] overlap in memory"):
        ops.rms_norm_backward(g, x, w, out=(d, second(d)))
    assert not d.any()


def test_numpy_interleaved_outs_apart_still_run() -> None:
    g, x, w = _f32(4, 8), _f32(4, 8), np.ones(8, F32)
    dx, dw = ops.rms_norm_backward(g, x, w)
    buf = np.zeros((4, 16), F32)
    ops.rms_norm_backward(g, x, w, out=(buf[:, ::2], buf[0, 1::2]))
    np.testing.assert_array_equal(buf[:, ::2], dx)
    np.testing.assert_array_equal(buf[0, 1::2], dw)


# -- Paddle ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def paddle() -> Any:
    return pytest.importorskip("paddle")


@pytest.mark.parametrize("row_stride", [0, 4])
def test_paddle_written_argument_sharing_memory(paddle: Any, row_stride: int) -> None:
    x = paddle.to_tensor(_f32(4, 8))
    base = paddle.to_tensor(_f32(64))
    residual = paddle.as_strided(base, [4, 8], [row_stride, 1])
    x0, b0 = x.numpy().copy(), base.numpy().copy()
    with pytest.raises(ValueError, match=r"^fused_add_rms_norm: argument 'residual' has elements that share "
                                         r"memory"):
        ops.fused_add_rms_norm(x, residual, paddle.ones([8]))
    np.testing.assert_array_equal(x.numpy(), x0)
    np.testing.assert_array_equal(base.numpy(), b0)


def test_paddle_out_sharing_memory(paddle: Any) -> None:
    base = paddle.zeros([8])
    with pytest.raises(ValueError, match=r"^add: out has elements that share memory"):
        ops.add(paddle.to_tensor(_f32(4, 8)), paddle.to_tensor(_f32(4, 8)), out=paddle.as_strided(base, [4, 8], [0, 1]))
    assert not base.numpy().any()


def test_paddle_outs_overlapping_each_other(paddle: Any) -> None:
    g, x, w = (paddle.to_tensor(a) for a in (_f32(4, 8), _f32(4, 8), np.ones(8, F32)))
    d = paddle.zeros([4, 8])
    with pytest.raises(ValueError, match=r"^rms_norm_backward: out\[0\] and out\[1\] overlap in memory"):
        ops.rms_norm_backward(g, x, w, out=(d, d[0]))
    assert not d.numpy().any()


def test_paddle_interleaved_outs_apart_still_run(paddle: Any) -> None:
    g, x, w = (paddle.to_tensor(a) for a in (_f32(4, 8), _f32(4, 8), np.ones(8, F32)))
    dx, dw = ops.rms_norm_backward(g, x, w)
    buf = paddle.zeros([4, 16])
    ops.rms_norm_backward(g, x, w, out=(buf[:, ::2], buf[0, 1::2]))
    np.testing.assert_array_equal(buf.numpy()[:, ::2], dx.numpy())
    np.testing.assert_array_equal(buf.numpy()[0, 1::2], dw.numpy())


# -- torch: out= buffers over each other, and written arguments through its dense copies ------------


def test_torch_outs_overlapping_each_other() -> None:
    torch = pytest.importorskip("torch")
    g, x, w = torch.randn(4, 8), torch.randn(4, 8), torch.ones(8)
    d = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"^rms_norm_backward: out\[0\] and out\[1\] overlap in memory"):
        ops.rms_norm_backward(g, x, w, out=(d, d[0]))
    assert not d.any()
    buf = torch.zeros(4, 16)  # interleaved out= slices of one buffer that share no element still run
    ops.rms_norm_backward(g, x, w, out=(buf[:, ::2], buf[0, 1::2]))
    ex, ew = ops.rms_norm_backward(g, x, w)
    torch.testing.assert_close(buf[:, ::2], ex, rtol=0, atol=0)
    torch.testing.assert_close(buf[0, 1::2], ew, rtol=0, atol=0)


def test_torch_a_written_argument_whose_elements_share_memory() -> None:
    """torch refused an expanded written argument only when copying it back, after the kernel had
    written the call's other tensors; now before anything runs, on every path."""
    torch = pytest.importorskip("torch")
    r, w = torch.randn(8), torch.ones(8)
    for _ in range(2):  # the first call and one a fast path may take
        x = torch.randn(4, 8)
        before = x.clone()
        with pytest.raises(ValueError, match=r"fused_add_rms_norm: argument 'residual' has elements that share"):
            ops.fused_add_rms_norm(x, r.expand(4, 8), w)
        assert torch.equal(x, before)


# -- MindSpore: its own environment (numpy<2), in a subprocess ---------------------------------------

_MS_SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, ops as msops
    import opbridge.ops as O

    def outcome(f, *watched):
        before = [t.asnumpy().copy() for t in watched]
        try:
            f()
            error = None
        except ValueError as e:
            error = str(e)
        return {"error": error, "unchanged": all(np.array_equal(t.asnumpy(), b) for t, b in zip(watched, before))}

    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((4, 8)).astype(np.float32))
    residual = msops.broadcast_to(Tensor(rng.standard_normal(8).astype(np.float32)), (4, 8))
    g = Tensor(rng.standard_normal((4, 8)).astype(np.float32))
    d = msops.zeros((4, 8), ms.float32)
    w = msops.ones(8, ms.float32)
    print(json.dumps({
        "broadcast_stride": list(residual.stride()),
        "written": outcome(lambda: O.fused_add_rms_norm(x, residual, w), x),
        "outs": outcome(lambda: O.rms_norm_backward(g, x, w, out=(d, d[0])), d),
    }))
""")


def _ms_python() -> str:
    from opbridge.bench.frameworks import ms_python

    python, why = ms_python()
    if python is None:
        pytest.skip(f"MindSpore: {why}")
    return python


def test_mindspore_written_tensors() -> None:
    python = _ms_python()
    src = str(Path(opbridge.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([python, "-c", _MS_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0 and "No module named 'mindspore'" in proc.stderr:
        pytest.skip(f"MindSpore is not installed in {python}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if 0 not in got["broadcast_stride"]:
        pytest.skip(f"this MindSpore's broadcast_to makes a copy (strides {got['broadcast_stride']})")
    assert got["written"]["error"] is not None and got["written"]["error"].startswith(
        "fused_add_rms_norm: argument 'residual' has elements that share memory"), got
    assert got["written"]["unchanged"], got
    assert got["outs"]["error"] is not None and got["outs"]["error"].startswith(
        "rms_norm_backward: out[0] and out[1] overlap in memory"), got
    assert got["outs"]["unchanged"], got
