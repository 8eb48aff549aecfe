"""Paddle adapter: eager kernel calls, autograd through ``PyLayer``, ``to_static`` through Python ops.

Eager (dygraph), :mod:`.eager`
    tvm-ffi takes ``paddle.Tensor`` directly (DLPack exchange): a call is one
    contiguous allocation per new output (on the dispatching tensor's place;
    a large CPU one from opbridge's pool of recycled, huge-page buffers:
    :func:`._base.large_empty`) and the kernel
    call, with no copies. CPU tensors run the CPU kernel through a function generated per
    op; GPU tensors run the CUDA kernel on Paddle's current stream, where the
    build has CUDA; another device, or tensors on two, raise a clear error
    before any kernel runs. Strided inputs are passed as one dense copy each
    (a mutated one is written back through the caller's view). The
    dispatching tensor's dtype must be one the op declares. ``out=`` writes
    into the caller's tensors.
Autograd
    When grad is enabled and a tensor argument has ``stop_gradient=False`` the
    call goes through a ``paddle.autograd.PyLayer`` whose backward is the
    declared ``backward`` (opbridge ops on paddle tensors, dispatching back
    here). Ops without one raise when differentiated; mutating ops refuse to
    be called on tensors that need grad.
``paddle.jit.to_static`` and ``paddle.static`` (PIR), :mod:`.static`
    The kernel call becomes a Python op running the eager call at run time,
    wrapped in ``static_pylayer`` when gradients are needed. Functional ops
    are marked *unified* so SOT (``full_graph=False``) records them as graph
    ops too; mutating ops are marked *force_dynamic* (SOT runs them eagerly)
    and raise :class:`PaddleStaticError` in a full graph, as do legacy
    ``Program``/``Variable`` graphs. Programs holding opbridge ops cannot be
    serialised (``paddle.jit.save``): Python ops hold Python callables.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import paddle

from opbridge import registry
from opbridge.adapters.paddle._base import CORE, VALUE, PaddleStaticError, T, host_only
from opbridge.adapters.paddle.eager import call_with_out, make_eager
from opbridge.adapters.paddle.static import legacy_static, make_static
from opbridge.call import dispatch

if TYPE_CHECKING:
    from opbridge.declare import Library, OpDef

__all__ = ["ADAPTER", "PaddleAdapter", "PaddleStaticError", "register"]


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
        old = CORE.set_eval_frame(None)
        try:
            return self._make_call(op, array_type)
        finally:
            CORE.set_eval_frame(old)

    def _make_call(self, op: OpDef, array_type: type) -> Callable[..., Any]:
        _mark_for_to_static(op)
        if issubclass(array_type, VALUE):
            return make_static(op)
        if issubclass(array_type, T):
            # Reached under SOT only for an op whose first call is being traced:
            # run it eagerly there rather than letting SOT step through it.
            return paddle.jit.marker.force_dynamic(make_eager(op, check_places=not host_only()))
        if issubclass(array_type, paddle.static.Variable):
            return legacy_static(op)
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
            One paddle tensor per new output, on the inputs' device, checked by the kernel.

        Returns
        -------
        Any
            The op's results per schema, *outs* themselves for new outputs.
        """
        return call_with_out(op, args, outs)


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
    prefixes = {str(Path(__file__).resolve().parents[2]) + os.sep, "<opbridge "}
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
