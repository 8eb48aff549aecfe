"""The test matrix's ``rows`` check: what an op declares with ``Library.op(rows=...)`` holds.

``jax.vmap`` and ``torch.func.vmap`` run such an op once over a batch, one more leading dim in its
row arguments (:mod:`opbridge.call.batching`), trusting the declaration: each row of the results
comes from the same rows of those arguments alone, and the kernels take the extra dim. This check
calls the op on two elements (a case's inputs, and the same with every row argument reversed along
its first dim: the same values, other rows) and on the two stacked along a new leading dim, and
compares each half of the batched results (outputs and written arguments) with the element's own.
Where the framework has a vmap that batches opbridge ops (the kit's ``vmap``: torch, JAX), the batch
also goes through it, against the same elements: the batching rule, not only the declaration.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opbridge.cases import Case
from opbridge.testing.runner import Runner, describe

__all__ = ["run_rows"]


def run_rows(r: Runner, case: Case) -> None:
    """Check *r*'s op, which declares rows, on *case* (contiguous, non-empty) and its batch of two."""
    op, kit = r.op, r.kit
    how = f" (and through {kit.vmap_name})" if kit.vmap_name else ""
    r.where = describe(op, case) + f" (rows: a batch of two in one call{how} against each element alone)"
    with r.checking("setup"):
        full, _ = r.materialize(case)
        rows = [i for i in op.rows if full[i] is not None]
        first = {i: kit.to_np64(full[i]) for i in rows}
        second = {i: a[::-1].copy() if a.ndim else a for i, a in first.items()}
        elements = [_with(r, full, first), _with(r, full, second)]
        stacked = {i: np.stack([first[i], second[i]]) for i in rows}
        batch = _with(r, full, stacked)
        vmap_batch = _with(r, full, stacked)  # its own arrays: an op that writes its rows writes them
    with r.checking("rows"):
        alone = [r.call(e) for e in elements]
        _compare(r, alone, r.call(batch), "")
        if kit.vmap_name:
            _compare(r, alone, _vmapped(r, vmap_batch, rows), f" through {kit.vmap_name}")


def _compare(r: Runner, alone: list[tuple[tuple[Any, ...], dict[int, Any]]],
             together: tuple[tuple[Any, ...], dict[int, Any]], how: str) -> None:
    """Each half of the batch's results (*together*: outputs, written arguments) against its element *alone*."""
    outs, written = together
    for b, (e_outs, e_written) in enumerate(alone):
        for j, (got, want) in enumerate(zip(outs, e_outs, strict=True)):
            r.compare(got[b], r.kit.to_np64(want), f"{r._return_name(j)}[{b}] of the batch{how}",
                      against=f"element {b} alone")
        for i, want in e_written.items():
            r.compare(written[i][b], r.kit.to_np64(want),
                      f"written argument '{r.args[i].name}'[{b}] of the batch{how}", against=f"element {b} alone")


def _vmapped(r: Runner, batch: list[Any], rows: list[int]) -> tuple[tuple[Any, ...], dict[int, Any]]:
    """The op on *batch* through the framework's vmap over the *rows* arguments (the others closed over)."""
    def element(*values: Any) -> Any:
        full = list(batch)
        for i, v in zip(rows, values, strict=True):
            full[i] = v
        pos, kw = r.op.schema.split(full)
        result = r.op.call(*pos, **kw)
        return () if result is None else result  # a vmap returns arrays: an op that writes in place returns ()

    vmapped = r.kit.vmap(element)
    if vmapped is None:
        raise RuntimeError(f"{r.kit.name} has no vmap")
    return r.results(vmapped(*(batch[i] for i in rows)), batch)


def _with(r: Runner, full: list[Any], values: dict[int, np.ndarray]) -> list[Any]:
    """*full* with the row arguments *values* as fresh framework arrays (in the case's dtype, as
    :meth:`Runner.materialize` makes them: integer arrays keep theirs)."""
    out = list(full)
    for i, v in values.items():
        out[i] = r.kit.from_np(v, r.dtype)
    return out
