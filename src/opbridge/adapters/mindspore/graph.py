"""Graph substitutes and bprops: what MindSpore compiles in place of an op's public callable.

MindSpore's parser replaces any object found in
``mindspore.graph._parse.resources.convert_object_map`` by its value when it
resolves a name, so ``opbridge.ops.<op>`` written inside ``ms.jit`` or a
``GRAPH_MODE`` cell resolves to a generated *substitute* with the op's exact
Python signature that calls the op's :class:`~.primitive.OpCustom`. The
primitive carries a *bprop* generated from the declared backward:
``bprop(*inputs, out, dout)`` calls ``op.backward(*douts, *args)`` (scalars
converted back with ``.item()``), maps ``None`` to zeros and gives scalar
inputs zero gradients. The declared backward is written with opbridge ops,
which resolve to their own substitutes when MindSpore compiles it; a lambda
backward is re-emitted as a ``def`` (:mod:`.lambdas`). An op without a
backward gets a bprop that raises ``NotImplementedError`` naming the op.

The generated source is written into opbridge's cache (MindSpore parses it
from there and reports errors against it); everything it uses is a closure
variable, which the parser resolves.
"""

from __future__ import annotations

import builtins
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mindspore import Tensor, ops
from mindspore.common import dtype as mstype

from opbridge.adapters.mindspore.lambdas import global_names, redefine_lambda
from opbridge.adapters.mindspore.primitive import OpCustom
from opbridge.adapters.mindspore.shim import aot_module
from opbridge.adapters.mindspore.support import LOCK, unsupported_reason, write_source
from opbridge.call.callable import signature_source
from opbridge.call.core import no_backward_error, tensor_indices

if TYPE_CHECKING:
    from opbridge.declare import Library, OpDef

# The helpers below are parsed by MindSpore's graph compiler (their source is
# this file), so they stay within its Python subset.


def _scalar_tensor(value: Any, dtype: Any) -> Any:
    """A scalar argument as the 0-d tensor the aot entry point reads.

    ``Tensor(value, float64)`` keeps a double that a graph receives as an
    argument (``ops.scalar_to_tensor`` rounds it to float32 there; MindSpore
    keeps float literals written in graph source in float32 either way).
    """
    if isinstance(value, Tensor):
        return value.astype(dtype)
    return Tensor(value, dtype)


def _item(t: Any) -> Any:
    """A scalar argument back as a Python scalar, for the declared backward."""
    return t.item()


def _zeros(t: Any) -> Any:
    return ops.zeros_like(t)


def _checked(grads: Any, count: int, head: str, tail: str) -> Any:
    """The declared backward's result, after checking it has one entry per Tensor argument."""
    n = len(grads) if isinstance(grads, (tuple, list)) else 1
    if n != count:
        raise RuntimeError(head + str(n) + tail)
    return grads


def _grad_at(grads: Any, k: int, like_: Any) -> Any:
    """Gradient *k* of the declared backward, zeros where it returned None."""
    if isinstance(grads, (tuple, list)):
        g = grads[k]
    else:
        g = grads
    if g is None:
        return ops.zeros_like(like_)
    return g


_HELPERS: dict[str, Any] = {
    "_opb_scalar_tensor": _scalar_tensor,
    "_opb_item": _item,
    "_opb_zeros": _zeros,
    "_opb_checked": _checked,
    "_opb_grad_at": _grad_at,
    "_opb_float_dtype": mstype.float64,
    "_opb_int_dtype": mstype.int64,
    "_opb_bool_dtype": mstype.bool_,
}


def _bprop_lines(op: OpDef) -> list[str]:
    """The body of *op*'s bprop: the declared backward, checked, one gradient per input."""
    args = op.schema.arguments
    if op.backward is None:
        return [f"        raise NotImplementedError({str(no_backward_error(op))!r})"]
    douts = ["dout"] if op.n_outputs == 1 else [f"dout[{j}]" for j in range(op.n_outputs)]
    bargs = [a.name if a.type.is_tensor else f"_opb_item({a.name})" for a in args]
    n_tensor = len(tensor_indices(op))
    # The message of opbridge.call.core.run_backward, assembled around the count in the graph.
    head = f"{op.name}: backward returned "
    tail = f" gradient(s), expected one per Tensor argument ({n_tensor})"
    lines = [f"        _g = _opb_checked(_backward({', '.join([*douts, *bargs])}), {n_tensor}, "
             f"{head!r}, {tail!r})"]
    grads = []
    k = 0
    for a in args:
        if a.type.is_tensor:
            grads.append(f"_opb_grad_at(_g, {k}, {a.name})")
            k += 1
        else:
            grads.append(f"_opb_zeros({a.name})")
    lines.append(f"        return ({', '.join(grads)},)")
    return lines


def _factory_source(op: OpDef, backward_src: str, closure: Sequence[str]) -> str:
    """Source of ``_make_<op>(<closure>)``, which returns ``(substitute, bprop)`` for *op*."""
    params, kw = signature_source(op)
    out_check = ""
    if op.accepts_out:
        # The public callable's out= (writing into existing tensors) has no graph equivalent.
        params.append("out=None" if kw else "*, out=None")
        msg = f"{op.name}: out= cannot be used inside a MindSpore graph; use the returned tensor(s)"
        out_check = f"        if out is not None:\n            raise NotImplementedError({msg!r})\n"
    sig = ", ".join(params)
    args = op.schema.arguments
    # Prefixed, so that it cannot shadow a name the (re-emitted) backward uses, e.g. the op itself.
    sub = f"_opb_graph_{op.name}"
    lines = [f"def _make_{op.name}({', '.join(closure)}):"]
    reason = unsupported_reason(op)
    if reason is not None:
        msg = (f"{op.name}: cannot be used inside a MindSpore graph (ms.jit / GRAPH_MODE): {reason}; "
               f"call it in PyNative mode")
        lines += [f"    def {sub}({sig}):", f"        raise NotImplementedError({msg!r})",
                  f"    return {sub}, None", ""]
        return "\n".join(lines)
    conv = [a.name if a.type.is_tensor else f"_opb_scalar_tensor({a.name}, _opb_{a.type.base}_dtype)"
            for a in args]
    lines += [f"    def {sub}({sig}):", out_check + f"        return _opb_prim({', '.join(conv)})"]
    if backward_src:
        lines.append(backward_src.rstrip("\n"))
    lines.append(f"    def bprop({', '.join(a.name for a in args)}, out, dout):")
    lines += _bprop_lines(op)
    lines += [f"    return {sub}, bprop", ""]
    return "\n".join(lines)


class _Factory:
    """*op*'s generated ``_make_<op>`` and the closure values it takes (all but the primitive)."""

    def __init__(self, op: OpDef) -> None:
        self.op = op
        self.backward = op.backward
        backward_src = ""
        self.values: dict[str, Any] = dict(_HELPERS)
        #: Global names the backward uses that its module did not define yet (an op declared before
        #: the op its backward calls, as gelu before gelu_backward): the factory is remade once they are.
        self.missing = _undefined_globals(op.backward)
        self.pending = _has_empty_cell(op.backward)  # a closure variable assigned after the declaration
        if unsupported_reason(op) is None and op.backward is not None and not self.pending:
            found = redefine_lambda(op.backward, "_backward")
            if found is None:  # a def (or a lambda whose source is lost: MindSpore reports it)
                self.values["_backward"] = op.backward
            else:
                backward_src, free = found
                self.values.update(free)
        self.closure = sorted(self.values)
        text = (f"# Generated by opbridge.adapters.mindspore.graph for {op.qualname}: {op.schema}\n"
                f"# MindSpore's graph compiler parses this file. Do not edit.\n\n"
                + _factory_source(op, backward_src, [*self.closure, "_opb_prim"]))
        path = write_source(f"{op.library.namespace}_graph", text)
        ns: dict[str, Any] = {"__name__": __name__}
        exec(compile(text, str(path), "exec"), ns)  # noqa: S102 - generated from a parsed schema, in a file
        self.make = ns[f"_make_{op.name}"]

    def stale(self, op: OpDef) -> bool:
        """Whether *op* changed since, or what its backward uses has been defined since."""
        if self.op is not op or self.backward is not op.backward:
            return True
        backward = op.backward
        if backward is None:  # nothing it could have been missing
            return False
        return any(n in backward.__globals__ for n in self.missing) or (
            self.pending and not _has_empty_cell(backward))

    def __call__(self, prim: OpCustom | None) -> tuple[Callable[..., Any], Any]:
        return self.make(*(self.values[n] for n in self.closure), prim)  # type: ignore[no-any-return]


def _undefined_globals(fn: Any) -> set[str]:
    """Names *fn*'s code loads that are neither in its globals nor builtins (yet)."""
    if not isinstance(fn, types.FunctionType):
        return set()
    return {n for n in global_names(fn.__code__) if n not in fn.__globals__ and not hasattr(builtins, n)}


def _has_empty_cell(fn: Any) -> bool:
    """Whether a closure variable of *fn* is not assigned yet (``backward=lambda g, x: (op(g),)`` inside the
    function that declares ``op``: its cell fills when the decorator returns)."""
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            cell.cell_contents  # noqa: B018 - the read is the test
        except ValueError:
            return True
    return False


_FACTORIES: dict[str, _Factory] = {}
_GRAPH: dict[str, tuple[Callable[..., Any], OpCustom | None]] = {}


def _build_graph(op: OpDef) -> tuple[Callable[..., Any], OpCustom | None]:
    """Wire *op*'s substitute, bprop and primitive (the generated source is made once per op)."""
    factory = _FACTORIES.get(op.qualname)
    if factory is None or factory.stale(op):
        factory = _FACTORIES[op.qualname] = _Factory(op)
    prim: OpCustom | None = None
    if unsupported_reason(op) is None:
        # The primitive keeps its bprop, and only the substitute uses the primitive.
        _, bprop = factory(None)
        prim = OpCustom(op, aot_module(op.library), bprop)
    fn, _ = factory(prim)
    fn.__name__ = fn.__qualname__ = op.name
    fn.__doc__ = f"{op.qualname} inside MindSpore graphs (ops.Custom aot): {op.schema}"
    fn.opdef = op  # type: ignore[attr-defined]
    fn.primitive = prim  # type: ignore[attr-defined]
    return fn, prim


def graph_function(op: OpDef) -> Callable[..., Any]:
    """The graph substitute of *op*: its Python signature, calling its ``ops.Custom`` primitive."""
    key = op.qualname
    entry = _GRAPH.get(key)
    # Rebuilt when the library declared more ops since: the primitive names the module's path.
    factory = _FACTORIES.get(key)
    if (entry is None or entry[0].opdef is not op  # type: ignore[attr-defined]
            or (entry[1] is not None and entry[1].aot is not aot_module(op.library))
            or factory is None or factory.stale(op)):
        with LOCK:
            entry = _build_graph(op)
            _GRAPH[key] = entry
    return entry[0]


def opdef_of(op: OpDef | Callable[..., Any]) -> OpDef:
    """The OpDef of a public op callable (or *op* itself)."""
    found: OpDef = getattr(op, "opdef", None) or op  # type: ignore[assignment]
    return found


def custom_op(op: OpDef | Callable[..., Any]) -> OpCustom:
    """The ``ops.Custom`` (func_type ``"aot"``) primitive of *op* (an OpDef or a public op callable).

    It takes the op's arguments positionally in schema order, scalars as 0-d
    tensors (float64 / int64 / bool), and carries the bprop derived from the
    declared backward. Usable in PyNative and graph mode.
    """
    opdef = opdef_of(op)
    reason = unsupported_reason(opdef)
    if reason is not None:
        raise NotImplementedError(f"{opdef.name}: has no MindSpore graph primitive: {reason}")
    graph_function(opdef)
    prim = _GRAPH[opdef.qualname][1]
    if prim is None:  # pragma: no cover - supported ops always get one
        raise RuntimeError(f"{opdef.name}: its MindSpore graph primitive is missing")
    return prim


def register(lib: Library) -> None:
    """Make every op of *lib* usable inside MindSpore graphs (idempotent, compiles nothing).

    Adds ``op.call -> graph substitute`` to MindSpore's parser conversion
    map. The wrapper module is built the first time MindSpore infers a shape
    with one of the primitives.
    """
    from mindspore.graph._parse.resources import convert_object_map

    for op in lib.ops.values():
        fn = graph_function(op)
        if convert_object_map.get(op.call) is not fn:
            convert_object_map[op.call] = fn
