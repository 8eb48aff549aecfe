"""Peers of opbridge's CUDA kernels beyond torch eager: Inductor and, where installed, Liger-Kernel.

Liger-Kernel (``pip install liger-kernel``, optional) ships Triton kernels
for six of the ops (:data:`LIGER_OPS`): ``rms_norm`` and
``fused_add_rms_norm`` (Llama casting: the norm in float32, cast to the
input dtype, times the weight), ``silu_and_mul`` and ``gelu_and_mul`` (tanh
GELU), and the backward of these two, ``silu_and_mul_backward`` and
``gelu_and_mul_backward`` (the ``backward`` of the same autograd Functions;
Liger's GEGLU backward differentiates the tanh GELU, as opbridge's does).
Liger's gated activations take the two halves as separate tensors,
contiguous (its ``ensure_contiguous`` copies views first), as its MLP layers
produce them from two projections; so the halves of the case's ``[a | b]``
are copied into two tensors once, outside the timing, and its kernel alone
is timed. Its backward is called as autograd calls it, ``backward(ctx,
grad)``, on the context of one untimed forward on those halves; it returns
``grad_a`` and ``grad_b`` (joined into ``grad_x`` for the check, outside
the timing), which its Triton backward writes over the saved halves, so
each timed call runs on the previous call's gradients (the same reads and
writes). :func:`liger_impls` returns them per op; with Liger not installed
there are none, and the report says so once.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opbridge.bench.candidates import Bound, Candidate, formula_candidates
from opbridge.bench.verify import as_tuple

LIGER, COMPILE_NEW = "liger", "compile_new"
#: ops Liger-Kernel has a kernel for, and the autograd Function that computes it (a ``*_backward`` op:
#: the Function's ``backward``)
LIGER_OPS = {"rms_norm": "liger_kernel.ops.rms_norm.LigerRMSNormFunction",
             "fused_add_rms_norm": "liger_kernel.ops.fused_add_rms_norm.LigerFusedAddRMSNormFunction",
             "silu_and_mul": "liger_kernel.ops.swiglu.LigerSiLUMulFunction",
             "gelu_and_mul": "liger_kernel.ops.geglu.LigerGELUMulFunction",
             "silu_and_mul_backward": "liger_kernel.ops.swiglu.LigerSiLUMulFunction",
             "gelu_and_mul_backward": "liger_kernel.ops.geglu.LigerGELUMulFunction"}


def liger_missing() -> str | None:
    """Why Liger-Kernel is not a candidate in this process, or None when it is installed."""
    try:
        found = importlib.util.find_spec("liger_kernel") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "liger_kernel is not installed (pip install liger-kernel)"


@dataclass(frozen=True)
class LigerImpl:
    """Liger's kernel for one op: ``bind(args)`` prepares its inputs (untimed) and returns the call;
    ``results(returned value)`` gives the op's results to verify (untimed)."""

    bind: Callable[[list[Any]], Callable[[], Any]]
    what: str
    results: Callable[[Any], tuple[Any, ...]] = as_tuple


def _halves(args: list[Any]) -> tuple[Any, Any]:
    x = args[0]
    d = x.shape[-1] // 2
    return x[..., :d].contiguous(), x[..., d:].contiguous()


def _bind_backward(function: Any) -> Callable[[list[Any]], Callable[[], Any]]:
    """``bind`` of a gated op's backward ``(grad, x)``: Liger's ``function.backward(ctx, grad)``.

    Untimed: ``x``'s halves copied into two new contiguous tensors (never
    views of ``x``: the backward writes over them) and one forward
    ``function.apply(a, b)`` on them, whose autograd node is the ``ctx``
    (its saved halves, and whatever else the installed version's forward
    records). Timed: the backward alone, with grad mode off as autograd runs it.
    """
    import torch

    def bind(args: list[Any]) -> Callable[[], Any]:
        grad, x = args
        d = x.shape[-1] // 2
        a, b = (h.clone(memory_format=torch.contiguous_format).requires_grad_() for h in (x[..., :d], x[..., d:]))
        with torch.enable_grad():
            out = function.apply(a, b)

        def call() -> Any:
            # The ctx is out's node, reached through out: torch 2.11 (the GPU machine's) frees a node's
            # saved tensors once its outputs are gone ("backward through the graph a second time").
            with torch.no_grad():
                return function.backward(out.grad_fn, grad)

        return call

    return bind


def _backward_what(name: str) -> str:
    return (f"{name}.backward(ctx, grad) -> (grad_a, grad_b), ctx from one untimed {name}.apply(a, b) on "
            "contiguous copies of the halves; it writes over a and b, so each timed call runs on the last "
            "one's gradients (the same work); grad_a and grad_b joined into grad_x for the check, untimed")


def _joined(ret: Any) -> tuple[Any, ...]:
    """``(grad_x,)`` of Liger's backward's ``(grad_a, grad_b, ...)``: the halves joined along the last dim."""
    import torch

    return (torch.cat(as_tuple(ret)[:2], dim=-1),)


def liger_impls() -> dict[str, LigerImpl]:
    """``{op: LigerImpl}`` of Liger-Kernel's kernels (empty without Liger-Kernel)."""
    if liger_missing() is not None:
        return {}

    def function(op: str) -> Any:
        module, _, name = LIGER_OPS[op].rpartition(".")
        return getattr(importlib.import_module(module), name)

    rms, fused, silu, gelu = (function(op).apply for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul",
                                                            "gelu_and_mul"))
    return {
        "rms_norm": LigerImpl(lambda a: functools.partial(rms, a[0], a[1], a[2], 0.0, "llama", False),
                              "LigerRMSNormFunction.apply(x, w, eps, 0.0, 'llama', False)"),
        "fused_add_rms_norm": LigerImpl(
            lambda a: functools.partial(fused, a[0], a[1], a[2], a[3], 0.0, "llama", False),
            "LigerFusedAddRMSNormFunction.apply(x, residual, w, eps, 0.0, 'llama', False) -> (y, x + residual)"),
        "silu_and_mul": LigerImpl(lambda a: functools.partial(silu, *_halves(a)),
                                  "LigerSiLUMulFunction.apply(a, b), a and b contiguous (split outside the timing)"),
        "gelu_and_mul": LigerImpl(lambda a: functools.partial(gelu, *_halves(a)),
                                  "LigerGELUMulFunction.apply(a, b), a and b contiguous (split outside the timing)"),
        **{op: LigerImpl(_bind_backward(function(op)), _backward_what(LIGER_OPS[op].rpartition(".")[2]), _joined)
           for op in ("silu_and_mul_backward", "gelu_and_mul_backward")},
    }


def liger_candidate(op: Any, impl: LigerImpl) -> Candidate:
    """The ``liger`` candidate of *op* (new outputs)."""
    def bind(args: list[Any]) -> Bound:
        return impl.bind(args), impl.results

    return Candidate(LIGER, "new", impl.what, bind)


def compile_candidate(op: Any, impl: Any) -> Candidate:
    """``compile_new``: Inductor's compilation of the torch formula (static shapes, whole graph)."""
    import torch

    what = f"torch.compile(fullgraph=True, dynamic=False) of {impl.what or 'the formula'}"
    torch._dynamo.reset()  # one compilation per case: never the recompile limit across sizes and dtypes
    compiled = torch.compile(impl.new, fullgraph=True, dynamic=False)
    return formula_candidates(op, compiled, None, names=(COMPILE_NEW, ""), what=what, into_what="")[0]
