"""The tensor entry's method reader (opbridge.call.exchange, method_arrays.h) on MindSpore: the calls it takes,
the ones it leaves to Python. Runs in MindSpore's environment (scripts/test.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from mindspore import Tensor  # noqa: E402
from mindspore.graph.api import _pynative_executor  # noqa: E402

from _entry_checks import (  # noqa: E402
    RNG,
    Entry,
    kernel_errors_are_raised_after_one_run,
    outputs_shaped_by_a_shape_rule,
    overlapping_written_arguments_are_named_by_python,
    parameter_weights,
    qkv_slices_are_taken_where_they_lie,
    results_equal_the_reference,
    several_outputs_out,
    threads,
    unpassable_arguments_are_named_by_python,
)
from opbridge import config, loader, ops  # noqa: E402
from opbridge.adapters.mindspore.eager import ENTRY_TENSORS  # noqa: E402
from opbridge.build import compile as bcompile  # noqa: E402
from opbridge.call import exchange  # noqa: E402
from opbridge.testing.compare import assert_close  # noqa: E402


@pytest.fixture(scope="module")
def entry() -> exchange.Library:
    if not config.exchange_entry():  # the entry is off: nothing installs it (the adapters' tests run without it)
        pytest.skip("OPBRIDGE_EXCHANGE_ENTRY=0")
    lib = exchange.ENTRY.library(build_now=True)
    if lib is None:
        pytest.skip("the tensor entry could not be built here")
    for op in ops.LIBRARY.ops.values():  # as each op's first call on MindSpore tensors does
        exchange.install(op, loader.kernel(op, "cpu"), ENTRY_TENSORS)
    return lib


def _t(a: np.ndarray) -> Tensor:
    return Tensor(a)


def _np(t: Tensor) -> np.ndarray:
    return t.asnumpy()


E = Entry("mindspore", _t, _np)
_calls, _taken, _left = E.calls, E.taken, E.left


def test_a_shape_rule_dimension_below_zero_is_refused(entry: exchange.Library, tmp_path: Any) -> None:
    """MindSpore's tensors: a negative dimension (MindSpore's -1 means a dynamic one) or too many elements is
    the op's ValueError, never a tensor the entry makes."""
    import opbridge
    from _split_sum import REPEAT_FIRST_CC, declare_repeat_first, shape_rule_dimensions_below_zero_are_refused

    (tmp_path / "rep.cc").write_text("#include <opbridge/opbridge.h>\nusing tvm::ffi::TensorView;\n" + REPEAT_FIRST_CC)
    lib = opbridge.Library("ms_entry_rep", sources=["rep.cc"], root=tmp_path, dtypes=["float32"])
    repeat_first = declare_repeat_first(lib)
    shape_rule_dimensions_below_zero_are_refused(
        repeat_first, _t, lambda: exchange.entry_calls(lib.ops["repeat_first"], "mindspore"))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_results_equal_the_reference(entry: exchange.Library, dtype: str) -> None:
    def check(got: Any) -> None:
        assert type(got) is Tensor and got.is_contiguous() and got.dtype == getattr(ms, dtype)

    results_equal_the_reference(E, dtype, check)


def test_outputs_shaped_by_a_shape_rule(entry: exchange.Library) -> None:
    outputs_shaped_by_a_shape_rule(E)


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
    _taken("gelu", wide[:, ::2])  # strided, not declared row_strided: declined, then its dense copy's call is taken
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
    qkv_slices_are_taken_where_they_lie(E, lambda t: Tensor(_np(t).copy()))


def test_overlapping_written_arguments_are_named_by_python(entry: exchange.Library) -> None:
    overlapping_written_arguments_are_named_by_python(E)


def test_kernel_errors_are_raised_after_one_run(entry: exchange.Library) -> None:
    kernel_errors_are_raised_after_one_run(E)


def test_unpassable_arguments_are_named_by_python(entry: exchange.Library) -> None:
    """A complex weight (MindSpore tensors reach a kernel as NumPy views of the dtypes opbridge maps), ints
    outside int64."""
    unpassable_arguments_are_named_by_python(E, _t(np.ones(4, np.complex64)),
                                             r"rms_norm: argument 'weight' has dtype complex64, which no kernel "
                                             r"takes \(opbridge hands a kernel MindSpore tensors of float32, .* "
                                             r"only\); convert it first, e\.g\. weight\.astype\(\"float32\"\)")


def test_outputs_are_freed(entry: exchange.Library) -> None:
    """The entry's outputs hold no extra reference: MindSpore frees each with its tensor."""
    x = _t(np.ones((8, 64), np.float32))
    got = _taken("gelu", x)
    assert sys.getrefcount(got) == 2  # the name here, and getrefcount's argument
    got = _taken("silu_and_mul", x)
    assert sys.getrefcount(got) == 2


def test_threads(entry: exchange.Library) -> None:
    threads(E)


def test_out_of_several_outputs_is_written_by_the_entry(entry: exchange.Library) -> None:
    several_outputs_out(E)


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


def test_parameter_weights(entry: exchange.Library) -> None:
    parameter_weights(E, lambda a: ms.Parameter(Tensor(a), name="w"))
