"""What the tensor entry's tests check in every framework it reads (opbridge.call.exchange): Paddle's tensors
through their DLPack exchange table (test_exchange_entry.py), MindSpore's through their methods
(test_method_entry.py). Each framework gives how it makes a tensor from an ndarray and reads one back."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from opbridge import ops
from opbridge.call import exchange
from opbridge.testing.compare import assert_close


class Entry:
    """Counts the calls the entry completed for one framework's tensors; *to* and *back* convert arrays."""

    def __init__(self, framework: str, to: Callable[[np.ndarray], Any], back: Callable[[Any], np.ndarray]) -> None:
        self.framework, self.to, self.back = framework, to, back

    def calls(self, name: str) -> int:
        got = exchange.entry_calls(getattr(ops, name).opdef, self.framework)
        assert got is not None, f"{name} has no tensor entry for {self.framework}"
        return got

    def taken(self, name: str, *args: Any, **kw: Any) -> Any:
        """The op's result, asserting the entry took the call."""
        before = self.calls(name)
        got = getattr(ops, name)(*args, **kw)
        assert self.calls(name) == before + 1, f"{name}: the entry did not take the call"
        return got

    def left(self, name: str, *args: Any, **kw: Any) -> Any:
        """The op's result, asserting the entry left the call to the Python path."""
        before = self.calls(name)
        got = getattr(ops, name)(*args, **kw)
        assert self.calls(name) == before, f"{name}: the entry took a call it must leave to Python"
        return got


RNG = np.random.default_rng(0)


def results_equal_the_reference(e: Entry, dtype: str, check: Callable[[Any], None]) -> None:
    """Six ops through the entry against their references; *check* looks at each result tensor."""
    x, y, g = (RNG.standard_normal((5, 64)).astype(dtype) for _ in range(3))
    w = RNG.standard_normal(64).astype(dtype)
    tol = {"rtol": 2e-3, "atol": 2e-3} if dtype == "float16" else {}
    for name, args in (("add", (x, y)), ("gelu", (x,)), ("rms_norm", (x, w, 1e-6)),
                       ("silu_and_mul", (x,)), ("gelu_and_mul", (x,)), ("gelu_backward", (g, x))):
        op = getattr(ops, name).opdef
        got = e.taken(name, *(e.to(v) if isinstance(v, np.ndarray) else v for v in args))
        check(got)
        assert_close(e.back(got), op.reference(*args), **tol)


def outputs_shaped_by_a_shape_rule(e: Entry) -> None:
    """silu_and_mul halves the last dim: the rule's answer, kept per signature, across shapes and dtypes."""
    for shape, dt in (((3, 16), "float32"), ((3, 16), "float64"), ((2, 5, 8), "float32"), ((3, 16), "float32")):
        x = RNG.standard_normal(shape).astype(dt)
        got = e.back(e.taken("silu_and_mul", e.to(x)))
        assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == np.dtype(dt)
        assert_close(got, ops.silu_and_mul.opdef.reference(x))


def qkv_slices_are_taken_where_they_lie(e: Entry, slice_copy: Callable[[Any], Any]) -> None:
    """rotary_embedding declares query and key row_strided: column slices of one qkv tensor, no copy.
    *slice_copy* makes a dense copy of a slice."""
    tokens, heads, size = 6, 2, 16
    qkv = e.to(RNG.standard_normal((tokens, 3 * heads * size)).astype(np.float32))
    cache = e.to(RNG.standard_normal((32, size)).astype(np.float32))
    pos = e.to(np.arange(tokens, dtype=np.int64))
    q, k = qkv[:, :heads * size], qkv[:, heads * size:2 * heads * size]
    assert not q.is_contiguous()
    dense_q, dense_k = slice_copy(q), slice_copy(k)
    want = e.back(qkv).copy()
    e.taken("rotary_embedding", pos, q, k, size, cache, True)
    ops.rotary_embedding(pos, dense_q, dense_k, size, cache, True)
    want[:, :heads * size], want[:, heads * size:2 * heads * size] = e.back(dense_q), e.back(dense_k)
    np.testing.assert_array_equal(e.back(qkv), want)  # the v third untouched too


def overlapping_written_arguments_are_named_by_python(e: Entry) -> None:
    x, w = e.to(np.ones((2, 64), np.float32)), e.to(np.ones(64, np.float32))
    before = e.calls("fused_add_rms_norm")
    with pytest.raises(ValueError, match="overlaps argument 'residual' in memory"):
        ops.fused_add_rms_norm(x, x, w, 1e-6)
    assert e.calls("fused_add_rms_norm") == before


def kernel_errors_are_raised_after_one_run(e: Entry) -> None:
    """A bad shape reaches the kernel, whose error is raised as tvm-ffi raises it: never a second run."""
    before = e.calls("add")
    with pytest.raises(ValueError, match="add"):
        ops.add(e.to(np.ones(3, np.float32)), e.to(np.ones(4, np.float32)))
    assert e.calls("add") == before


def unpassable_arguments_are_named_by_python(e: Entry, weight: Any, named: str) -> None:
    """A weight the framework cannot hand a kernel (*weight*; *named* matches its error), and Python ints
    outside int64: the entry, which cannot view or pass them, leaves the call, and the Python path raises the
    op's error naming the argument, not the framework's or tvm-ffi's ("Expected `int` but got `ffi.BigInt`")."""
    x = e.to(np.ones((2, 4), np.float32))
    q, k = e.to(np.ones((2, 8), np.float32)), e.to(np.ones((2, 8), np.float32))
    pos, cache = e.to(np.zeros(2, np.int64)), e.to(np.ones((4, 8), np.float32))
    for name, call, error, match in (
            ("rms_norm", lambda: ops.rms_norm(x, weight), TypeError, named),
            ("rms_norm", lambda: ops.rms_norm(x, e.to(np.ones(4, np.float32)), 2**70), ValueError,
             r"rms_norm: argument 'eps' is the int 1180591620717411303424, outside int64's range"),
            ("rotary_embedding", lambda: ops.rotary_embedding(pos, q, k, 2**64, cache, True), ValueError,
             r"rotary_embedding: argument 'head_size' must be in int64's range \[-2\*\*63, 2\*\*63 - 1\] "
             r"\(a kernel's int64_t\), got the int 18446744073709551616")):
        before = e.calls(name)
        with pytest.raises(error, match=match):
            call()
        assert e.calls(name) == before


def threads(e: Entry) -> None:
    """Four threads, 200 calls each: every result right, every call the entry's."""
    x = e.to(RNG.standard_normal((16, 64)).astype(np.float32))
    want = 2 * e.back(x)
    bad: list[str] = []
    before = e.calls("add")

    def work() -> None:
        for _ in range(200):
            if not np.array_equal(e.back(ops.add(x, x)), want):
                bad.append("wrong")

    workers = [threading.Thread(target=work) for _ in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not bad and e.calls("add") == before + 800


def parameter_weights(e: Entry, parameter: Callable[[np.ndarray], Any]) -> None:
    """A model's weight is its framework's parameter type (a subclass of its tensor): taken beside a plain
    dispatching tensor, with the reference's result; as the dispatching argument it goes to Python."""
    x = RNG.standard_normal((4, 64)).astype(np.float32)
    w = RNG.standard_normal(64).astype(np.float32)
    got = e.taken("rms_norm", e.to(x), parameter(w), 1e-6)
    assert_close(e.back(got), ops.rms_norm.opdef.reference(x, w, 1e-6))
    e.left("gelu", parameter(w))


def several_outputs_out(e: Entry) -> None:
    """out= a tuple, for an op whose returns are its outputs (rms_norm_backward's (dx, dw)): the entry writes
    both and returns the caller's tuple; a wrong shape, or an output over an input, takes the Python path."""
    g, x = (RNG.standard_normal((4, 16)).astype(np.float32) for _ in range(2))
    w = RNG.standard_normal(16).astype(np.float32)
    want = ops.rms_norm_backward.opdef.reference(g, x, w)
    tg, tx, tw = e.to(g), e.to(x), e.to(w)
    outs = (e.to(np.full_like(g, np.nan)), e.to(np.full_like(w, np.nan)))
    assert e.taken("rms_norm_backward", tg, tx, tw, out=outs) is outs
    for got, ref in zip(outs, want, strict=True):
        assert_close(e.back(got), ref)
    with pytest.raises(ValueError, match=r"rms_norm_backward: out\[1\] has shape \(8,\)"):
        e.left("rms_norm_backward", tg, tx, tw, out=(outs[0], e.to(np.zeros(8, np.float32))))
    gc = e.to(g.copy())
    dx, _ = e.left("rms_norm_backward", gc, tx, tw, out=(gc, e.to(np.zeros(16, np.float32))))  # dx over grad
    assert_close(e.back(dx), want[0])
