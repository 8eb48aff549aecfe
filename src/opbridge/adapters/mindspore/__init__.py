"""MindSpore adapter: PyNative calls through DLPack, graphs and gradients through ``ops.Custom``.

PyNative (eager), no gradient being recorded
    The public callable calls the op's tvm-ffi kernel directly
    (:mod:`.eager`), on MindSpore's own memory: each call first waits for
    MindSpore's queued work (so a kernel never reads a tensor a queued op has
    yet to write, nor overwrites one a queued op has yet to read), then hands
    each tensor over as a NumPy view of its memory (:mod:`.views`; not
    ``Tensor.to_dlpack``, which costs 0.5-1 ms per tensor). Outputs are
    MindSpore tensors sharing memory with NumPy buffers
    (``Tensor.from_numpy``), written by the kernel: no copy. Strided inputs
    get one dense copy; mutated strided arguments are copied in, computed and
    copied back. Tensors on a GPU or Ascend device raise
    ``BackendUnavailableError`` naming op, framework and device: the CPU
    kernel never receives a device pointer.

PyNative while ``mindspore.grad`` / ``value_and_grad`` / ``GradOperation`` records
    The call goes through the op's ``ops.Custom`` primitive instead (see
    :mod:`.graph`, :mod:`.primitive`, :mod:`.shim`), which MindSpore records together
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
    registered on import, later ones when declared (once MindSpore is
    imported), on their first eager call or by :func:`register`.
    :func:`custom_op` returns the primitive itself. How the pieces fit:
    :mod:`.aot`.

``mindspore.ops.vmap``
    Compiles a graph, so an op is its primitive there, whose own vmap rule
    (:mod:`.vmap`) runs a batch over the op's declared ``rows`` as one call
    and any other batch through MindSpore's per-element rule.

Bad input raises ``TypeError`` / ``ValueError`` naming the op and the argument,
from the kernel's own checks, in every mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mindspore import Tensor

from opbridge import loader, registry
from opbridge.adapters.mindspore import graph, lambdas, shim
from opbridge.adapters.mindspore.checked import run_with_out
from opbridge.adapters.mindspore.eager import make_eager, make_eager_out
from opbridge.adapters.mindspore.support import unsupported_reason
from opbridge.call.callable import install_prelude

if TYPE_CHECKING:
    from opbridge.declare import Library, OpDef

__all__ = ["ADAPTER", "MindSporeAdapter", "custom_op", "graph_function", "graph_unsupported_reason",
           "load_kernels", "parseable", "register"]


def register(lib: Library) -> None:
    """Make *lib*'s ops usable inside MindSpore graphs (idempotent; compiles nothing).

    ``opbridge.ops.<op>`` (the public callable) written inside ``ms.jit`` or
    a ``GRAPH_MODE`` cell then compiles to the op's ``ops.Custom`` primitive.
    """
    graph.register(lib)


def load_kernels(lib: Library | None = None) -> None:
    """Build (or find in the cache) and bind the ``ops.Custom`` aot entry points of *lib*'s ops (default: the
    built-in library, which ``import opbridge.ops`` declares; a library of yours: pass it), as a graph's
    first call of them would.

    Call it before running a graph loaded from a MINDIR (``ms.export``, then ``ms.load`` and
    ``nn.GraphCell``) in a process that has not run those ops in a graph: the MINDIR names the aot
    module by its absolute path in ``OPBRIDGE_CACHE_DIR``, whose entry points find their kernels only
    once bound. (So a MINDIR with opbridge ops loads where that cache is, with the same opbridge.)
    """
    lib = registry.library("opbridge") if lib is None else lib
    register(lib)
    shim.aot_module(lib).ready()


def graph_function(op: OpDef | Callable[..., Any]) -> Callable[..., Any]:
    """The function MindSpore compiles in place of *op*'s public callable."""
    return graph.graph_function(graph.opdef_of(op))


def graph_unsupported_reason(op: OpDef | Callable[..., Any]) -> str | None:
    """Why *op* cannot run inside MindSpore graphs (and under gradient recording), or None."""
    return unsupported_reason(graph.opdef_of(op))


def parseable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """*fn*, or for a lambda an equivalent ``def`` that MindSpore can compile.

    ``ms.jit(lambda x: ...)`` fails in MindSpore ("Parse Lambda Function Fail")
    unless the lambda stands alone on its line; ``ms.jit(parseable(lambda x: ...))`` works.
    """
    return lambdas.parseable(fn)


def custom_op(op: OpDef | Callable[..., Any]) -> Any:
    """The ``ops.Custom(func_type="aot")`` primitive of *op*, with its bprop.

    Usable in PyNative and graph mode. It takes the op's arguments
    positionally in schema order, scalars as 0-d tensors (``float`` as
    float64, ``int`` as int64, ``bool`` as bool). Calling the public callable
    inside a graph is usually simpler: it compiles to this primitive.
    """
    return graph.custom_op(op)


class MindSporeAdapter:
    """Adapter for ``mindspore.Tensor`` (and ``Parameter``)."""

    name = "mindspore"

    def make_call(self, op: OpDef, array_type: type) -> Callable[..., Any]:
        """The op's eager call on MindSpore tensors (see the module docstring).

        The op's call with ``out=`` one tensor goes, from its public callable,
        to a generated call too (:func:`.eager.make_eager_out`).
        """
        register(op.library)
        if "mindspore" not in op.preludes:
            fast_out = make_eager_out(op)
            if fast_out is not None:
                names = [a.name for a in op.schema.arguments]
                lead = names[op.dispatch_arg]
                install_prelude(op, "mindspore", "", {"_ms_T": Tensor, "_ms_out": fast_out},
                                out_prelude=(f"        if type(out) is _ms_T and type({lead}) is _ms_T:\n"
                                             f"            return _ms_out({', '.join(names)}, out)\n"))
        return make_eager(op)

    def register(self, lib: Library) -> None:
        """Make *lib*'s ops known to MindSpore's graph compiler (called when a library is declared)."""
        register(lib)

    def call_with_out(self, op: OpDef, args: tuple[Any, ...], outs: tuple[Any, ...]) -> Any:
        """Run *op* into the caller's tensors *outs* (``out=``); PyNative only, no gradients.

        *args* are the op's arguments in schema order, *outs* one
        ``mindspore.Tensor`` per new output (the kernel checks their shapes and
        dtypes; a strided one is written through a dense copy). Returns the
        op's results per schema, *outs* themselves for new outputs.
        """
        return run_with_out(op, loader.kernel(op, "cpu"), args, outs)


ADAPTER = MindSporeAdapter()


def _register_declared() -> None:
    """Register every library declared so far (graphs may use them before any eager call)."""
    from opbridge import registry

    for lib in registry.libraries():
        register(lib)


_register_declared()
