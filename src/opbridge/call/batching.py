"""Batching from the declaration: how a framework's ``vmap`` runs an op over a batch.

An op that declares ``rows`` (:attr:`opbridge.declare.OpDef.rows`) maps the
leading dims of those Tensor arguments row by row, and its kernels take any
number of leading dims. A batch over those arguments alone is then one more
leading dim: one kernel call, with each row argument the batch left out
broadcast along it (a weight or cache stays as it is). A batch over any other
argument, or an op without rows, runs the kernel once per batch element. The
JAX adapter (``jax.custom_batching.custom_vmap``), the torch adapter
(``torch.library.register_vmap``) and the MindSpore adapter (the
``get_vmap_rule`` of its ``ops.Custom`` primitive) all ask :func:`one_call`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opbridge.declare import OpDef


def one_call(op: OpDef, batched: Iterable[int], present: Iterable[int]) -> tuple[int, ...] | None:
    """How a batch over the Tensor arguments *batched* (schema indices) of a call of *op* runs.

    *present*: the call's Tensor arguments that are not None. Returns the
    row arguments to broadcast along a new leading batch dim before one kernel
    call on the whole batch (those of *present* not in *batched*), or None:
    the batch runs the kernel once per element.
    """
    rows, batched = set(op.rows), set(batched)
    if not batched or not batched <= rows:
        return None
    return tuple(i for i in present if i in rows and i not in batched)
