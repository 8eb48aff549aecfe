"""JAX adapter: every op is an XLA FFI custom call, differentiable and batchable.

Each op becomes the custom-call target ``opbridge.<namespace>.<op>`` (registered
once per process, lazily, with ``jax_tvm_ffi.register_ffi_target``) and is
called with ``jax.ffi.ffi_call``, so it runs inside ``jax.jit`` with no host
callback. XLA allocates the outputs and the tvm-ffi handler passes them to the
kernel first, then the schema arguments in schema order.

Devices
    The target has a CPU handler, and a GPU handler with the op's CUDA kernel
    where the op has one and jaxlib has a CUDA backend
    (:mod:`opbridge.adapters.jax.targets`): on a CUDA ``jax.Array`` the op
    runs its CUDA kernel on XLA's stream, under ``jax.jit``, ``grad`` and
    ``vmap`` as on the CPU, and inside CUDA graphs where the op is
    ``graph_safe``.

Argument mapping
    Tensor arguments are the custom call's operands; every other argument is a
    static attribute (``float`` -> ``np.float64``, ``int`` -> ``np.int64``,
    ``bool`` -> ``np.bool_``, ``str``, lists -> 1-d arrays), which the handler
    decodes into the kernel's ``double`` / ``int64_t`` / ``bool`` parameters.
    When the kernel order is ``outputs, tensors..., scalars...`` the kernel is
    registered as it is, with arg_spec ``["rets", "args", "attrs.<name>"...]``.
    Otherwise (scalars before or between tensors, an optional argument passed
    as None, a mutating op) a small compiled tvm-ffi shim (``handler.cc``)
    reorders the handler's ``rets, args, attrs`` into kernel order, inserting
    None where needed. Changing a static argument re-traces and re-compiles the
    caller; it never re-registers. A traced value in a static slot is a
    TypeError: mark it static (``jax.jit(..., static_argnums=...)``).

Layout
    JAX arrays are always dense: a transposed or sliced array (``x.T``,
    ``x[:, ::2]``) is a new row-major array, and ``ffi_call`` gives the custom
    call row-major operand and result layouts, so XLA materialises a strided
    view before the kernel under ``jax.jit`` too. The kernels' contiguity
    checks therefore always pass, and no copy is made here.

Large outputs
    Outputs of 4 MiB and more that XLA allocates on the CPU get transparent
    huge-page advice before the kernel writes them, under the rules of
    :mod:`opbridge.call.memory` (the shim gives it, from C++): a fresh
    (4096, 4096) float32 output then takes about 550 page faults instead of
    16,385. XLA allocates a jitted program's outputs anew for each call;
    eager calls instead write buffers of opbridge's pool (recycled, so
    neither mapped nor zeroed again) that JAX takes through DLPack.

Mutating ops
    JAX arrays are immutable, so an op with ``Tensor(a!)`` arguments returns
    the *new values* of its mutated arguments, as a tuple in schema order
    (None for an optional one passed as None), followed by the op's declared
    returns; the arrays passed in are unchanged. The custom call aliases each
    mutated operand to its result (``input_output_aliases``), so under
    ``jax.jit`` with donated inputs XLA updates the buffer in place.

Differentiation
    ``jax.grad`` / ``jax.vjp`` go through a ``jax.custom_vjp`` built from the
    declared backward, which calls opbridge ops and so runs as custom calls
    too (grad of grad works when the backward's ops have backwards). Non-tensor
    arguments are static; integer tensors get symbolic zero (float0)
    cotangents. Differentiating an op without a backward, or a mutating op,
    raises NotImplementedError naming the op. Forward mode (``jax.jvp``,
    ``jax.hessian``) is not supported (a ``custom_vjp`` limitation).

Batching
    A ``jax.vmap`` over the arguments an op declares ``rows`` runs the kernel
    once on the whole batch, one more leading dim (a row argument the batch
    leaves out is broadcast along it; a weight stays as it is); any other
    batch runs it once per element (``vmap_method="sequential"``):
    :mod:`opbridge.call.batching`, through ``jax.custom_batching.custom_vmap``
    under the op's ``custom_vjp``.

Sharding
    Inside ``jax.shard_map`` a result varies over the mesh axes its inputs
    vary over, and on a mesh of explicit axes a ``like`` output has the
    sharding of the argument it copies (:mod:`.avals`), so ``out_specs``
    checks and ``jax.grad`` work as with jnp. The custom calls have no
    partitioning rule yet: XLA gathers sharded operands to every device and
    runs the whole kernel there.

Checks
    Argument types are checked in Python. When JAX traces a call (once per
    shape, dtype and static arguments; never on a call that reuses a compiled
    executable) the dtype of ``op.dtype_arg`` is checked against the op's
    declared dtypes, and the kernel is run once on zero-filled buffers of the
    real shapes and dtypes, so its own TypeError / ValueError
    (``"<op>: <arg> must ..."``) is raised before XLA runs, instead of
    surfacing later as a JaxRuntimeError. The dry run is cached per signature
    and skipped above :data:`opbridge.call.core.DRY_RUN_MAX_BYTES`; it assumes a kernel's
    argument checks look at shapes, dtypes and static arguments, not at tensor
    contents. An error that depends on contents (a position beyond a cache)
    is raised by the kernel when XLA runs it, as a ``JaxRuntimeError`` with
    the kernel's message, on the CPU and the GPU alike. float64 and int64 need
    ``jax_enable_x64`` (JAX narrows them to 32 bits otherwise).

Export
    ``jax.export`` needs ``disabled_checks=disabled_checks()`` (opbridge's
    targets are not on its list of stable custom calls), and a process that
    calls a deserialized export first calls :func:`register_targets`
    (:mod:`.exporting`). Symbolic dimensions pass through ``like`` outputs;
    a shape rule that cannot compute with them raises NotImplementedError.

``out=``
    Computes the result in the caller's array's buffer, which is donated
    (:mod:`.out`): eagerly always, under ``jax.jit`` when the caller donates
    it; the array passed as ``out`` is then deleted and the returned array
    is the result.

Eager calls on concrete arrays dispatch one ``jax.jit``-compiled executable,
cached per op and static arguments (the last :data:`MAX_VARIANTS`); one
whose outputs are large CPU arrays runs the kernel directly into buffers of
opbridge's pool, shared with JAX through DLPack, on the input's device
(:meth:`.eager.Compiled.eager`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from opbridge._codegen import compile_source
from opbridge.adapters.jax import avals, targets
from opbridge.adapters.jax.eager import MIN_POOL_ELEMENTS, Compiled
from opbridge.adapters.jax.exporting import disabled_checks, register_targets
from opbridge.adapters.jax.out import OutVariant
from opbridge.adapters.jax.targets import LOCK as _LOCK
from opbridge.adapters.jax.targets import REGISTERED as _REGISTERED  # noqa: F401  (targets by name)
from opbridge.adapters.jax.targets import target_name
from opbridge.call import core
from opbridge.call.callable import install_prelude

if TYPE_CHECKING:
    from opbridge.declare import OpDef

#: Most small avals one op remembers before it forgets them all (shapes that change every call).
MAX_SMALL_AVALS = 1024

#: Most variants (static arguments and None patterns, each with its compiled executables, about
#: 1.4 MiB) one op keeps; the oldest is forgotten first (an ``eps`` that changes every call).
MAX_VARIANTS = 64

__all__ = ["ADAPTER", "JaxAdapter", "disabled_checks", "register_targets", "target_name",
           "targets"]


def _coerce(base: str, is_list: bool, v: Any) -> Any:
    """A static argument as the attribute type the kernel decodes."""
    if v is None:
        return None
    if is_list:
        kind = {"float": np.float64, "int": np.int64, "bool": np.bool_}[base]
        return np.asarray(list(v), dtype=kind)
    if base == "float":
        return np.float64(v)
    if base == "int":
        return np.int64(v)
    if base == "bool":
        return np.bool_(v)
    return v


def _key_part(v: Any) -> Any:
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, list):
        return tuple(v)
    return v


def _is_array(v: Any) -> bool:
    return isinstance(v, jax.Array)


class _JaxOp:
    """Per-op call machinery: argument checks, variant cache, result packing."""

    def __init__(self, op: OpDef) -> None:
        self.op = op
        args = op.schema.arguments
        lists = [a.name for a in args if a.type.is_tensor_list]
        if lists:
            raise NotImplementedError(f"{op.name}: Tensor[] arguments ({', '.join(lists)}) are not "
                                      f"supported by the JAX adapter")
        self.tensor_idx = core.tensor_indices(op)
        self.scalar_idx = [i for i, a in enumerate(args) if not a.type.is_tensor]
        self.mutated_idx = [i for i, a in enumerate(args) if a.is_mutated]
        self.optional_idx = [i for i, a in enumerate(args) if a.type.optional]
        self.optional_tensor_idx = [i for i in self.optional_idx if args[i].type.is_tensor]
        self.variants: dict[Any, Compiled] = {}
        self.out_variants: dict[Any, OutVariant] = {}
        #: (scalar, type(scalar), ...) -> jitted call, for concrete arrays with every tensor present
        self.fast: dict[tuple[Any, ...], Callable[..., Any]] = {}
        #: Avals of dispatching arrays too small for pool-sized outputs (see make_call); JAX
        #: interns avals and hashes them by identity, so the test is a set lookup, not ``.size``.
        self.small_avals: set[Any] = set()
        self.sized = (not self.mutated_idx and op.n_outputs > 0
                      and op.dispatch_arg in self.tensor_idx)
        self.prelude_installed = False

    @staticmethod
    def raw_scalar(v: Any) -> Any:
        """The Python value of a coerced static (for the backward and the dry run)."""
        if isinstance(v, np.ndarray):
            return v.tolist()
        if isinstance(v, np.generic):
            return v.item()
        return v

    def check(self, args: Sequence[Any]) -> None:
        """Raise TypeError naming the op and argument for a wrongly typed argument."""
        op = self.op
        for i in self.scalar_idx:
            if isinstance(args[i], jax.core.Tracer):
                a = op.schema.arguments[i]
                raise TypeError(f"{op.name}: argument '{a.name}' must be {a.type}, got a traced value; it is "
                                f"static (an XLA attribute): pass a Python value, e.g. mark it with "
                                f"jax.jit(..., static_argnums=...)")
        core.validate_args(op, args, _is_array, "a jax.Array")

    def key(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """A variant's key: the static arguments' values and types, and which optionals are None."""
        return (tuple((_key_part(args[i]), type(args[i])) for i in self.scalar_idx),
                tuple(args[i] is None for i in self.optional_idx))

    def variant(self, args: Sequence[Any]) -> Compiled:
        """The variant for these arguments' static values and None pattern (checked when new)."""
        key = self.key(args)
        try:
            var = self.variants.get(key)
        except TypeError:  # unhashable: a traced value in a static slot, a nested list
            self.check(args)
            raise
        if var is None:
            self.check(args)
            spec = self.op.schema.arguments
            statics: dict[int, Any] = {i: (True if args[i] is not None else None) for i in self.tensor_idx}
            for i in self.scalar_idx:
                statics[i] = _coerce(spec[i].type.base, spec[i].type.is_list, args[i])
            with _LOCK:
                var = self.variants.get(key)
                if var is None:
                    while len(self.variants) >= max(1, MAX_VARIANTS):
                        self.forget(next(iter(self.variants)))
                    var = self.variants[key] = Compiled(self, statics)
        return var

    def forget(self, key: Any) -> None:
        """Drop the variant of *key* and every cache entry that holds it, so its executables can be freed.

        Called under the lock. The generated calls read :attr:`fast` without
        it: they see the entry or not, and a call already holding the
        variant finishes with it.
        """
        var = self.variants.pop(key)
        self.out_variants.pop(key, None)
        for k, f in tuple(self.fast.items()):  # a snapshot: other threads add entries lock-free
            if f is var.jitted:
                self.fast.pop(k, None)

    def with_out(self, args: Sequence[Any], outs: Sequence[Any]) -> Any:
        """``out=``: the result computed in the donated buffers of *outs* (:mod:`.out`)."""
        op = self.op
        if self.mutated_idx:
            raise TypeError(f"{op.name}: out= is not supported for ops that mutate their arguments under JAX "
                            f"(they return the new values)")
        for i, o in enumerate(outs):
            if not isinstance(o, jax.Array):
                raise TypeError(f"{op.name}: out[{i}] must be a jax.Array, got {type(o).__name__}")
        var = self.variant(args)  # checks the arguments, caches the plain variant (its `full`)
        key = self.key(args)
        with _LOCK:
            ov = self.out_variants.get(key)
            if ov is None:
                ov = self.out_variants[key] = OutVariant(self, var.statics, var.full)
        ts = [args[i] for i in self.tensor_idx]
        if any(isinstance(t, jax.core.Tracer) for t in (*ts, *outs)):
            return ov.fn(*avals.match_varying([*ts, *outs]))
        return ov.eager(ts, outs)

    def general(self, *args: Any) -> Any:
        """Any call: checks, then the custom_vjp function (tracers) or its jitted executable."""
        for i in self.tensor_idx:
            if not isinstance(args[i], jax.Array):
                self.check(args)  # raises unless an optional None
        var = self.variant(args)
        ts = [args[i] for i in self.tensor_idx]
        if any(isinstance(t, jax.core.Tracer) for t in ts):
            return var.fn(*avals.match_varying(ts))  # inside shard_map: the results' per-device type
        if all(type(args[i]) is not list for i in self.scalar_idx):
            statics = tuple(x for i in self.scalar_idx for x in (args[i], type(args[i])))
            if len(self.fast) >= 4 * max(1, MAX_VARIANTS):  # entries of forgotten variants raced in
                self.fast.clear()
            self.fast[statics + tuple(args[i] is None for i in self.optional_tensor_idx)] = var.jitted
            if self.sized and args[self.op.dispatch_arg].size < MIN_POOL_ELEMENTS:
                if len(self.small_avals) >= MAX_SMALL_AVALS:  # bounded under dynamic shapes
                    self.small_avals.clear()
                self.small_avals.add(args[self.op.dispatch_arg].aval)
        return var.eager(*ts)

    def pack(self, full: list[Any], new: list[Any], muts: dict[int, Any]) -> Any:
        """Results as documented: declared returns, preceded by mutated values for mutating ops.

        A return aliased to a mutated argument is that argument's new value.
        """
        rets = core.pack_results(self.op, [muts.get(i, v) for i, v in enumerate(full)], new)
        if not self.mutated_idx:
            return rets
        n = len(self.op.schema.returns)
        rets = () if n == 0 else rets if n > 1 else (rets,)
        return (*(muts.get(i) for i in self.mutated_idx), *rets)

    def fast_lines(self, indent: str, prefix: str = "_") -> list[str]:
        """Lines that call the op's jitted executable for concrete arrays of a seen signature (one dict lookup)
        and return; the globals they use start with *prefix* (:meth:`fast_names`)."""
        names = [a.name for a in self.op.schema.arguments]
        tensors = [names[i] for i in self.tensor_idx]
        key = "".join(f"{names[i]}, type({names[i]}), " for i in self.scalar_idx)
        key += "".join(f"{names[i]} is None, " for i in self.optional_tensor_idx)  # the variant's None pattern
        optional = {names[i] for i in self.optional_tensor_idx}
        conds = [f"({t} is None or type({t}) is {prefix}A)" if t in optional else f"type({t}) is {prefix}A"
                 for t in tensors]
        if self.sized:
            # Large arrays may have outputs for opbridge's pool (Compiled.eager): the checked path.
            # Avals the checked path has seen small (30 ns; `.size` takes 100, `.nbytes` 550).
            conds.append(f"{names[self.op.dispatch_arg]}.aval in {prefix}small")
        return [f"{indent}if {' and '.join(conds)}:",
                f"{indent}    try:",
                f"{indent}        {prefix}f = {prefix}fast.get(({key}))",
                f"{indent}    except TypeError:  # an unhashable static: a list, a traced value",
                f"{indent}        {prefix}f = None",
                f"{indent}    if {prefix}f is not None:",
                f"{indent}        return {prefix}f({', '.join(tensors)})"]

    def fast_names(self, concrete: type, prefix: str = "_") -> dict[str, Any]:
        """The globals of :meth:`fast_lines`."""
        return {f"{prefix}A": concrete, f"{prefix}fast": self.fast, f"{prefix}small": self.small_avals}

    def make_call(self, concrete: type) -> Callable[..., Any]:
        """A call specialised to the schema: concrete arrays and seen statics take one dict lookup."""
        names = [a.name for a in self.op.schema.arguments]
        src = "\n".join([f"def call({', '.join(names)}):", *self.fast_lines("    "),
                         f"    return _general({', '.join(names)})"]) + "\n"
        ns: dict[str, Any] = {**self.fast_names(concrete), "_general": self.general}
        compile_source(src, f"<opbridge jax call {self.op.qualname}>", ns)
        call: Callable[..., Any] = ns["call"]
        call.__name__ = self.op.name
        return call

    def install_prelude(self, concrete: type) -> None:
        """Put :meth:`fast_lines` in the op's public callable (once): a call of a seen signature on concrete
        arrays then skips the type lookup and this adapter's frame."""
        if self.prelude_installed:
            return
        self.prelude_installed = True
        install_prelude(self.op, "jax", "\n".join(self.fast_lines("    ", "_jx_")) + "\n",
                        self.fast_names(concrete, "_jx_"))


class JaxAdapter:
    """Adapter for ``jax.Array`` and JAX tracers."""

    name = "jax"

    def make_call(self, op: OpDef, array_type: type) -> Callable[..., Any]:
        """The call for *op* on arrays of *array_type* (a concrete array or a tracer type)."""
        array = _array_type()
        concrete = array_type if not issubclass(array_type, jax.core.Tracer) else array
        jop = _jop(op)
        jop.install_prelude(array)
        return jop.make_call(concrete)

    def call_with_out(self, op: OpDef, args: tuple[Any, ...], outs: tuple[Any, ...]) -> Any:
        """``out=``: the result in the (donated) buffers of *outs*; see :mod:`opbridge.adapters.jax.out`."""
        return _jop(op).with_out(args, outs)


@functools.cache
def _array_type() -> type:
    """The type of a concrete ``jax.Array`` (jaxlib's ArrayImpl), found once by making one."""
    return type(jnp.zeros(()))


def _jop(op: OpDef) -> _JaxOp:
    with _LOCK:
        jop = _OPS.get(op.qualname)
        if jop is None or jop.op is not op:
            jop = _OPS[op.qualname] = _JaxOp(op)
    return jop


_OPS: dict[str, _JaxOp] = {}
ADAPTER = JaxAdapter()
