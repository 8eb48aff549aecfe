"""The DLPack exchange entry (opbridge.call.exchange) on Paddle: the calls it takes, the ones it leaves to Python."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from opbridge import config, loader, ops

paddle = pytest.importorskip("paddle")

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
from opbridge.adapters.paddle.eager import EXCHANGE  # noqa: E402
from opbridge.call import c_entry, exchange  # noqa: E402
from opbridge.testing.compare import assert_close  # noqa: E402


@pytest.fixture(scope="module")
def entry() -> exchange.Library:
    if not config.exchange_entry():  # the entry is off: nothing installs it (the adapters' tests run without it)
        pytest.skip("OPBRIDGE_EXCHANGE_ENTRY=0")
    if exchange.exchange_table(paddle.Tensor) is None:
        pytest.skip("this Paddle has no DLPack exchange table")
    lib = exchange.ENTRY.library(build_now=True)
    if lib is None:
        pytest.skip("the DLPack exchange entry could not be built here")
    for op in ops.LIBRARY.ops.values():  # as each op's first call on paddle tensors does
        exchange.install(op, loader.kernel(op, "cpu"), EXCHANGE)
    return lib


def _t(a: np.ndarray) -> Any:
    return paddle.to_tensor(a)


E = Entry("paddle", _t, lambda t: t.numpy())
_calls, _taken, _left = E.calls, E.taken, E.left


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_results_equal_the_reference(entry: exchange.Library, dtype: str) -> None:
    def check(got: Any) -> None:
        assert isinstance(got, paddle.Tensor) and got.is_contiguous() and got.stop_gradient

    results_equal_the_reference(E, dtype, check)


def test_outputs_shaped_by_a_shape_rule(entry: exchange.Library) -> None:
    outputs_shaped_by_a_shape_rule(E)


def test_bfloat16(entry: exchange.Library) -> None:
    x = paddle.to_tensor(RNG.standard_normal((4, 32)).astype(np.float32)).astype("bfloat16")
    got = _taken("add", x, x)
    assert got.dtype == paddle.bfloat16
    np.testing.assert_array_equal(got.astype("float32").numpy(), 2 * x.astype("float32").numpy())


def test_ops_that_write_their_arguments(entry: exchange.Library) -> None:
    """In place: the arguments are written where they lie, their inplace version bumped, None returned."""
    x, res = RNG.standard_normal((4, 64)).astype(np.float32), RNG.standard_normal((4, 64)).astype(np.float32)
    w = RNG.standard_normal(64).astype(np.float32)
    tx, tres = _t(x), _t(res)
    px, pres, v0 = tx.data_ptr(), tres.data_ptr(), tx._inplace_version()
    assert _taken("fused_add_rms_norm", tx, tres, _t(w), 1e-6) is None
    want_x, want_res = x.copy(), res.copy()
    ops.fused_add_rms_norm.opdef.reference(want_x, want_res, w, 1e-6)  # writes its arguments, as the kernel
    assert tx.data_ptr() == px and tres.data_ptr() == pres
    assert_close(tres.numpy(), want_res)
    assert_close(tx.numpy(), want_x)
    assert tx._inplace_version() == v0 + 1 and tres._inplace_version() == v0 + 1


def test_qkv_slices_are_taken_where_they_lie(entry: exchange.Library) -> None:
    qkv_slices_are_taken_where_they_lie(E, lambda t: t.clone())


def test_calls_left_to_python(entry: exchange.Library) -> None:
    """What the Python path must take: gradients to record, strided, undeclared dtypes, subclasses, pool sizes."""
    x = _t(np.ones((4, 8), np.float32))
    xg = x.clone()
    xg.stop_gradient = False
    y = _left("gelu", xg)
    assert not y.stop_gradient
    y.sum().backward()
    assert xg.grad is not None
    with paddle.no_grad():
        _taken("gelu", xg)  # grad off: nothing to record
    _taken("gelu", x)
    _taken("gelu", x[:, ::2])  # strided, not declared row_strided: declined, then its dense copy's call is taken
    with pytest.raises(TypeError, match="dtype"):
        _left("gelu", _t(np.ones(4, np.int32)))
    param = paddle.create_parameter([4], "float32")
    param.stop_gradient = True
    _left("gelu", param)  # a subclass of paddle.Tensor
    big = paddle.ones([1024, 1024])  # 4 MiB: the pool's output
    np.testing.assert_array_equal(_left("add", big, big).numpy(), np.full((1024, 1024), 2, np.float32))


def test_overlapping_written_arguments_are_named_by_python(entry: exchange.Library) -> None:
    overlapping_written_arguments_are_named_by_python(E)


def test_kernel_errors_are_raised_after_one_run(entry: exchange.Library) -> None:
    kernel_errors_are_raised_after_one_run(E)


def test_unpassable_arguments_are_named_by_python(entry: exchange.Library) -> None:
    """A sparse weight (DLPack carries dense tensors only), ints outside int64."""
    unpassable_arguments_are_named_by_python(E, paddle.ones([4]).to_sparse_coo(1),
                                             r"rms_norm: argument 'weight' has a sparse COO layout, which no kernel "
                                             r"takes \(DLPack carries dense tensors only\); convert it first, e\.g\. "
                                             r"weight\.to_dense\(\)")


def test_outputs_are_freed(entry: exchange.Library) -> None:
    """Every output the entry makes goes back when Paddle frees its tensor (Paddle 3.3 calls a DLPack deleter
    only when manager_ctx is set: without it each one leaked)."""
    x = _t(np.ones((8, 64), np.float32))
    base = entry.live()
    kept = [_taken("gelu", x) for _ in range(50)]
    assert entry.live() == base + 50
    del kept
    for _ in range(1000):
        ops.silu_and_mul(x)
    assert entry.live() == base


def test_threads(entry: exchange.Library) -> None:
    threads(E)


def test_takes_the_ops_their_kernels_declare() -> None:
    assert {name: c_entry.takes(op) for name, op in ops.LIBRARY.ops.items()} == dict.fromkeys(ops.LIBRARY.ops, True)


def test_dl_codes_match_dlpack() -> None:
    assert c_entry.dl_code("float32") == 2 | 32 << 8 | 1 << 16
    assert c_entry.dl_code("bfloat16") == 4 | 16 << 8 | 1 << 16
    assert c_entry.dl_code("bool") == 6 | 8 << 8 | 1 << 16


def test_off_builds_and_loads_nothing() -> None:
    code = ("import opbridge.ops as ops, paddle\nfrom opbridge.call import exchange\n"
            "x = paddle.ones([2])\nops.add(x, x); ops.add(x, x)\n"
            "print(exchange.ENTRY.loaded() is None, exchange.ENTRY.builder is None, "
            "exchange.entry_calls(ops.add.opdef, 'paddle'))\n")
    env = {**os.environ, "OPBRIDGE_EXCHANGE_ENTRY": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["True", "True", "None"]


def test_a_shape_rule_dimension_below_zero_is_refused(entry: exchange.Library, tmp_path: Any) -> None:
    """Paddle's entry once made a (-4,) tensor of a 0-byte buffer from such a rule (a negative byte count,
    wrapped); it now leaves the call to Python, which raises the op's error."""
    import opbridge
    from _split_sum import REPEAT_FIRST_CC, declare_repeat_first, shape_rule_dimensions_below_zero_are_refused

    (tmp_path / "rep.cc").write_text("#include <opbridge/opbridge.h>\nusing tvm::ffi::TensorView;\n" + REPEAT_FIRST_CC)
    lib = opbridge.Library("paddle_entry_rep", sources=["rep.cc"], root=tmp_path, dtypes=["float32"])
    repeat_first = declare_repeat_first(lib)
    shape_rule_dimensions_below_zero_are_refused(
        repeat_first, _t, lambda: exchange.entry_calls(lib.ops["repeat_first"], "paddle"))


def test_out_of_several_outputs_is_written_by_the_entry(entry: exchange.Library) -> None:
    several_outputs_out(E)


def test_out_is_written_by_the_entry(entry: exchange.Library) -> None:
    """out=: the entry's out= builtin writes the caller's tensor (its inplace version bumped) and returns it."""
    x, y = _t(RNG.standard_normal((4, 16)).astype(np.float32)), _t(RNG.standard_normal((4, 16)).astype(np.float32))
    o = paddle.empty([4, 16])
    v0 = o._inplace_version()
    assert _taken("add", x, y, out=o) is o
    np.testing.assert_array_equal(o.numpy(), x.numpy() + y.numpy())
    assert o._inplace_version() == v0 + 1
    h = paddle.empty([4, 8])
    assert _taken("silu_and_mul", x, out=h) is h
    assert_close(h.numpy(), ops.silu_and_mul.opdef.reference(x.numpy()))
    xc = x.clone()
    assert _left("add", xc, y, out=xc) is xc  # out= is an input: Python's fresh buffer, copied back
    np.testing.assert_array_equal(xc.numpy(), x.numpy() + y.numpy())
    wide = paddle.zeros([4, 32])
    _left("add", x, y, out=wide[:, ::2])  # strided out=: through a dense copy
    np.testing.assert_array_equal(wide.numpy()[:, ::2], x.numpy() + y.numpy())
    og = paddle.empty([4, 16])
    og.stop_gradient = False
    with pytest.raises(RuntimeError, match="out= does not support autograd"):
        _left("add", x, y, out=og)
    with paddle.no_grad():
        assert _taken("add", x, y, out=og) is og
    small = paddle.empty([2, 16])
    with pytest.raises(ValueError, match="add"):
        _left("add", x, y, out=small)  # the kernel's error, raised by the entry after one run


def test_each_entrys_key_covers_the_shared_call() -> None:
    """Both entries' builds hash the shared call's headers (call/py_entry.h, entry_state.h) and their own."""
    from opbridge.adapters.numpy import native
    from opbridge.build import compile as bcompile

    shared = {"py_entry.h", "entry_state.h"}
    assert shared | {"method_arrays.h"} <= {name for name, _ in bcompile.local_headers(exchange.spec())}
    numpy_spec = native.spec()
    assert c_entry.SHARED_DIR in numpy_spec.include_dirs  # an include directory: every header in it is hashed
    assert {name for name, _ in bcompile.local_headers(numpy_spec)} == {"arrays.h"}
    assert shared <= {p.name for p in c_entry.SHARED_DIR.glob("*.h")}


def test_parameter_weights(entry: exchange.Library) -> None:
    def param(a: np.ndarray) -> Any:
        p = paddle.create_parameter([a.shape[0]], "float32")
        p.set_value(a)
        p.stop_gradient = True
        return p

    with paddle.no_grad():
        parameter_weights(E, param)
