"""MindSpore adapter: PyNative calls through DLPack, graphs and gradients through ``ops.Custom``.

PyNative (eager), no gradient being recorded
    The public callable calls the op's tvm-ffi kernel directly. MindSpore
    tensors have no ``__dlpack__``; each tensor argument is exported with
    ``Tensor.to_dlpack()`` (what ``mindspore.utils.dlpack.to_dlpack`` calls)
    and imported by ``tvm_ffi.from_dlpack``, so the kernel reads and writes
    MindSpore's own memory. Outputs are allocated as MindSpore tensors that
    share memory with a NumPy buffer (``Tensor.from_numpy``; bfloat16 through
    a uint16 buffer viewed as bfloat16), and the kernel writes into them, so
    results are MindSpore tensors without a copy. ``to_dlpack`` waits for
    MindSpore's asynchronous pipeline, so a kernel never reads a tensor a
    queued op has yet to write, nor overwrites one a queued op has yet to read.

PyNative while ``mindspore.grad`` / ``value_and_grad`` / ``GradOperation`` records
    The call goes through the op's ``ops.Custom`` primitive instead (see
    :mod:`opbridge.adapters.mindspore_aot`), which MindSpore records together
    with a bprop derived from the declared backward. A kernel call MindSpore
    cannot see would silently get zero gradients; this way an op without a
    declared backward raises ``NotImplementedError`` naming it when
    differentiated. Ops that mutate arguments refuse to run while gradients
    are recorded (MindSpore could not see the write).

Graph mode (``ms.jit``, ``GRAPH_MODE`` cells)
    MindSpore compiles source, so the public callable itself is never run
    there: :func:`register` maps it, in MindSpore's parser conversion map, to
    a generated substitute with the same signature that calls the
    ``ops.Custom(func_type="aot")`` primitive; ``opbridge.ops.<op>(...)``
    written inside a graph therefore becomes that primitive, gradients
    included. Every library declared before this module is imported is
    registered on import, later ones on their first eager call or by
    :func:`register`. :func:`custom_op` returns the primitive itself.

Bad input raises ``TypeError`` / ``ValueError`` naming the op and the argument,
from the kernel's own checks, in every mode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mindspore as ms
import numpy as np
from mindspore import Tensor
from mindspore.graph.api import _pynative_executor

from opbridge import loader
from opbridge._codegen import compile_source
from opbridge._tvm import tvm_ffi as _import_tvm_ffi
from opbridge.adapters.mindspore import aot
from opbridge.call.core import check_no_alias, make_alias_check, pack_results, validate_args
from opbridge.declare import like

if TYPE_CHECKING:
    from opbridge.declare import Library, OpDef

__all__ = ["ADAPTER", "MindSporeAdapter", "custom_op", "graph_function", "graph_unsupported_reason",
           "parseable", "register"]

#: MindSpore dtype -> NumPy dtype of the output buffer (bfloat16 is handled apart)
_NUMPY: dict[Any, Any] = {
    ms.float32: np.float32,
    ms.float16: np.float16,
    ms.float64: np.float64,
    ms.int8: np.int8,
    ms.int16: np.int16,
    ms.int32: np.int32,
    ms.int64: np.int64,
    ms.uint8: np.uint8,
    ms.bool_: np.bool_,
}

_requires_grad: Callable[[], bool] = _pynative_executor._executor.requires_grad

tvm_ffi = _import_tvm_ffi()  # without importing torch, which `import tvm_ffi` otherwise does


def _is_tensor(x: Any) -> bool:
    return isinstance(x, Tensor)


def _span(t: Tensor) -> tuple[int, int]:
    p = int(t.data_ptr())
    return p, p + int(t.nbytes)


def _alloc(shape: Sequence[int], dtype: Any) -> tuple[Tensor, Any]:
    """A new MindSpore tensor and the kernel argument aliasing its memory."""
    npd = _NUMPY.get(dtype)
    if npd is not None:
        buf = np.empty(tuple(shape), npd)
        return Tensor.from_numpy(buf), buf
    if dtype == ms.bfloat16:
        buf = np.empty(tuple(shape), np.uint16)
        t = Tensor.from_numpy(buf).view(ms.bfloat16)
        return t, tvm_ffi.from_dlpack(t.to_dlpack())
    raise TypeError(f"opbridge: cannot allocate a MindSpore output of dtype {dtype}")


def _eager_source(op: OpDef) -> str:
    """Source of the op's eager call, specialised to its schema (no loops, no lookups)."""
    args = op.schema.arguments
    names = [a.name for a in args]
    sig = ", ".join(names)
    kernel_args: list[str] = []
    lines = [f"def {op.name}({sig}):", "    if _requires_grad():", f"        return _on_tape({sig})"]
    lines.append("    try:")
    for i, a in enumerate(args):
        if a.type.is_tensor:
            # A tensor made with ``init=`` has no memory until init_data() (to_dlpack would crash).
            conv = f"_fd(({a.name}.init_data() if {a.name}.has_init else {a.name}).to_dlpack())"
            if a.type.optional:
                conv = f"None if {a.name} is None else {conv}"
            lines.append(f"        _a{i} = {conv}")
            kernel_args.append(f"_a{i}")
        else:
            kernel_args.append(a.name)
    lines += ["    except AttributeError:", f"        _bad(({sig},))", "        raise"]
    if op.schema.is_mutating:
        lines.append(f"    _alias(({sig},))")
    n_out = op.n_outputs
    outs = [f"_o{j}" for j in range(n_out)]
    bufs = [f"_b{j}" for j in range(n_out)]
    if isinstance(op.shape, like):
        for j, n in enumerate(op.shape.names):
            lines.append(f"    _o{j}, _b{j} = _alloc({n}.shape, {n}.dtype)")
    elif n_out:
        lines.append(f"    _specs = _output_specs(({sig},))")
        for j in range(n_out):
            lines.append(f"    _o{j}, _b{j} = _alloc(_specs[{j}].shape, _dtype(_specs[{j}].dtype))")
    lines += ["    try:", f"        _k({', '.join([*bufs, *kernel_args])})",
              "    except TypeError:", f"        _bad(({sig},))", "        raise"]
    returns = op.schema.returns
    if not returns:
        lines.append("    return None")
    elif len(returns) == 1 and n_out == 1:
        lines.append("    return _o0")
    else:
        lines.append(f"    return _pack(({sig},), ({''.join(o + ', ' for o in outs)}))")
    return "\n".join(lines) + "\n"


def _on_tape_call(op: OpDef) -> Callable[..., Any]:
    """What a call does while MindSpore records gradients: the recorded primitive, or a clear error."""
    reason = aot.unsupported_reason(op)
    if reason is None:
        kw_names = [a.name for a in op.schema.arguments if a.kwarg_only]
        n_pos = len(op.schema.arguments) - len(kw_names)

        def recorded(*args: Any) -> Any:
            fn = aot.graph_function(op)
            # The primitive's own shape inference sees scalars only as tensors of unknown
            # value; run the kernel's checks here, on the real arguments, instead.
            validate_args(op, args, _is_tensor, "a mindspore.Tensor")
            aot.check_call(op, args, module=fn.primitive.aot)  # type: ignore[attr-defined]
            with aot.checked():
                return fn(*args[:n_pos], **dict(zip(kw_names, args[n_pos:], strict=True)))

        return recorded
    if op.schema.is_mutating:
        names = [a.name for a in op.schema.mutated_args]
        message = (f"{op.name}: mutates {', '.join(repr(n) for n in names)} in place and declares no "
                   f"backward, so it cannot run while MindSpore records gradients (inside "
                   f"mindspore.grad / value_and_grad); call it outside the differentiated function")
    else:
        message = f"{op.name}: cannot be differentiated by MindSpore: {reason}"

    def refuse(*args: Any) -> Any:
        raise RuntimeError(message)

    return refuse


def _make_eager(op: OpDef) -> Callable[..., Any]:
    kern = loader.kernel(op, "cpu")

    def bad(args: tuple[Any, ...]) -> None:
        validate_args(op, args, _is_tensor, "a mindspore.Tensor")

    ns: dict[str, Any] = {
        "_requires_grad": _requires_grad,
        "_on_tape": _on_tape_call(op),
        "_fd": tvm_ffi.from_dlpack,
        "_k": kern,
        "_bad": bad,
        "_alias": make_alias_check(op, _span),
        "_alloc": _alloc,
        "_output_specs": op.output_specs,
        "_dtype": aot.ms_dtype,
        "_pack": lambda a, o: pack_results(op, a, o),
    }
    compile_source(_eager_source(op), f"<opbridge mindspore {op.qualname}>", ns)
    fn: Callable[..., Any] = ns[op.name]
    return fn


def register(lib: Library) -> None:
    """Make *lib*'s ops usable inside MindSpore graphs (idempotent; compiles nothing).

    ``opbridge.ops.<op>`` (the public callable) written inside ``ms.jit`` or
    a ``GRAPH_MODE`` cell then compiles to the op's ``ops.Custom`` primitive.
    """
    aot.register(lib)


def graph_function(op: OpDef | Callable[..., Any]) -> Callable[..., Any]:
    """The function MindSpore compiles in place of *op*'s public callable."""
    return aot.graph_function(aot._opdef(op))


def graph_unsupported_reason(op: OpDef | Callable[..., Any]) -> str | None:
    """Why *op* cannot run inside MindSpore graphs (and under gradient recording), or None."""
    return aot.unsupported_reason(aot._opdef(op))


def parseable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """*fn*, or for a lambda an equivalent ``def`` that MindSpore can compile.

    ``ms.jit(lambda x: ...)`` fails in MindSpore ("Parse Lambda Function Fail")
    unless the lambda stands alone on its line; ``ms.jit(parseable(lambda x: ...))`` works.
    """
    return aot.parseable(fn)


def custom_op(op: OpDef | Callable[..., Any]) -> Any:
    """The ``ops.Custom(func_type="aot")`` primitive of *op*, with its bprop.

    Usable in PyNative and graph mode. It takes the op's arguments
    positionally in schema order, scalars as 0-d tensors (``float`` as
    float64, ``int`` as int64, ``bool`` as bool). Calling the public callable
    inside a graph is usually simpler: it compiles to this primitive.
    """
    return aot.custom_op(op)


def _dl(t: Tensor) -> Any:
    """*t*'s memory as a tvm-ffi tensor, through MindSpore's DLPack export."""
    if t.has_init:
        t.init_data()
    return tvm_ffi.from_dlpack(t.to_dlpack())


class MindSporeAdapter:
    """Adapter for ``mindspore.Tensor`` (and ``Parameter``)."""

    name = "mindspore"

    def make_call(self, op: OpDef, array_type: type) -> Callable[..., Any]:
        """The op's eager call on MindSpore tensors (see the module docstring)."""
        register(op.library)
        return _make_eager(op)

    def call_with_out(self, op: OpDef, args: tuple[Any, ...], outs: tuple[Any, ...]) -> Any:
        """Run *op* into the caller's tensors *outs* (``out=``); PyNative only, no gradients.

        Parameters
        ----------
        op
            The op's declaration.
        args
            Its arguments in schema order.
        outs
            One ``mindspore.Tensor`` per new output; the kernel checks shapes and dtypes.

        Returns
        -------
        Any
            The op's results per schema: *outs* themselves for new outputs.
        """
        validate_args(op, args, _is_tensor, "a mindspore.Tensor")
        for i, o in enumerate(outs):
            if not isinstance(o, Tensor):
                raise TypeError(f"{op.name}: out[{i}] must be a mindspore.Tensor, got {type(o).__name__}")
        if _requires_grad():
            raise RuntimeError(f"{op.name}: out= writes into existing tensors, which MindSpore cannot "
                               f"differentiate; call it outside mindspore.grad / value_and_grad or "
                               f"without out=")
        if op.schema.is_mutating:
            check_no_alias(op, args, _span)
        kernel_args = [_dl(a) if isinstance(a, Tensor) else a for a in args]
        loader.kernel(op, "cpu")(*(_dl(o) for o in outs), *kernel_args)
        return pack_results(op, args, outs)


ADAPTER = MindSporeAdapter()


def _register_declared() -> None:
    """Register every library declared so far (graphs may use them before any eager call)."""
    from opbridge import registry

    for lib in registry.libraries():
        register(lib)


_register_declared()
