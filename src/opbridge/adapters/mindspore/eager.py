"""PyNative calls: the op's kernel on MindSpore's own memory, specialised per op.

Each op's eager call is generated from its schema (:func:`eager_source`): no
loops or lookups, one wait for MindSpore's queued work, each tensor as a
NumPy view of its memory (:mod:`.views`), a one-set-lookup check of the
declared dtypes, new outputs from the shape rule (contiguous, the core's one
rule), the kernel, the results. A tensor in a layout the kernels do not take
runs the op again on dense copies (``overlap.recall_dense``: the C entry takes
them; mutated ones are copied back). Anything else unusual (a non-tensor, a
tensor on another device, an undeclared dtype, ``out=`` with a strided
argument, a kernel error) falls back to the checked call
(:func:`.checked.run_checked`), which runs the same call through the op-call
core with every check and either raises the named error or completes it.

While MindSpore records gradients, a call goes through the op's
``ops.Custom`` primitive instead (:func:`on_tape_call`), so the declared
backward is recorded; a call MindSpore cannot see would get zero gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mindspore import Tensor

from opbridge import loader
from opbridge._codegen import compile_source
from opbridge.adapters.mindspore import graph, primitive
from opbridge.adapters.mindspore.checked import (
    host_views,
    is_tensor,
    not_on_host_error,
    requires_grad,
    run_checked,
    run_with_out,
    view_span,
)
from opbridge.adapters.mindspore.support import dtype_name, ms_dtype, unsupported_reason
from opbridge.adapters.mindspore.views import (
    NUMPY,
    NotOnHostError,
    alloc,
    copy_back,
    dense_copy,
    host_view,
    kernel_arg,
    new_tensor,
    rows,
    sync,
)
from opbridge.call import exchange
from opbridge.call.core import (
    alloc_source,
    framework_dtypes,
    layout_source,
    like_indices,
    out_fits_source,
    pack_results,
    returns_its_out,
    returns_source,
    rule_plan,
    scalar_guards,
    validate_args,
)
from opbridge.call.layout import NDARRAY_SHARES, NDARRAY_WRITTEN
from opbridge.call.overlap import alias_check_source, check_no_alias, recall_dense

if TYPE_CHECKING:
    from opbridge.declare import OpDef

#: Tensor ``{t}``'s byte span ``{s}, {e}``, its full reach where it is rows at a stride (an argument the op
#: declares ``row_strided``): the generated alias checks' and the ``out=`` call's overlap test's.
_ROWS_SPAN = "{s}, {e} = (_sp := {t}.data_ptr(), _sp + {t}.nbytes) if {t}.is_contiguous() else _rspan({t})"


def eager_source(op: OpDef, out: bool = False) -> str:
    """Source of the op's eager call, specialised to its schema (no loops, no lookups).

    With *out*, the call with ``out=`` one tensor (an op that returns it:
    :func:`opbridge.call.core.returns_its_out`):
    the kernel writes it where it lies when it is dense and shares no byte
    with an argument; anything else takes :func:`run_with_out`'s checked call.
    """
    args = op.schema.arguments
    names = [a.name for a in args]
    sig = ", ".join(names)
    tup = f"({sig},)"
    slow = f"_checked_out({tup}, out)" if out else f"_checked({tup})"
    lead = names[op.dtype_arg]  # the argument whose dtype the declared dtypes constrain
    # Not a tensor, not on the CPU, a dtype NumPy cannot view: the checked call says or does it.
    guards = [f"{lead}.dtype not in _dtypes", *(f"not ({g})" for g in scalar_guards(op, names))]
    # A layout the kernels do not take (strided; rows at a stride are taken where declared row_strided), tested
    # before the host views are made, runs on dense copies (_copies: overlap.recall_dense, the C entry's).
    takes = layout_source(op, names, "{t}.is_contiguous()", "_rows({t})") if op.schema.tensor_args else ""
    lines = [f"def {op.name}({sig}{', out' if out else ''}):", "    if _requires_grad():",
             f"        return {slow if out else f'_on_tape({sig})'}",
             "    _sync()"]
    if takes and not out:
        lines += ["    try:", f"        _strided = not ({takes})", "    except Exception:", f"        return {slow}",
                  "    if _strided:", f"        return {slow} if {' or '.join(guards)} else _copies({tup})"]
    lines.append("    try:")
    kernel_args = []
    for i, a in enumerate(args):
        if a.type.is_tensor:
            conv = f"_arg({a.name})"
            lines.append(f"        _a{i} = {'None if ' + a.name + ' is None else ' if a.type.optional else ''}{conv}")
            kernel_args.append(f"_a{i}")
        else:
            kernel_args.append(a.name)
    if out:
        lines.append("        _b0 = _arg(out)")
    lines += ["    except Exception:", f"        return {slow}",
              f"    if {' or '.join(guards)}:", f"        return {slow}"]
    if takes and out:
        lines += [f"    if not ({takes}):", f"        return {slow}"]
    lines += alias_check_source(op, names, "{s} = {t}.data_ptr(); {e} = {s} + {t}.nbytes", "    ",
                                rows=(_ROWS_SPAN, "_exact({a}, {b})")).splitlines()
    n_out = op.n_outputs
    if out:
        # out= must be of the output's shape and dtype (else the checked call's ValueError), dense and apart
        # from every tensor argument (the checked call writes a fresh buffer)
        fits = out_fits_source(op, names, "out", "_out_plan")
        lines += [f"    if not ({fits}) or not out.is_contiguous():", f"        return {slow}",
                  "    _so = out.data_ptr(); _eo = _so + out.nbytes"]
        for a in args:
            if a.type.is_tensor:
                test = f"{a.name} is not None and " if a.type.optional else ""
                lines += [f"    if {test}_so < _eo:", "        " + _ROWS_SPAN.format(s="_s", e="_e", t=a.name),
                          f"        if _s < _eo and _so < _e and _s != _e: return {slow}"]
        outs = ["out"]
    else:
        pairs = [f"_p{j}" for j in range(n_out)]
        lines += ["    " + s for s in alloc_source(op, names, pairs, "_alloc({x}.shape, {x}.dtype)",
                                                     "_from_rule({args})")]
        for j in range(n_out):
            lines.append(f"    _o{j}, _b{j} = _p{j}")
        outs = [f"_o{j}" for j in range(n_out)]
    lines += ["    try:", f"        _k({', '.join([*(f'_b{j}' for j in range(n_out)), *kernel_args])})",
              "    except (TypeError, ValueError):",
              f"        return {slow}  # the kernel's named error"]
    lines += ["    return out"] if out else returns_source(op, names, outs, "    ")
    return "\n".join(lines) + "\n"


def on_tape_call(op: OpDef) -> Callable[..., Any]:
    """What a call does while MindSpore records gradients: the recorded primitive, or a clear error."""
    reason = unsupported_reason(op)
    if reason is None:
        split = op.schema.split

        def recorded(*args: Any) -> Any:
            fn = graph.graph_function(op)
            # The primitive's own shape inference sees scalars only as tensors of unknown
            # value; run the kernel's checks here, on the real arguments, instead.
            validate_args(op, args, is_tensor, "a mindspore.Tensor")
            err = not_on_host_error(op, args)
            if err is not None:
                raise err
            primitive.check_call(op, args, module=fn.primitive.aot)  # type: ignore[attr-defined]
            # The aot entry point takes dense buffers: strided inputs get one (recorded) copy.
            args = tuple(a.contiguous() if isinstance(a, Tensor) and not a.is_contiguous() else a for a in args)
            with primitive.checked():
                pos, kw = split(args)
                return fn(*pos, **kw)

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


def _generated_names(op: OpDef, kern: Callable[..., Any]) -> dict[str, Any]:
    """The globals both generated calls (:func:`eager_source`, with and without *out*) use."""
    return {
        "_requires_grad": requires_grad,
        "_sync": sync,
        "_arg": kernel_arg,
        "_dtypes": framework_dtypes(op, ms_dtype),
        # a quick hit on byte spans: the host views' strides say whether an element is shared
        "_alias": lambda a: check_no_alias(op, host_views(op, a), view_span, NDARRAY_SHARES),
        # row_strided arguments (rows at a stride reach the kernel as they are): their host views' reach
        "_rspan": lambda t: view_span(host_view(t)),
        "_exact": lambda a, b: NDARRAY_SHARES(host_view(a), host_view(b)),
        "_rows": rows,
        "_k": kern,
    }


class _DeclineError(Exception):
    """A copy cannot be made (a tensor off the CPU, a dtype NumPy cannot view): the checked call names it."""


def _strided_copies(op: OpDef, checked: Callable[[tuple[Any, ...]], Any]) -> Callable[[tuple[Any, ...]], Any]:
    """:func:`opbridge.call.overlap.recall_dense` for MindSpore: dense copies made and written back through
    host views (bfloat16 as its bits), the alias check on the caller's tensors' host views. Where a copy
    cannot be made, before anything is written, *checked* (the checked call) takes the call and names why."""
    def check_alias(args: Sequence[Any]) -> None:
        if op.schema.is_mutating:
            check_no_alias(op, host_views(op, args), view_span, NDARRAY_SHARES)

    def densify(t: Any) -> Tensor:
        try:
            return dense_copy(t)
        except (NotOnHostError, KeyError, AttributeError) as e:
            raise _DeclineError from e

    def written(op: OpDef, what: str, t: Any) -> None:  # on its host view: strides, elements that meet
        try:
            view = host_view(t)
        except (NotOnHostError, KeyError, AttributeError) as e:
            raise _DeclineError from e
        NDARRAY_WRITTEN(op, what, view)

    recall = recall_dense(op, check_alias, Tensor.is_contiguous, densify, rows, copy_back, written=written)

    def run(args: tuple[Any, ...]) -> Any:
        try:
            return recall(args)
        except _DeclineError:
            return checked(args)

    return run


#: MindSpore's tensors for the tensor C entry, read through their methods: ``Tensor`` (a ``Parameter`` too,
#: except as the dispatching argument) on the CPU
#: with its memory there (``has_init`` false), after one wait for queued work, while nothing is recorded
#: for gradients (then the call goes on the tape here).
ENTRY_TENSORS = exchange.Framework(
    "mindspore", Tensor, requires_grad, None, None, dtype_name,
    exchange.Methods({d: dtype_name(d) for d in NUMPY}, new_tensor, sync, ("device", "CPU"), "has_init"))


def make_eager(op: OpDef) -> Callable[..., Any]:
    """The op's generated eager call on MindSpore tensors (see the module docstring).

    The tensor C entry (:mod:`opbridge.call.exchange`), once loaded, goes first
    in the op's public callable and takes what this call's fast path would;
    this call takes the rest.
    """
    kern = loader.kernel(op, "cpu")
    exchange.install(op, kern, ENTRY_TENSORS)

    def checked(args: tuple[Any, ...]) -> Any:
        return run_checked(op, kern, args)

    plans = rule_plan(op, "{t}.shape, {t}.dtype", lambda shape, dt: (shape, ms_dtype(dt)), "mindspore") \
        if op.n_outputs else None

    def from_rule(args: tuple[Any, ...]) -> list[tuple[Tensor, Any]]:
        assert plans is not None
        return [alloc(shape, dt) for shape, dt in plans(args)]

    ns: dict[str, Any] = {
        **_generated_names(op, kern),
        "_on_tape": on_tape_call(op),
        "_checked": checked,
        "_copies": _strided_copies(op, checked),
        "_alloc": alloc,
        "_from_rule": from_rule,
        "_pack": lambda a, o: pack_results(op, a, o),
    }
    compile_source(eager_source(op), f"<opbridge mindspore {op.qualname}>", ns)
    fn: Callable[..., Any] = ns[op.name]
    return fn


def make_eager_out(op: OpDef) -> Callable[..., Any] | None:
    """The op's generated call with ``out=`` (its last argument), or None: for an op whose call returns its
    ``out=`` only (:func:`opbridge.call.core.returns_its_out`)."""
    if not returns_its_out(op):
        return None
    kern = loader.kernel(op, "cpu")
    ns: dict[str, Any] = {**_generated_names(op, kern), "_checked_out": lambda a, o: run_with_out(op, kern, a, (o,))}
    if like_indices(op) is None:
        ns["_out_plan"] = rule_plan(op, "{t}.shape, {t}.dtype", lambda s, dt: (s, ms_dtype(dt)), "mindspore out=")
    compile_source(eager_source(op, out=True), f"<opbridge mindspore {op.qualname} out=>", ns)
    fn: Callable[..., Any] = ns[op.name]
    return fn
