"""Peers of opbridge's CUDA kernels beyond torch eager: Inductor and, where installed, Liger-Kernel.

Liger-Kernel (``pip install liger-kernel``, optional) ships Triton kernels
for some of the ops: ``LigerRMSNormFunction`` for ``rms_norm`` (Llama
casting: the norm in float32, cast to the input dtype, times the weight)
and ``LigerSiLUMulFunction`` for ``silu_and_mul`` (its two halves passed
separately). :func:`liger_impls` returns them as
:class:`~opbridge.bench.workloads.TorchImpl` for those ops, so they become
candidates like any other formula; with Liger not installed there are none,
and the report says so once.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from opbridge.bench.candidates import Candidate, formula_candidates

LIGER, COMPILE_NEW = "liger", "compile_new"
#: ops Liger-Kernel has a forward for, and the class that computes it
LIGER_OPS = {"rms_norm": "liger_kernel.ops.rms_norm.LigerRMSNormFunction",
             "silu_and_mul": "liger_kernel.ops.swiglu.LigerSiLUMulFunction"}


def liger_missing() -> str | None:
    """Why Liger-Kernel is not a candidate in this process, or None when it is installed."""
    try:
        found = importlib.util.find_spec("liger_kernel") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "liger_kernel is not installed (pip install liger-kernel)"


def liger_impls() -> dict[str, Any]:
    """``{op: TorchImpl}`` of Liger-Kernel's forwards (empty without Liger-Kernel)."""
    if liger_missing() is not None:
        return {}
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    from opbridge.bench.workloads import TorchImpl

    def rms(x: Any, w: Any, eps: float) -> tuple[Any, ...]:
        return (LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False),)

    def silu_mul(x: Any) -> tuple[Any, ...]:
        d = x.shape[-1] // 2
        return (LigerSiLUMulFunction.apply(x[..., :d], x[..., d:]),)

    return {"rms_norm": TorchImpl(rms, what="LigerRMSNormFunction.apply(x, w, eps, 0.0, 'llama', False)"),
            "silu_and_mul": TorchImpl(silu_mul, what="LigerSiLUMulFunction.apply(x[..., :d], x[..., d:])")}


def liger_candidate(op: Any, impl: Any) -> Candidate:
    """The ``liger`` candidate of *op* (new output)."""
    return formula_candidates(op, impl.new, None, names=(LIGER, ""), what=impl.what, into_what="")[0]


def compile_candidate(op: Any, impl: Any) -> Candidate:
    """``compile_new``: Inductor's compilation of the torch formula (static shapes, whole graph)."""
    import torch

    what = f"torch.compile(fullgraph=True, dynamic=False) of {impl.what or 'the formula'}"
    torch._dynamo.reset()  # one compilation per case: never the recompile limit across sizes and dtypes
    compiled = torch.compile(impl.new, fullgraph=True, dynamic=False)
    return formula_candidates(op, compiled, None, names=(COMPILE_NEW, ""), what=what, into_what="")[0]
