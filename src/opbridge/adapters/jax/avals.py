"""The types of the JAX adapter's custom-call results: shape, dtype, per-device variance and sharding.

``jax.ffi.ffi_call`` gives its results the types it is handed, and JAX
checks them against the inputs' types wherever they meet again (a
``custom_vjp``'s cotangents must have its primal inputs' types). So each
result type carries what JAX's own elementwise ops would give it:

- inside ``jax.shard_map``, the mesh axes its inputs vary over (their
  union, the "varying manual axes" JAX prints as ``{V:d}``), so that
  ``out_specs`` checks and ``jax.grad`` see a per-device value as one;
- on a mesh of ``AxisType.Explicit`` axes (``jax.make_mesh``'s default,
  under ``jax.set_mesh``), the sharding of the argument a ``like`` output
  copies (a shape rule's outputs are replicated);
- symbolic dimensions (``jax.export.symbolic_shape``) as they are.

The custom calls have no partitioning rule yet: XLA gathers sharded
operands, runs the kernel on whole arrays and slices the results to the
sharding given here.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


def varying(x: Any) -> frozenset[Any]:
    """The mesh axes *x* varies over inside ``jax.shard_map`` (empty elsewhere, and for None)."""
    if x is None:
        return frozenset()
    t = jax.typeof(x)
    mat = getattr(t, "mat", None)  # jax >= 0.9: ManualAxisType; earlier releases: .vma
    return frozenset(mat.varying if mat is not None else getattr(t, "vma", ()))


def match_varying(ts: Sequence[Any]) -> list[Any]:
    """*ts* (None for absent optionals), each cast to vary over every mesh axis any of them varies over.

    Inside ``jax.shard_map`` a custom call's results vary wherever one of its
    inputs does. Casting the invariant inputs first (what JAX's own ops do
    implicitly) gives the ``custom_vjp`` primal inputs of the results' type,
    so the declared backward's cotangents have their type, and JAX's
    transpose of the cast sums the cotangent of an invariant input over the
    axes it was cast to.
    """
    axes = [varying(t) for t in ts]
    union = frozenset().union(*axes)
    if not union:
        return list(ts)
    return [t if t is None or a == union else _pcast(t, tuple(sorted(union - a, key=str)))
            for t, a in zip(ts, axes, strict=True)]


def _pcast(x: Any, axes: tuple[Any, ...]) -> Any:
    pcast = getattr(jax.lax, "pcast", None)
    if pcast is not None:
        return pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)  # type: ignore[attr-defined]  # jax < 0.8


def explicit_sharding(x: Any) -> Any | None:
    """*x*'s sharding when it is on a mesh with an ``Explicit`` axis (its type carries it), else None."""
    if x is None:
        return None
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True):
        return None
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    if explicit is None or explicit not in tuple(getattr(mesh, "axis_types", ())):
        return None
    return sharding


def same_sharding(a: Any, b: Any) -> bool:
    """Whether two shardings of types (either may be None) lay an array out the same way."""
    if a is None or b is None:
        return a is b
    return bool(a.spec == b.spec and a.mesh == b.mesh)


def reshard_like(r: Any, t: Any) -> Any:
    """Cotangent *r* with primal *t*'s explicit sharding (a custom_vjp's backward must return that type)."""
    want = explicit_sharding(t)
    if want is None or same_sharding(explicit_sharding(r), want):
        return r
    return jax.sharding.reshard(r, want.spec)


@functools.cache
def _sds_keywords() -> frozenset[str]:
    return frozenset(inspect.signature(jax.ShapeDtypeStruct).parameters)


def result_type(shape: tuple[Any, ...], dtype: Any, vma: frozenset[Any] = frozenset(),
                sharding: Any | None = None, mesh: Any | None = None) -> Any:
    """The ``ShapeDtypeStruct`` of one result varying over *vma* (axes of *mesh*, the abstract mesh of
    the ``shard_map`` body), laid out as *sharding* (None: replicated)."""
    kw: dict[str, Any] = {}
    if vma:
        keys = _sds_keywords()
        if "manual_axis_type" in keys:  # jax >= 0.9: a manual axis type needs its mesh
            kw["manual_axis_type"] = jax.sharding.ManualAxisType(varying=vma)  # type: ignore[attr-defined]
            if sharding is None and mesh is not None:
                sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        elif "vma" in keys:
            kw["vma"] = vma
    if sharding is not None:
        kw["sharding"] = sharding
    return jax.ShapeDtypeStruct(shape, dtype, **kw)  # type: ignore[no-untyped-call]


def mesh_of(x: Any) -> Any | None:
    """The (abstract) mesh of *x*'s type, if it has one."""
    return getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)


def is_static(shape: Sequence[Any]) -> bool:
    """Whether every dimension of *shape* is a known integer (not a ``jax.export`` symbol)."""
    return all(isinstance(d, (int, np.integer)) for d in shape)
