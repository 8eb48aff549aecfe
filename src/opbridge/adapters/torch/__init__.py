"""PyTorch adapter: ``torch.library`` registration plus an eager fast path.

Every op is defined with its declared schema under ``torch.ops.<ns>.<op>``
(:mod:`.dispatcher`), with CPU/CUDA kernels, a fake kernel derived from the
shape rule and an autograd formula derived from the declared backward, so it
works under autograd, ``opcheck``, ``torch.compile(fullgraph=True)`` and
``torch.export``. The public callable skips the dispatcher when that is
provably equivalent (:mod:`.fast`), on CPU and CUDA tensors alike. Where the
native shim is built (once per torch version, never at import: :mod:`.native`),
the dispatcher's device and autograd kernels are C++ ones that run the
compiled kernel without a Python frame and hand everything else to the
Python kernels.

Every path checks the dtype argument against the op's declared dtypes
(:func:`opbridge.call.core.dtype_error`), accepts non-contiguous inputs (one
dense copy each; mutated ones are copied back) and returns contiguous new
outputs (:mod:`.calls`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from opbridge import registry
from opbridge.adapters.torch import calls, dispatcher, dynamo, fast, flags
from opbridge.call import core, overlap

if TYPE_CHECKING:
    from opbridge.declare import Library, OpDef


def register(lib: Library) -> None:
    """Define and implement every op of *lib* in ``torch.ops.<namespace>`` (idempotent)."""
    dispatcher.register(lib, dynamo.substitute)


def _no_modes() -> bool:
    return (not torch._C._len_torch_dispatch_stack() and not torch._C._is_torch_function_mode_enabled()
            and torch._C._functorch.peek_interpreter_stack() is None)


class TorchAdapter:
    """Adapter for ``torch.Tensor`` (and subclasses, through the dispatcher)."""

    name = "torch"

    def register(self, lib: Library) -> None:
        """Register every op of *lib* with the framework (idempotent)."""
        register(lib)

    def make_call(self, op: OpDef, array_type: type) -> Callable[..., Any]:
        """The dispatcher call of *op*; for plain tensors, also install the fast path in its callable."""
        register(op.library)
        slow = dispatcher.checked(op)
        if array_type is torch.Tensor:
            fast.install(op, slow)
        return slow

    def call_with_out(self, op: OpDef, args: tuple[Any, ...], outs: tuple[Any, ...]) -> Any:
        """Run *op* into the caller's tensors *outs* (``out=``); no autograd, like torch's own ``out=``.

        Every tensor must be on the dispatching tensor's device (else a
        ValueError naming them, before anything is written); non-contiguous
        inputs and outputs go through dense copies, and so do all outputs
        where one shares memory with an input (which is read as it was).
        Inputs with the negative or conjugate bit are read resolved, and
        ``out=`` buffers with one are written through ``copy_``; an argument
        the op mutates with one raises (:func:`.flags.check_written_bits`), and
        so, outside inference mode, does an inference tensor it would write, as
        torch raises for its own in-place ops.
        """
        if op.qualname not in dispatcher.REGISTERED:
            register(op.library)
        tensors = [a for a in (*args, *outs) if isinstance(a, torch.Tensor)]
        if len(tensors) != len(outs) + sum(1 for a in args if isinstance(a, torch.Tensor)) or not all(
                isinstance(args[i], torch.Tensor) for i in op.differentiable):
            core.validate_args(op, args, calls.is_tensor, "a torch.Tensor")  # names the offending argument
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            raise RuntimeError(f"{op.name}: out= does not support autograd (an argument requires grad); "
                               f"call it under torch.no_grad() or without out=")
        mutated = [(a.name, args[i]) for i, a in enumerate(op.schema.arguments) if a.is_mutated]
        flags.check_written_bits(op, mutated)
        flags.check_inference_writes(op, [*mutated, *_out_names(outs)])
        if not (all(type(t) is torch.Tensor for t in tensors) and _no_modes()):
            core.validate_args(op, args, calls.is_tensor, "a torch.Tensor")
            core.check_outs(op, args, outs, calls.dtype_name)
            results = dispatcher.packet(op)(*args)
            for o, r in zip(outs, results if isinstance(results, tuple) else (results,)):
                o.copy_(r)
            return core.pack_results(op, args, outs)
        core.check_lead_dtype(op, args, calls.dtype_name, calls.CONVERT)
        core.check_outs(op, args, outs, calls.dtype_name)
        calls.check_devices(op, args, outs)
        overlap.make_alias_check(op, calls.span, exact=calls.EXACT)(args)
        # inputs with the negative or conjugate bit are read resolved (the kernel reads raw memory)
        full, back = overlap.dense_args(op, [flags.resolved(a) for a in args], torch.Tensor.is_contiguous,
                                        torch.Tensor.contiguous, calls.rows, written=calls.WRITTEN)
        fresh = overlap.outputs_overlap(op, args, outs, calls.OVERLAP, calls.EXACT, written=calls.WRITTEN,
                                        is_dense=torch.Tensor.is_contiguous)
        # and out= buffers with one are written through a dense buffer and copy_, which honours the bit
        dense, out_back = overlap.dense_outputs(outs, _dense_plain, _empty_dense, fresh=fresh)
        try:
            calls.run_kernel(op, dense, full)
        except TypeError:
            core.validate_args(op, args, calls.is_tensor, "a torch.Tensor")  # a named error for a bad scalar
            raise
        except RuntimeError:
            flags.check_passable(op, args)  # a named error for a tensor DLPack cannot carry (quantized)
            raise
        for orig, copy in back:
            orig.copy_(copy)
        for o, d in out_back:
            o.copy_(d)
        for o in outs:
            torch.autograd.graph.increment_version(o)
        return outs[0] if len(outs) == 1 and len(op.schema.returns) == 1 else core.pack_results(op, args, outs)


def _out_names(outs: tuple[Any, ...]) -> list[tuple[str, Any]]:
    return [("out" if len(outs) == 1 else f"out[{i}]", o) for i, o in enumerate(outs)]


def _dense_plain(t: torch.Tensor) -> bool:
    """Whether the kernel may write the ``out=`` buffer *t* as it is: contiguous, with no negative or
    conjugate bit."""
    return t.is_contiguous() and not flags.math_bits(t)


def _empty_dense(o: torch.Tensor) -> torch.Tensor:
    return torch.empty(o.shape, dtype=o.dtype, device=o.device)


ADAPTER = TorchAdapter()


def _register_declared() -> None:
    """Register every op declared so far (torch is in use from here on)."""
    for lib in registry.libraries():
        register(lib)


_register_declared()
