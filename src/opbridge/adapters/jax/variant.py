"""One variant of a JAX op: its custom call, its trace-time checks and its VJP.

A variant is one (op, static arguments, None pattern) combination. It owns
the XLA target it calls (:mod:`opbridge.adapters.jax.targets`), the
``jax.custom_vjp`` function built from the declared backward, and the
``jax.jit`` executable that eager calls dispatch.

An eager call whose outputs are large CPU arrays (4 MiB and more each) runs
the kernel itself instead (:meth:`Variant.eager`): its outputs come from
opbridge's pool (:func:`opbridge.call.memory.host_empty`, recycled huge
pages) and become ``jax.Array`` through DLPack without a copy, so it does not
pay for the fresh memory XLA maps for each output (at (4096, 4096) float32
about 5 ms of a 3 ms kernel). Under ``jax.jit`` XLA allocates, as always.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from opbridge import loader
from opbridge.adapters.jax import targets
from opbridge.call import core, memory

if TYPE_CHECKING:
    from opbridge.adapters.jax import _JaxOp

#: Fewest elements of a dispatching array whose call may have pool-sized (4 MiB+) outputs.
MIN_POOL_ELEMENTS = memory.MIN_BYTES // 8

#: Largest total size (inputs + outputs) of a trace-time dry run of the kernel.
DRY_RUN_MAX_BYTES = 256 << 20


def _dry_run_limit() -> int:
    """:data:`DRY_RUN_MAX_BYTES` as it is now (change it here: ``opbridge.adapters.jax.variant``)."""
    return DRY_RUN_MAX_BYTES


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


def _sds(shape: tuple[int, ...], dtype: Any) -> Any:
    return jax.ShapeDtypeStruct(shape, dtype)  # type: ignore[no-untyped-call]


def _jnp_dtype(op: Any, d: Any) -> Any:
    """The JAX dtype of an output spec's dtype (an input's dtype or a name such as "int64")."""
    dt = jnp.dtype(d)
    if jax.dtypes.canonicalize_dtype(dt) != dt:
        raise TypeError(f"{op.name}: an output of dtype {dt} needs jax_enable_x64 "
                        f"(JAX would silently narrow it)")
    return dt


def output_specs(op: Any, full: Sequence[Any]) -> list[tuple[tuple[int, ...], Any]]:
    """``(shape, JAX dtype)`` of each new output of a call of *op* on schema-ordered *full*."""
    return core.alloc_outputs(op, full, lambda shape, dt, lead: (tuple(int(d) for d in shape),
                                                                  _jnp_dtype(op, dt)))


class Variant:
    """One (op, static arguments, None pattern) combination: target, custom_vjp function, jitted call."""

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
        n_out, n_mut = op.n_outputs, len(self.mutated)
        n_rets = n_out + n_mut
        # incoming order on the handler side: rets (outputs, then mutated aliases), args, attrs
        where: dict[int, int] = {}
        for j, i in enumerate(self.mutated):
            where[i] = n_out + j
        for j, i in enumerate(present):
            where.setdefault(i, n_rets + j)
        for j, i in enumerate(attr_idx):
            where[i] = n_rets + len(present) + j
        plan = list(range(n_out)) + [where.get(i, -1) for i in range(len(args))]
        direct = plan == list(range(n_rets + len(present) + len(attr_idx)))
        mask = "".join("1" if statics[i] is not None else "0" for i in jop.optional_idx)
        self.kernel = loader.kernel(op, "cpu")
        arg_spec = ["rets", "args", *(f"attrs.{args[i].name}" for i in attr_idx)]
        # "p" for permuted, then which optional arguments are present
        name = targets.target_name(op, "" if direct else f"p{mask}")
        self.target = targets.register(op, name, plan, direct, arg_spec)
        self.aliases = {present.index(i): n_out + j for j, i in enumerate(self.mutated)}
        self.checked: set[tuple[Any, ...]] = set()
        self.fn = self._custom_vjp()
        self.jitted = jax.jit(self.fn)
        self.lead = jop.tensor_idx.index(op.dispatch_arg) if op.dispatch_arg in jop.tensor_idx else None
        self.poolable = not self.mutated and op.n_outputs > 0 and self.lead is not None

    def eager(self, *ts: Any) -> Any:
        """A call on concrete arrays that is not on the fast path: large CPU outputs from the pool, else jitted.

        Calls on small arrays go straight to the jitted executable from the
        op's generated call (its test of remembered small avals); this runs on the checked path.
        """
        if self.poolable and ts[self.lead].size >= MIN_POOL_ELEMENTS:  # type: ignore[index]
            got = self._pooled(ts)
            if got is not None:
                return got
        return self.jitted(*ts)

    def _pooled(self, ts: Sequence[Any]) -> Any | None:
        """The kernel on *ts* into pool buffers (None: an output is small or not on the CPU, or no pool)."""
        lead = ts[self.lead]  # type: ignore[index]
        if isinstance(lead, jax.core.Tracer):  # a call first seen inside a trace can land here
            return None
        devices = lead.devices()
        if len(devices) != 1 or next(iter(devices)).platform != "cpu":
            return None
        op = self.op
        full = self.full(ts)
        core.check_lead_dtype(op, full, dtype_name)
        specs = output_specs(op, full)
        bufs = []
        for shape, dt in specs:
            b = memory.host_empty(shape, dt.name, math.prod(shape) * dt.itemsize)
            if b is None:
                return None
            bufs.append(b)
        self.kernel(*bufs, *full)
        return self.jop.pack(full, [_to_jax(b) for b in bufs], {})

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
        if sig in self.checked:
            return
        total = sum(math.prod(s) * jnp.dtype(d).itemsize for s, d in specs)
        total += sum(math.prod(full[i].shape) * full[i].dtype.itemsize for i in self.present)
        if total <= _dry_run_limit():
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
        core.check_lead_dtype(op, full, dtype_name)
        specs = output_specs(op, full)
        self._dry_run(full, specs)
        shapes = [*specs, *((tuple(full[i].shape), full[i].dtype) for i in self.mutated)]
        outs: list[Any] = []
        if shapes:  # else the call could have no observable effect
            call = jax.ffi.ffi_call(
                self.target, [_sds(s, d) for s, d in shapes], vmap_method="sequential",
                input_output_aliases=self.aliases or None,
            )
            outs = list(call(*(full[i] for i in self.present), **self.attrs))
        n = op.n_outputs
        return self.jop.pack(full, outs[:n], dict(zip(self.mutated, outs[n:], strict=True)))

    # -- autodiff ----------------------------------------------------------

    def _custom_vjp(self) -> Callable[..., Any]:
        """``_forward`` with the declared backward as its VJP (static scalars closed over)."""
        op = self.op
        fn = jax.custom_vjp(self._forward)

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
                    out.append(r if r.dtype == t.dtype else r.astype(t.dtype))
            return tuple(out)

        fn.defvjp(fwd, bwd)
        return fn


_KDL_CPU = 1
_IMPORT: list[Any] = []


def _to_jax(buf: Any) -> Any:
    """A pool buffer (a ``tvm_ffi.Tensor`` on the CPU) as a ``jax.Array`` on it, without a copy.

    jaxlib's own DLPack import (4 µs) where this jaxlib has the signature it
    was written against, else ``jax.dlpack.from_dlpack`` (23 µs: it looks up
    the backend and device and re-wraps the array each call).
    """
    if not _IMPORT:
        fn: Any = None
        try:
            from jax._src.lib import _jax  # type: ignore[attr-defined]

            raw, cpu = _jax.dlpack_managed_tensor_to_buffer, jax.devices("cpu")[0]
            probe = memory.host_empty((memory.MIN_BYTES // 4,), "float32", memory.MIN_BYTES)
            if probe is not None:
                got = raw(probe.__dlpack__(), cpu, None, False, _KDL_CPU)
                if isinstance(got, jax.Array) and got.unsafe_buffer_pointer() == probe.data_ptr():
                    fn = lambda b: raw(b.__dlpack__(), cpu, None, False, _KDL_CPU)  # noqa: E731
        except Exception:  # any jaxlib without it: the public import
            fn = None
        _IMPORT.append(fn or jax.dlpack.from_dlpack)
    return _IMPORT[0](buf)
