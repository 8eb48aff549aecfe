"""The test matrix's ``rows`` check: what an op declares with ``Library.op(rows=...)`` holds.

``jax.vmap`` and ``torch.func.vmap`` run such an op once over a batch, one more leading dim in its
row arguments (:mod:`opbridge.call.batching`), trusting the declaration: each row of the results
comes from the same rows of those arguments alone, and the kernels take the extra dim. This check
calls the op on two elements (a case's inputs, and the same with every row argument reversed along
its first dim: the same values, other rows) and on the two stacked along a new leading dim, and
compares each half of the batched results (outputs and written arguments) with the element's own.
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
    r.where = describe(op, case) + " (rows: a batch of two in one call against each alone)"
    with r.checking("setup"):
        full, _ = r.materialize(case)
        rows = [i for i in op.rows if full[i] is not None]
        first = {i: kit.to_np64(full[i]) for i in rows}
        second = {i: a[::-1].copy() if a.ndim else a for i, a in first.items()}
        elements = [_with(r, full, first), _with(r, full, second)]
        batch = _with(r, full, {i: np.stack([first[i], second[i]]) for i in rows})
    with r.checking("rows"):
        alone = [r.call(e) for e in elements]
        together = r.call(batch)
        for b, (e, outs) in enumerate(zip(elements, alone, strict=True)):
            for j, (got, want) in enumerate(zip(together, outs, strict=True)):
                r.compare(got[b], kit.to_np64(want), f"{r._return_name(j)}[{b}] of the batch",
                          against=f"element {b} alone")
            for i in rows:
                if op.schema.arguments[i].is_mutated:
                    r.compare(batch[i][b], kit.to_np64(e[i]),
                              f"written argument '{op.schema.arguments[i].name}'[{b}] of the batch",
                              against=f"element {b} alone")


def _with(r: Runner, full: list[Any], values: dict[int, np.ndarray]) -> list[Any]:
    """*full* with the row arguments *values* as fresh framework arrays (in the case's dtype, as
    :meth:`Runner.materialize` makes them: integer arrays keep theirs)."""
    out = list(full)
    for i, v in values.items():
        out[i] = r.kit.from_np(v, r.dtype)
    return out
