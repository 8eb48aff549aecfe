"""Test-case building blocks for op declarations: ``Library.op(..., hints=...)``.

A *case* is a dict mapping argument names to values (NumPy arrays for Tensor
arguments, Python values for the rest) plus optional ``_``-prefixed layout
keys (:data:`LAYOUT`, :data:`NONCONTIGUOUS`). A *hint* is an op's case
generator, ``hint(dtype, rng) -> list of cases``, declared beside the op::

    @lib.op("rms_norm(Tensor x, Tensor weight, float eps=1e-6) -> Tensor",
            shape=like("x"), hints=last_dim_hint(("x",), ("weight",)))
    def rms_norm(x, weight, eps=1e-6): ...

The test matrix (:mod:`opbridge.testing`) and the benchmarks read an op's
hint; ops without one get :func:`elementwise_cases`. This module needs only
NumPy, so declaring hints never imports the testing kit or a framework.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "ELEMENTWISE_SHAPES",
    "LAYOUT",
    "META_KEYS",
    "NONCONTIGUOUS",
    "Case",
    "CaseHint",
    "elementwise_cases",
    "elementwise_hint",
    "gated_hint",
    "last_dim_hint",
    "shaped_cases",
]

#: One test case: argument name -> value, plus optional ``_``-prefixed keys.
Case = dict[str, Any]
#: A per-op case generator: ``hint(dtype, rng) -> list of cases``.
CaseHint = Callable[[str, np.random.Generator], list[Case]]

#: Case key: ``"contiguous"`` (default) or ``"sliced"`` -- every Tensor argument
#: is then a contiguous slice at an odd element offset of a NaN-filled buffer.
LAYOUT = "_layout"
#: Case key naming one Tensor argument to pass non-contiguous; the call must
#: raise ``ValueError`` naming the op (kernels require contiguous inputs).
NONCONTIGUOUS = "_noncontiguous"
#: Every key a case may hold besides argument names.
META_KEYS = (LAYOUT, NONCONTIGUOUS)

#: Shapes of the generic elementwise matrix: odd sizes, a single element, an
#: empty tensor, a size-1 middle dimension, and one case large enough
#: (> 2^16 elements) to take the kernels' multi-threaded path.
ELEMENTWISE_SHAPES: tuple[tuple[int, ...], ...] = (
    (1,), (7,), (3, 769), (2, 5125), (0, 16), (4, 1, 33), (33, 2053),
)


def shaped_cases(
    shape_sets: Sequence[Mapping[str, tuple[int, ...] | None]],
    rng: np.random.Generator,
    *,
    scale: float = 2.0,
    sliced: bool = True,
    noncontiguous: bool = True,
) -> list[Case]:
    """Cases with random normal values from ``{tensor argument: shape}`` mappings.

    Parameters
    ----------
    shape_sets
        One mapping per case; a shape of ``None`` passes ``None`` (for
        ``Tensor?`` arguments).
    rng
        Source of the values (standard normal times *scale*, in float64).
    scale
        Standard deviation of the values.
    sliced
        Also add a ``"sliced"`` variant of the first shape set whose tensors
        are all non-empty and at least 2-D (else non-empty).
    noncontiguous
        Also add one case per Tensor argument that makes just that argument
        non-contiguous, using the first shape set whose tensors all have a
        last dimension > 1.

    Returns
    -------
    list of Case
    """
    def values(shapes: Mapping[str, tuple[int, ...] | None]) -> Case:
        return {n: None if s is None else rng.standard_normal(s) * scale for n, s in shapes.items()}

    cases = [values(s) for s in shape_sets]
    present = [{n: s for n, s in ss.items() if s is not None} for ss in shape_sets]
    if sliced:
        nonempty = [i for i, ss in enumerate(present) if ss and all(int(np.prod(s)) > 0 for s in ss.values())]
        wide = [i for i in nonempty if all(len(s) >= 2 for s in present[i].values())]
        if wide or nonempty:
            cases.append({**values(shape_sets[(wide or nonempty)[0]]), LAYOUT: "sliced"})
    if noncontiguous:
        nc_pick = next((i for i, ss in enumerate(present)
                        if ss and all(len(s) >= 1 and s[-1] > 1 and int(np.prod(s)) > 0 for s in ss.values())),
                       None)
        if nc_pick is not None:
            for name in present[nc_pick]:
                cases.append({**values(shape_sets[nc_pick]), NONCONTIGUOUS: name})
    return cases


def elementwise_cases(op: Any, dtype: str, rng: np.random.Generator) -> list[Case]:
    """The generic matrix: every Tensor argument has the lead argument's shape.

    Runs over :data:`ELEMENTWISE_SHAPES` plus a sliced and non-contiguous
    variants (see :func:`shaped_cases`). Each shape runs with the optional
    Tensor arguments given a tensor of that shape too, and then as ``None``
    (so a kernel that ignores one fails); the sliced and non-contiguous
    variants give them a tensor.

    Parameters
    ----------
    op
        The op's :class:`~opbridge.OpDef` or its public callable.
    dtype
        Dtype name the cases are for (unused: the values are float64).
    rng
        Source of the values.

    Returns
    -------
    list of Case
    """
    opdef = getattr(op, "opdef", op)
    tensors = [a for a in opdef.schema.arguments if a.type.is_tensor]
    given = [dict.fromkeys((a.name for a in tensors), s) for s in ELEMENTWISE_SHAPES]
    if not any(a.type.optional for a in tensors):
        return shaped_cases(given, rng)
    left_out = [{a.name: (None if a.type.optional else s) for a in tensors} for s in ELEMENTWISE_SHAPES]
    return shaped_cases([ss for pair in zip(given, left_out, strict=True) for ss in pair], rng)


def elementwise_hint(*names: str) -> CaseHint:
    """A case generator for ops whose Tensor arguments *names* all share one shape.

    Parameters
    ----------
    *names
        The Tensor arguments, all given each shape of :data:`ELEMENTWISE_SHAPES`.

    Returns
    -------
    CaseHint
        For ``Library.op(hints=...)``; adds the sliced and non-contiguous cases.
    """

    def hint(dtype: str, rng: np.random.Generator) -> list[Case]:
        return shaped_cases([dict.fromkeys(names, s) for s in ELEMENTWISE_SHAPES], rng)

    hint.__doc__ = f"Elementwise cases: {', '.join(names)} share each shape of ELEMENTWISE_SHAPES."
    return hint


def last_dim_hint(full: tuple[str, ...], row: tuple[str, ...]) -> CaseHint:
    """A case generator for ops over the last dimension (normalisations).

    Parameters
    ----------
    full
        Tensor arguments of shape ``(*lead, H)``: each shape of :data:`ELEMENTWISE_SHAPES`.
    row
        Tensor arguments of shape ``(H,)``.

    Returns
    -------
    CaseHint
        For ``Library.op(hints=...)``; adds the sliced and non-contiguous cases.
    """

    def hint(dtype: str, rng: np.random.Generator) -> list[Case]:
        sets = [{**dict.fromkeys(full, s), **dict.fromkeys(row, (s[-1],))} for s in ELEMENTWISE_SHAPES]
        return shaped_cases(sets, rng)

    hint.__doc__ = (f"Normalisation cases: {', '.join(full)} of shape (*lead, H), "
                    f"{', '.join(row)} of shape (H,).")
    return hint


def gated_hint(wide: tuple[str, ...], half: tuple[str, ...] = ()) -> CaseHint:
    """A case generator for gated activations, whose input ``[a | b]`` doubles the last dimension.

    Parameters
    ----------
    wide
        Tensor arguments of shape ``(*lead, 2 H)`` (the halves side by side).
    half
        Tensor arguments of shape ``(*lead, H)`` (e.g. the incoming gradient),
        ``(*lead, H)`` running over each shape of :data:`ELEMENTWISE_SHAPES`.

    Returns
    -------
    CaseHint
        For ``Library.op(hints=...)``; adds the sliced and non-contiguous cases.
    """

    def hint(dtype: str, rng: np.random.Generator) -> list[Case]:
        sets = [{**dict.fromkeys(half, s), **dict.fromkeys(wide, (*s[:-1], 2 * s[-1]))}
                for s in ELEMENTWISE_SHAPES]
        return shaped_cases(sets, rng)

    hint.__doc__ = (f"Gated cases: {', '.join(wide)} of shape (*lead, 2H)"
                    + (f", {', '.join(half)} of shape (*lead, H)." if half else "."))
    return hint
