"""The tensor entry's method reader (opbridge.call.exchange, method_arrays.h) on MindSpore: the calls it takes,
the ones it leaves to Python. Runs in MindSpore's environment (scripts/test.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from mindspore import Tensor  # noqa: E402
from mindspore.graph.api import _pynative_executor  # noqa: E402

from opbridge import loader, ops  # noqa: E402
from opbridge.adapters.mindspore.eager import ENTRY_TENSORS  # noqa: E402
from opbridge.build import compile as bcompile  # noqa: E402
from opbridge.call import exchange  # noqa: E402
from opbridge.testing.compare import assert_close  # noqa: E402


@pytest.fixture(scope="module")
def entry() -> exchange.Library:
    lib = exchange.ENTRY.library(build_now=True)
    if lib is None:
        pytest.skip("the tensor entry could not be built here")
    for op in ops.LIBRARY.ops.values():  # as each op's first call on MindSpore tensors does
        exchange.install(op, loader.kernel(op, "cpu"), ENTRY_TENSORS)
    return lib


def _calls(name: str) -> int:
    got = exchange.entry_calls(getattr(ops, name).opdef, "mindspore")
    assert got is not None, f"{name} has no tensor entry"
    return got


def _taken(name: str, *args: Any, **kw: Any) -> Any:
    before = _calls(name)
    got = getattr(ops, name)(*args, **kw)
    assert _calls(name) == before + 1, f"{name}: the entry did not take the call"
    return got


def _left(name: str, *args: Any, **kw: Any) -> Any:
    before = _calls(name)
    got = getattr(ops, name)(*args, **kw)
    assert _calls(name) == before, f"{name}: the entry took a call it must leave to Python"
    return got


def _t(a: np.ndarray) -> Tensor:
    return Tensor(a)


def _np(t: Tensor) -> np.ndarray:
    return t.asnumpy()


RNG = np.random.default_rng(0)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_results_equal_the_reference(entry: exchange.Library, dtype: str) -> None:
    x, y, g = (RNG.standard_normal((5, 64)).astype(dtype) for _ in range(3))
    w = RNG.standard_normal(64).astype(dtype)
    tol = {"rtol": 2e-3, "atol": 2e-3} if dtype == "float16" else {}
    for name, args in (("add", (x, y)), ("gelu", (x,)), ("rms_norm", (x, w, 1e-6)),
                       ("silu_and_mul", (x,)), ("gelu_and_mul", (x,)), ("gelu_backward", (g, x))):
        op = getattr(ops, name).opdef
        got = _taken(name, *(_t(v) if isinstance(v, np.ndarray) else v for v in args))
        assert type(got) is Tensor and got.is_contiguous() and got.dtype == getattr(ms, dtype)
        assert_close(_np(got), op.reference(*args), **tol)


def test_outputs_shaped_by_a_shape_rule(entry: exchange.Library) -> None:
    """silu_and_mul halves the last dim: the rule's answer, kept per signature, across shapes and dtypes."""
    for shape, dt in (((3, 16), "float32"), ((3, 16), "float64"), ((2, 5, 8), "float32"), ((3, 16), "float32")):
        x = RNG.standard_normal(shape).astype(dt)
        got = _taken("silu_and_mul", _t(x))
        assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == getattr(ms, dt)
        assert_close(_np(got), ops.silu_and_mul.opdef.reference(x))


def test_bfloat16(entry: exchange.Library) -> None:
    pytest.importorskip("ml_dtypes")  # the entry's bfloat16 outputs are ml_dtypes buffers
    x = _t(np.arange(32, dtype=np.float32).reshape(4, 8) / 8).astype(ms.bfloat16)
    got = _taken("add", x, x)
    assert got.dtype == ms.bfloat16
    np.testing.assert_array_equal(_np(got.astype(ms.float32)), np.arange(32).reshape(4, 8) / 4)


def test_ops_that_write_their_arguments(entry: exchange.Library) -> None:
    """In place: the arguments are written where they lie, None returned."""
    x, res = RNG.standard_normal((4, 64)).astype(np.float32), RNG.standard_normal((4, 64)).astype(np.float32)
    w = RNG.standard_normal(64).astype(np.float32)
    tx, tres = _t(x), _t(res)
    px, pres = tx.data_ptr(), tres.data_ptr()
    assert _taken("fused_add_rms_norm", tx, tres, _t(w), 1e-6) is None
    want_x, want_res = x.copy(), res.copy()
    ops.fused_add_rms_norm.opdef.reference(want_x, want_res, w, 1e-6)  # writes its arguments, as the kernel
    assert tx.data_ptr() == px and tres.data_ptr() == pres
    assert_close(_np(tres), want_res)
    assert_close(_np(tx), want_x)


def test_inputs_produced_by_queued_mindspore_ops(entry: exchange.Library) -> None:
    """PyNative queues its ops: the entry waits for them (the framework's `before`) before reading a tensor."""
    a = RNG.standard_normal((256, 256)).astype(np.float32)
    x = Tensor(a)
    for _ in range(3):
        x = ms.ops.matmul(x, Tensor(np.eye(256, dtype=np.float32) * 1.5))
    got = _taken("gelu", x)
    assert_close(_np(got), ops.gelu.opdef.reference(a.astype(np.float64) * 1.5**3), rtol=1e-4, atol=1e-4)


def test_calls_left_to_python(entry: exchange.Library) -> None:
    """What the Python path must take: gradients to record, strided, undeclared dtypes, subclasses, tensors
    without memory yet, tensors on a device, pool sizes."""
    x = _t(np.ones((4, 8), np.float32))
    before = _calls("gelu")
    grad = ms.grad(lambda a: ops.gelu(a).sum())(x)  # recorded on the tape by the Python path
    assert _calls("gelu") == before
    assert_close(_np(grad), ops.gelu_backward.opdef.reference(np.ones((4, 8), np.float32), _np(x)))
    _taken("gelu", x)
    wide = _t(np.ones((4, 16), np.float32))
    assert not wide[:, ::2].is_contiguous()
    _left("gelu", wide[:, ::2])  # strided, not declared row_strided: one dense copy on the Python path
    with pytest.raises(TypeError, match="dtype"):
        _left("gelu", _t(np.ones(4, np.int32)))
    _left("gelu", ms.Parameter(_t(np.ones(4, np.float32)), name="p"))  # a subclass of Tensor
    lazy = Tensor(shape=(4,), dtype=ms.float32, init=ms.common.initializer.One())
    assert lazy.has_init
    np.testing.assert_array_equal(_np(_left("gelu", lazy)), _np(ops.gelu(_t(np.ones(4, np.float32)))))
    big = _t(np.ones((1024, 1024), np.float32))  # 4 MiB: the pool's output
    np.testing.assert_array_equal(_np(_left("add", big, big)), np.full((1024, 1024), 2, np.float32))


def test_tensors_on_a_device_are_left_to_python(entry: exchange.Library, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor whose device is not the host's: the Python path names op, framework and device."""
    import opbridge

    x = _t(np.ones(4, np.float32))
    with monkeypatch.context() as m:
        m.setattr(Tensor, "device", property(lambda self: "GPU:0"))
        before = _calls("add")
        with pytest.raises(opbridge.BackendUnavailableError, match=r"add: argument 'x' is a MindSpore tensor on GPU:0"):
            ops.add(x, x)
        assert _calls("add") == before
    np.testing.assert_array_equal(_np(_taken("add", x, x)), np.full(4, 2.0))


def test_qkv_slices_are_taken_where_they_lie(entry: exchange.Library) -> None:
    """rotary_embedding declares query and key row_strided: column slices of one qkv tensor, no copy."""
    tokens, heads, size = 6, 2, 16
    qkv = _t(RNG.standard_normal((tokens, 3 * heads * size)).astype(np.float32))
    cache = _t(RNG.standard_normal((32, size)).astype(np.float32))
    pos = _t(np.arange(tokens, dtype=np.int64))
    q, k = qkv[:, :heads * size], qkv[:, heads * size:2 * heads * size]
    if q.is_contiguous():
        pytest.skip("this MindSpore copies column slices")
    dense_q, dense_k = Tensor(_np(q).copy()), Tensor(_np(k).copy())
    want = _np(qkv).copy()
    _taken("rotary_embedding", pos, q, k, size, cache, True)
    ops.rotary_embedding(pos, dense_q, dense_k, size, cache, True)
    want[:, :heads * size], want[:, heads * size:2 * heads * size] = _np(dense_q), _np(dense_k)
    np.testing.assert_array_equal(_np(qkv), want)  # the v third untouched too


def test_overlapping_written_arguments_are_named_by_python(entry: exchange.Library) -> None:
    x = _t(np.ones((2, 64), np.float32))
    w = _t(np.ones(64, np.float32))
    before = _calls("fused_add_rms_norm")
    with pytest.raises(ValueError, match="overlaps argument 'residual' in memory"):
        ops.fused_add_rms_norm(x, x, w, 1e-6)
    assert _calls("fused_add_rms_norm") == before


def test_kernel_errors_are_raised_after_one_run(entry: exchange.Library) -> None:
    """A bad shape reaches the kernel, whose error is raised as tvm-ffi raises it: never a second run."""
    before = _calls("add")
    with pytest.raises(ValueError, match="add"):
        ops.add(_t(np.ones(3, np.float32)), _t(np.ones(4, np.float32)))
    assert _calls("add") == before


def test_outputs_are_freed(entry: exchange.Library) -> None:
    """The entry's outputs hold no extra reference: MindSpore frees each with its tensor."""
    x = _t(np.ones((8, 64), np.float32))
    got = _taken("gelu", x)
    assert sys.getrefcount(got) == 2  # the name here, and getrefcount's argument
    got = _taken("silu_and_mul", x)
    assert sys.getrefcount(got) == 2


def test_threads(entry: exchange.Library) -> None:
    x = _t(RNG.standard_normal((16, 64)).astype(np.float32))
    want = 2 * _np(x)
    bad: list[str] = []
    before = _calls("add")

    def work() -> None:
        for _ in range(200):
            if not np.array_equal(_np(ops.add(x, x)), want):
                bad.append("wrong")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad and _calls("add") == before + 800


def test_out_is_written_by_the_entry(entry: exchange.Library) -> None:
    """out=: the entry's out= builtin goes before the adapter's generated out= call and returns the caller's
    tensor; an out= that is an input, strided, or to be differentiated takes the Python path."""
    x, y = _t(RNG.standard_normal((4, 16)).astype(np.float32)), _t(RNG.standard_normal((4, 16)).astype(np.float32))
    o = Tensor(np.zeros((4, 16), np.float32))
    assert _taken("add", x, y, out=o) is o
    np.testing.assert_array_equal(_np(o), _np(x) + _np(y))
    h = Tensor(np.zeros((4, 8), np.float32))
    assert _taken("silu_and_mul", x, out=h) is h
    assert_close(_np(h), ops.silu_and_mul.opdef.reference(_np(x)))
    xc = Tensor(_np(x).copy())
    assert _left("add", xc, y, out=xc) is xc  # out= is an input: Python's fresh buffer, copied back
    np.testing.assert_array_equal(_np(xc), _np(x) + _np(y))
    wide = Tensor(np.zeros((4, 32), np.float32))
    assert not wide[:, ::2].is_contiguous()
    before = _calls("add")
    ops.add(x, y, out=wide[:, ::2])  # strided out=: the Python path (a view MindSpore may or may not write back)
    assert _calls("add") == before
    small = Tensor(np.zeros((2, 16), np.float32))
    with pytest.raises(ValueError, match="add"):
        _left("add", x, y, out=small)  # the kernel's error, raised by the entry after one run
    try:
        with pytest.raises(RuntimeError, match="out= writes into existing tensors"):
            ms.grad(lambda a: ops.gelu(a, out=Tensor(np.zeros(4, np.float32))).sum())(_t(np.ones(4, np.float32)))
    finally:  # MindSpore stays in grad mode after an error inside ms.grad: reset it
        _pynative_executor.clear_res()


def test_off_builds_and_loads_nothing() -> None:
    code = ("import mindspore, numpy as np, opbridge.ops as ops\nfrom opbridge.call import exchange\n"
            "x = mindspore.Tensor(np.ones(2, np.float32))\nops.add(x, x); ops.add(x, x)\n"
            "print(exchange.ENTRY.loaded() is None, exchange.ENTRY.builder is None, "
            "exchange.entry_calls(ops.add.opdef, 'mindspore'))\n")
    env = {**os.environ, "OPBRIDGE_EXCHANGE_ENTRY": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split()[-3:] == ["True", "True", "None"]


def test_the_entrys_key_covers_the_method_reader() -> None:
    assert "method_arrays.h" in {name for name, _ in bcompile.local_headers(exchange.spec())}
