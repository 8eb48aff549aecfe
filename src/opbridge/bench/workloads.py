"""What ``opbridge bench kernels`` runs for each op: input shapes, torch formulas, bytes moved.

A :class:`Workload` says, for one op, which shape each Tensor argument gets
for a benchmark size ``(rows, cols)`` and how PyTorch computes the same
thing (:class:`TorchImpl`): a functional formula (eager "new output", and
what ``torch.compile`` compiles) and, where torch can, an eager formula that
writes into caller-provided buffers (or in place, for ops that mutate their
arguments).

Ops are looked up by name in :func:`workloads`; an op without an entry gets
an inferred workload when its test cases (``opbridge.testing.matrix``) show
only arguments shaped like its lead argument or like one row of it (then it
is timed against its reference only); any other op is skipped with the
reason. Nothing here imports torch until a function needs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opbridge.declare import OpDef

Shape = tuple[int, ...]
#: Named benchmark sizes ``(rows, cols)``; for the gated ops (``*_and_mul``) this is ``x``'s shape.
SIZES: dict[str, tuple[int, int]] = {"small": (8, 4096), "large": (4096, 4096), "odd": (257, 5125)}
_C = 0.7978845608028654  # sqrt(2/pi)


@dataclass(frozen=True)
class TorchImpl:
    """How PyTorch computes an op.

    Attributes
    ----------
    new
        ``new(*args)`` -> tuple of new tensors, in the order of the op's
        results (its returned tensors; for a mutating op, the new values of
        its mutated arguments in schema order). Timed eagerly and compiled.
    out
        Eager, into buffers: ``out(*args, outs)`` writes the results into the
        tensors *outs*; for a mutating op ``out(*args)`` updates the
        arguments in place. None where torch has no such form.
    out_note
        How *out* is composed, when it is not one native ``out=`` call.
    what
        What *new* calls, for the results.
    label
        Names the variant when an op has several (see :attr:`Workload.torch`).
    """

    new: Callable[..., tuple[Any, ...]]
    out: Callable[..., Any] | None = None
    out_note: str = ""
    what: str = ""
    label: str = ""


@dataclass(frozen=True)
class Workload:
    """The benchmark workload of one op.

    Attributes
    ----------
    op
        The op's name.
    shapes
        ``shapes((rows, cols))`` -> ``{tensor argument: shape}``.
    torch
        Torch implementations to try in order; the first whose float32
        result matches opbridge's is used for every case of the op (an op
        whose exact semantics vary, e.g. erf or tanh GELU, lists both).
        Empty: no torch competitor.
    note
        Anything a reader of the results needs to know.
    scalars
        Values of non-Tensor arguments that have no schema default.
    """

    op: str
    shapes: Callable[[tuple[int, int]], dict[str, Shape]]
    torch: tuple[TorchImpl, ...] = ()
    note: str = ""
    scalars: Mapping[str, Any] = field(default_factory=dict)


# -- shapes ---------------------------------------------------------------------


# A shape rule may name arguments an op does not have (spellings differ:
# ``x`` or ``input``); only the op's own arguments are looked up.


def full(*names: str) -> Callable[[tuple[int, int]], dict[str, Shape]]:
    """Every named tensor has the size's shape (elementwise ops)."""
    return lambda size: dict.fromkeys(names, tuple(size))


def normed(full_names: Sequence[str], row: Sequence[str]) -> Callable[[tuple[int, int]], dict[str, Shape]]:
    """*full_names* get the size's shape ``(R, H)``, *row* get ``(H,)`` (normalisations)."""
    return lambda size: {**dict.fromkeys(full_names, tuple(size)), **dict.fromkeys(row, (size[1],))}


def gated(size: tuple[int, int]) -> dict[str, Shape]:
    """``x`` of a ``*_and_mul`` op: ``(R, C)``; an odd C gives ``(R, 2C)`` so the half-width stays odd.

    ``grad`` (of the backward ops) is the forward's output, ``(R, C/2)``.
    """
    rows, cols = size
    width = cols if cols % 2 == 0 else 2 * cols
    return {"x": (rows, width), "grad": (rows, width // 2)}


# -- torch formulas -----------------------------------------------------------------


def _torch_impls() -> dict[str, tuple[TorchImpl, ...]]:
    import torch
    import torch.nn.functional as F  # noqa: N812

    f32 = torch.float32

    def rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
        # (R, 1) float32, no full-size temporary: vector_norm reduces in one pass.
        h = x.shape[-1]
        r: torch.Tensor = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=f32)
        return r.pow_(2).div_(h).add_(eps).rsqrt_()

    def rms_into(dst: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float) -> None:
        torch.mul(x, rstd(x, eps), out=dst)
        dst.mul_(w)

    def halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = x.shape[-1] // 2
        return x[..., :d], x[..., d:]

    def silu_mul_out(x: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        a, b = halves(x)
        torch.ops.aten.silu.out(a, out=outs[0])
        outs[0].mul_(b)

    def gelu_mul(approximate: str) -> TorchImpl:
        def new(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            a, b = halves(x)
            return (F.gelu(a, approximate=approximate) * b,)

        def out(x: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
            a, b = halves(x)
            torch.ops.aten.gelu.out(a, approximate=approximate, out=outs[0])
            outs[0].mul_(b)

        return TorchImpl(new, out, f"gelu(a, approximate={approximate!r}, out=buf) then buf.mul_(b)",
                         f"F.gelu(a, approximate={approximate!r}) * b", f"approximate={approximate!r}")

    def silu_mul_backward(grad: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, b = halves(x)
        s = torch.sigmoid(a)
        return (torch.cat([grad * b * s * (1 + a * (1 - s)), grad * a * s], dim=-1),)

    def gelu_mul_backward(grad: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, b = halves(x)
        return (torch.cat([torch.ops.aten.gelu_backward(grad * b, a, approximate="tanh"),
                           grad * F.gelu(a, approximate="tanh")], dim=-1),)

    def fused_add_rms_new(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, ...]:
        s = x + residual
        return F.rms_norm(s, (s.shape[-1],), w, eps), s

    def fused_add_rms_inplace(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float) -> None:
        residual.add_(x)
        rms_into(x, residual, w, eps)

    def rms_backward_new(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, ...]:
        xf, gf, wf = x.float(), grad.float(), w.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        xhat = xf * r
        gx = gf * wf
        dx = r * (gx - xhat * (gx * xhat).mean(-1, keepdim=True))
        dw = (gf * xhat).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(w.dtype)

    return {
        "add": (TorchImpl(lambda x, y: (torch.add(x, y),), lambda x, y, outs: torch.add(x, y, out=outs[0]),
                          "torch.add(x, y, out=buf)", "torch.add(x, y)"),),
        "gelu": (TorchImpl(lambda x: (F.gelu(x, approximate="tanh"),),
                           lambda x, outs: torch.ops.aten.gelu.out(x, approximate="tanh", out=outs[0]),
                           "gelu(x, approximate='tanh', out=buf)", "F.gelu(x, approximate='tanh')"),),
        "gelu_backward": (TorchImpl(
            lambda grad, x: (torch.ops.aten.gelu_backward(grad, x, approximate="tanh"),),
            lambda grad, x, outs: torch.ops.aten.gelu_backward.grad_input(grad, x, approximate="tanh",
                                                                         grad_input=outs[0]),
            "aten.gelu_backward.grad_input(grad, x, approximate='tanh', grad_input=buf)",
            "aten.gelu_backward(grad, x, approximate='tanh')"),),
        "rms_norm": (TorchImpl(
            lambda x, w, eps: (F.rms_norm(x, (x.shape[-1],), w, eps),),
            lambda x, w, eps, outs: rms_into(outs[0], x, w, eps),
            "F.rms_norm has no out=; composed: vector_norm -> (R,1) rstd, mul(x, rstd, out=buf), buf.mul_(w)",
            "F.rms_norm(x, (H,), w, eps)"),),
        "rms_norm_backward": (TorchImpl(rms_backward_new, what="float32 formula (no CPU aten kernel)"),),
        "silu_and_mul": (TorchImpl(lambda x: (F.silu(halves(x)[0]) * halves(x)[1],), silu_mul_out,
                                   "silu(a, out=buf) then buf.mul_(b)", "F.silu(a) * b"),),
        "gelu_and_mul": (gelu_mul("none"), gelu_mul("tanh")),
        "silu_and_mul_backward": (TorchImpl(silu_mul_backward, what="torch.cat of the two halves' gradients"),),
        "gelu_and_mul_backward": (TorchImpl(gelu_mul_backward, what="aten.gelu_backward + gelu, torch.cat"),),
        "gelu_tanh_and_mul": (gelu_mul("tanh"),),
        "fused_add_rms_norm": (TorchImpl(
            fused_add_rms_new, fused_add_rms_inplace,
            "in place: residual.add_(x), vector_norm -> (R,1) rstd, mul(residual, rstd, out=x), x.mul_(w)",
            "s = x + residual; (F.rms_norm(s, (H,), w, eps), s)"),),
    }


#: name -> (shape rule, note); the torch formulas are attached by :func:`workloads`.
_SHAPES: dict[str, tuple[Callable[[tuple[int, int]], dict[str, Shape]], str]] = {
    "add": (full("x", "y"), ""),
    "gelu": (full("x"), ""),
    "gelu_backward": (full("grad", "x"), ""),
    "rms_norm": (normed(["x"], ["weight"]), ""),
    "rms_norm_backward": (normed(["grad", "x"], ["weight"]),
                          "torch has no CPU rms_norm backward kernel; its competitor is the float32 formula"),
    "silu_and_mul": (gated, "size is x's shape (R, 2d); an odd size uses x = (R, 2C) so d = C stays odd"),
    "gelu_and_mul": (gated, "size is x's shape (R, 2d); an odd size uses x = (R, 2C) so d = C stays odd"),
    "gelu_tanh_and_mul": (gated, "size is x's shape (R, 2d); an odd size uses x = (R, 2C)"),
    "silu_and_mul_backward": (gated, "size is x's shape (R, 2d), grad (R, d); an odd size uses x = (R, 2C)"),
    "gelu_and_mul_backward": (gated, "size is x's shape (R, 2d), grad (R, d); an odd size uses x = (R, 2C)"),
    "fused_add_rms_norm": (normed(["input", "x", "residual"], ["weight"]),
                           "mutates its input and residual in place"),
}


def workloads() -> dict[str, Workload]:
    """Every known workload by op name (imports torch)."""
    impls = _torch_impls()
    return {name: Workload(name, shapes, impls.get(name, ()), note) for name, (shapes, note) in _SHAPES.items()}


def infer(op: OpDef) -> tuple[Workload | None, str]:
    """A workload for an op without an entry, from its test cases; or None and why not.

    Uses the first 2-D contiguous case of ``opbridge.testing.matrix.make_cases``:
    every floating Tensor argument must have the lead argument's shape or
    ``(cols,)``. The result has no torch competitor.
    """
    from opbridge.testing.matrix import LAYOUT, NONCONTIGUOUS, make_cases

    try:
        cases = make_cases(op, "float32")
    except (ValueError, TypeError) as e:
        return None, f"no workload and no test cases to infer one from ({e})"
    lead = op.schema.arguments[op.dispatch_arg].name
    for case in cases:
        if case.get(LAYOUT, "contiguous") != "contiguous" or case.get(NONCONTIGUOUS):
            continue
        ref: tuple[int, ...] = tuple(getattr(case.get(lead), "shape", ()))
        if len(ref) != 2 or 0 in ref:
            continue
        roles: dict[str, str] = {}
        scalars: dict[str, Any] = {}
        for a in op.schema.arguments:
            v = case.get(a.name)
            if not a.type.is_tensor:
                scalars[a.name] = v
                continue
            if v is None:
                continue
            if getattr(v, "dtype", None) is None or v.dtype.kind != "f":
                return None, f"argument {a.name!r} is not floating; add a workload to opbridge.bench.workloads"
            if tuple(v.shape) == tuple(ref):
                roles[a.name] = "full"
            elif tuple(v.shape) == (ref[-1],):
                roles[a.name] = "row"
            else:
                return None, (f"cannot infer shapes (argument {a.name!r} has shape {tuple(v.shape)} beside "
                              f"{lead} {tuple(ref)}); add a workload to opbridge.bench.workloads")
        fulls = [n for n, r in roles.items() if r == "full"]
        rows = [n for n, r in roles.items() if r == "row"]
        note = "inferred from its test cases; no torch formula"
        return Workload(op.name, normed(fulls, rows), note=note, scalars=scalars), ""
    return None, "no 2-D test case to infer shapes from; add a workload to opbridge.bench.workloads"


# -- bytes moved -------------------------------------------------------------------------


def itemsize(dtype: Any) -> int:
    """Bytes per element of a torch or NumPy dtype, or of a dtype name such as ``"bfloat16"``."""
    n = getattr(dtype, "itemsize", None)
    if isinstance(n, int):
        return n
    name = str(dtype).rpartition(".")[2]
    if name == "bfloat16":
        return 2
    import numpy as np

    return int(np.dtype(name).itemsize)


def nbytes(t: Any) -> int:
    """Bytes of tensor or array *t* (anything with ``.shape`` and ``.dtype``)."""
    return int(math.prod(tuple(t.shape))) * itemsize(t.dtype)


def bytes_moved(op: OpDef, args: Sequence[Any]) -> dict[str, int]:
    """Bytes a kernel must move for *args*: every Tensor argument read once, every result written once.

    Results are the op's new outputs (from its shape rule) plus its mutated
    arguments. *args* are schema-ordered values; tensors need ``.shape`` and
    ``.dtype``.

    Returns
    -------
    dict
        ``{"read": bytes, "written": bytes, "total": bytes}``.
    """
    read = written = 0
    for a, v in zip(op.schema.arguments, args):
        if a.type.is_tensor and v is not None:
            read += nbytes(v)
            if a.is_mutated:
                written += nbytes(v)
    for spec in op.output_specs(args):
        written += math.prod(tuple(spec.shape)) * itemsize(spec.dtype)
    return {"read": read, "written": written, "total": read + written}
