"""Declare stage: a library of kernels and the ops it provides, as pure data.

An op is declared once, by decorating its reference implementation::

    lib = Library("myops", sources=["csrc/scale.cc"])

    @lib.op("scale(Tensor x, float alpha) -> Tensor", shape=like("x"))
    def scale(x, alpha):              # the reference, on NumPy arrays
        return x * alpha

The decorator returns the op's public callable. Everything else -- framework
registrations, fake kernels, JAX output specs, the AOT build list, the test
matrix, benchmarks and generated wrappers -- is derived from the
:class:`OpDef` it records. This package imports nothing of the later stages
(build, load, call, adapters): :class:`opbridge.Library` (in
:mod:`opbridge.library`) adds the public callables and the build/load
conveniences on top of the :class:`Library` declared here.

It holds two things: one op's declaration (:mod:`.op`: :class:`OpDef`,
:class:`like`, :class:`Spec`, tolerances and dtypes) and the library that
declares ops (:mod:`.library`: :class:`Library`).
"""

from opbridge.declare.library import Library
from opbridge.declare.op import (
    DEFAULT_DTYPES,
    DEFAULT_TOLERANCES,
    HEADER_SUFFIXES,
    KNOWN_DTYPES,
    SOURCE_SUFFIXES,
    TOLERANCES,
    BackwardFn,
    CaseHint,
    OpDef,
    ShapeRule,
    Spec,
    like,
)

__all__ = ["DEFAULT_DTYPES", "DEFAULT_TOLERANCES", "HEADER_SUFFIXES", "KNOWN_DTYPES", "SOURCE_SUFFIXES", "TOLERANCES",
           "BackwardFn", "CaseHint", "Library", "OpDef", "ShapeRule", "Spec", "like"]
