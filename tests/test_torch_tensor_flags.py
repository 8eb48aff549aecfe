"""Tensor flags the dispatcher honours, which the fast paths must not read past.

A tensor with the negative or conjugate bit (``z.conj().imag``,
``torch._neg_view``) is a view whose memory holds the values before negation;
an inference tensor may not be written outside inference mode. The first call
of an op goes through the dispatcher, later ones through the public callable's
dispatcher-free paths (its C entry, :mod:`opbridge.adapters.torch.native`, then
its Python fast path, :mod:`opbridge.adapters.torch.fast`), so each test calls
the op several times, through each path, and wants the same outcome every time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import opbridge.ops as ops
from test_torch_native import built_shim

CALLS = 3
INFERENCE = "Inplace update to inference tensor outside InferenceMode"
WRITTEN_BITS = "has the negative \\(or conjugate\\) bit set; the op writes it in place"
OPS = (ops.add, ops.gelu, ops.fused_add_rms_norm, ops.rms_norm)


@contextmanager
def _declined(entries: bool) -> Iterator[None]:
    """With *entries* False, the ops' C entries decline every call (the Python fast path takes them)."""
    saved: list[tuple[dict[str, Any], str, Any]] = []
    if not entries:
        for fn in OPS:
            ns = fn.__globals__
            for k in ("_t_native", "_t_native_out"):
                if k in ns:
                    saved.append((ns, k, ns[k]))
                    ns[k] = lambda *a: NotImplemented
    try:
        yield
    finally:
        for ns, k, v in saved:
            ns[k] = v


@pytest.fixture(params=["entry", "python"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """``entry``: the C entry first (the native shim built); ``python``: the Python fast path."""
    if request.param == "entry":
        built_shim()
    x = torch.ones(2, 8)
    for _ in range(2):  # installs the fast paths (and the entries, where the shim is)
        ops.add(x, x)
        ops.add(x, x, out=torch.empty(2, 8))
        ops.gelu(x)
        ops.rms_norm(x, torch.ones(8))
        ops.fused_add_rms_norm(x.clone(), x.clone(), torch.ones(8))
    if request.param == "entry":
        assert "_t_native" in ops.add.__globals__, "no C entry installed"
    with _declined(request.param == "entry"):
        yield request.param


def _neg_views() -> dict[str, Callable[[], torch.Tensor]]:
    """Contiguous and strided float32 tensors with the negative bit, each holding -(0.5, 1.5, ...)."""
    def imag(n: int) -> torch.Tensor:  # conj().imag: memory holds +k, the tensor reads -k
        z = torch.complex(torch.zeros(n), torch.arange(n, dtype=torch.float32) + 0.5)
        return z.conj().imag

    return {
        "conj_imag_strided": lambda: imag(8),
        "conj_imag_one": lambda: imag(8)[:1],
        "neg_view": lambda: torch._neg_view(-(torch.arange(8, dtype=torch.float32) + 0.5)),
    }


@pytest.mark.parametrize("make", list(_neg_views().values()), ids=list(_neg_views()))
def test_neg_bit_inputs_are_read_negated(path: str, make: Callable[[], torch.Tensor]) -> None:
    t = make()
    assert t.is_neg()
    plain = t.resolve_neg()
    x = torch.ones_like(plain)
    for _ in range(CALLS):
        torch.testing.assert_close(ops.add(x, t), x + plain)
        torch.testing.assert_close(ops.add(t, x), x + plain)
        torch.testing.assert_close(ops.gelu(t), ops.gelu(plain.clone()))
        torch.testing.assert_close(ops.rms_norm(x.reshape(1, -1), t), ops.rms_norm(x.reshape(1, -1), plain.clone()))
        out = torch.empty_like(plain)
        assert ops.add(x, t, out=out) is out
        torch.testing.assert_close(out, x + plain)


def test_neg_bit_scalar_view_as_in_the_report(path: str) -> None:
    z = torch.tensor([1 + 2j, 3 + 4j])
    im = z.conj().imag[:1]
    x = torch.zeros(1)
    for _ in range(CALLS):
        torch.testing.assert_close(ops.add(x, im), torch.tensor([-2.0]))
        torch.testing.assert_close(ops.gelu(z[0].conj().imag), torch.nn.functional.gelu(torch.tensor(-2.0)),
                                   rtol=1e-4, atol=1e-4)


def test_neg_bit_out_is_written_through_the_bit(path: str) -> None:
    x, y = torch.randn(8), torch.randn(8)
    for _ in range(CALLS):
        buf = torch.zeros(8)
        out = torch._neg_view(buf)
        assert ops.add(x, y, out=out) is out
        torch.testing.assert_close(out.resolve_neg(), x + y)
        torch.testing.assert_close(buf, -(x + y))  # memory holds the negation, as torch's copy_ leaves it


@pytest.mark.parametrize("which", ["input", "residual"])
def test_neg_bit_written_argument_raises_every_call(path: str, which: str) -> None:
    for _ in range(CALLS):
        args = {"input": torch.randn(4, 6), "residual": torch.randn(4, 6)}
        args[which] = torch.randn(4, 6, dtype=torch.complex64).conj().imag
        assert args[which].is_neg()
        before = {k: v.clone() for k, v in args.items()}
        with pytest.raises(RuntimeError, match=f"^fused_add_rms_norm: argument '{which}' {WRITTEN_BITS}"):
            ops.fused_add_rms_norm(args["input"], args["residual"], torch.ones(6))
        for k, v in args.items():  # nothing written before the error
            assert torch.equal(v, before[k]), k


def test_neg_bit_read_only_argument_of_a_mutating_op(path: str) -> None:
    w = torch._neg_view(-torch.rand(6) - 0.5)
    for _ in range(CALLS):
        x, r = torch.randn(4, 6), torch.randn(4, 6)
        x2, r2 = x.clone(), r.clone()
        ops.fused_add_rms_norm(x, r, w)
        ops.fused_add_rms_norm(x2, r2, w.resolve_neg())
        torch.testing.assert_close(x, x2)
        torch.testing.assert_close(r, r2)


@pytest.mark.parametrize("which", ["input", "residual", "both"])
def test_inference_tensor_written_outside_inference_mode_raises(path: str, which: str) -> None:
    for _ in range(CALLS):
        with torch.inference_mode():
            inf = {"input": torch.randn(6, 10), "residual": torch.randn(6, 10)}
        args = dict(inf) if which == "both" else {**{k: torch.randn(6, 10) for k in inf}, which: inf[which]}
        before = {k: v.clone() for k, v in args.items()}
        with pytest.raises(RuntimeError, match=INFERENCE):
            ops.fused_add_rms_norm(args["input"], args["residual"], torch.randn(10))
        for k, v in args.items():  # raised before anything was written
            assert torch.equal(v, before[k]), k


def test_inference_out_outside_inference_mode_raises(path: str) -> None:
    x, y = torch.randn(8), torch.randn(8)
    for _ in range(CALLS):
        with torch.inference_mode():
            out = torch.zeros(8)
        with pytest.raises(RuntimeError, match=INFERENCE):
            ops.add(x, y, out=out)
        assert torch.equal(out, torch.zeros(8))


def test_inference_tensors_written_inside_inference_mode(path: str) -> None:
    w = torch.rand(10) + 0.5
    for _ in range(CALLS):
        with torch.inference_mode():
            x, r, out = torch.randn(6, 10), torch.randn(6, 10), torch.empty(8)
            x2, r2 = x.clone(), r.clone()
            ops.fused_add_rms_norm(x, r, w)
            a, b = torch.randn(8), torch.randn(8)
            assert ops.add(a, b, out=out) is out
        torch.testing.assert_close(out, a + b)
        s = x2 + r2
        torch.testing.assert_close(r, s)
        torch.testing.assert_close(x, s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w)


def test_torch_ops_inference_write_raises() -> None:
    """The dispatcher's call too (its device kernels check it: inference tensors skip the autograd kernel)."""
    for _ in range(CALLS):
        with torch.inference_mode():
            x, r, w = torch.randn(6, 10), torch.randn(6, 10), torch.randn(10)
        with pytest.raises(RuntimeError, match=INFERENCE):
            torch.ops.opbridge.fused_add_rms_norm(x, r, w)
