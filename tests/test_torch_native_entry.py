"""The public callable's C entry into the native shim (``native/python_entry.h``).

``opbridge.ops.<op>`` calls the entry before its Python fast path. Each test
asserts something that fails without it: the entry's call counter moves, the
call makes no C call but the entry's, and where the entry declines, the
counter stays put and the results and messages equal the Python path's (the
same callable with its entry answering ``NotImplemented``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import opbridge
import opbridge.ops as ops
from opbridge.adapters.torch import native
from opbridge.testing.generate import make_cases
from test_torch_adapter import RecordingMode
from test_torch_native import BUILTINS, _clone, _same, _tensors, built_shim


@pytest.fixture(scope="module", autouse=True)
def shim() -> native.Shim:
    sh = built_shim()
    x = torch.ones(4)
    ops.add(x, x)  # installs add's fast path, and with it the entry
    return sh


def _entry(op: opbridge.OpDef) -> int:
    n = native.entry_calls(op)
    assert n is not None, f"{op.name} has no native kernels"
    return n


@contextmanager
def python_path(op: opbridge.OpDef) -> Iterator[None]:
    """The callable as it was before the entry: its entry declines every call."""
    ns = op.call.__globals__
    saved = {k: ns[k] for k in ("_t_native", "_t_native_out") if k in ns}
    assert "_t_native" in saved, f"{op.name}: no C entry installed"
    for k in saved:
        ns[k] = lambda *a: NotImplemented
    try:
        yield
    finally:
        ns.update(saved)


def _outcome(fn: Callable[[], Any]) -> Any:
    """The result, or the error's type and message (random inputs drawn the same each time)."""
    torch.manual_seed(0)
    try:
        return fn()
    except Exception as e:  # compared, not handled
        return (type(e), str(e))


def _assert_same_outcome(op: opbridge.OpDef, call: Callable[[], Any], entered: bool = False) -> Any:
    before = _entry(op)
    got = _outcome(call)
    assert _entry(op) == before + int(entered), f"{op.name}: the entry {'declined' if entered else 'took'} the call"
    with python_path(op):
        expected = _outcome(call)
    if isinstance(expected, tuple) and len(expected) == 2 and isinstance(expected[0], type):
        assert got == expected
    else:
        _same(got, expected)
    return got


@pytest.mark.parametrize("op", BUILTINS, ids=lambda o: o.name)
def test_every_builtin_op_and_dtype_runs_through_the_entry_bit_equal_to_the_python_path(op: opbridge.OpDef) -> None:
    fn = op.call
    fn(*_tensors(op, make_cases(op, op.dtypes[0])[0], op.dtypes[0]))  # installs the fast path and the entry
    mutated = [i for i, a in enumerate(op.schema.arguments) if a.is_mutated]
    for dtype in op.dtypes:
        cases = [c for c in make_cases(op, dtype) if c.get("_noncontiguous") is None][:3]
        assert cases
        for case in cases:
            args = _tensors(op, case, dtype)
            entry_args, python_args = _clone(args), _clone(args)
            versions = [entry_args[i]._version for i in mutated if entry_args[i] is not None]
            before = _entry(op)
            got = fn(*entry_args)
            assert _entry(op) == before + 1, f"{op.name} {dtype}: not run by the C entry"
            with python_path(op):
                expected = fn(*python_args)
            _same(got, expected)
            assert [entry_args[i]._version for i in mutated if entry_args[i] is not None] == [
                v + 1 for v in versions], f"{op.name}: mutated arguments' versions not bumped"
            for i in mutated:
                _same(entry_args[i], python_args[i])


def test_the_call_makes_no_c_call_but_the_entrys() -> None:
    x, y = torch.randn(8), torch.randn(8)
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call":
            seen.append(arg.__name__)
        elif event == "call":
            seen.append(frame.f_code.co_name)

    ops.add(x, y)
    sys.setprofile(profile)
    try:
        ops.add(x, y)
    finally:
        sys.setprofile(None)
    # The callable itself, the Dynamo probe (a Python function in torch 2.x, which Dynamo folds) and
    # the entry: no empty_like, no tvm-ffi call, no torch._C probe.
    seen = [s for s in seen if s != "setprofile"]
    assert seen[0] == "add" and seen[-1] == "opbridge_native_entry"
    assert set(seen) <= {"add", "is_dynamo_compiling", "opbridge_native_entry"}, seen


def test_out_runs_through_the_entry_and_bumps_the_version() -> None:
    op = ops.add.opdef
    x, y, out = torch.randn(3, 5), torch.randn(3, 5), torch.full((3, 5), float("nan"))
    version = out._version
    before = _entry(op)
    assert ops.add(x, y, out=out) is out
    assert _entry(op) == before + 1 and out._version == version + 1
    _same(out, x + y)
    wrong = torch.empty(3, 4)
    _assert_same_outcome(op, lambda: ops.add(x, y, out=wrong))  # the kernel refuses: today's message
    _assert_same_outcome(op, lambda: ops.add(x, y, out=torch.empty(5, 3).t()))  # a strided out=


def test_out_of_several_outputs_runs_through_the_entry() -> None:
    """out= a tuple, for an op whose returns are its outputs (rms_norm_backward's (dx, dw)): the entry writes
    both, bumps both versions and returns the tuple; what it cannot take has the Python path's outcome."""
    op = ops.rms_norm_backward.opdef
    g, x, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    want = ops.rms_norm_backward(g, x, w)
    outs = (torch.full((3, 8), float("nan")), torch.full((8,), float("nan")))
    versions = [o._version for o in outs]
    before = _entry(op)
    assert ops.rms_norm_backward(g, x, w, out=outs) is outs
    assert _entry(op) == before + 1 and [o._version for o in outs] == [v + 1 for v in versions]
    for got, ref in zip(outs, want, strict=True):
        _same(got, ref)
    _assert_same_outcome(op, lambda: ops.rms_norm_backward(g, x, w, out=(outs[0], torch.empty(4))))  # wrong shape
    _assert_same_outcome(op, lambda: ops.rms_norm_backward(g, x, w, out=(outs[0],)))  # too few
    def over_grad() -> Any:  # dx over grad: a fresh buffer, copied back
        gc = g.clone()
        return ops.rms_norm_backward(gc, x, w, out=(gc, torch.empty(8)))

    _assert_same_outcome(op, over_grad)
    buf = torch.zeros(32)
    _assert_same_outcome(op, lambda: ops.rms_norm_backward(g, x, w, out=(buf[:24].view(3, 8), buf[20:28])))


class _Sub(torch.Tensor):
    pass


class _Seen(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


FALLBACKS: dict[str, Callable[[], Any]] = {
    "strided": lambda: ops.add(torch.randn(4, 8)[:, ::2], torch.randn(4, 4)),
    "requires_grad": lambda: ops.rms_norm(torch.randn(3, 8, requires_grad=True), torch.randn(8)),
    "undeclared dtype": lambda: ops.add(torch.ones(3, dtype=torch.int16), torch.ones(3, dtype=torch.int16)),
    "mixed dtypes": lambda: ops.add(torch.ones(3), torch.ones(3, dtype=torch.float64)),
    "shape mismatch": lambda: ops.add(torch.ones(3), torch.ones(4)),
    "subclass": lambda: ops.add(torch.ones(3).as_subclass(_Sub), torch.ones(3)),
    "parameter": lambda: ops.add(torch.nn.Parameter(torch.ones(3), requires_grad=False), torch.ones(3)),
    "meta": lambda: ops.add(torch.ones(3, device="meta"), torch.ones(3, device="meta")),
    "mixed devices": lambda: ops.add(torch.ones(3), torch.ones(3, device="meta")),
    "not a tensor": lambda: ops.add(torch.ones(3), 2.0),
    "none": lambda: ops.add(torch.ones(3), None),
    "int eps": lambda: ops.rms_norm(torch.randn(2, 8), torch.randn(8), 1),
    "neg view": lambda: ops.add(torch._neg_view(torch.ones(3)), torch.ones(3)),
    "alias": lambda: (lambda x: ops.fused_add_rms_norm(x, x, torch.randn(8)))(torch.randn(2, 8)),
}


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_calls_the_entry_declines_give_the_python_paths_results_and_messages(name: str) -> None:
    call = FALLBACKS[name]
    op = {"requires_grad": ops.rms_norm, "int eps": ops.rms_norm, "alias": ops.fused_add_rms_norm}.get(name, ops.add)
    # strided: the entry declines the call, and takes the fast path's call on its dense copies
    _assert_same_outcome(op.opdef, call, entered=name == "strided")


def test_a_numpy_float64_scalar_is_taken_as_the_python_path_takes_it() -> None:
    """numpy.float64 is a float: the entry takes it where a float is declared, as the other C entries do,
    with the Python path's result; numpy.float32 is not, and goes to the Python path."""
    import numpy as np

    x, w = torch.randn(2, 8), torch.randn(8)
    _assert_same_outcome(ops.rms_norm.opdef, lambda: ops.rms_norm(x, w, np.float64(1e-6)), entered=True)
    _assert_same_outcome(ops.rms_norm.opdef, lambda: ops.rms_norm(x, w, np.float32(1e-6)))


def test_parameter_weights_are_taken_where_nothing_is_recorded() -> None:
    """A model's weight is a torch.nn.Parameter: taken beside a plain tensor under no_grad and inference_mode
    (before, these calls went through torch.ops: 2.2 us against 0.84), or when it needs no grad; declined
    while autograd records it, and as out=; the same outcome as the Python path each time."""
    x, w = torch.randn(4, 16), torch.randn(16)
    p = torch.nn.Parameter(w.clone())
    op = ops.rms_norm.opdef
    with torch.no_grad():
        _same(_assert_same_outcome(op, lambda: ops.rms_norm(x, p, 1e-6), entered=True), ops.rms_norm(x, w, 1e-6))
    with torch.inference_mode():
        _assert_same_outcome(op, lambda: ops.rms_norm(x, p, 1e-6), entered=True)
    frozen = torch.nn.Parameter(w.clone(), requires_grad=False)
    _assert_same_outcome(op, lambda: ops.rms_norm(x, frozen, 1e-6), entered=True)
    before = _entry(op)
    y = ops.rms_norm(x, p, 1e-6)  # grad mode on, p requires grad: the autograd path records it
    assert _entry(op) == before and y.requires_grad
    y.sum().backward()
    assert p.grad is not None
    with torch.no_grad():
        _assert_same_outcome(ops.gelu.opdef, lambda: ops.gelu(x, out=torch.nn.Parameter(torch.empty(4, 16))))


def test_grad_flows_as_before() -> None:
    x = torch.randn(3, 8, requires_grad=True)
    before = _entry(ops.rms_norm.opdef)
    out = ops.rms_norm(x, torch.randn(8))
    assert out.requires_grad and _entry(ops.rms_norm.opdef) == before
    out.sum().backward()
    assert x.grad is not None


def test_modes_and_transforms_see_the_call() -> None:
    op = ops.add.opdef
    x, y = torch.randn(4), torch.randn(4)
    before = _entry(op)
    with _Seen() as seen:
        _same(ops.add(x, y), x + y)
    assert any("opbridge.add" in n for n in seen.names)
    with RecordingMode() as dispatched:
        _same(ops.add(x, y), x + y)
    assert any("opbridge.add" in n for n in dispatched.seen)
    _same(torch.vmap(ops.add)(x.reshape(2, 2), y.reshape(2, 2)), (x + y).reshape(2, 2))
    traced = torch.jit.trace(lambda a, b: ops.add(a, b), (x, y), check_trace=False)
    assert "opbridge::add" in str(traced.graph)
    assert _entry(op) == before


def test_inference_tensors_are_written_inside_inference_mode_only() -> None:
    op = ops.fused_add_rms_norm.opdef
    with torch.inference_mode():
        x, res = torch.randn(2, 8), torch.randn(2, 8)
    w = torch.randn(8)
    ops.fused_add_rms_norm(torch.randn(2, 8), torch.randn(2, 8), w)  # installs its fast path and entry (run alone)
    expect_x, expect_res = x.clone(), res.clone()
    with python_path(op):
        ops.fused_add_rms_norm(expect_x, expect_res, w)
    before = _entry(op)
    saved_x, saved_res = x.clone(), res.clone()
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        ops.fused_add_rms_norm(x, res, w)  # as torch raises; the entry declines, nothing is written
    assert _entry(op) == before
    _same(x, saved_x)
    _same(res, saved_res)
    with torch.inference_mode():
        assert ops.fused_add_rms_norm(x, res, w) is None  # no version counter to bump: no error either
    assert _entry(op) == before + 1
    _same(x, expect_x)
    _same(res, expect_res)


def test_compiled_graphs_trace_the_dispatcher_call() -> None:
    op = ops.add.opdef
    x, y = torch.randn(8), torch.randn(8)
    compiled = torch.compile(lambda a, b: ops.add(a, b) * 2, fullgraph=True, backend="aot_eager")
    _same(compiled(x, y), (x + y) * 2)
    before, native_before = _entry(op), native.native_calls(op)
    _same(compiled(x, y), (x + y) * 2)
    assert _entry(op) == before and native.native_calls(op) == native_before + 1
