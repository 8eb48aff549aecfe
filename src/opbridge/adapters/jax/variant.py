"""One variant of a JAX op: its custom call, its trace-time checks and its VJP.

A variant is one (op, static arguments, None pattern) combination. It owns
the XLA target it calls (:mod:`opbridge.adapters.jax.targets`) and the
``jax.custom_vjp`` function built from the declared backward; the ``jax.jit``
executable that eager calls dispatch is :class:`.eager.Compiled`'s, which
holds a variant. Nothing a traced call keeps (the jaxpr's forward and
backward rules) refers back to that executable, so JAX's caches, keyed
weakly on the function it compiles, let it go with its ``Compiled``.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from opbridge import loader
from opbridge.adapters.jax import avals, targets
from opbridge.call import batching, core

if TYPE_CHECKING:
    from opbridge.adapters.jax import _JaxOp

def dtype_name(x: Any) -> str:
    """The dtype of an array or tracer by name (``"bfloat16"``, ``"float32"``, ...)."""
    return str(jnp.dtype(x.dtype).name)


def _zeros(shape: tuple[int, ...], dtype: Any) -> Any:
    """A concrete zero-filled buffer the kernel can take through DLPack."""
    a = np.zeros(shape, dtype)
    if a.dtype.kind in "biufc":
        return a
    with jax.ensure_compile_time_eval():  # bfloat16 and friends: NumPy's DLPack refuses them
        return jax.device_put(a, jax.devices("cpu")[0])


#: 64-bit dtypes and what JAX narrows each to without ``jax_enable_x64``.
_NARROWED = {"int64": "int32", "uint64": "uint32", "float64": "float32", "complex128": "complex64"}
_DTYPE_ERROR = re.compile(r"must have dtype (?P<want>[\w, ]+?), got (?P<got>\w+)")


def _with_x64_hint(msg: str) -> str | None:
    """*msg* (a dtype error) with how to get 64-bit arrays in JAX, where a 64-bit dtype was wanted and
    x64 is off so the array came narrowed; None where that is not the story."""
    m = _DTYPE_ERROR.search(msg)
    if m is None or jax.config.jax_enable_x64:  # type: ignore[attr-defined]
        return None
    wanted = {w.strip() for part in m["want"].split(" or ") for w in part.split(",")}
    if m["got"] in wanted or not any(_NARROWED.get(w) == m["got"] for w in wanted):
        return None
    msg = msg.partition(core.CONVERT_HINT)[0]  # a conversion would be narrowed again: x64 is the fix
    return (f"{msg} (JAX makes 64-bit arrays 32-bit unless x64 is on: "
            f'jax.config.update("jax_enable_x64", True) at startup, or JAX_ENABLE_X64=1)')


@contextlib.contextmanager
def x64_hint() -> Iterator[None]:
    """Re-raise a dtype TypeError (declared dtypes or the kernel's own check) with :func:`_with_x64_hint`."""
    try:
        yield
    except TypeError as e:
        msg = _with_x64_hint(str(e))
        if msg is None:
            raise
        raise TypeError(msg) from e


def _jnp_dtype(op: Any, d: Any) -> Any:
    """The JAX dtype of an output spec's dtype (an input's dtype or a name such as "int64")."""
    dt = jnp.dtype(d)
    if jax.dtypes.canonicalize_dtype(dt) != dt:
        raise TypeError(f"{op.name}: an output of dtype {dt} needs jax_enable_x64 "
                        f"(JAX would silently narrow it)")
    return dt


def _dim(d: Any) -> Any:
    return int(d) if isinstance(d, (int, np.integer)) else d  # a jax.export symbol stays one


def output_specs(op: Any, full: Sequence[Any]) -> list[tuple[tuple[Any, ...], Any]]:
    """``(shape, JAX dtype)`` of each new output of a call of *op* on schema-ordered *full*.

    Symbolic dimensions (``jax.export.symbolic_shape``) pass through a ``like`` rule as they are; a
    shape rule that cannot compute with them raises NotImplementedError naming the op.
    """
    try:
        return core.alloc_outputs(op, full, lambda shape, dt, lead: (tuple(_dim(d) for d in shape),
                                                                      _jnp_dtype(op, dt)))
    except Exception as e:
        if all(avals.is_static(a.shape) for a in full if hasattr(a, "shape")):
            raise
        raise NotImplementedError(
            f"{op.name}: its shape rule cannot take symbolic dimensions (jax.export.symbolic_shape); "
            f"export it with concrete shapes ({type(e).__name__}: {e})") from e


def result_types(op: Any, full: Sequence[Any], specs: Sequence[tuple[tuple[Any, ...], Any]],
                 present: Sequence[int], mutated: Sequence[int] = ()) -> list[Any]:
    """The ``ShapeDtypeStruct`` of each new output (*specs*), then of each *mutated* argument's new value.

    Each varies over the mesh axes its tensors vary over (inside ``jax.shard_map``) and, on a mesh
    of explicit axes, a ``like`` output has the sharding of the argument it copies (:mod:`.avals`).
    """
    vma = frozenset().union(*(avals.varying(full[i]) for i in present))
    mesh = avals.mesh_of(full[present[0]]) if vma else None
    like = core.like_indices(op)
    types = [avals.result_type(s, d, vma, avals.explicit_sharding(full[like[k]]) if like else None, mesh)
             for k, (s, d) in enumerate(specs)]
    types += [avals.result_type(tuple(full[i].shape), full[i].dtype, vma, avals.explicit_sharding(full[i]), mesh)
              for i in mutated]
    return types


class Variant:
    """One (op, static arguments, None pattern) combination: its target and custom_vjp function."""

    def __init__(self, jop: _JaxOp, statics: dict[int, Any]) -> None:
        op = self.op = jop.op
        args = op.schema.arguments
        self.jop = jop
        self.statics = statics  # schema index -> coerced value (tensors: True if present, None if absent)
        present = [i for i in jop.tensor_idx if statics[i] is not None]
        self.present = present
        self.mutated = [i for i in jop.mutated_idx if statics[i] is not None]
        attr_idx = [i for i in jop.scalar_idx if statics[i] is not None]
        self.attrs = {args[i].name: statics[i] for i in attr_idx}
        self.kernel = loader.kernel(op, "cpu")
        self.target = targets.register_call(op, frozenset(i for i, v in statics.items() if v is None))
        self.aliases = {present.index(i): op.n_outputs + j for j, i in enumerate(self.mutated)}
        self.checked: set[tuple[Any, ...]] = set()
        self.fn = self._custom_vjp()

    # -- forward -----------------------------------------------------------

    def full(self, ts: Sequence[Any]) -> list[Any]:
        """Schema-ordered arguments from the tensor slots *ts* and the static scalars."""
        full: list[Any] = [None] * len(self.op.schema.arguments)
        for i in self.jop.scalar_idx:
            full[i] = self.jop.raw_scalar(self.statics[i])
        for i, t in zip(self.jop.tensor_idx, ts, strict=True):
            full[i] = t
        return full

    def _dry_run(self, full: list[Any], specs: Sequence[Any]) -> None:
        """Run the kernel once on zeros of these shapes so its own argument errors are raised now."""
        sig = tuple((tuple(full[i].shape), str(full[i].dtype)) for i in self.present)
        if sig in self.checked or not all(avals.is_static(s) for s, _ in (*sig, *specs)):
            return  # seen, or symbolic dimensions (jax.export): nothing to allocate
        total = sum(math.prod(s) * jnp.dtype(d).itemsize for s, d in specs)
        total += sum(math.prod(full[i].shape) * full[i].dtype.itemsize for i in self.present)
        if core.dry_run_fits(total):
            present = set(self.present)
            call = [_zeros(tuple(v.shape), v.dtype) if i in present else v for i, v in enumerate(full)]
            self.kernel(*(_zeros(s, d) for s, d in specs), *call)
        if len(self.checked) < 256:
            self.checked.add(sig)

    def _forward(self, *ts: Any) -> Any:
        """The custom call on tensor slots *ts* (arrays or tracers; None for absent optionals).

        Runs when JAX traces the call, so the declared-dtype check and the dry
        run cost nothing on calls that reuse a compiled executable.
        """
        op = self.op
        full = self.full(ts)
        with x64_hint():
            core.check_lead_dtype(op, full, dtype_name)
            specs = output_specs(op, full)
            self._dry_run(full, specs)
        types = result_types(op, full, specs, self.present, self.mutated)
        outs: list[Any] = []
        if types:  # else the call could have no observable effect
            call = jax.ffi.ffi_call(
                self.target, types, vmap_method="sequential",
                input_output_aliases=self.aliases or None,
            )
            outs = list(call(*(full[i] for i in self.present), **self.attrs))
        n = op.n_outputs
        return self.jop.pack(full, outs[:n], dict(zip(self.mutated, outs[n:], strict=True)))

    # -- autodiff ----------------------------------------------------------

    def _custom_vmap(self) -> Callable[..., Any]:
        """``_forward`` with the op's batching rule (:mod:`opbridge.call.batching`).

        A batch over the declared rows alone is one custom call at the batched
        shapes, each row argument the batch leaves out broadcast along it;
        any other batch runs the custom call once per element (the custom
        call's own ``vmap_method="sequential"``).
        """
        call = jax.custom_batching.custom_vmap(self._forward)
        tensor_idx = self.jop.tensor_idx

        def rule(axis_size: int, in_batched: Sequence[Any], *ts: Any) -> tuple[Any, Any]:
            flags = [bool(b) for b in in_batched]  # an absent optional (None) has no batch flag
            plan = batching.one_call(self.op, [i for i, b in zip(tensor_idx, flags, strict=True) if b],
                                     [i for i, t in zip(tensor_idx, ts, strict=True) if t is not None])
            if plan is None:
                out = jax.vmap(self._forward, in_axes=tuple(0 if b else None for b in flags),
                               axis_size=axis_size)(*ts)
            else:
                out = call(*(jnp.broadcast_to(t, (axis_size, *t.shape)) if i in plan else t
                             for i, t in zip(tensor_idx, ts, strict=True)))
            return out, jax.tree.map(lambda _: True, out)

        call.def_vmap(rule)
        return call

    def _custom_vjp(self) -> Callable[..., Any]:
        """``_forward`` with its batching rule and the declared backward as its VJP (static scalars closed over)."""
        op = self.op
        fn = jax.custom_vjp(self._custom_vmap())

        def fwd(*ts: Any) -> tuple[Any, Any]:
            # fn, not _forward: under an outer differentiation (grad of grad) the call
            # must stay differentiable by its own rule.
            return fn(*ts), ts

        def bwd(ts: tuple[Any, ...], g: Any) -> tuple[Any, ...]:
            # Cotangents may arrive as NumPy arrays (what a user passed to the pullback).
            grads = [None if c is None else jnp.asarray(c) for c in (g if isinstance(g, tuple) else (g,))]
            res = core.run_backward(op, grads, self.full(ts))
            out: list[Any] = []
            for t, r in zip(ts, res, strict=True):
                if t is None or r is None or not jnp.issubdtype(t.dtype, jnp.inexact):
                    out.append(None)  # integer tensors: a symbolic zero (float0) cotangent
                else:
                    r = r if r.dtype == t.dtype else r.astype(t.dtype)
                    out.append(avals.reshard_like(r, t))  # the primal's type, on an explicit mesh too
            return tuple(out)

        fn.defvjp(fwd, bwd)
        return fn
