"""The executable an eager JAX call dispatches, and its path for large CPU outputs.

An eager call (concrete arrays) runs one variant's ``jax.jit`` executable
(:class:`Compiled`), cached per op and static arguments. One whose outputs
are large CPU arrays (4 MiB and more each) runs the kernel itself instead
(:meth:`Compiled.eager`): its outputs come from opbridge's pool
(:func:`opbridge.call.memory.host_empty`, recycled huge pages) and become
``jax.Array`` through DLPack without a copy, on the input's device, so it
does not pay for the fresh memory XLA maps for each output (at (4096, 4096)
float32 about 5 ms of a 3 ms kernel). Under ``jax.jit`` XLA allocates, as
always.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from opbridge.adapters.jax.variant import Variant, dtype_name, output_specs, x64_hint
from opbridge.call import core, memory

if TYPE_CHECKING:
    from opbridge.adapters.jax import _JaxOp

#: Fewest elements of a dispatching array whose call may have pool-sized (4 MiB+) outputs.
MIN_POOL_ELEMENTS = memory.MIN_BYTES // 8


def _entry(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A new function calling *fn*, for ``jax.jit`` to key its caches on.

    JAX's trace caches hold their key weakly and the traced jaxpr strongly;
    the jaxpr refers to *fn* (the custom_vjp's rules), so keyed on *fn* an
    entry would keep itself alive. Nothing refers back to this function but
    its executable, so a forgotten :class:`Compiled` frees its compilations.
    """
    def call(*ts: Any) -> Any:
        return fn(*ts)

    call.__name__ = call.__qualname__ = name
    return call


class Compiled:
    """One variant (:class:`.variant.Variant`) and the executable that eager calls of it dispatch."""

    def __init__(self, jop: _JaxOp, statics: dict[int, Any]) -> None:
        var = self.variant = Variant(jop, statics)
        op = jop.op
        self.fn, self.statics, self.full, self.target = var.fn, var.statics, var.full, var.target
        self.jitted = jax.jit(_entry(var.fn, op.name))
        self.lead = jop.tensor_idx.index(op.dispatch_arg) if op.dispatch_arg in jop.tensor_idx else None
        self.poolable = not var.mutated and op.n_outputs > 0 and self.lead is not None

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
        if len(devices) != 1:
            return None
        device = next(iter(devices))
        if device.platform != "cpu":
            return None
        op = self.variant.op
        full = self.variant.full(ts)
        with x64_hint():
            core.check_lead_dtype(op, full, dtype_name)
            specs = output_specs(op, full)
            bufs = []
            for shape, dt in specs:
                b = memory.host_empty(shape, dt.name, math.prod(shape) * dt.itemsize)
                if b is None:
                    return None
                bufs.append(b)
            self.variant.kernel(*bufs, *full)
        return self.variant.jop.pack(full, [_to_jax(b, device) for b in bufs], {})


_KDL_CPU = 1
_IMPORT: list[Any] = []


def _to_jax(buf: Any, device: Any) -> Any:
    """A pool buffer (a ``tvm_ffi.Tensor`` in host memory) as a ``jax.Array`` on CPU *device*, without a copy.

    jaxlib's own DLPack import (4 µs) where this jaxlib has the signature it
    was written against, else ``jax.dlpack.from_dlpack`` (23 µs: it looks up
    the backend and device and re-wraps the array each call). The array is
    placed on *device*, the input's (all CPU devices share the host's memory).
    """
    if not _IMPORT:
        fn: Any = None
        try:
            from jax._src.lib import _jax  # type: ignore[attr-defined]

            raw, cpu = _jax.dlpack_managed_tensor_to_buffer, jax.devices("cpu")[-1]
            probe = memory.host_empty((memory.MIN_BYTES // 4,), "float32", memory.MIN_BYTES)
            if probe is not None:
                got = raw(probe.__dlpack__(), cpu, None, False, _KDL_CPU)
                if (isinstance(got, jax.Array) and got.unsafe_buffer_pointer() == probe.data_ptr()
                        and got.devices() == {cpu}):
                    fn = lambda b, d: raw(b.__dlpack__(), d, None, False, _KDL_CPU)  # noqa: E731
        except Exception:  # any jaxlib without it: the public import
            fn = None
        _IMPORT.append(fn or (lambda b, d: jax.dlpack.from_dlpack(b, device=d)))
    return _IMPORT[0](buf, device)
