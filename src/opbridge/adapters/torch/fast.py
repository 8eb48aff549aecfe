"""The dispatcher-free fast path, spliced into each op's public callable.

It is taken only when skipping the dispatcher is provably equivalent: every
tensor argument is a plain ``torch.Tensor`` that does not require grad and
has no negative or conjugate bit (a kernel reads raw memory, which such a
view holds un-negated or un-conjugated: :func:`_bits_guard`), every tensor
the op writes (a mutated argument, ``out=``) is not an inference tensor
outside inference mode (torch refuses to write one), the dtype argument's
dtype is declared (one frozenset lookup), and no dispatch/function mode,
functorch transform, JIT tracer or Dynamo trace is active. CPU and CUDA
tensors both take it, each calling its device's kernel (CUDA on torch's
current stream of the tensor's device, read from its raw handle: no Python
stream object and no host synchronisation, so calls are safe under CUDA
graph capture). In every other case the call goes through
``torch.ops.<ns>.<op>``, and so does a call whose kernel rejects an argument
type (the dispatcher's parser names it). Inputs in a layout the kernels do not
take (not contiguous, nor rows at a stride where declared) run on dense copies
from the fast path itself (:func:`.calls.strided_fast`), never through a
kernel's error. The fast path bumps the version counter of every tensor it
mutates, as the dispatcher's ADInplaceOrView kernel would.

Every attribute read costs tens of nanoseconds per call, so the path
reads what it must and lets the kernel check the rest (shapes, the other
arguments' dtypes and devices, contiguity), raising before it writes.

Once the op has native kernels (:mod:`.native`), the callable first hands a
plain tensor call to the shim's C entry, which makes the same checks in C++
(no Python frame, no argument parser, outputs allocated with ``at::empty``)
and answers ``NotImplemented`` for whatever it leaves to this path: about
0.8 times ``torch.add`` per call where this path costs 1.9 times. Inside a Dynamo
trace it is skipped (Dynamo traces the callable as the dispatcher call).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from opbridge.adapters.torch import calls, native
from opbridge.call import core
from opbridge.call.callable import install_prelude

if TYPE_CHECKING:
    from opbridge.declare import OpDef

#: Ops whose fast path is installed.
INSTALLED: set[str] = set()

#: The guards' helpers (the mode and tracer probes torch keeps in C).
_PROBES = {
    "_t_dstack": torch._C._len_torch_dispatch_stack,
    "_t_tfmode": torch._C._is_torch_function_mode_enabled,
    "_t_fstack": torch._C._functorch.peek_interpreter_stack,
    "_t_trace": torch._C._get_tracing_state,
    "_t_dyn": torch.compiler.is_dynamo_compiling,
    "_t_bump": torch.autograd.graph.increment_version,
    "_t_infmode": torch.is_inference_mode_enabled,
}
_NO_MODES = ["not _t_dstack()", "not _t_tfmode()", "_t_fstack() is None", "_t_trace() is None"]


def _devices(op: OpDef) -> list[str]:
    return [d for d in calls.DEVICES if d in op.kernels]


def _bits_guard(op: OpDef, t: str) -> str:
    """A condition true where the tensor *t* has neither the negative nor the conjugate bit.

    Such a tensor (``z.conj().imag``, ``torch._neg_view``, ``z.conj()``) is a
    view whose memory holds the values before negation or conjugation; the
    dispatcher's Negative and Conjugate fallbacks resolve it, a kernel reading
    raw memory would not. The conjugate bit is only ever set on a complex
    tensor, so it is tested only for an op that declares a complex dtype: any
    other op's kernels do not take a complex tensor (its dtype test sends it
    to the dispatcher, or the kernel's TypeError does). One method call per
    tensor: the hot path's only cost.
    """
    if any(d.startswith("complex") for d in op.dtypes):
        return f"not {t}.is_neg() and not {t}.is_conj()"
    return f"not {t}.is_neg()"


def _writable(t: str) -> str:
    """A condition true where torch lets the op write the tensor *t*: not an inference tensor, or
    inside inference mode (outside it, torch raises; the dispatcher's call says so)."""
    return f"(not {t}.is_inference() or _t_infmode())"


def _guards(op: OpDef, extra: list[str]) -> str:
    """The fast path's condition: plain tensors, no grad, no negative or conjugate bit, written tensors
    that torch lets it write, a declared dtype, no mode or tracer."""
    args = op.schema.arguments
    lead = args[op.dispatch_arg].name
    conds = [f"type({lead}) is _T", "not _t_dyn()", f"not {lead}.requires_grad"]
    for i, a in enumerate(args):
        if a.type.is_tensor and i != op.dispatch_arg:
            c = f"(type({a.name}) is _T and not {a.name}.requires_grad)"
            conds.append(f"({a.name} is None or {c})" if a.type.optional else c)
    for a in args:  # after every type test: these call tensor methods
        if a.type.is_tensor:
            c = _bits_guard(op, a.name) + (f" and {_writable(a.name)}" if a.is_mutated else "")
            conds.append(f"({a.name} is None or ({c}))" if a.type.optional else c)
    conds += extra  # after the type tests: they may call tensor methods
    conds += core.scalar_guards(op, [a.name for a in args])
    if not op.library.kernels_check_inputs:  # else the kernel's TypeError falls back to the checked path
        conds.append(f"{args[op.dtype_arg].name}.dtype in _t_dts")
    return " and ".join(conds + _NO_MODES)


def _device_branches(op: OpDef, body: Callable[[str, str], list[str]], slow: str, dense: str, devices: str,
                     indent: str, first: Sequence[str] = ()) -> list[str]:
    """``if lead.is_cpu: ... elif lead.is_cuda: ... else: <slow>``, each device's *body* in a try,
    after the lines *first*.

    A TypeError from the kernel, or a ValueError while some input is not
    dense, goes to *slow*; any other error is the kernel's own and is raised,
    a RuntimeError (a tensor tvm-ffi cannot pass, e.g. on ``meta``) after the
    *devices* check and the check of tensors DLPack cannot carry (a quantized
    one: :func:`.flags.check_passable`, the dispatcher's quantized kernel's
    error) have had their say, unless some input is not dense (a sparse
    tensor has no ``nbytes``): that goes to *slow*, which says what the
    dispatcher says of it on every call.
    """
    names = [a.name for a in op.schema.arguments]
    passable = f"_t_passable(({''.join(n + ', ' for n in names)}))"
    lead = op.schema.arguments[op.dispatch_arg].name
    lines = []
    for n, device in enumerate(_devices(op)):
        lines += [f"{indent}{'if' if n == 0 else 'elif'} {lead}.is_{device}:"]
        lines += [f"{indent}    {line}" for line in first] + [f"{indent}    try:"]
        lines += body(device, indent + " " * 8)
        lines += [f"{indent}    except TypeError:", f"{indent}        return {slow}",
                  f"{indent}    except ValueError:", f"{indent}        if {dense}: raise",
                  f"{indent}        return {slow}",
                  f"{indent}    except RuntimeError:", f"{indent}        {devices}", f"{indent}        {passable}",
                  f"{indent}        if not ({dense}): return {slow}  # e.g. a sparse tensor (no nbytes)",
                  f"{indent}        raise"]
    return [*lines, f"{indent}else:", f"{indent}    return {slow}"]


def prelude(op: OpDef) -> str | None:
    """Body lines of the fast path, or None if the op has none (no CPU/CUDA kernel, or a Tensor[] argument)."""
    args = op.schema.arguments
    if not _devices(op) or any(a.type.is_tensor_list for a in args):
        return None
    names = [a.name for a in args]
    outs = [f"_o{i}" for i in range(op.n_outputs)]
    slow = f"_t_slow({', '.join(a.name if not a.kwarg_only else f'{a.name}={a.name}' for a in args)})"
    # Layouts the kernels take only (a kernel, a user's too, may read raw memory): a strided call runs the
    # kernel on dense copies here (_t_copies), never through the dispatcher or a kernel's ValueError
    # (about 100 us for the C++ exception alone, where the copies cost a few).
    lines = [f"    if {_guards(op, [])}:"]
    devices = f"_t_check_devices(({''.join(n + ', ' for n in names)}))"
    strided = [f"if not ({calls.dense_test(op, names, rows=True)}):",
               f"    return _t_copies(({''.join(n + ', ' for n in names)}), _t_slow)"]  # no lambda: no cells
    lines += _device_branches(op, lambda d, ind: calls.kernel_lines(op, d, names, outs, ind), slow,
                              calls.dense_test(op, names), devices, "        ", first=strided)
    # One increment_version call for the tensors that are always there (it takes an iterable).
    required = [a.name for a in op.schema.mutated_args if not a.type.optional]
    if required:
        lines.append(f"        _t_bump(({''.join(n + ', ' for n in required)}))")
    lines += [f"        if {a.name} is not None: _t_bump({a.name})" for a in op.schema.mutated_args if a.type.optional]
    lines += core.returns_source(op, names, outs, "        ")
    return "\n".join(lines) + "\n"


def out_prelude(op: OpDef) -> str:
    """Body lines of the fast ``out=`` path (one output), or ``""``."""
    args = op.schema.arguments
    if not core.returns_its_out(op) or not _devices(op) or any(a.type.is_tensor_list for a in args):
        return ""
    names = [a.name for a in args]
    slow = f"_with_out(({''.join(n + ', ' for n in names)}), out)"
    dense = f"{calls.dense_test(op, names)} and out.is_contiguous()"

    def body(device: str, indent: str) -> list[str]:
        return calls.kernel_lines(op, device, names, ["out"], indent, allocate=False)

    # out= sharing memory with an input: the checked path writes a fresh buffer (overlap.outputs_overlap)
    apart = f"not _t_ovl(out, ({''.join(names[i] + ', ' for i in core.tensor_indices(op))}))"
    fits = core.out_fits_source(op, names, "out", "_t_out_plan")  # else the checked path's ValueError
    # Layouts the kernels take, else the checked path (dense copies), not a kernel's ValueError.
    takes = f"{calls.dense_test(op, names, rows=True)} and out.is_contiguous()"
    guards = ["type(out) is _T", "not out.requires_grad", _bits_guard(op, "out"), _writable("out"), fits, takes,
              apart]
    lines = [f"        if {_guards(op, guards)}:"]
    devices = f"_t_check_devices(({''.join(n + ', ' for n in names)}), (out,))"
    lines += _device_branches(op, body, slow, dense, devices, " " * 12)
    lines += ["            _t_bump(out)", "            return out"]
    return "\n".join(lines) + "\n"


def install(op: OpDef, slow: Callable[..., Any]) -> None:
    """Splice *op*'s fast paths into its public callable (once per op); *slow* is the dispatcher call."""
    if op.qualname in INSTALLED:
        return
    body = prelude(op)
    if body is None:
        return
    # Bound straight into the callable's globals, where the lazy kernels replace themselves.
    calls.namespace(op, op.call.__globals__)
    install_prelude(op, "torch", body, {**_PROBES, "_t_slow": slow, "_t_copies": calls.strided_fast(op)},
                    out_prelude=out_prelude(op))
    INSTALLED.add(op.qualname)
    native.when_native(op, lambda sh, handle: _install_entry(op, sh, handle))


def entry_lines(op: OpDef, fn: str, args: list[str], indent: str) -> list[str]:
    """Lines calling the C entry *fn* first, outside a Dynamo trace, and returning what it handled.

    Only for a plain tensor first: other frameworks' arrays, which share the
    callable, pay one type test for it.
    """
    lead = op.schema.arguments[op.dispatch_arg].name
    return [f"{indent}if type({lead}) is _T and not _t_dyn():", f"{indent}    _t_r = {fn}({', '.join(args)})",
            f"{indent}    if _t_r is not _t_ni:", f"{indent}        return _t_r"]


def _install_entry(op: OpDef, sh: native.Shim, handle: int) -> None:
    """Put the native shim's C entry in front of *op*'s fast paths (once the op has native kernels)."""
    names = [a.name for a in op.schema.arguments]
    body = "\n".join(entry_lines(op, "_t_native", names, "    ")) + "\n" + (prelude(op) or "")
    ns: dict[str, Any] = {"_t_native": sh.entry(handle), "_t_ni": NotImplemented}
    out_body = out_prelude(op)
    # the C entry takes out= of every op returning it, one tensor or a tuple (rms_norm_backward's (dx, dw)):
    # the ops out_prelude gives a body for, and those with several outputs
    if core.returns_its_outs(op) and not any(a.type.is_tensor_list for a in op.schema.arguments):
        ns["_t_native_out"] = sh.entry(handle, with_out=True)
        out_body = "\n".join(entry_lines(op, "_t_native_out", [*names, "out"], " " * 8)) + "\n" + out_body
    install_prelude(op, "torch", body, ns, out_prelude=out_body)
