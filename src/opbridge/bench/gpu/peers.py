"""Peers of opbridge's CUDA kernels beyond torch eager: Inductor and, where installed, Liger-Kernel.

Liger-Kernel (``pip install liger-kernel``, optional) ships Triton kernels
for four of the ops (:data:`LIGER_OPS`): ``rms_norm`` and
``fused_add_rms_norm`` (Llama casting: the norm in float32, cast to the
input dtype, times the weight), ``silu_and_mul`` and ``gelu_and_mul`` (tanh
GELU). Liger's gated activations take the two halves as separate tensors,
contiguous (its ``ensure_contiguous`` copies views first), as its MLP layers
produce them from two projections; so the halves of the case's ``[a | b]``
are copied into two tensors once, outside the timing, and its kernel alone
is timed. :func:`liger_impls` returns them per op; with Liger not installed
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
#: ops Liger-Kernel has a forward for, and the autograd Function that computes it
LIGER_OPS = {"rms_norm": "liger_kernel.ops.rms_norm.LigerRMSNormFunction",
             "fused_add_rms_norm": "liger_kernel.ops.fused_add_rms_norm.LigerFusedAddRMSNormFunction",
             "silu_and_mul": "liger_kernel.ops.swiglu.LigerSiLUMulFunction",
             "gelu_and_mul": "liger_kernel.ops.geglu.LigerGELUMulFunction"}


def liger_missing() -> str | None:
    """Why Liger-Kernel is not a candidate in this process, or None when it is installed."""
    try:
        found = importlib.util.find_spec("liger_kernel") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "liger_kernel is not installed (pip install liger-kernel)"


@dataclass(frozen=True)
class LigerImpl:
    """Liger's forward for one op: ``bind(args)`` prepares its inputs (untimed) and returns the call."""

    bind: Callable[[list[Any]], Callable[[], Any]]
    what: str


def _halves(args: list[Any]) -> tuple[Any, Any]:
    x = args[0]
    d = x.shape[-1] // 2
    return x[..., :d].contiguous(), x[..., d:].contiguous()


def liger_impls() -> dict[str, LigerImpl]:
    """``{op: LigerImpl}`` of Liger-Kernel's forwards (empty without Liger-Kernel)."""
    if liger_missing() is not None:
        return {}

    def fn(op: str) -> Any:
        module, _, name = LIGER_OPS[op].rpartition(".")
        return getattr(importlib.import_module(module), name).apply

    rms, fused, silu, gelu = (fn(op) for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "gelu_and_mul"))
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
    }


def liger_candidate(op: Any, impl: LigerImpl) -> Candidate:
    """The ``liger`` candidate of *op* (new outputs)."""
    def bind(args: list[Any]) -> Bound:
        return impl.bind(args), as_tuple

    return Candidate(LIGER, "new", impl.what, bind)


def compile_candidate(op: Any, impl: Any) -> Candidate:
    """``compile_new``: Inductor's compilation of the torch formula (static shapes, whole graph)."""
    import torch

    what = f"torch.compile(fullgraph=True, dynamic=False) of {impl.what or 'the formula'}"
    torch._dynamo.reset()  # one compilation per case: never the recompile limit across sizes and dtypes
    compiled = torch.compile(impl.new, fullgraph=True, dynamic=False)
    return formula_candidates(op, compiled, None, names=(COMPILE_NEW, ""), what=what, into_what="")[0]
