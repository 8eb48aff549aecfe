"""``jax.export`` of programs that call opbridge ops: their custom-call targets, registered up front.

An exported program names the XLA FFI targets it calls
(``opbridge.<namespace>.<op>[.<variant>]``, :mod:`.targets`), and a process
that deserializes it must have them registered before it calls it. The
adapter registers a target lazily, the first time a call traces it, so a
fresh process that runs a deserialized export first calls
:func:`register_targets`. ``jax.export`` also refuses custom calls it does
not know to be stable unless told (:func:`disabled_checks`).

A target's name depends on which optional arguments a call passes as None
(and whether it uses ``out=``), never on the values of static arguments, so
every target an op library's exports can use is known in advance: for each
op, one per None pattern of its optional arguments, and one per pattern with
``out=``. The declared backwards run the library's own ops (the built-in
library's ``*_backward`` ops), so their targets are among them; a backward
that calls ops of another library needs that library registered too.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from opbridge import registry
from opbridge.adapters.jax import targets

if TYPE_CHECKING:
    from opbridge.declare import Library, OpDef


def _targets_of(op: OpDef) -> list[str]:
    """Register every target of *op* (each None pattern, with and without ``out=``); return their names."""
    args = op.schema.arguments
    if any(a.type.is_tensor_list for a in args):  # the JAX adapter refuses these ops
        return []
    optional = [i for i, a in enumerate(args) if a.type.optional]
    mutating = any(a.is_mutated for a in args)
    names: list[str] = []
    for n in range(len(optional) + 1):
        for absent in itertools.combinations(optional, n):
            calls = any(a.is_mutated and i not in absent for i, a in enumerate(args)) or op.n_outputs > 0
            if calls:
                names.append(targets.register_call(op, frozenset(absent)))
            if op.n_outputs > 0 and not mutating:
                names.append(targets.register_call(op, frozenset(absent), out=True))
    return names


def register_targets(lib: Library | None = None) -> list[str]:
    """Register every XLA FFI target the ops of *lib* can call (default: the built-in library, which
    ``import opbridge.ops`` declares; a library of yours: pass it).

    Call it in a process that runs a deserialized ``jax.export`` before its
    first call (the adapter otherwise registers a target only when a call of
    the op traces it). Builds or loads the library's kernels, as a first call
    would. Returns the targets' names, each once.
    """
    seen: dict[str, None] = {}
    for op in (registry.library("opbridge") if lib is None else lib).ops.values():
        for name in _targets_of(op):
            seen[name] = None
    return list(seen)


def disabled_checks(lib: Library | None = None) -> list[Any]:
    """``jax.export``'s ``disabled_checks`` for every target of *lib* (default: the built-in library).

    ``jax.export.export(f, disabled_checks=disabled_checks())(...)`` exports
    a program calling opbridge ops; their targets are registered as a side
    effect (:func:`register_targets`).
    """
    from jax import export

    return [export.DisabledSafetyCheck.custom_call(name) for name in register_targets(lib)]
