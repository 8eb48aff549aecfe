"""Checking a candidate's results before it is timed.

Two kinds of expected values:

* **opbridge's own result** (``bench kernels``): every peer must agree with
  opbridge within twice the op's tolerance, since both sides approximate
  the exact value within it. The NumPy reference is one of the peers.
* **A float64 reference** (``bench gpu``): the op's NumPy reference run on
  float64 copies of the inputs, so that no float32 result is ever the
  yardstick of another. Each candidate, opbridge's included, must then be
  within the op's tolerance of it, grown for results that sum over many
  rows (:func:`reduction_tolerance`).

Integer results must match exactly. Failures name the case, the candidate
and the first bad elements (:func:`opbridge.testing.compare.assert_close`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opbridge.bench import BenchError
from opbridge.testing.tolerances import numel, reduction_length, reduction_tolerance, result_tolerance

__all__ = ["numel", "reduction_length", "reduction_tolerance"]  # the testing kit's rule, re-exported


def as_tuple(x: Any) -> tuple[Any, ...]:
    """A call's return value as a tuple of results (None: no result)."""
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def mutated(op: Any) -> list[int]:
    """Indices of the arguments *op* mutates."""
    return [i for i, a in enumerate(op.schema.arguments) if a.is_mutated]


def peer_tolerance(op: Any, dtype: str) -> tuple[float, float]:
    """``(rtol, atol)`` between two approximations of *op*'s result: twice the op's own."""
    rtol, atol = op.tolerance(dtype)
    return 2 * rtol, 2 * atol


def close(got: Any, expected: Any, rtol: float, atol: float) -> bool:
    """``|got - expected| <= atol + rtol |expected|`` everywhere (NaN matching NaN), computed by torch.

    A fast pass for large results (on their device);
    :func:`~opbridge.testing.compare.assert_close` explains a failure.
    """
    import torch

    g = torch.from_numpy(got) if not isinstance(got, torch.Tensor) else got
    e = torch.from_numpy(expected) if not isinstance(expected, torch.Tensor) else expected
    if g.shape != e.shape:
        return False
    if not (g.is_floating_point() or e.is_floating_point()):  # exact; float32 would round ids past 2^24
        return g.dtype == e.dtype and bool(torch.equal(g.cpu(), e.cpu()))
    e = e.to(g.device)
    wide = torch.float64 if torch.float64 in (g.dtype, e.dtype) else torch.float32
    return bool(torch.isclose(g.to(wide), e.to(wide), rtol=rtol, atol=atol, equal_nan=True).all())


def _cpu(t: Any) -> Any:
    return t.cpu() if hasattr(t, "cpu") else t


def mismatch(got: Sequence[Any], expected: Sequence[Any], tolerances: Sequence[tuple[float, float]],
             dtype: str) -> str | None:
    """Why *got* does not match *expected* (result by result, each with its tolerances), or None."""
    from opbridge.testing.compare import assert_close

    if len(got) != len(expected):
        return f"gave {len(got)} result(s), expected {len(expected)}"
    for j, (g, e, (rtol, atol)) in enumerate(zip(got, expected, tolerances)):
        if g is None or e is None:
            if g is not e:
                return f"result {j} is {'missing' if g is None else 'unexpected'}"
            continue
        if close(g, e, rtol, atol):
            continue
        try:
            assert_close(_cpu(g), _cpu(e), rtol=rtol, atol=atol, dtype=dtype, name=f"result {j}")
        except AssertionError as err:
            return str(err)
        return f"result {j} differs (rtol={rtol}, atol={atol})"
    return None


def check(op: Any, label: str, name: str, got: Sequence[Any], expected: Sequence[Any], dtype: str) -> None:
    """Raise :class:`BenchError` unless candidate *name*'s results match opbridge's *expected*."""
    if len(got) != len(expected):
        raise BenchError(f"{label}: {name} gave {len(got)} result(s), opbridge {len(expected)}")
    # A result smaller than the largest one is a sum over the rest (a weight gradient over rows):
    # its tolerance grows with the number of terms, as against the float64 reference.
    sizes = [numel(e) for e in expected]
    lead = max(sizes, default=1)
    tols = [reduction_tolerance(*peer_tolerance(op, dtype), reduction_length(n, lead)) for n in sizes]
    why = mismatch(got, expected, tols, dtype)
    if why is not None:
        raise BenchError(f"{label}: candidate {name!r} disagrees with opbridge:\n{why}")


# -- the float64 reference --------------------------------------------------------------------------


def reference64(op: Any, args: Sequence[Any]) -> tuple[Any, ...]:
    """The op's NumPy reference on float64 copies of *args*: new outputs, then mutated arguments.

    Floating tensors (any device, any float dtype) become float64 NumPy
    arrays; integer tensors keep their dtype.

    Raises
    ------
    BenchError
        If the op declares no reference.
    """
    import numpy as np

    if op.reference is None:
        raise BenchError(f"{op.name}: declares no NumPy reference to verify against")

    def wide(a: Any) -> Any:
        if not hasattr(a, "shape"):
            return a
        if hasattr(a, "is_floating_point"):
            return a.detach().double().cpu().numpy() if a.is_floating_point() else a.detach().cpu().numpy().copy()
        return np.array(a, dtype=np.float64 if a.dtype.kind == "f" else a.dtype)

    np_args = [wide(a) for a in args]
    pos, kw = op.schema.split(np_args)
    ret = as_tuple(op.reference(*pos, **kw))[:op.n_outputs]
    return (*ret, *(np_args[i] for i in mutated(op)))


def reference_tolerances(op: Any, dtype: str, expected: Sequence[Any],
                         args: Sequence[Any]) -> list[tuple[float, float]]:
    """``(rtol, atol)`` per result against the float64 reference: the op's, grown for reductions."""
    return [result_tolerance(op, dtype, e, args[op.dispatch_arg]) for e in expected]
