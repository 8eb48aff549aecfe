"""``out=`` on JAX arrays: the op's result computed in the caller's buffer, which is donated.

JAX arrays are immutable, so ``ops.<op>(..., out=o)`` cannot change ``o``.
It returns the op's result computed in ``o``'s memory instead: the custom
call takes ``o`` as an extra operand aliased to its output
(``input_output_aliases``; the kernel only writes it), so XLA puts the
result where ``o`` was whenever ``o`` is donated:

- an eager call donates ``o`` itself: afterwards ``o`` is deleted, as any
  donated array, and the returned array lives in its buffer;
- under a caller's ``jax.jit``, when the caller donates the array passed as
  ``out`` (``donate_argnums``); otherwise XLA copies it first, and the call
  costs what a call without ``out=`` costs.

An eager ``out`` that is also one of the call's inputs, or given twice, is
not donated (XLA cannot donate a buffer the same call reads): the call
returns a new array, as without ``out=``, and the arrays stay valid.

A large output then needs no new memory: under ``jax.jit`` XLA maps every
program output afresh, and the OS zeroes it on the kernel's first write
(``add`` at (4096, 4096) float32: 545 page faults per call even on huge
pages). ``out`` must have the output's shape and dtype (a ValueError says
which); ops that mutate their arguments refuse ``out=``, and the call is not
differentiable: under ``jax.grad`` or ``jax.jvp`` it raises NotImplementedError naming the
op (call the op without ``out=`` there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from opbridge.adapters.jax import targets
from opbridge.adapters.jax.variant import dtype_name, output_specs, result_types, x64_hint
from opbridge.call import core

if TYPE_CHECKING:
    from opbridge.adapters.jax import _JaxOp


def _not_differentiable(forward: Callable[..., Any], name: str) -> Callable[..., Any]:
    """*forward* with a derivative rule that raises NotImplementedError naming the op (else JAX's own error
    names the internal target, ``opbridge.<ns>.<op>.o``)."""
    fn = jax.custom_jvp(forward)

    def refuse(primals: Any, tangents: Any) -> Any:
        raise NotImplementedError(f"{name}: out= is not differentiable (the result is written into the out "
                                  f"array's donated buffer); call {name} without out= inside jax.grad, "
                                  f"jax.vjp or jax.jvp")

    fn.defjvp(refuse)
    return fn


class OutVariant:
    """One (op, static arguments, None pattern) combination called with ``out=``."""

    def __init__(self, jop: _JaxOp, statics: dict[int, Any], full_of: Any) -> None:
        op = self.op = jop.op
        args = op.schema.arguments
        self.jop = jop
        self.full_of = full_of  # tensor slots -> schema-ordered arguments (the plain variant's `full`)
        present = self.present = [i for i in jop.tensor_idx if statics[i] is not None]
        attr_idx = [i for i in jop.scalar_idx if statics[i] is not None]
        self.attrs = {args[i].name: statics[i] for i in attr_idx}
        n_out = op.n_outputs
        self.target = targets.register_call(op, frozenset(i for i, v in statics.items() if v is None), out=True)
        self.aliases = {len(present) + k: k for k in range(n_out)}
        n_slots = len(jop.tensor_idx)
        self.fn = _not_differentiable(self.forward, op.name)
        self.jitted = jax.jit(self.fn, donate_argnums=tuple(range(n_slots, n_slots + n_out)))
        self._kept: Callable[..., Any] | None = None

    def eager(self, ts: Any, outs: Any) -> Any:
        """An eager call: *outs* donated, unless one is also an input or given twice (then kept)."""
        ids = [id(o) for o in outs]
        if len(set(ids)) == len(ids) and not any(id(t) in ids for t in ts):
            return self.jitted(*ts, *outs)
        if self._kept is None:
            self._kept = jax.jit(self.fn)
        return self._kept(*ts, *outs)

    def forward(self, *slots: Any) -> Any:
        """The custom call on tensor slots then the outs (arrays or tracers)."""
        op = self.op
        n = len(self.jop.tensor_idx)
        ts, outs = slots[:n], slots[n:]
        full = self.full_of(ts)
        with x64_hint():
            core.check_lead_dtype(op, full, dtype_name)
        specs = output_specs(op, full)
        core.check_outs(op, full, outs, dtype_name)
        call = jax.ffi.ffi_call(self.target, result_types(op, full, specs, self.present),
                                vmap_method="sequential",
                                input_output_aliases=self.aliases)
        res = call(*(full[i] for i in self.present), *outs, **self.attrs)
        return self.jop.pack(full, list(res), {})
