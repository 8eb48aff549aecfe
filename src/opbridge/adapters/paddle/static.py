"""Paddle static graphs: ``paddle.jit.to_static`` (PIR) through Python ops and ``static_pylayer``.

Under PIR tracing the arguments are ``paddle.pir.Value``. The kernel call
becomes a Python op (``_C_ops._run_python_op``, the primitive behind
``paddle.static.register_op``) that runs the checked eager call on the
program's tensors at run time; its output metadata comes from the shape
rule. With gradients it is wrapped in ``paddle.static.nn.static_pylayer``
whose backward block is traced from the declared ``backward``.
"""

from __future__ import annotations

import itertools
import math
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import paddle
from paddle import _C_ops

from opbridge import loader
from opbridge.adapters.paddle._base import VALUE, PaddleStaticError, dtype, dtype_name, materialise, name_of
from opbridge.adapters.paddle.eager import Run, make_checked
from opbridge.call import core
from opbridge.declare import Spec, like

if TYPE_CHECKING:
    from opbridge.declare import OpDef

_NAMES = itertools.count()
_STATIC = threading.local()  # .in_backward: tracing a static backward block


def _trace_checks(op: OpDef, args: Sequence[Any]) -> tuple[Spec, ...]:
    """The argument errors a call would raise when the program runs, raised while it is traced instead;
    returns the op's output specs (its shape rule, applied once).

    At run time an error inside a Python op reaches the caller as Paddle's ``SystemError`` with the
    op's message only in the log. So the declared dtype is checked here, and where every shape is
    known the kernel runs once on zeros of these shapes and dtypes (as the JAX adapter does when it
    traces), raising its own TypeError / ValueError; it checks shapes, dtypes and scalars, not
    values. A dimension Paddle leaves open (-1, ``InputSpec([None, ...])``) passes a ``like`` rule
    (the output has the input's shape); any other rule needs it known.
    """
    values: list[tuple[int, Any]] = [(i, v) for i, v in enumerate(args) if isinstance(v, VALUE)]
    dynamic = [op.schema.arguments[i].name for i, v in values if any(d < 0 for d in v.shape)]
    if dynamic and op.n_outputs and not isinstance(op.shape, like):
        raise PaddleStaticError(
            f"{op.name}: its shape rule needs every dimension of {', '.join(map(repr, dynamic))} under "
            f"paddle.jit.to_static, and Paddle left one open (-1: an InputSpec dimension of None); give "
            f"InputSpec the full shape, or call the op eagerly")
    core.check_lead_dtype(op, args, dtype_name)
    specs = op.output_specs(args)
    if not dynamic:
        _dry_run(op, args, values, specs)
    return specs


def _dry_run(op: OpDef, args: Sequence[Any], values: Sequence[tuple[int, Any]], specs: Sequence[Spec]) -> None:
    """The kernel once on NumPy zeros of the traced shapes (all known), so that its own argument errors are
    raised now; skipped for bfloat16 (NumPy has none) and above :data:`opbridge.call.core.DRY_RUN_MAX_BYTES`."""
    names = {i: name_of(v.dtype) for i, v in values}
    outs = [(tuple(int(d) for d in s.shape), name_of(s.dtype)) for s in specs]
    shapes = [*((tuple(v.shape), names[i]) for i, v in values), *outs]
    if any(d == "bfloat16" for _, d in shapes):
        return
    if not core.dry_run_fits(sum(math.prod(s) * np.dtype(d).itemsize for s, d in shapes)):
        return
    full: list[Any] = list(args)
    for i, v in values:
        full[i] = np.zeros(tuple(v.shape), names[i])
    loader.kernel(op, "cpu")(*(np.zeros(s, d) for s, d in outs), *full)


def _python_op(op: OpDef, run: Run, cache: dict[str, Any], args: Sequence[Any]) -> list[Any]:
    """Insert one Python op running *run* on the program's tensors; return its output Values."""
    slots = [i for i, v in enumerate(args) if isinstance(v, VALUE)]
    template = [None if isinstance(v, VALUE) else v for v in args]
    specs = _trace_checks(op, args)  # dtype, shape-rule and the kernel's argument errors surface here, at trace time
    key = repr((slots, template))  # which arguments are Values: a None there is an optional left out
    entry = cache.get(key)
    if entry is None:
        # Paddle keys a Python op's runtime function on its name: one name per constant set.
        name = f"opbridge__{op.library.namespace}__{op.name}__{next(_NAMES)}"

        def fill(values: Sequence[Any]) -> list[Any]:
            full = list(template)
            for i, v in zip(slots, values, strict=True):
                full[i] = v
            return full

        def runtime(*tensors: Any) -> tuple[Any, ...]:
            return run(*fill(tensors))

        def infer_meta(*metas: Any) -> tuple[Any, ...]:
            # An exception escaping here aborts the process, so never let one out.
            try:
                got = op.output_specs(fill(metas))
            except Exception:
                traceback.print_exc(file=sys.stderr)
                got = specs
            meta_tensor: Any = paddle.static.MetaTensor  # type: ignore[attr-defined]
            return tuple(meta_tensor(dtype=dtype(s.dtype), shape=list(s.shape)) for s in got)

        entry = cache[key] = (name, runtime, infer_meta)
    name, runtime, infer_meta = entry
    outs = _C_ops._run_python_op(  # type: ignore[attr-defined]
        *(args[i] for i in slots), name=name,
        input_names=[op.schema.arguments[i].name for i in slots],
        output_names=[f"out{j}" for j in range(len(specs))],
        attrs={"infer_meta_fn_ptr": infer_meta, "fn_ptr": runtime}, inplace_map={},
    )
    return list(outs)


def unsupported_reason(op: OpDef) -> str | None:
    """Why *op* cannot run inside a ``paddle.jit.to_static`` program (the error its traced call raises), or None."""
    if op.schema.is_mutating:
        return (f"{op.name}: mutates its arguments in place, which opbridge cannot express in a "
                f"paddle.jit.to_static program (PIR values are immutable and Paddle's Python ops "
                f"cannot alias a graph input); call it eagerly, outside to_static")
    if not hasattr(_C_ops, "_run_python_op"):
        return (f"{op.name}: this Paddle ({paddle.version.full_version}) has no Python ops "
                f"(paddle.static.register_op, Paddle >= 3.2), so opbridge ops cannot run inside "
                f"paddle.jit.to_static programs; call them eagerly or use Paddle >= 3.2")
    return None


def make_static(op: OpDef) -> Callable[..., Any]:
    """The call of *op* while a PIR program is traced."""
    reason = unsupported_reason(op)
    if reason is not None:
        return _refusal(reason)
    run = make_checked(op)
    cache: dict[str, Any] = {}
    tensor_idx = core.tensor_indices(op)

    def call(*args: Any) -> Any:
        core.validate_args(op, args, lambda v: isinstance(v, VALUE), "a paddle.pir.Value under to_static")
        needs_grad = not getattr(_STATIC, "in_backward", False) and any(
            args[i] is not None and not args[i].stop_gradient for i in tensor_idx)
        if not needs_grad:
            return core.pack_results(op, args, _python_op(op, run, cache, args))
        # static_pylayer: forward and backward blocks traced from Python; tensors
        # reach the backward block through the context's save_for_backward pipe.
        from paddle.jit.dy2static.py_layer import StaticPyLayerContext
        from paddle.static.nn import static_pylayer

        ctx: Any = StaticPyLayerContext()  # type: ignore[no-untyped-call]
        present = [i for i in tensor_idx if args[i] is not None]
        meta: list[Any] = []

        def forward(*a: Any) -> Any:
            ctx.save_for_backward(*(a[i] for i in present))
            outs = _python_op(op, run, cache, a)
            meta.extend((o.shape, o.dtype) for o in outs)
            return outs[0] if len(outs) == 1 else tuple(outs)

        def backward(*grads: Any) -> Any:
            full = list(args)
            for i, v in zip(present, ctx.saved_tensor(), strict=True):
                full[i] = v
            _STATIC.in_backward = True
            try:
                res = core.run_backward(op, materialise(grads, meta), full)
            finally:
                _STATIC.in_backward = False
            out = [g for i, g in zip(tensor_idx, res, strict=True) if i in present]
            return out[0] if len(out) == 1 else tuple(out)

        result = static_pylayer(forward, list(args), backward)  # type: ignore[no-untyped-call]
        outs = list(result) if isinstance(result, (list, tuple)) else [result]
        return core.pack_results(op, args, outs)

    return call


def legacy_static(op: OpDef) -> Callable[..., Any]:
    """The call of *op* in a legacy ``Program``: a clear refusal."""
    return _refusal(f"{op.name}: legacy static graphs (paddle.static.Program with FLAGS_enable_pir_api=0) "
                    f"are not supported; use the default PIR mode of paddle.jit.to_static or eager mode")


def _refusal(message: str) -> Callable[..., Any]:
    def refuse(*args: Any) -> Any:
        raise PaddleStaticError(message)
    return refuse
