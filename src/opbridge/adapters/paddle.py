"""Paddle adapter: eager kernel calls, autograd through ``PyLayer``, ``to_static`` through Python ops.

Eager (dygraph)
    tvm-ffi takes ``paddle.Tensor`` directly (DLPack exchange), so a call is
    one ``empty_like``-style allocation per output (on the input's place) and
    the kernel call, with no copies. The call is a function generated per op
    with the schema's arity, so the common case costs a few attribute reads.
    ``out=`` writes into the caller's tensors.
Autograd
    When grad is enabled and a tensor argument has ``stop_gradient=False`` the
    call goes through a ``paddle.autograd.PyLayer`` whose backward is the
    declared ``backward`` (opbridge ops on paddle tensors, dispatching back
    here). Ops without one raise when differentiated; mutating ops refuse to
    be called on tensors that need grad.
``paddle.jit.to_static`` and ``paddle.static`` (PIR)
    Under PIR tracing the arguments are ``paddle.pir.Value``. The kernel call
    becomes a Python op (``_C_ops._run_python_op``, the primitive behind
    ``paddle.static.register_op``) that runs the eager call on the program's
    tensors at run time; its output metadata comes from the shape rule. With
    gradients it is wrapped in ``paddle.static.nn.static_pylayer`` whose
    backward block is traced from the declared ``backward``. Functional ops
    are marked *unified* so SOT (``full_graph=False``) records them as graph
    ops too; mutating ops are marked *force_dynamic* (SOT runs them eagerly)
    and raise :class:`PaddleStaticError` in a full graph, as do legacy
    ``Program``/``Variable`` graphs. Programs holding opbridge ops cannot be
    serialised (``paddle.jit.save``): Python ops hold Python callables.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

with warnings.catch_warnings():
    # Paddle warns at import when ccache is missing (it matters only for its own C++ extensions).
    warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
    import paddle
from paddle import _C_ops
from paddle.autograd import PyLayer

from opbridge import loader, registry
from opbridge._codegen import compile_source
from opbridge.call import dispatch
from opbridge.call.core import (
    alias_check_source,
    check_no_alias,
    make_alias_check,
    pack_results,
    validate_args,
)
from opbridge.declare import like
from opbridge.errors import OpbridgeError

if TYPE_CHECKING:
    from opbridge.declare import Library, OpDef

_T = paddle.Tensor
_VALUE: type = paddle.pir.Value  # type: ignore[attr-defined]
_NAMES = itertools.count()
_core: Any = paddle.base.core
_STATIC = threading.local()  # .in_backward: tracing a static backward block


class PaddleStaticError(OpbridgeError, NotImplementedError):
    """An opbridge op cannot be put into this kind of Paddle static graph."""


def _dtype(d: Any) -> Any:
    return getattr(paddle, d) if isinstance(d, str) else d


def _span(t: paddle.Tensor) -> tuple[int, int]:
    p = t.data_ptr()
    return p, p + math.prod(t.shape) * t.element_size()  # t.size is the same number, 30x slower (6.8 µs)


# _span inline, for alias_check_source.
_SPAN_SOURCE = "{s} = {t}.data_ptr(); {e} = {s} + _prod({t}.shape) * {t}.element_size()"


def _is_tensor(x: Any) -> bool:
    return isinstance(x, _T)


def _like_idx(op: OpDef) -> list[int] | None:
    if not isinstance(op.shape, like):
        return None
    names = [a.name for a in op.schema.arguments]
    return [names.index(n) for n in op.shape.names]


def _alloc(op: OpDef, args: Sequence[Any]) -> list[paddle.Tensor]:
    place = args[op.dispatch_arg].place
    return [_C_ops.empty(list(s.shape), _dtype(s.dtype), place) for s in op.output_specs(args)]


def _raise_named(op: OpDef, args: Sequence[Any]) -> None:
    """Raise the TypeError naming the first argument of the wrong Python type, if any."""
    validate_args(op, args, _is_tensor, "a paddle.Tensor")


def _tensor_idx(op: OpDef) -> list[int]:
    return [i for i, a in enumerate(op.schema.arguments) if a.type.is_tensor]


# -- eager ---------------------------------------------------------------------


def _make_raw(op: OpDef) -> Callable[..., tuple[paddle.Tensor, ...]]:
    """The plain kernel call on paddle tensors, returning the allocated outputs (no autograd, no checks)."""
    kern = loader.kernel(op, "cpu")
    like_idx = _like_idx(op)
    mutating = op.schema.is_mutating
    check_alias = make_alias_check(op, _span)

    def raw(*args: Any) -> tuple[paddle.Tensor, ...]:
        if like_idx is not None:
            outs = [_C_ops.empty_like(args[i], args[i].dtype, args[i].place) for i in like_idx]
        else:
            outs = _alloc(op, args)
        if mutating:
            check_alias(args)
        try:
            kern(*outs, *args)
        except TypeError:
            _raise_named(op, args)
            raise
        return tuple(outs)

    return raw


def _backward_grads(op: OpDef, grads: Sequence[Any], full: list[Any], meta: Sequence[Any],
                    zeros: Callable[[Any], Any]) -> list[Any]:
    """Run the declared backward; one gradient (or None) per Tensor argument."""
    if op.backward is None:
        raise NotImplementedError(f"{op.name}: no backward is declared, so it cannot be differentiated "
                                  f"(declare backward= in its Library.op)")
    grads = [zeros(m) if g is None else g for g, m in zip(grads, meta, strict=True)]
    res = op.backward(*grads, *full)
    res = list(res) if isinstance(res, (tuple, list)) else [res]
    n = len(_tensor_idx(op))
    if len(res) != n:
        raise RuntimeError(f"{op.name}: backward returned {len(res)} gradient(s), expected one "
                           f"per Tensor argument ({n})")
    return res


def _make_layer(op: OpDef, raw: Callable[..., tuple[paddle.Tensor, ...]]) -> type[PyLayer]:
    """A PyLayer running *raw* forward and the declared backward."""
    tensor_idx = _tensor_idx(op)

    def forward(ctx: Any, *args: Any) -> Any:
        present = [i for i in tensor_idx if args[i] is not None]
        ctx.opb_full = [None if i in tensor_idx else v for i, v in enumerate(args)]
        ctx.opb_present = present
        ctx.opb_needs = [not args[i].stop_gradient for i in present]
        ctx.save_for_backward(*(args[i] for i in present))
        outs = raw(*args)
        ctx.opb_meta = [(o.shape, o.dtype) for o in outs]
        return outs[0] if len(outs) == 1 else outs

    def backward(ctx: Any, *grads: Any) -> Any:
        full = list(ctx.opb_full)
        for i, t in zip(ctx.opb_present, ctx.saved_tensor(), strict=True):
            full[i] = t
        grads = tuple(g if g is None or g.is_contiguous() else g.contiguous() for g in grads)
        res = _backward_grads(op, grads, full, ctx.opb_meta,
                              lambda m: paddle.zeros(m[0], m[1]))
        # PyLayer wants one gradient per Tensor passed to forward (None ones were not),
        # and None for those with stop_gradient=True.
        got = [g for i, g in zip(tensor_idx, res, strict=True) if i in ctx.opb_present]
        out = tuple(g if need else None for g, need in zip(got, ctx.opb_needs, strict=True))
        return out[0] if len(out) == 1 else out

    return type(f"{op.name}_PyLayer", (PyLayer,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward),
        "__module__": __name__, "__qualname__": f"{op.name}_PyLayer",
    })


def _fast_source(op: OpDef) -> str:
    """Source of the eager call: checks, then autograd, mutation or plain call."""
    args = op.schema.arguments
    names = [f"a{i}" for i in range(len(args))]
    params = ", ".join(names)
    lines = [f"def call({params}):"]
    tensors = [(i, a) for i, a in enumerate(args) if a.type.is_tensor]
    for i, a in tensors:
        if i != op.dispatch_arg:
            cond = f"isinstance(a{i}, _T)" + (f" or a{i} is None" if a.type.optional else "")
            lines.append(f"    if not ({cond}): _bad(({params},))")
    no_grad = [f"(a{i} is None or a{i}.stop_gradient)" if a.type.optional else f"a{i}.stop_gradient"
               for i, a in tensors]
    lines.append(f"    if _grad() and not ({' and '.join(no_grad)}):")
    lines.append(f"        return _ag({params})")
    outs = [f"_o{i}" for i in range(op.n_outputs)]
    like_idx = _like_idx(op)
    if like_idx is not None:
        lines += [f"    {o} = _empty_like(a{i}, a{i}.dtype, a{i}.place)"
                  for o, i in zip(outs, like_idx, strict=True)]
    elif outs:
        lines.append(f"    {', '.join(outs)}, = _alloc(({params},))")
    alias = alias_check_source(op, names, _SPAN_SOURCE, "    ")
    if alias:
        lines.append(alias.rstrip("\n"))
    lines += ["    try:", f"        _k({', '.join([*outs, *names])})",
              "    except TypeError:", f"        _bad(({params},))", "        raise"]
    for i, a in enumerate(args):
        if a.is_mutated:
            guard = f"if a{i} is not None: " if a.type.optional else ""
            lines.append(f"    {guard}a{i}._bump_inplace_version()")
    returns = op.schema.returns
    if not returns:
        lines.append("    return None")
    elif len(returns) == 1 and len(outs) == 1:
        lines.append("    return _o0")
    else:
        lines.append(f"    return _pack(({params},), ({''.join(o + ', ' for o in outs)}))")
    return "\n".join(lines) + "\n"


def _refuse_grad(op: OpDef) -> Callable[..., Any]:
    tensor_args = [(i, a.name) for i, a in enumerate(op.schema.arguments) if a.type.is_tensor]

    def refuse(*args: Any) -> Any:
        name = next(n for i, n in tensor_args if args[i] is not None and not args[i].stop_gradient)
        raise RuntimeError(f"{op.name}: argument '{name}' requires grad (stop_gradient=False), but this op "
                           f"mutates its inputs in place and declares no backward; call it under "
                           f"paddle.no_grad() or on tensors with stop_gradient=True")

    return refuse


def _make_eager(op: OpDef) -> Callable[..., Any]:
    raw = _make_raw(op)
    ns: dict[str, Any] = {
        "_T": _T,
        "_k": loader.kernel(op, "cpu"),
        "_grad": paddle.is_grad_enabled,
        "_ag": _refuse_grad(op) if op.schema.is_mutating else _make_layer(op, raw).apply,
        "_bad": lambda a: _raise_named(op, a),
        "_empty_like": _C_ops.empty_like,
        "_alloc": lambda a: _alloc(op, a),
        "_alias": lambda a: check_no_alias(op, a, _span),
        "_prod": math.prod,
        "_pack": lambda a, o: pack_results(op, a, o),
    }
    compile_source(_fast_source(op), f"<opbridge paddle {op.qualname}>", ns)
    fn: Callable[..., Any] = ns["call"]
    fn.__name__ = fn.__qualname__ = op.name
    return fn


# -- static (paddle.jit.to_static, PIR) -----------------------------------------


def _python_op(op: OpDef, raw: Callable[..., tuple[paddle.Tensor, ...]], cache: dict[str, Any],
               args: Sequence[Any]) -> list[Any]:
    """Insert one Python op running *raw* on the program's tensors; return its output Values."""
    slots = [i for i, v in enumerate(args) if isinstance(v, _VALUE)]
    template = [None if isinstance(v, _VALUE) else v for v in args]
    specs = op.output_specs(args)  # shape-rule errors surface here, at trace time
    key = repr(template)
    entry = cache.get(key)
    if entry is None:
        # Paddle keys a Python op's runtime function on its name: one name per constant set.
        name = f"opbridge__{op.library.namespace}__{op.name}__{next(_NAMES)}"

        def fill(values: Sequence[Any]) -> list[Any]:
            full = list(template)
            for i, v in zip(slots, values, strict=True):
                full[i] = v
            return full

        def run(*tensors: Any) -> tuple[paddle.Tensor, ...]:
            return raw(*fill(tensors))

        def infer_meta(*metas: Any) -> tuple[Any, ...]:
            # An exception escaping here aborts the process, so never let one out.
            try:
                got = op.output_specs(fill(metas))
            except Exception:
                traceback.print_exc(file=sys.stderr)
                got = specs
            meta_tensor: Any = paddle.static.MetaTensor  # type: ignore[attr-defined]
            return tuple(meta_tensor(dtype=_dtype(s.dtype), shape=list(s.shape)) for s in got)

        entry = cache[key] = (name, run, infer_meta)
    name, run, infer_meta = entry
    outs = _C_ops._run_python_op(  # type: ignore[attr-defined]
        *(args[i] for i in slots), name=name,
        input_names=[op.schema.arguments[i].name for i in slots],
        output_names=[f"out{j}" for j in range(len(specs))],
        attrs={"infer_meta_fn_ptr": infer_meta, "fn_ptr": run}, inplace_map={},
    )
    return list(outs)


def _make_static(op: OpDef) -> Callable[..., Any]:
    if op.schema.is_mutating:
        def refuse(*args: Any) -> Any:
            raise PaddleStaticError(
                f"{op.name}: mutates its arguments in place, which opbridge cannot express in a "
                f"paddle.jit.to_static program (PIR values are immutable and Paddle's Python ops "
                f"cannot alias a graph input); call it eagerly, outside to_static")
        return refuse
    if not hasattr(_C_ops, "_run_python_op"):
        def unsupported(*args: Any) -> Any:
            raise PaddleStaticError(
                f"{op.name}: this Paddle ({paddle.version.full_version}) has no Python ops "
                f"(paddle.static.register_op, Paddle >= 3.2), so opbridge ops cannot run inside "
                f"paddle.jit.to_static programs; call them eagerly or use Paddle >= 3.2")
        return unsupported
    raw = _make_raw(op)
    cache: dict[str, Any] = {}
    tensor_idx = _tensor_idx(op)

    def plain(*args: Any) -> Any:
        return pack_results(op, args, _python_op(op, raw, cache, args))

    def call(*args: Any) -> Any:
        validate_args(op, args, lambda v: isinstance(v, _VALUE), "a paddle.pir.Value under to_static")
        needs_grad = not getattr(_STATIC, "in_backward", False) and any(
            args[i] is not None and not args[i].stop_gradient for i in tensor_idx)
        if not needs_grad:
            return plain(*args)
        # static_pylayer: forward and backward blocks traced from Python; tensors
        # reach the backward block through the context's save_for_backward pipe.
        from paddle.jit.dy2static.py_layer import StaticPyLayerContext
        from paddle.static.nn import static_pylayer

        ctx: Any = StaticPyLayerContext()  # type: ignore[no-untyped-call]
        present = [i for i in tensor_idx if args[i] is not None]
        meta: list[Any] = []

        def forward(*a: Any) -> Any:
            ctx.save_for_backward(*(a[i] for i in present))
            outs = _python_op(op, raw, cache, a)
            meta.extend((o.shape, o.dtype) for o in outs)
            return outs[0] if len(outs) == 1 else tuple(outs)

        def backward(*grads: Any) -> Any:
            full = list(args)
            for i, v in zip(present, ctx.saved_tensor(), strict=True):
                full[i] = v
            _STATIC.in_backward = True
            try:
                res = _backward_grads(op, grads, full, meta, lambda m: paddle.zeros(m[0], m[1]))
            finally:
                _STATIC.in_backward = False
            out = [g for i, g in zip(tensor_idx, res, strict=True) if i in present]
            return out[0] if len(out) == 1 else tuple(out)

        result = static_pylayer(forward, list(args), backward)  # type: ignore[no-untyped-call]
        outs = list(result) if isinstance(result, (list, tuple)) else [result]
        return pack_results(op, args, outs)

    return call


def _legacy_static(op: OpDef) -> Callable[..., Any]:
    def refuse(*args: Any) -> Any:
        raise PaddleStaticError(
            f"{op.name}: legacy static graphs (paddle.static.Program with FLAGS_enable_pir_api=0) "
            f"are not supported; use the default PIR mode of paddle.jit.to_static or eager mode")
    return refuse


def _mark_for_to_static(op: OpDef) -> None:
    """Tell ``to_static`` how to treat the public callable.

    Functional ops are marked *unified*: SOT records them in its graph like a
    Paddle API (tracing them with ``pir.Value``) instead of stepping through
    opbridge's dispatch and breaking the graph at the kernel call, and AST mode
    does not try to transcribe them. Mutating ops are marked *force_dynamic*:
    SOT breaks the graph and runs them eagerly.
    """
    if getattr(op.call, "_opbridge_paddle_marked", False):
        return
    if op.schema.is_mutating:
        paddle.jit.marker.force_dynamic(op.call)
    else:
        paddle.jit.marker.unified(op.call)
    op.call._opbridge_paddle_marked = True  # type: ignore[attr-defined]


class PaddleAdapter:
    """Adapter for ``paddle.Tensor`` (eager) and ``paddle.pir.Value`` (``to_static`` tracing)."""

    name = "paddle"

    def register(self, lib: Library) -> None:
        """Register every op of *lib* with the framework (idempotent)."""
        register(lib)

    def make_call(self, op: OpDef, array_type: type) -> Callable[..., Any]:
        """The call of *op* for arguments of *array_type*.

        Parameters
        ----------
        op
            The op's declaration.
        array_type
            ``paddle.Tensor`` (or a subclass such as a parameter) for eager
            calls, ``paddle.pir.Value`` while a static program is traced.

        Returns
        -------
        Callable
            Takes the op's arguments positionally in schema order.
        """
        # An op's first call may happen while SOT traces: its frame hook would then
        # translate everything this runs (imports, the kernel build). Switch it off.
        old = _core.set_eval_frame(None)
        try:
            return self._make_call(op, array_type)
        finally:
            _core.set_eval_frame(old)

    def _make_call(self, op: OpDef, array_type: type) -> Callable[..., Any]:
        _mark_for_to_static(op)
        if issubclass(array_type, _VALUE):
            return _make_static(op)
        if issubclass(array_type, _T):
            # Reached under SOT only for an op whose first call is being traced:
            # run it eagerly there rather than letting SOT step through it.
            return paddle.jit.marker.force_dynamic(_make_eager(op))
        if issubclass(array_type, paddle.static.Variable):
            return _legacy_static(op)
        arg = op.schema.arguments[op.dispatch_arg].name
        raise TypeError(f"{op.name}: argument '{arg}' must be a paddle.Tensor, got "
                        f"{array_type.__module__}.{array_type.__qualname__}")

    def call_with_out(self, op: OpDef, args: tuple[Any, ...], outs: tuple[Any, ...]) -> Any:
        """Run *op* into the caller's tensors *outs* (``out=``); no autograd, eager only.

        Parameters
        ----------
        op
            The op's declaration.
        args
            Its arguments in schema order.
        outs
            One paddle tensor per new output, checked by the kernel.

        Returns
        -------
        Any
            The op's results per schema, *outs* themselves for new outputs.
        """
        if any(isinstance(v, _VALUE) for v in (*args, *outs)):
            raise PaddleStaticError(f"{op.name}: out= cannot be used under paddle.jit.to_static (it writes "
                                    f"into existing tensors); use the returned tensor instead")
        validate_args(op, args, _is_tensor, "a paddle.Tensor")
        for i, o in enumerate(outs):
            if not isinstance(o, _T):
                raise TypeError(f"{op.name}: out[{i}] must be a paddle.Tensor, got {type(o).__name__}")
        if paddle.is_grad_enabled() and any(
                isinstance(t, _T) and not t.stop_gradient for t in (*args, *outs)):
            raise RuntimeError(f"{op.name}: out= does not support autograd (a tensor has "
                               f"stop_gradient=False); call it under paddle.no_grad() or without out=")
        if op.schema.is_mutating:
            make_alias_check(op, _span)(args)
        loader.kernel(op, "cpu")(*outs, *args)
        for o in outs:
            o._bump_inplace_version()
        for i, a in enumerate(op.schema.arguments):
            if a.is_mutated and args[i] is not None:
                args[i]._bump_inplace_version()
        return pack_results(op, args, outs)


ADAPTER = PaddleAdapter()


def _sot_skip_opbridge_frames() -> None:
    """Never let SOT translate opbridge's own frames (dispatch, adapters, generated callables).

    Those frames run when SOT breaks the graph at a mutating op; translating
    them would only re-simulate Python bookkeeping, which SOT does not always
    support (it fails on dataclass properties). Paddle keeps one prefix list
    for the whole process, so ours is added to its own.
    """
    try:
        from paddle.jit.sot.opcode_translator import skip_files
    except ImportError:  # pragma: no cover - Paddle without SOT
        return
    prefixes = {str(Path(__file__).resolve().parent.parent) + os.sep, "<opbridge "}
    if not prefixes <= skip_files.skip_file_names:
        skip_files.skip_file_names |= prefixes
        skip_files.setup_skip_files()  # type: ignore[no-untyped-call]


def register(lib: Library) -> None:
    """Prepare every op of *lib* for ``paddle.jit.to_static`` (idempotent; nothing is built)."""
    for op in lib.ops.values():
        _mark_for_to_static(op)


def _register_declared() -> None:
    _sot_skip_opbridge_frames()
    # An op's first call under SOT resolves its adapter (and may build its
    # kernels): make SOT break the graph there and run it natively.
    paddle.jit.marker.force_dynamic(dispatch.resolve)
    for lib in registry.libraries():
        register(lib)


_register_declared()
