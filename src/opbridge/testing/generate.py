"""Case generation for the test matrix: :func:`make_cases` and the deprecated ``CASE_HINTS``.

An op's cases come from its declaration (``Library.op(..., hints=...)``, built
with the helpers of :mod:`opbridge.cases`), else from the deprecated
:data:`CASE_HINTS`, else from :func:`opbridge.cases.elementwise_cases`;
:func:`complete_case` then checks each case against the schema and fills in
the scalar arguments it leaves out.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from opbridge.cases import LAYOUT, META_KEYS, NONCONTIGUOUS, Case, CaseHint, elementwise_cases
from opbridge.declare import OpDef

__all__ = ["CASE_HINTS", "as_opdef", "case_rng", "complete_case", "held_cases", "make_cases", "only_none",
           "small_case"]


class _DeprecatedCaseHints(dict[str, CaseHint]):
    """``CASE_HINTS``: kept for one release; declare ``Library.op(..., hints=...)`` instead.

    Reading an op's qualname gives its declared hint; writing one still works
    (:func:`make_cases` consults it after the op's own ``hints``) but warns.
    """

    def __setitem__(self, key: str, value: CaseHint) -> None:
        warnings.warn(
            "opbridge.testing.CASE_HINTS is deprecated: declare the op's test cases with "
            f"Library.op(..., hints=...) instead of CASE_HINTS[{key!r}] = ...",
            DeprecationWarning, stacklevel=2,
        )
        super().__setitem__(key, value)

    def __missing__(self, key: str) -> CaseHint:
        from opbridge import registry

        namespace, _, name = key.partition("::")
        for lib in registry.libraries():
            op = lib.ops.get(name) if lib.namespace == namespace else None
            if op is not None and op.hints is not None:
                return op.hints
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None


#: Deprecated: per-op case generators by qualname (``"namespace::name"``), consulted
#: after the op's declared ``hints``. Declare them with the op instead::
#:
#:     @lib.op("layer_norm(...) -> Tensor", ..., hints=last_dim_hint(("x",), ("weight", "bias")))
CASE_HINTS: dict[str, CaseHint] = _DeprecatedCaseHints()

_GENERIC_SCALARS: dict[str, Any] = {"float": 0.5, "int": 1, "bool": True}


def complete_case(op: OpDef, case: Mapping[str, Any]) -> Case:
    """Validate *case* against the schema and fill in the arguments it leaves out."""
    names = [a.name for a in op.schema.arguments]
    unknown = [k for k in case if k not in names and k not in META_KEYS]
    if unknown:
        raise ValueError(f"{op.qualname}: case names unknown argument(s) {unknown}; the schema has {names}")
    out: Case = {}
    for a in op.schema.arguments:
        if a.name in case:
            out[a.name] = case[a.name]
        elif a.type.is_tensor and a.type.optional:
            out[a.name] = None
        elif a.type.is_tensor:
            raise ValueError(f"{op.qualname}: case gives no value for Tensor argument '{a.name}'")
        elif a.has_default:
            out[a.name] = a.default
        elif not a.type.is_list and a.type.base in _GENERIC_SCALARS and not a.type.optional:
            out[a.name] = _GENERIC_SCALARS[a.type.base]
        elif a.type.optional:
            out[a.name] = None
        else:
            raise ValueError(
                f"{op.qualname}: no value for argument '{a.name}' ({a.type}) and no generic one; "
                "declare a case generator with Library.op(..., hints=...)"
            )
    for k in META_KEYS:
        if k in case:
            out[k] = case[k]
    layout = out.get(LAYOUT, "contiguous")
    if layout not in ("contiguous", "sliced"):
        raise ValueError(f"{op.qualname}: case {LAYOUT}={layout!r}; expected 'contiguous' or 'sliced'")
    nc = out.get(NONCONTIGUOUS)
    if nc is not None and (nc not in names or not op.schema.arguments[names.index(nc)].type.is_tensor):
        raise ValueError(f"{op.qualname}: case {NONCONTIGUOUS}={nc!r} names no Tensor argument")
    return out


def make_cases(op: Any, dtype: str = "float32", seed: int = 0) -> list[Case]:
    """The test cases of *op* for *dtype*.

    Uses the op's declared ``hints`` (``Library.op(..., hints=...)``), else a
    generator registered in the deprecated :data:`CASE_HINTS`, else
    :func:`elementwise_cases`; arguments a case leaves out get their schema
    default (or a generic value for ``float``/``int``/``bool``).

    Parameters
    ----------
    op
        The op's public callable or its :class:`~opbridge.OpDef`.
    dtype
        Dtype name the cases are for (hints may vary values with it).
    seed
        Seed; the same ``(op, dtype, seed)`` always gives the same cases.

    Returns
    -------
    list of Case
        Tensor values are float64 NumPy arrays (cast to *dtype* when run);
        integer or boolean arrays keep their dtype.
    """
    opdef = as_opdef(op)
    rng = case_rng(seed, opdef.qualname, dtype)
    hint = opdef.hints or dict.get(CASE_HINTS, opdef.qualname)
    raw = hint(dtype, rng) if hint is not None else elementwise_cases(opdef, dtype, rng)
    return [complete_case(opdef, c) for c in raw]


def held_cases(op: OpDef, cases: Sequence[Case], dtypes: Iterable[str]) -> tuple[list[Case], str | None]:
    """The *cases* whose integer arrays a framework holding *dtypes* can hold, and, where none is left,
    why (else None).

    JAX without ``jax_enable_x64`` has no int64: it runs ``rotary_embedding``'s cases with int32
    positions and ``advance_step_flashattn``'s with int32 ids, and leaves out their int64 ones.
    """
    have = set(dtypes)

    def ints(c: Case) -> set[str]:
        return {str(v.dtype) for v in c.values() if isinstance(v, np.ndarray) and v.dtype.kind in "iu"}

    held = [c for c in cases if ints(c) <= have]
    if held or not cases:
        return held, None
    missing = sorted(set().union(*(ints(c) for c in cases)) - have)
    return held, f"no {missing}, which every case of {op.name} takes"


def small_case(op: OpDef, cases: Sequence[Case]) -> Case | None:
    """The smallest contiguous non-empty case, preferring ones whose tensors are at least 2-D."""
    def tensors(c: Case) -> list[np.ndarray]:
        return [np.asarray(c[a.name]) for a in op.schema.arguments
                if a.type.is_tensor and c[a.name] is not None]

    ok = [c for c in cases if c.get(NONCONTIGUOUS) is None and c.get(LAYOUT, "contiguous") == "contiguous"
          and all(t.size > 0 for t in tensors(c))]
    if not ok:
        return None
    wide = [c for c in ok if any(t.ndim >= 2 for t in tensors(c))]
    return min(wide or ok, key=lambda c: sum(t.size for t in tensors(c)))


def only_none(op: OpDef, cases: Iterable[Mapping[str, Any]]) -> str | None:
    """What to report when *cases* never give one of *op*'s ``Tensor?`` arguments a tensor, else None.

    A kernel that ignores such an argument passes every case, so a check
    that ran only these says so (in its report's ``skipped``).
    """
    given = {n for c in cases for n, v in c.items() if v is not None}
    names = [a.name for a in op.schema.arguments if a.type.is_tensor and a.type.optional and a.name not in given]
    if not names:
        return None
    return (f"{', '.join(names)} (Tensor?): only tested as None, no case gives {'them' if len(names) > 1 else 'it'} "
            f"a tensor (declare Library.op(..., hints=...) with cases that do)")


def case_rng(seed: int, *keys: object) -> np.random.Generator:
    return np.random.default_rng([seed, *(zlib.crc32(str(k).encode()) for k in keys)])


def as_opdef(op: Any) -> OpDef:
    opdef = op if isinstance(op, OpDef) else getattr(op, "opdef", None)
    if not isinstance(opdef, OpDef):
        raise TypeError(f"expected an opbridge op (its public callable or OpDef), got {op!r}")
    return opdef
