"""Eager Paddle calls: a fast path generated per op, the checked call, autograd through ``PyLayer``, ``out=``.

tvm-ffi takes ``paddle.Tensor`` directly (DLPack C exchange), so a call is
one allocation per new output and the kernel call: no copies, no
synchronisation. The fast path serves the common case (CPU tensors, dense,
of a declared dtype, no gradient needed) with a few attribute reads; every
other call takes the checked path, which accepts strided inputs (one dense
copy each; a mutated one is written back through the caller's view, and
refused before anything runs where its elements share memory), runs
GPU tensors on the CUDA kernel and raises the named errors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import paddle
from paddle import _C_ops
from paddle.autograd import PyLayer

from opbridge import loader
from opbridge._codegen import compile_source
from opbridge.adapters.paddle._base import (
    CORE,
    EXACT,
    KIND,
    SPAN_SOURCE,
    VALUE,
    WRITTEN,
    PaddleStaticError,
    T,
    alloc,
    check_passable,
    densify,
    dtype_name,
    is_dense,
    is_tensor,
    large_like,
    materialise,
    name_of,
    op_dtypes,
    rows,
    rows_of,
    rule_alloc,
    strided_span,
    target,
    write_back,
)
from opbridge.call import core, exchange, layout, memory, overlap

if TYPE_CHECKING:
    from opbridge.declare import OpDef

Run = Callable[..., tuple[Any, ...]]

# A new output's size in bytes, for the huge-page test: the size of its allocation (0.1 µs) where
# Paddle says it, else from its shape (0.5-0.7 µs; the advice itself takes the exact size).
_NBYTES = "{o}._holder_size()" if hasattr(T, "_holder_size") else "_prod({o}.shape) * {o}.element_size()"
# The C function behind paddle.is_grad_enabled, without its Python frame.
_HAS_GRAD = getattr(CORE, "_has_grad", paddle.is_grad_enabled)


def _mutated(op: OpDef) -> list[int]:
    return [i for i, a in enumerate(op.schema.arguments) if a.is_mutated]


def make_checked(op: OpDef) -> Run:
    """The checked kernel call, no autograd: returns the new outputs (a tuple).

    Checks the arguments against the schema and the declared dtypes, picks
    the kernel of the tensors' device (:func:`~opbridge.adapters.paddle._base.target`),
    densifies strided inputs and writes mutated ones back.
    """
    check_alias = overlap.make_alias_check(op, strided_span, exact=EXACT)
    mutated = _mutated(op)

    def run(*args: Any) -> tuple[Any, ...]:
        core.validate_args(op, args, is_tensor, KIND)
        core.check_lead_dtype(op, args, dtype_name)
        kern, launch, place = target(op, args)
        try:
            check_alias(args)
            full, back = overlap.dense_args(op, args, is_dense, densify, rows, written=WRITTEN)
            outs = alloc(op, full, place)
            with launch():
                kern(*outs, *full)
        except Exception:
            check_passable(op, args)  # a sparse tensor, which fails any of these: the op's TypeError naming it
            raise
        for orig, copy in back:
            write_back(orig, copy)
        for i in mutated:
            if args[i] is not None:
                args[i]._bump_inplace_version()
        return tuple(outs)

    return run


def make_layer(op: OpDef, run: Run) -> type[PyLayer]:
    """A PyLayer running *run* forward and the declared backward."""
    tensor_idx = core.tensor_indices(op)
    reads = op.backward_reads  # only what the backward reads is kept for it

    def forward(ctx: Any, *args: Any) -> Any:
        present = [i for i in tensor_idx if args[i] is not None]
        ctx.opb_full = [None if i in tensor_idx else v for i, v in enumerate(args)]
        ctx.opb_present = present
        ctx.opb_saved = [i for i in present if i in reads]
        ctx.opb_needs = [not args[i].stop_gradient for i in present]
        ctx.save_for_backward(*(args[i] for i in ctx.opb_saved))
        outs = run(*args)
        ctx.opb_meta = [(o.shape, o.dtype) for o in outs]
        return outs[0] if len(outs) == 1 else outs

    def backward(ctx: Any, *grads: Any) -> Any:
        full = list(ctx.opb_full)
        for i, t in zip(ctx.opb_saved, ctx.saved_tensor(), strict=True):
            full[i] = t
        # A backward written with other Paddle code may want dense output gradients.
        grads = tuple(g if g is None or g.is_contiguous() else densify(g) for g in grads)
        res = core.run_backward(op, materialise(grads, ctx.opb_meta), full)
        # PyLayer wants one gradient per Tensor passed to forward (None ones were not),
        # and None for those with stop_gradient=True.
        got = [g for i, g in zip(tensor_idx, res, strict=True) if i in ctx.opb_present]
        out = tuple(g if need else None for g, need in zip(got, ctx.opb_needs, strict=True))
        return out[0] if len(out) == 1 else out

    return type(f"{op.name}_PyLayer", (PyLayer,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward),
        "__module__": __name__, "__qualname__": f"{op.name}_PyLayer",
    })


def fast_source(op: OpDef, check_places: bool) -> str:
    """Source of the eager call: the CPU fast path, else autograd or the checked call.

    The fast path's guard reads the dispatching tensor's dtype and checks it
    by identity (Paddle's dtype objects are singletons, and their
    ``==``/``hash`` cost 1-2 µs each, a frozenset lookup 2 µs). Where this
    Paddle can hold only host tensors (*check_places* False) no place is read
    (``tensor.place`` costs about 0.9 µs): outputs go to one ``CPUPlace``.
    Elsewhere every tensor must be on the CPU. Anything else goes to
    ``_slow`` (the checked call), which is also where a wrong argument type
    gets its named error. Then every tensor must be in a layout the kernels
    take (:func:`opbridge.call.core.layout_source`: a kernel that does not
    check it would read a strided view as dense; an argument the op declares
    ``row_strided`` may be rows at a stride, and its alias test then reaches
    every row); other layouts go to ``_copies`` (dense copies).
    """
    args = op.schema.arguments
    names = [f"a{i}" for i in range(len(args))]
    params = ", ".join(names)
    tensors = [(i, a) for i, a in enumerate(args) if a.type.is_tensor]
    lines = [f"def call({params}):"]
    for i, a in tensors:
        if i != op.dispatch_arg:
            cond = f"isinstance(a{i}, _T)" + (f" or a{i} is None" if a.type.optional else "")
            lines.append(f"    if not ({cond}): return _slow({params})")
    no_grad = [f"(a{i} is None or a{i}.stop_gradient)" if a.type.optional else f"a{i}.stop_gradient"
               for i, a in tensors]
    lines += [f"    if _grad() and not ({' and '.join(no_grad)}):", f"        return _ag({params})"]
    like = core.like_indices(op) or []
    typed = [op.dtype_arg, *sorted(set(like) - {op.dtype_arg})]
    lines.append(f"    _p = {names[op.dispatch_arg]}.place" if check_places else "    _p = _cpu")
    lines += [f"    _dt_a{i} = a{i}.dtype" for i in typed]
    guard = [f"_id(_dt_a{op.dtype_arg}) in _dtids", *core.scalar_guards(op, names)]
    if check_places:
        for i, a in tensors:
            place = "_p" if i == op.dispatch_arg else f"a{i}.place"
            guard.append(f"(a{i} is None or {place}.is_cpu_place())" if a.type.optional else f"{place}.is_cpu_place()")
    lines.append(f"    if not ({' and '.join(guard)}): return _slow({params})")
    # Tensors in a layout the kernels do not take run on dense copies: the op's public callable again
    # (_copies: overlap.recall_dense), whose exchange entry takes them, not the checked call (28-31 us for
    # add on a (64, 128) slice, where the contiguous call costs 2.4). For a mutating op the test keeps a
    # row_strided argument's contiguity (_ca<i>), else its rows (_ra<i>), for the alias test below; an op
    # that writes no argument only asks whether it is rows at a stride.
    mutating = op.schema.is_mutating
    layout = core.layout_source(op, names, "{t}.is_contiguous()", "_rows_of({t})" if mutating else "_rows({t})",
                                capture=("_c{t}", "_r{t}") if mutating else None)
    lines.append(f"    if not ({layout}): return _copies(({params},))")
    outs = [f"_o{i}" for i in range(op.n_outputs)]
    # A large CPU output (4 MiB+, sized from its model: 0.1 µs) is made by _large_like; _alloc does the same
    # for rule-made outputs itself.
    new_like = f"(_large_like({{x}}) if {_NBYTES.format(o='{x}')} >= _hmin else _empty_like({{x}}, _dt_{{x}}, _p))"
    body = core.alloc_source(op, names, outs, new_like, "_alloc({args}, _p)")
    alias = overlap.alias_check_source(  # _c<name>, _r<name>: the layout test's capture
        op, names, SPAN_SOURCE, "",
        rows=("{s}, {e} = (_sp := {t}.data_ptr(), _sp + _prod({t}.shape) * {t}.element_size()) "
              "if _c{t} else _rows_span(_r{t})",
              "_rows_meet(_rows_of({a}) if _c{a} else _r{a}, _rows_of({b}) if _c{b} else _r{b})"))
    body += [*alias.splitlines(), f"_k({', '.join([*outs, *names])})"]
    # A wrong scalar, or a tensor DLPack cannot carry (a sparse one, which fails the allocation, the alias
    # check's reads or the kernel's conversion): the op's error naming it (_bad), else the error as it is.
    lines += ["    try:", *(f"        {line}" for line in body), "    except Exception:", f"        _bad(({params},))",
              "        raise"]
    for i in _mutated(op):
        guard_none = f"if a{i} is not None: " if args[i].type.optional else ""
        lines.append(f"    {guard_none}a{i}._bump_inplace_version()")
    lines += core.returns_source(op, names, outs, "    ")
    return "\n".join(lines) + "\n"


def _name_the_error(op: OpDef, args: Any) -> None:
    """Raise the op's error naming the argument behind a failed fast call, if it is one: a wrong scalar
    (:func:`opbridge.call.core.validate_args`) or a tensor DLPack cannot carry (:func:`._base.check_passable`)."""
    core.validate_args(op, args, is_tensor, KIND)
    check_passable(op, args)


def _strided_copies(op: OpDef) -> Callable[[Any], Any]:
    """:func:`opbridge.call.overlap.recall_dense` for Paddle (copies by ``clone``, written back through the
    caller's view), every mutated argument's inplace version bumped after it, as the checked call does."""
    recall = overlap.recall_dense(op, overlap.make_alias_check(op, strided_span, exact=EXACT), is_dense, densify,
                                  rows, write_back, written=WRITTEN)
    mutated = _mutated(op)

    def run(args: Any) -> Any:
        result = recall(args)
        for i in mutated:
            if args[i] is not None:
                args[i]._bump_inplace_version()
        return result

    return run


def _refuse_grad(op: OpDef) -> Callable[..., Any]:
    tensor_args = [(i, a.name) for i, a in enumerate(op.schema.arguments) if a.type.is_tensor]

    def refuse(*args: Any) -> Any:
        name = next(n for i, n in tensor_args if args[i] is not None and not args[i].stop_gradient)
        raise RuntimeError(f"{op.name}: argument '{name}' requires grad (stop_gradient=False), but this op "
                           f"mutates its inputs in place and declares no backward; call it under "
                           f"paddle.no_grad() or on tensors with stop_gradient=True")

    return refuse


#: Paddle's tensors for the DLPack exchange entry: ``paddle.Tensor`` (a parameter too, except as the
#: dispatching argument), nothing to record for autograd
#: while grad is off or every tensor has ``stop_gradient``; a written argument's inplace version is bumped.
EXCHANGE = exchange.Framework("paddle", T, _HAS_GRAD, "stop_gradient", "_bump_inplace_version", name_of)


def make_eager(op: OpDef, check_places: bool) -> Callable[..., Any]:
    """The eager call of *op* on paddle tensors (:func:`fast_source`).

    The DLPack exchange entry (:mod:`opbridge.call.exchange`), once loaded,
    goes first in the op's public callable and takes what this call's fast
    path would; this call takes the rest.
    """
    if "cpu" in op.kernels:
        exchange.install(op, loader.kernel(op, "cpu"), EXCHANGE)
    run = make_checked(op)
    ns: dict[str, Any] = {
        "_T": T,
        "_k": loader.kernel(op, "cpu") if "cpu" in op.kernels else None,
        "_grad": _HAS_GRAD,
        "_ag": _refuse_grad(op) if op.schema.is_mutating else make_layer(op, run).apply,
        "_slow": lambda *a: core.pack_results(op, a, run(*a)),
        "_bad": lambda a: _name_the_error(op, a),
        "_empty_like": _C_ops.empty_like,
        "_alloc": rule_alloc(op) if core.like_indices(op) is None and op.n_outputs else None,
        "_alias": lambda a: overlap.check_no_alias(op, a, strided_span, EXACT),
        "_rows": rows,
        "_rows_of": rows_of,
        "_rows_span": lambda r: (r[0], r[0] + (r[1] - 1) * r[3] + r[2]),
        "_rows_meet": layout.rows_meet,
        "_prod": math.prod,
        "_pack": lambda a, o: core.pack_results(op, a, o),
        "_id": id,
        "_dtids": frozenset(id(d) for d in op_dtypes(op)) if "cpu" in op.kernels else frozenset(),
        "_hmin": memory.MIN_BYTES,
        "_cpu": paddle.CPUPlace(),
        "_large_like": large_like,
        "_copies": _strided_copies(op),
    }
    compile_source(fast_source(op, check_places), f"<opbridge paddle {op.qualname}>", ns)
    fn: Callable[..., Any] = ns["call"]
    fn.__name__ = fn.__qualname__ = op.name
    return fn


def call_with_out(op: OpDef, args: tuple[Any, ...], outs: tuple[Any, ...]) -> Any:
    """Run *op* into the caller's tensors *outs* (``out=``); no autograd, eager only."""
    if any(isinstance(v, VALUE) for v in (*args, *outs)):
        raise PaddleStaticError(f"{op.name}: out= cannot be used under paddle.jit.to_static (it writes "
                                f"into existing tensors); use the returned tensor instead")
    core.validate_args(op, args, is_tensor, KIND)
    for i, o in enumerate(outs):
        if not isinstance(o, T):
            raise TypeError(f"{op.name}: out[{i}] must be a paddle.Tensor, got {type(o).__name__}")
    if paddle.is_grad_enabled() and any(isinstance(t, T) and not t.stop_gradient for t in (*args, *outs)):
        raise RuntimeError(f"{op.name}: out= does not support autograd (a tensor has "
                           f"stop_gradient=False); call it under paddle.no_grad() or without out=")
    core.check_lead_dtype(op, args, dtype_name)
    core.check_outs(op, args, outs, dtype_name)
    kern, launch, _ = target(op, args, outs)
    try:
        overlap.make_alias_check(op, strided_span, exact=EXACT)(args)
        full, back = overlap.dense_args(op, args, is_dense, densify, rows, written=WRITTEN)
        # a strided out=, or every out= where one shares memory with an input, through dense copies; two that
        # share an element, or one whose elements do, raise
        fresh = overlap.outputs_overlap(op, args, outs, overlap.span_overlap(strided_span), EXACT, written=WRITTEN,
                                        is_dense=is_dense)
        dense, out_back = overlap.dense_outputs(outs, is_dense, densify, fresh=fresh)
        with launch():
            kern(*dense, *full)
    except Exception:
        check_passable(op, args)  # a sparse tensor, which fails any of these: the op's TypeError naming it
        raise
    for orig, copy in back + out_back:
        write_back(orig, copy)
    for o in outs:
        o._bump_inplace_version()
    for i in _mutated(op):
        if args[i] is not None:
            args[i]._bump_inplace_version()
    return core.pack_results(op, args, outs)

